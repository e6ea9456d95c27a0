/* The C ABI end to end, compiled as C: engines from a local group (emulated ranks on GPU 0) and from
 * caller-owned NCCL communicators, dispatch -> an identity expert (expert_output = recv_x) ->
 * combine, eagerly and as a graph whose expert child graph is swapped; the combined output checked
 * against a CPU reference (out[t] = sum_k w[t][k] x[t]) on fresh random data; argument errors named;
 * everything destroyed. Exit 77 (skipped) without a GPU. */
#include <graphep/graphep.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SKIP 77

static int failures = 0;

#define CHECK_G(call)                                                                           \
  do {                                                                                          \
    graphep_status_t s_ = (call);                                                               \
    if (s_ != GRAPHEP_SUCCESS) {                                                                \
      fprintf(stderr, "%s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #call, graphep_status_name(s_), \
              graphep_last_error());                                                            \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)
#define CHECK_CUDA(call)                                                                         \
  do {                                                                                           \
    cudaError_t e_ = (call);                                                                     \
    if (e_ != cudaSuccess) {                                                                     \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));     \
      exit(1);                                                                                   \
    }                                                                                            \
  } while (0)
#define EXPECT(cond, ...)                      \
  do {                                         \
    if (!(cond)) {                             \
      fprintf(stderr, "FAILED: " __VA_ARGS__); \
      fprintf(stderr, "\n");                   \
      ++failures;                              \
    }                                          \
  } while (0)

enum { T_MAX = 32, H = 128, K = 2, MAX_LOCAL = 4 };

static uint32_t lcg = 12345u;
static uint32_t next_u32(void) {
  lcg = lcg * 1664525u + 1013904223u;
  return lcg >> 8;
}
static float next_uniform(float lo, float hi) { return lo + (hi - lo) * (float)(next_u32() & 0xffffff) / 16777216.0f; }

static uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static float from_bf16(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

typedef struct {
  graphep_engine_t engine;
  graphep_layout_t layout;
  cudaStream_t stream;
  int device;
  void *x, *idx, *out;
  float* w;
  int* n;
  uint16_t hx[T_MAX * H];
  int32_t hidx[T_MAX * K];
  float hw[T_MAX * K];
  int T;
} rank_t;

/* New inputs for every rank: T live tokens, K distinct experts each (some slots masked). */
static void new_inputs(rank_t* r, int count, int experts) {
  for (int i = 0; i < count; ++i) {
    rank_t* q = &r[i];
    q->T = 1 + (int)(next_u32() % T_MAX);
    for (int j = 0; j < T_MAX * H; ++j) q->hx[j] = to_bf16(next_uniform(-1.0f, 1.0f));
    for (int t = 0; t < T_MAX; ++t) {
      const int a = (int)(next_u32() % (uint32_t)experts);
      int b = (int)(next_u32() % (uint32_t)experts);
      if (b == a) b = (a + 1) % experts;
      q->hidx[t * K] = a;
      q->hidx[t * K + 1] = next_u32() % 5 == 0 ? -1 : b;
      q->hw[t * K] = next_uniform(0.1f, 1.0f);
      q->hw[t * K + 1] = next_uniform(0.1f, 1.0f);
    }
    CHECK_CUDA(cudaSetDevice(q->device));
    CHECK_CUDA(cudaMemcpy(q->x, q->hx, sizeof q->hx, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(q->idx, q->hidx, sizeof q->hidx, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(q->w, q->hw, sizeof q->hw, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(q->n, &q->T, sizeof q->T, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemset(q->out, 0xff, (size_t)T_MAX * H * 2));
  }
}

/* out[t] = sum over valid k of w[t][k] * x[t], within 2^-7 of the magnitudes (two bf16 roundings). */
static int check_outputs(rank_t* r, int count, const char* what) {
  int wrong = 0;
  static uint16_t got[T_MAX * H];
  for (int i = 0; i < count; ++i) {
    rank_t* q = &r[i];
    CHECK_CUDA(cudaSetDevice(q->device));
    CHECK_CUDA(cudaMemcpy(got, q->out, sizeof got, cudaMemcpyDeviceToHost));
    for (int t = 0; t < q->T; ++t) {
      double wsum = 0;
      for (int k = 0; k < K; ++k) {
        if (q->hidx[t * K + k] >= 0) wsum += q->hw[t * K + k];
      }
      for (int h = 0; h < H; ++h) {
        const double ref = wsum * from_bf16(q->hx[t * H + h]);
        const double g = from_bf16(got[t * H + h]);
        if (!(fabs(g - ref) <= fabs(ref) / 128.0 + 1e-6)) {
          if (wrong < 5) fprintf(stderr, "%s: rank %d out[%d][%d] = %f, reference %f\n", what, i, t, h, g, ref);
          ++wrong;
        }
      }
    }
  }
  EXPECT(wrong == 0, "%s: %d wrong values", what, wrong);
  return wrong;
}

/* The identity expert: expert_output = recv_x (bf16 rows). */
static void identity_expert(rank_t* q, cudaStream_t s) {
  CHECK_CUDA(cudaMemcpyAsync(q->layout.expert_output, q->layout.recv_x, (size_t)q->layout.capacity * H * 2,
                             cudaMemcpyDeviceToDevice, s));
}

static void run_engines(graphep_comm_t comm, const char* what, int with_graph) {
  int world = 0, local = 0;
  CHECK_G(graphep_comm_world_size(comm, &world));
  CHECK_G(graphep_comm_local_ranks(comm, &local));
  if (local > MAX_LOCAL) local = MAX_LOCAL;
  graphep_moe_config_t cfg = GRAPHEP_MOE_CONFIG_INIT;
  cfg.max_tokens_per_rank = T_MAX;
  cfg.hidden = H;
  cfg.num_experts = 4 * world;
  cfg.top_k = K;
  graphep_engine_t engines[MAX_LOCAL];
  CHECK_G(graphep_engine_create_all(comm, &cfg, engines, local));
  rank_t* r = (rank_t*)calloc((size_t)local, sizeof(rank_t));
  for (int i = 0; i < local; ++i) {
    rank_t* q = &r[i];
    q->engine = engines[i];
    graphep_layout_t lay = GRAPHEP_LAYOUT_INIT;
    CHECK_G(graphep_engine_layout(q->engine, &lay));
    q->layout = lay;
    /* The layout's device is the engine's: find it from recv_x. */
    struct cudaPointerAttributes attr;
    CHECK_CUDA(cudaPointerGetAttributes(&attr, lay.recv_x));
    q->device = attr.device;
    CHECK_CUDA(cudaSetDevice(q->device));
    CHECK_CUDA(cudaStreamCreateWithFlags(&q->stream, cudaStreamNonBlocking));
    CHECK_CUDA(cudaMalloc(&q->x, sizeof q->hx));
    CHECK_CUDA(cudaMalloc(&q->idx, sizeof q->hidx));
    CHECK_CUDA(cudaMalloc((void**)&q->w, sizeof q->hw));
    CHECK_CUDA(cudaMalloc((void**)&q->n, sizeof(int)));
    CHECK_CUDA(cudaMalloc(&q->out, (size_t)T_MAX * H * 2));
  }
  graphep_dispatch_args_t da[MAX_LOCAL];
  graphep_combine_args_t ca[MAX_LOCAL];
  for (int i = 0; i < local; ++i) {
    graphep_dispatch_args_t d = GRAPHEP_DISPATCH_ARGS_INIT;
    d.x = r[i].x;
    d.topk_idx = r[i].idx;
    d.index_type = GRAPHEP_INDEX_INT32;
    d.topk_weights = r[i].w;
    d.num_tokens = r[i].n;
    da[i] = d;
    graphep_combine_args_t c = GRAPHEP_COMBINE_ARGS_INIT;
    c.out = r[i].out;
    ca[i] = c;
  }
  char label[128];
  /* Eager: every rank enqueued before any waits. */
  for (int round = 0; round < 3; ++round) {
    new_inputs(r, local, cfg.num_experts);
    for (int i = 0; i < local; ++i) {
      CHECK_CUDA(cudaSetDevice(r[i].device));
      CHECK_G(graphep_dispatch(r[i].engine, &da[i], r[i].stream));
      identity_expert(&r[i], r[i].stream);
      CHECK_G(graphep_combine(r[i].engine, &ca[i], r[i].stream));
    }
    for (int i = 0; i < local; ++i) CHECK_CUDA(cudaStreamSynchronize(r[i].stream));
    snprintf(label, sizeof label, "%s eager round %d", what, round);
    check_outputs(r, local, label);
  }
  if (with_graph) {  /* MoeGraph with an expert child graph, swapped for a two-node one */
    graphep_graph_t graphs[MAX_LOCAL];
    cudaGraph_t experts[MAX_LOCAL][2];
    for (int i = 0; i < local; ++i) {
      CHECK_CUDA(cudaSetDevice(r[i].device));
      for (int v = 0; v < 2; ++v) {
        CHECK_CUDA(cudaStreamBeginCapture(r[i].stream, cudaStreamCaptureModeThreadLocal));
        if (v == 1) {
          CHECK_CUDA(cudaMemsetAsync(r[i].layout.expert_output, 0, (size_t)r[i].layout.capacity * H * 2, r[i].stream));
        }
        identity_expert(&r[i], r[i].stream);
        CHECK_CUDA(cudaStreamEndCapture(r[i].stream, &experts[i][v]));
      }
      CHECK_G(graphep_graph_create(r[i].engine, &da[i], &ca[i], experts[i][0], &graphs[i]));
    }
    for (int replay = 0; replay < 6; ++replay) {
      if (replay == 3) {
        for (int i = 0; i < local; ++i) CHECK_G(graphep_graph_set_experts(graphs[i], experts[i][1]));
      }
      new_inputs(r, local, cfg.num_experts);
      for (int i = 0; i < local; ++i) {
        CHECK_CUDA(cudaSetDevice(r[i].device));
        CHECK_G(graphep_graph_launch(graphs[i], r[i].stream));
      }
      for (int i = 0; i < local; ++i) CHECK_CUDA(cudaStreamSynchronize(r[i].stream));
      snprintf(label, sizeof label, "%s graph replay %d", what, replay);
      check_outputs(r, local, label);
    }
    for (int i = 0; i < local; ++i) {
      CHECK_G(graphep_graph_destroy(graphs[i]));
      CHECK_CUDA(cudaGraphDestroy(experts[i][0]));
      CHECK_CUDA(cudaGraphDestroy(experts[i][1]));
    }
  }
  for (int i = 0; i < local; ++i) {
    graphep_moe_status_t st = GRAPHEP_MOE_STATUS_INIT;
    CHECK_G(graphep_engine_status(r[i].engine, &st));
    EXPECT(st.invalid_expert_ids == 0 && st.dropped_rows == 0 && st.clamped_token_counts == 0 && !st.device_error &&
               st.unpaired_dispatches == 0 && st.unpaired_combines == 0,
           "%s: rank %d status not clean", what, i);
  }
  for (int i = 0; i < local; ++i) {
    CHECK_CUDA(cudaSetDevice(r[i].device));
    CHECK_CUDA(cudaFree(r[i].x));
    CHECK_CUDA(cudaFree(r[i].idx));
    CHECK_CUDA(cudaFree(r[i].w));
    CHECK_CUDA(cudaFree(r[i].n));
    CHECK_CUDA(cudaFree(r[i].out));
    CHECK_CUDA(cudaStreamDestroy(r[i].stream));
    CHECK_G(graphep_engine_destroy(r[i].engine));
  }
  free(r);
}

static void argument_errors(graphep_comm_t comm) {
  graphep_moe_config_t cfg = GRAPHEP_MOE_CONFIG_INIT;
  cfg.max_tokens_per_rank = 8;
  cfg.hidden = 7; /* not a multiple of 8 */
  cfg.num_experts = 4;
  cfg.top_k = 2;
  graphep_engine_t engines[MAX_LOCAL];
  int local = 0;
  CHECK_G(graphep_comm_local_ranks(comm, &local));
  graphep_status_t s = graphep_engine_create_all(comm, &cfg, engines, local);
  EXPECT(s == GRAPHEP_INVALID_ARGUMENT, "hidden=7: status %s", graphep_status_name(s));
  EXPECT(strstr(graphep_last_error(), "hidden=7") != NULL, "hidden=7: message \"%s\"", graphep_last_error());
  graphep_moe_config_t old = cfg;
  old.struct_size = 8; /* a caller that did not initialise the struct */
  s = graphep_engine_create_all(comm, &old, engines, local);
  EXPECT(s == GRAPHEP_INVALID_ARGUMENT && strstr(graphep_last_error(), "struct_size=8") != NULL,
         "struct_size=8: %s \"%s\"", graphep_status_name(s), graphep_last_error());
  s = graphep_dispatch(NULL, NULL, 0);
  EXPECT(s == GRAPHEP_INVALID_ARGUMENT, "NULL engine: status %s", graphep_status_name(s));
}

int main(void) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    printf("SKIP: no CUDA device (graphep %s)\n", graphep_version());
    return SKIP;
  }
  /* A local group: two emulated ranks on GPU 0. */
  const int local_devices[2] = {0, 0};
  graphep_comm_t comm = NULL;
  CHECK_G(graphep_comm_create_local_group(local_devices, 2, &comm));
  argument_errors(comm);
  run_engines(comm, "local group", 1);
  CHECK_G(graphep_comm_destroy(comm));

  /* Caller-owned NCCL communicators: one rank per GPU (NCCL allows one rank per device). */
  const int n = devices >= 2 ? 2 : 1;
  int devlist[2] = {0, 1};
  ncclComm_t nccl[2];
  if (ncclCommInitAll(nccl, n, devlist) != ncclSuccess) {
    fprintf(stderr, "FAILED: ncclCommInitAll\n");
    return 1;
  }
  CHECK_G(graphep_comm_adopt_nccl(nccl, n, &comm));
  run_engines(comm, n == 2 ? "adopted NCCL, 2 GPUs" : "adopted NCCL, 1 GPU", 0);
  CHECK_G(graphep_comm_destroy(comm));
  for (int i = 0; i < n; ++i) ncclCommDestroy(nccl[i]);

  if (failures != 0) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  printf("C API: all checks passed\n");
  return 0;
}
