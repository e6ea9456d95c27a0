/* The C ABI end to end, compiled as C11: every layout field, every config field and the status
 * checked against references computed here, in C, from all ranks' inputs.
 *
 * Communicators: a local group (two emulated ranks on GPU 0), then caller-owned NCCL
 * communicators (one rank per visible GPU, at most 8). This process drives every rank, so the
 * reference sees every source. Each config below runs eagerly, some also as MoeGraphs:
 *
 *   rank s: x[T_s, H], topk_idx[T_s, K], w[T_s, K]
 *      | dispatch          poison first: recv_x and row metadata 0x5a bytes, out 0xffff
 *      v
 *   dest d: recv_x  [ e0 rows | pad | e1 rows | pad | ... ]  unused rows keep 0x5a to capacity
 *      |   checked: every row, offsets, counts, dropped, totals, metadata, fp8 bytes and scales
 *      | host expert     y[row] = bf16(g(e) * x[row]), g(e) = 1 + e / 8, for the documented rows
 *      v                 only; every other row of expert_output NaN (a row combine must not read)
 *   rank s: out[t] = sum over kept slots k of w[t][k] * y(t, k); rows t >= T keep 0xffff
 *
 * The reference layout: rows grouped by local expert, within an expert in (source rank, token,
 * slot) order, each expert's first row at a multiple of expert_alignment; past recv_capacity the
 * rows are dropped (offsets clamped to the capacity, counts of the rows kept, expert_dropped of the
 * rest). The reference combine (a distinct g per expert, so permuted slots, weights or experts
 * show): per destination rank an fp32 fmaf over the kept slots in ascending slot order, rounded to
 * bf16; at home the destinations' partials summed in ascending rank order in fp32, rounded to
 * bf16. Bit-exact when a token's kept slots all live on one destination rank; otherwise within
 * (sum_r |S_r| + |S|) * 2^-8 + 1e-6 of the exact sum S = sum_r S_r. fp8 dispatch: recv_x bytes and
 * scales compared with the e4m3 encoder below; the expert dequantises (byte * scale).
 *
 * Configs: bf16 / int32 / AUTO (LATENCY picked); fp8 / int64 on both paths; THROUGHPUT;
 * expert_alignment 8; a recv_capacity that drops rows (every token's first choice is expert 1);
 * strict with clean inputs; invalid ids (999, -5, 5e9) with live counts T_max + 5 and -3 (status
 * first_* fields; entries past the live count are never read). Strict mode's trap runs in a child
 * process (this binary re-executed with --strict-child: a process that initialised CUDA cannot
 * fork a CUDA user), which must die of the trap's CUDA error (exit 3), within a time limit.
 *
 * Latency halves (API version 5): round 0 passes version-4-sized dispatch and combine structs whose
 * version-5 fields hold values the library would refuse (so they must not be read); later rounds
 * enqueue each dispatch and combine as its send half on every rank, then graphep_receive on every
 * rank, the combine bringing topk_weights (the dispatch's own, so the reference above holds) and the
 * dispatch adding its per-expert rows to recv_stats. A receive with no send half waiting is refused.
 *
 * Graphs (MoeGraph with an expert child graph, swapped between replays): the identity expert
 * (expert_output = recv_x, checked as out[t] = sum_k w_k x_t), the same after a memset, then the
 * host expert above as captured nodes (copies to pinned memory, a host node, the copy back), so
 * replays are checked against the per-expert reference too.
 *
 * Exit 77 (skipped) without a usable GPU, unless GRAPHEP_EXPECT_GPUS says the machine has one:
 * then a missing GPU or a CUDA error at start fails (tests/common/gpu_env.hpp's rule). */
#define _POSIX_C_SOURCE 200809L

#include <graphep/graphep.h>

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char** environ;

#define SKIP 77
#define STRICT_CHILD_ARG "--strict-child"
#define STRICT_CHILD_TRAPPED 3   /* the child's exit status when the trap killed its CUDA context */
#define STRICT_CHILD_LIMIT_S 120 /* the child is killed past this */
#define EXPECT_GPUS_VAR "GRAPHEP_EXPECT_GPUS"

/* T_max tokens per rank, hidden H (two fp8 tiles of 128 values), top-k K, L local experts. */
enum { T_MAX = 32, H = 256, K = 3, L = 4, MAX_RANKS = 8, TILE = 128, SC = H / TILE };

#define POISON_BYTE 0x5a
#define POISON_WORD 0x5a5a5a5au
#define OUT_POISON 0xffffu /* out rows past the live count */
#define BF16_NAN 0x7fc0u   /* expert_output rows no documented row maps to */
#define MAX_REPORTS 4      /* mismatches printed per check */

static int failures = 0;

#define CHECK_G(call)                                                                             \
  do {                                                                                            \
    graphep_status_t s_ = (call);                                                                 \
    if (s_ != GRAPHEP_SUCCESS) {                                                                  \
      fprintf(stderr, "%s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #call, graphep_status_name(s_), \
              graphep_last_error());                                                              \
      exit(1);                                                                                    \
    }                                                                                             \
  } while (0)
#define CHECK_CUDA(call)                                                                                       \
  do {                                                                                                         \
    cudaError_t e_ = (call);                                                                                   \
    if (e_ != cudaSuccess) {                                                                                   \
      fprintf(stderr, "%s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #call, cudaGetErrorName(e_),                 \
              cudaGetErrorString(e_));                                                                         \
      exit(1);                                                                                                 \
    }                                                                                                          \
  } while (0)
#define EXPECT(cond, ...)                      \
  do {                                         \
    if (!(cond)) {                             \
      fprintf(stderr, "FAILED: " __VA_ARGS__); \
      fprintf(stderr, "\n");                   \
      ++failures;                              \
    }                                          \
  } while (0)

/* One check's wrong elements: counted, the first MAX_REPORTS printed, one failure per check. */
typedef struct {
  const char* label;
  long long wrong;
} tally_t;

static void wrong(tally_t* c, const char* fmt, ...) {
  if (c->wrong++ < MAX_REPORTS) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", c->label);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
  }
}

static void close_tally(const tally_t* c, const char* what) {
  EXPECT(c->wrong == 0, "%s: %lld wrong %s", c->label, c->wrong, what);
}

/* --- Numbers ---------------------------------------------------------------------------------- */

static uint32_t lcg = 12345u;
static uint32_t next_u32(void) {
  lcg = lcg * 1664525u + 1013904223u;
  return lcg >> 8;
}
static int next_below(int n) { return (int)(next_u32() % (uint32_t)n); }
static float next_uniform(float lo, float hi) { return lo + (hi - lo) * (float)(next_u32() & 0xffffff) / 16777216.0f; }

static uint16_t to_bf16(float f) { /* round to nearest even */
  if (isnan(f)) return BF16_NAN;
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static float from_bf16(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static float round_bf16(float f) { return from_bf16(to_bf16(f)); }
static uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

/* fp32 -> e4m3 (bias 7, no infinities, 0x7f NaN), round to nearest even, saturating to +-448. */
static uint8_t e4m3_encode(float x) {
  const uint8_t sign = signbit(x) ? 0x80 : 0x00;
  const float a = fabsf(x);
  if (a >= 448.0f) return sign | 0x7e;
  if (a < 0.015625f) return sign | (uint8_t)rintf(a * 512.0f); /* subnormal: multiples of 2^-9 (8: 2^-6) */
  int ex = 0;
  (void)frexpf(a, &ex); /* a in [2^(ex-1), 2^ex) */
  int e = ex - 1;
  int m = (int)rintf(ldexpf(a, 3 - e)); /* [8, 16]: exact scaling, then the one rounding */
  if (m == 16) {
    m = 8;
    ++e;
  }
  return sign | (uint8_t)(((e + 7) << 3) | (m - 8));
}
static float e4m3_decode(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const float v = e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), e - 10);
  return (b & 0x80) ? -v : v;
}

/* One token's row as fp8 tiles: scale = amax / 448 (1 when amax is 0), bytes e4m3(x * (1 / scale)). */
static void fp8_encode_row(const uint16_t* x, uint8_t* q, float* scales) {
  for (int tile = 0; tile < SC; ++tile) {
    float amax = 0.0f;
    for (int i = 0; i < TILE; ++i) amax = fmaxf(amax, fabsf(from_bf16(x[tile * TILE + i])));
    const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
    const float inv = 1.0f / scale;
    scales[tile] = scale;
    for (int i = 0; i < TILE; ++i) {
      const float v = from_bf16(x[tile * TILE + i]) * inv;
      q[tile * TILE + i] = e4m3_encode(v);
    }
  }
}

/* The expert's factor: distinct per global expert, exact in fp32. */
static float expert_gain(long long e) { return 1.0f + (float)e / 8.0f; }

/* --- Ranks ------------------------------------------------------------------------------------ */

typedef enum { EXPERT_SCALED, EXPERT_IDENTITY } expert_kind_t;

/* The input of an expert: a layout's contents on the host. */
typedef struct {
  int fp8;
  long long capacity;
  int first_expert;
  const void* recv_x;   /* [capacity, H] bf16 or e4m3 */
  const float* scales;  /* fp8: [capacity, SC] */
  const int* offsets;   /* [L + 1] */
  const int* counts;    /* [L] */
} expert_input_t;

/* What a graph's host node works on (pinned copies of the layout made by the graph's own nodes). */
typedef struct {
  expert_input_t in;
  uint16_t* y; /* [capacity, H] */
  int calls;
} host_node_t;

typedef struct {
  graphep_engine_t engine;
  graphep_layout_t lay;
  cudaStream_t stream;
  int device;
  /* Device inputs and outputs. */
  void *x, *idx, *out, *expert_out;
  float* w;
  int* n;
  int* stats; /* [L] recv_stats of a halves run */
  unsigned long long exp_stats[L];
  /* Host inputs of the current round. */
  uint16_t hx[T_MAX * H];
  long long hid[T_MAX * K];
  float hw[T_MAX * K];
  uint8_t q8[T_MAX * H]; /* the reference fp8 encoding of x */
  float sc8[T_MAX * SC];
  int raw_T; /* the live count passed */
  int T;     /* ... clamped to [0, T_max] */
  /* Reference, as a source: the destination row of each (token, slot), -1 dropped, -2 none. */
  int dst_rank[T_MAX * K];
  long long dst_row[T_MAX * K];
  /* Reference, as a destination. */
  int ref_offsets[L + 1], ref_counts[L], ref_dropped[L], ref_rows;
  unsigned long long ref_totals[L]; /* cumulative */
  unsigned char* ref_valid;         /* [capacity] */
  int *ref_src, *ref_tok, *ref_slot;
  float* ref_w;
  /* Expected status (cumulative). */
  unsigned long long exp_invalid, exp_dropped, exp_clamped;
  int exp_first_clamped;
  /* Read back. */
  uint8_t* hb_x; /* [capacity, H] elements of 1 or 2 bytes */
  float* hb_sc;
  int *hb_src, *hb_tok, *hb_slot;
  float* hb_w;
  int hb_offsets[L + 1], hb_counts[L], hb_dropped[L], hb_rows;
  unsigned long long hb_totals[L];
  uint16_t* hy;                 /* [capacity, H]: the eager host expert's output */
  uint16_t hout[T_MAX * H];
  /* Graph host expert. */
  host_node_t node;
  void *pin_x, *pin_sc, *pin_offsets, *pin_counts, *pin_y;
} rank_t;

/* One config's run over one communicator. */
typedef struct {
  const char* name;
  int dtype;
  int index_type;
  int path;
  int alignment;
  int capacity_per_rank; /* 0: the worst case; else recv_capacity = this x world size */
  int strict;
  int skew;              /* every token's first choice is expert 1 */
  int bad_input;         /* invalid ids, live counts T_max + 5 (even ranks) and -3 (odd ranks) */
  int caller_output;     /* combine reads the caller's expert output, not the layout's */
  int halves;            /* latency path: round 0 version-4 structs, then send halves + graphep_receive */
  int graphs;
  int rounds;
} run_cfg_t;

static const run_cfg_t kRuns[] = {
    {.name = "bf16 int32 auto", .dtype = GRAPHEP_DTYPE_BF16, .index_type = GRAPHEP_INDEX_INT32,
     .path = GRAPHEP_PATH_AUTO, .alignment = 1, .graphs = 1, .rounds = 3},
    {.name = "fp8 int64 auto", .dtype = GRAPHEP_DTYPE_FP8_E4M3, .index_type = GRAPHEP_INDEX_INT64,
     .path = GRAPHEP_PATH_AUTO, .alignment = 1, .caller_output = 1, .graphs = 1, .rounds = 2},
    {.name = "bf16 int32 throughput", .dtype = GRAPHEP_DTYPE_BF16, .index_type = GRAPHEP_INDEX_INT32,
     .path = GRAPHEP_PATH_THROUGHPUT, .alignment = 1, .caller_output = 1, .graphs = 1, .rounds = 2},
    {.name = "fp8 int64 throughput", .dtype = GRAPHEP_DTYPE_FP8_E4M3, .index_type = GRAPHEP_INDEX_INT64,
     .path = GRAPHEP_PATH_THROUGHPUT, .alignment = 1, .rounds = 2},
    {.name = "alignment 8", .dtype = GRAPHEP_DTYPE_BF16, .index_type = GRAPHEP_INDEX_INT32,
     .path = GRAPHEP_PATH_AUTO, .alignment = 8, .rounds = 2},
    {.name = "capacity 20 x world, skewed", .dtype = GRAPHEP_DTYPE_BF16, .index_type = GRAPHEP_INDEX_INT32,
     .path = GRAPHEP_PATH_AUTO, .alignment = 1, .capacity_per_rank = 20, .skew = 1, .rounds = 2},
    {.name = "capacity 20 x world, skewed, alignment 4, throughput", .dtype = GRAPHEP_DTYPE_BF16,
     .index_type = GRAPHEP_INDEX_INT32, .path = GRAPHEP_PATH_THROUGHPUT, .alignment = 4, .capacity_per_rank = 20,
     .skew = 1, .caller_output = 1, .rounds = 2},
    {.name = "latency halves, combine-time weights", .dtype = GRAPHEP_DTYPE_BF16, .index_type = GRAPHEP_INDEX_INT32,
     .path = GRAPHEP_PATH_LATENCY, .alignment = 1, .halves = 1, .rounds = 3},
    {.name = "strict, clean inputs", .dtype = GRAPHEP_DTYPE_BF16, .index_type = GRAPHEP_INDEX_INT32,
     .path = GRAPHEP_PATH_AUTO, .alignment = 1, .strict = 1, .rounds = 2},
    {.name = "invalid ids and live counts, auto", .dtype = GRAPHEP_DTYPE_BF16, .index_type = GRAPHEP_INDEX_INT64,
     .path = GRAPHEP_PATH_AUTO, .alignment = 1, .bad_input = 1, .rounds = 2},
    {.name = "invalid ids and live counts, throughput", .dtype = GRAPHEP_DTYPE_BF16,
     .index_type = GRAPHEP_INDEX_INT32, .path = GRAPHEP_PATH_THROUGHPUT, .alignment = 1, .bad_input = 1,
     .rounds = 2},
};

/* The invalid entries of a bad_input run: (token, slot, id); T_max + 5 keeps them all live. */
typedef struct {
  int token, slot;
  long long id;
} bad_entry_t;
static const bad_entry_t kBadEntries[] = {{1, 2, 999}, {5, 0, -5}, {17, 1, 5000000000ll}};
enum { NUM_BAD = sizeof kBadEntries / sizeof kBadEntries[0] };

typedef struct {
  const run_cfg_t* cfg;
  const char* comm_name;
  rank_t* r;
  int world;
  int experts;
  long long capacity;
  int fp8;
  size_t x_bytes; /* bytes of one recv_x element */
  char label[256];
} run_t;

static void set_label(run_t* run, const char* fmt, ...) {
  int n = snprintf(run->label, sizeof run->label, "%s / %s: ", run->comm_name, run->cfg->name);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(run->label + n, sizeof run->label - (size_t)n, fmt, ap);
  va_end(ap);
}

static void download(rank_t* q, void* dst, const void* src, size_t bytes) {
  CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, q->stream));
}

/* --- Inputs ----------------------------------------------------------------------------------- */

/* Fresh inputs for every rank, uploaded (stream-ordered) with the layout and out poisoned. */
static void new_inputs(run_t* run) {
  const run_cfg_t* c = run->cfg;
  const int E = run->experts;
  for (int i = 0; i < run->world; ++i) {
    rank_t* q = &run->r[i];
    if (c->bad_input) {
      q->raw_T = i % 2 == 0 ? T_MAX + 5 : -3;
    } else if (c->skew) {
      q->raw_T = 24 + next_below(T_MAX - 24 + 1); /* expert 1 gets >= 24 rows per rank: it overflows */
    } else {
      q->raw_T = 1 + next_below(T_MAX);
    }
    q->T = q->raw_T < 0 ? 0 : (q->raw_T > T_MAX ? T_MAX : q->raw_T);
    for (int j = 0; j < T_MAX * H; ++j) q->hx[j] = to_bf16(next_uniform(-1.0f, 1.0f));
    const int zero_token = next_below(T_MAX); /* an all-zero fp8 tile: scale 1 */
    for (int j = 0; j < TILE; ++j) q->hx[zero_token * H + TILE + j] = 0;
    for (int t = 0; t < T_MAX; ++t) {
      /* K distinct experts, except: slot 2 sometimes repeats slot 0's expert (two rows of one
       * expert for one token), slots past 0 sometimes -1; skewed: slot 0 is expert 1. */
      long long* id = &q->hid[t * K];
      id[0] = c->skew ? 1 : next_below(E);
      for (int k = 1; k < K; ++k) {
        long long e;
        int again;
        do {
          e = next_below(E);
          again = 0;
          for (int kk = 0; kk < k; ++kk) again |= id[kk] == e;
        } while (again && E > K);
        id[k] = e;
      }
      if (next_below(8) == 0) id[2] = id[0];
      for (int k = 1; k < K; ++k) {
        if (next_below(6) == 0) id[k] = -1;
      }
      for (int k = 0; k < K; ++k) q->hw[t * K + k] = next_uniform(0.1f, 1.0f);
      fp8_encode_row(&q->hx[t * H], &q->q8[t * H], &q->sc8[t * SC]);
    }
    if (c->bad_input) {
      for (int b = 0; b < NUM_BAD; ++b) {
        long long id = kBadEntries[b].id;
        if (c->index_type == GRAPHEP_INDEX_INT32 && (id > INT32_MAX || id < INT32_MIN)) id = 1000000;
        q->hid[kBadEntries[b].token * K + kBadEntries[b].slot] = id;
      }
    }
    CHECK_CUDA(cudaSetDevice(q->device));
    CHECK_CUDA(cudaMemcpyAsync(q->x, q->hx, sizeof q->hx, cudaMemcpyHostToDevice, q->stream));
    if (c->index_type == GRAPHEP_INDEX_INT64) {
      CHECK_CUDA(cudaMemcpyAsync(q->idx, q->hid, sizeof q->hid, cudaMemcpyHostToDevice, q->stream));
    } else {
      static int32_t ids32[T_MAX * K];
      for (int j = 0; j < T_MAX * K; ++j) ids32[j] = (int32_t)q->hid[j];
      CHECK_CUDA(cudaMemcpyAsync(q->idx, ids32, sizeof ids32, cudaMemcpyHostToDevice, q->stream));
      CHECK_CUDA(cudaStreamSynchronize(q->stream)); /* ids32 is reused by the next rank */
    }
    CHECK_CUDA(cudaMemcpyAsync(q->w, q->hw, sizeof q->hw, cudaMemcpyHostToDevice, q->stream));
    CHECK_CUDA(cudaMemcpyAsync(q->n, &q->raw_T, sizeof q->raw_T, cudaMemcpyHostToDevice, q->stream));
    /* Poison everything the dispatch writes (expert_totals accumulate: not poisoned) and out. */
    const graphep_layout_t* y = &q->lay;
    const size_t cap = (size_t)run->capacity;
    CHECK_CUDA(cudaMemsetAsync(y->recv_x, POISON_BYTE, cap * H * run->x_bytes, q->stream));
    if (run->fp8) CHECK_CUDA(cudaMemsetAsync(y->recv_scales, POISON_BYTE, cap * SC * sizeof(float), q->stream));
    CHECK_CUDA(cudaMemsetAsync((void*)y->expert_offsets, POISON_BYTE, (L + 1) * sizeof(int), q->stream));
    CHECK_CUDA(cudaMemsetAsync((void*)y->expert_counts, POISON_BYTE, L * sizeof(int), q->stream));
    CHECK_CUDA(cudaMemsetAsync((void*)y->expert_dropped, POISON_BYTE, L * sizeof(int), q->stream));
    CHECK_CUDA(cudaMemsetAsync((void*)y->num_recv_rows, POISON_BYTE, sizeof(int), q->stream));
    CHECK_CUDA(cudaMemsetAsync((void*)y->row_src_rank, POISON_BYTE, cap * sizeof(int), q->stream));
    CHECK_CUDA(cudaMemsetAsync((void*)y->row_src_token, POISON_BYTE, cap * sizeof(int), q->stream));
    CHECK_CUDA(cudaMemsetAsync((void*)y->row_topk_slot, POISON_BYTE, cap * sizeof(int), q->stream));
    CHECK_CUDA(cudaMemsetAsync((void*)y->row_weight, POISON_BYTE, cap * sizeof(float), q->stream));
    CHECK_CUDA(cudaMemsetAsync(q->out, 0xff, (size_t)T_MAX * H * 2, q->stream));
  }
}

/* The reference layout of every destination (and every source's view of where its slots went),
 * for the inputs of this round; the expected status advanced by one dispatch. */
static void reference_layouts(run_t* run) {
  const long long cap = run->capacity;
  const int A = run->cfg->alignment;
  for (int s = 0; s < run->world; ++s) {
    rank_t* q = &run->r[s];
    for (int n = 0; n < T_MAX * K; ++n) {
      q->dst_rank[n] = -1;
      q->dst_row[n] = -2;
    }
    if (q->raw_T != q->T) {
      if (q->exp_clamped == 0) q->exp_first_clamped = q->raw_T;
      ++q->exp_clamped;
    }
    for (int n = 0; n < q->T * K; ++n) {
      if (q->hid[n] != -1 && (q->hid[n] < 0 || q->hid[n] >= run->experts)) ++q->exp_invalid;
    }
  }
  for (int d = 0; d < run->world; ++d) {
    rank_t* D = &run->r[d];
    memset(D->ref_valid, 0, (size_t)cap);
    long long off = 0;
    D->ref_rows = 0;
    for (int j = 0; j < L; ++j) {
      const long long e = (long long)d * L + j;
      int count = 0;
      for (int s = 0; s < run->world; ++s) {
        for (int n = 0; n < run->r[s].T * K; ++n) count += run->r[s].hid[n] == e;
      }
      const long long first = off < cap ? off : cap;
      const int kept = (int)(count < cap - first ? count : cap - first);
      D->ref_offsets[j] = (int)first;
      D->ref_counts[j] = kept;
      D->ref_dropped[j] = count - kept;
      D->ref_totals[j] += (unsigned long long)count;
      D->exp_dropped += (unsigned long long)(count - kept);
      D->ref_rows += kept;
      int index = 0;
      for (int s = 0; s < run->world; ++s) { /* (source rank, token, slot) order */
        rank_t* S = &run->r[s];
        for (int n = 0; n < S->T * K; ++n) {
          if (S->hid[n] != e) continue;
          S->dst_rank[n] = d;
          if (index < kept) {
            const long long row = off + index;
            S->dst_row[n] = row;
            D->ref_valid[row] = 1;
            D->ref_src[row] = s;
            D->ref_tok[row] = n / K;
            D->ref_slot[row] = n % K;
            D->ref_w[row] = S->hw[n];
          } else {
            S->dst_row[n] = -1;
          }
          ++index;
        }
      }
      off += ((long long)count + A - 1) / A * A;
    }
    D->ref_offsets[L] = (int)(off < cap ? off : cap);
  }
}

/* --- Checks ----------------------------------------------------------------------------------- */

/* Reads rank d's layout back and compares every field with the reference; unused rows must hold
 * the poison. Leaves the copy in the rank's hb_* buffers (the eager host expert's input). */
static void check_layout(run_t* run, int d) {
  rank_t* q = &run->r[d];
  const graphep_layout_t* y = &q->lay;
  const size_t cap = (size_t)run->capacity;
  CHECK_CUDA(cudaSetDevice(q->device));
  download(q, q->hb_x, y->recv_x, cap * H * run->x_bytes);
  if (run->fp8) download(q, q->hb_sc, y->recv_scales, cap * SC * sizeof(float));
  download(q, q->hb_offsets, y->expert_offsets, sizeof q->hb_offsets);
  download(q, q->hb_counts, y->expert_counts, sizeof q->hb_counts);
  download(q, q->hb_dropped, y->expert_dropped, sizeof q->hb_dropped);
  download(q, &q->hb_rows, y->num_recv_rows, sizeof q->hb_rows);
  download(q, q->hb_totals, y->expert_totals, sizeof q->hb_totals);
  download(q, q->hb_src, y->row_src_rank, cap * sizeof(int));
  download(q, q->hb_tok, y->row_src_token, cap * sizeof(int));
  download(q, q->hb_slot, y->row_topk_slot, cap * sizeof(int));
  download(q, q->hb_w, y->row_weight, cap * sizeof(float));
  CHECK_CUDA(cudaStreamSynchronize(q->stream));

  char label[320];
  snprintf(label, sizeof label, "%s, rank %d layout", run->label, d);
  tally_t c = {label, 0};
  for (int j = 0; j <= L; ++j) {
    if (q->hb_offsets[j] != q->ref_offsets[j]) {
      wrong(&c, "expert_offsets[%d] = %d, reference %d", j, q->hb_offsets[j], q->ref_offsets[j]);
    }
  }
  for (int j = 0; j < L; ++j) {
    if (q->hb_counts[j] != q->ref_counts[j]) {
      wrong(&c, "expert_counts[%d] = %d, reference %d", j, q->hb_counts[j], q->ref_counts[j]);
    }
    if (q->hb_dropped[j] != q->ref_dropped[j]) {
      wrong(&c, "expert_dropped[%d] = %d, reference %d", j, q->hb_dropped[j], q->ref_dropped[j]);
    }
    if (q->hb_totals[j] != q->ref_totals[j]) {
      wrong(&c, "expert_totals[%d] = %llu, reference %llu", j, q->hb_totals[j], q->ref_totals[j]);
    }
  }
  if (q->hb_rows != q->ref_rows) wrong(&c, "num_recv_rows = %d, reference %d", q->hb_rows, q->ref_rows);

  const uint16_t* xb = (const uint16_t*)q->hb_x;
  for (size_t row = 0; row < cap; ++row) {
    if (q->ref_valid[row]) {
      const int s = q->ref_src[row], t = q->ref_tok[row], k = q->ref_slot[row];
      const rank_t* S = &run->r[s];
      if (q->hb_src[row] != s || q->hb_tok[row] != t || q->hb_slot[row] != k ||
          float_bits(q->hb_w[row]) != float_bits(q->ref_w[row])) {
        wrong(&c, "row %zu: (src rank, token, slot, weight) = (%d, %d, %d, %g), reference (%d, %d, %d, %g)", row,
              q->hb_src[row], q->hb_tok[row], q->hb_slot[row], (double)q->hb_w[row], s, t, k, (double)q->ref_w[row]);
      }
      int bad = -1;
      for (int h = 0; h < H && bad < 0; ++h) {
        if (run->fp8 ? q->hb_x[row * H + h] != S->q8[t * H + h] : xb[row * H + h] != S->hx[t * H + h]) bad = h;
      }
      if (bad >= 0) {
        wrong(&c, "recv_x[%zu][%d] = 0x%x, reference 0x%x (rank %d token %d)", row, bad,
              run->fp8 ? q->hb_x[row * H + bad] : xb[row * H + bad], run->fp8 ? S->q8[t * H + bad] : S->hx[t * H + bad],
              s, t);
      }
      for (int tile = 0; run->fp8 && tile < SC; ++tile) {
        if (float_bits(q->hb_sc[row * SC + tile]) != float_bits(S->sc8[t * SC + tile])) {
          wrong(&c, "recv_scales[%zu][%d] = %a, reference %a", row, tile, (double)q->hb_sc[row * SC + tile],
                (double)S->sc8[t * SC + tile]);
        }
      }
    } else {  /* padding, dropped or unused: untouched */
      if ((uint32_t)q->hb_src[row] != POISON_WORD || (uint32_t)q->hb_tok[row] != POISON_WORD ||
          (uint32_t)q->hb_slot[row] != POISON_WORD || float_bits(q->hb_w[row]) != POISON_WORD) {
        wrong(&c, "row %zu (no row of the reference) metadata written: (%d, %d, %d, %g)", row, q->hb_src[row],
              q->hb_tok[row], q->hb_slot[row], (double)q->hb_w[row]);
      }
      for (size_t b = 0; b < H * run->x_bytes; ++b) {
        if (q->hb_x[row * H * run->x_bytes + b] != POISON_BYTE) {
          wrong(&c, "row %zu (no row of the reference) recv_x written (byte %zu = 0x%02x)", row, b,
                q->hb_x[row * H * run->x_bytes + b]);
          break;
        }
      }
      for (int tile = 0; run->fp8 && tile < SC; ++tile) {
        if (float_bits(q->hb_sc[row * SC + tile]) != POISON_WORD) {
          wrong(&c, "row %zu (no row of the reference) recv_scales[%d] written", row, tile);
        }
      }
    }
  }
  close_tally(&c, "layout elements");
}

/* Element h of recv_x row `row` as the expert sees it (fp8: dequantised). */
static float expert_x(const expert_input_t* in, long long row, int h) {
  if (!in->fp8) return from_bf16(((const uint16_t*)in->recv_x)[row * H + h]);
  return e4m3_decode(((const uint8_t*)in->recv_x)[row * H + h]) * in->scales[row * SC + h / TILE];
}

/* The host expert: y[row] = bf16(g(e) * x[row]) for the rows the layout documents, found as a real
 * expert finds them (from the offsets and counts); NaN in every other row. */
static void host_expert(const expert_input_t* in, uint16_t* y) {
  for (long long i = 0; i < in->capacity * H; ++i) y[i] = BF16_NAN;
  for (int j = 0; j < L; ++j) {
    const long long first = in->offsets[j], n = in->counts[j];
    if (first < 0 || n < 0 || first + n > in->capacity) continue; /* a bad layout: check_layout says so */
    const float g = expert_gain(in->first_expert + j);
    for (long long row = first; row < first + n; ++row) {
      for (int h = 0; h < H; ++h) y[row * H + h] = to_bf16(g * expert_x(in, row, h));
    }
  }
}

static void CUDART_CB host_expert_node(void* user) {
  host_node_t* node = (host_node_t*)user;
  host_expert(&node->in, node->y);
  ++node->calls;
}

/* y(t, k) of source s's slot n = t * K + k, element h: what the expert computes from the
 * reference's recv_x row. */
static float reference_y(const run_t* run, const rank_t* S, int n, int h, expert_kind_t kind) {
  const int t = n / K;
  const float x = run->fp8 ? e4m3_decode(S->q8[t * H + h]) * S->sc8[t * SC + h / TILE] : from_bf16(S->hx[t * H + h]);
  return kind == EXPERT_IDENTITY ? round_bf16(x) : round_bf16(expert_gain(S->hid[n]) * x);
}

/* out of every rank against the reference combine; rows past the live count keep the poison. */
static void check_outputs(run_t* run, expert_kind_t kind) {
  for (int s = 0; s < run->world; ++s) {
    rank_t* S = &run->r[s];
    CHECK_CUDA(cudaSetDevice(S->device));
    download(S, S->hout, S->out, sizeof S->hout);
    CHECK_CUDA(cudaStreamSynchronize(S->stream));
    char label[320];
    snprintf(label, sizeof label, "%s, rank %d out", run->label, s);
    tally_t c = {label, 0};
    for (int t = 0; t < S->T; ++t) {
      int kept_dests = 0; /* destination ranks holding a kept row of the token */
      for (int d = 0; d < run->world; ++d) {
        int kept = 0;
        for (int k = 0; k < K; ++k) kept |= S->dst_rank[t * K + k] == d && S->dst_row[t * K + k] >= 0;
        kept_dests += kept;
      }
      for (int h = 0; h < H; ++h) {
        float acc = 0.0f;
        double exact = 0.0, magnitude = 0.0;
        for (int d = 0; d < run->world; ++d) {
          float partial = 0.0f;
          double part_exact = 0.0;
          int any = 0;
          for (int k = 0; k < K; ++k) {
            const int n = t * K + k;
            if (S->dst_rank[n] != d) continue;
            any = 1;
            if (S->dst_row[n] < 0) continue; /* dropped: adds nothing */
            const float yv = reference_y(run, S, n, h, kind);
            partial = fmaf(S->hw[n], yv, partial);
            part_exact += (double)S->hw[n] * (double)yv;
          }
          if (!any) continue;
          acc = acc + round_bf16(partial);
          exact += part_exact;
          magnitude += fabs(part_exact);
        }
        const float ref = round_bf16(acc);
        const float got = from_bf16(S->hout[t * H + h]);
        const int ok = kept_dests <= 1 ? got == ref
                                       : fabs((double)got - exact) <= (magnitude + fabs(exact)) / 256.0 + 1e-6;
        if (!ok) {
          wrong(&c, "out[%d][%d] = %.8g, reference %.8g (exact %.8g, %d destination ranks)", t, h, (double)got,
                (double)ref, exact, kept_dests);
        }
      }
    }
    for (int t = S->T; t < T_MAX; ++t) {
      for (int h = 0; h < H; ++h) {
        if (S->hout[t * H + h] != OUT_POISON) {
          wrong(&c, "out[%d][%d] = 0x%04x past the live count %d: written", t, h, S->hout[t * H + h], S->T);
          break;
        }
      }
    }
    close_tally(&c, "values");
  }
}

static void check_status(run_t* run) {
  for (int i = 0; i < run->world; ++i) {
    rank_t* q = &run->r[i];
    graphep_moe_status_t st = GRAPHEP_MOE_STATUS_INIT;
    CHECK_G(graphep_engine_status(q->engine, &st));
    const char* what = run->label;
    EXPECT(st.struct_size == sizeof st, "%s: rank %d status struct_size %zu", what, i, st.struct_size);
    EXPECT(st.invalid_expert_ids == q->exp_invalid, "%s: rank %d invalid_expert_ids %llu, expected %llu", what, i,
           st.invalid_expert_ids, q->exp_invalid);
    EXPECT(st.dropped_rows == q->exp_dropped, "%s: rank %d dropped_rows %llu, expected %llu", what, i, st.dropped_rows,
           q->exp_dropped);
    EXPECT(st.clamped_token_counts == q->exp_clamped, "%s: rank %d clamped_token_counts %llu, expected %llu", what, i,
           st.clamped_token_counts, q->exp_clamped);
    if (q->exp_clamped > 0) {
      EXPECT(st.first_clamped_count == q->exp_first_clamped, "%s: rank %d first_clamped_count %d, expected %d", what,
             i, st.first_clamped_count, q->exp_first_clamped);
    }
    if (q->exp_invalid > 0) { /* which entry is first is a race between device threads */
      int found = 0;
      for (int b = 0; b < NUM_BAD; ++b) {
        const bad_entry_t* e = &kBadEntries[b];
        found |= st.first_invalid_token == e->token && st.first_invalid_slot == e->slot &&
                 st.first_invalid_id == q->hid[e->token * K + e->slot];
      }
      EXPECT(found, "%s: rank %d first invalid entry (id %lld, token %d, slot %d) is none of those passed", what, i,
             st.first_invalid_id, st.first_invalid_token, st.first_invalid_slot);
    }
    EXPECT(!st.device_error && st.unpaired_dispatches == 0 && st.unpaired_combines == 0,
           "%s: rank %d device_error %d, unpaired dispatches %llu, combines %llu (%s)", what, i, st.device_error,
           st.unpaired_dispatches, st.unpaired_combines, graphep_last_error());
  }
}

/* --- Runs ------------------------------------------------------------------------------------- */

static void* target_of(const run_t* run, const rank_t* q) {
  return run->cfg->caller_output ? q->expert_out : q->lay.expert_output;
}

static void sync_all(run_t* run) {
  for (int i = 0; i < run->world; ++i) {
    CHECK_CUDA(cudaSetDevice(run->r[i].device));
    CHECK_CUDA(cudaStreamSynchronize(run->r[i].stream));
  }
}

/* How a round enqueues its dispatch and combine. */
typedef enum { OPS_WHOLE, OPS_V4_STRUCTS, OPS_HALVES } ops_t;
static const char* const kOpsNames[] = {"", ", version-4 structs", ", send halves + receive"};

/* Junk in a field past a version-4 caller's struct_size: refused by name if the library read it. */
#define NOT_READ_INT (-1)
#define NOT_READ_PTR ((void*)(uintptr_t)8)

/* Whole: as given. Version-4 structs: struct_size ends before the version-5 fields, which hold junk.
 * Halves: every rank's send half, then every rank's receive half. */
static void enqueue_ops(run_t* run, const graphep_dispatch_args_t* da, const graphep_combine_args_t* ca, int combine,
                        ops_t ops) {
  for (int i = 0; i < run->world; ++i) { /* every rank enqueued before any waits */
    rank_t* q = &run->r[i];
    graphep_dispatch_args_t d = da[i];
    graphep_combine_args_t o = ca[i];
    if (ops == OPS_V4_STRUCTS) {
      d.struct_size = offsetof(graphep_dispatch_args_t, scale_format);
      d.scale_format = NOT_READ_INT;
      d.recv_stats = (int*)NOT_READ_PTR;
      d.half = NOT_READ_INT;
      o.struct_size = offsetof(graphep_combine_args_t, topk_weights);
      o.topk_weights = (const float*)NOT_READ_PTR;
      o.half = NOT_READ_INT;
    } else if (ops == OPS_HALVES) {
      d.half = GRAPHEP_HALF_SEND;
      d.recv_stats = q->stats;
      o.half = GRAPHEP_HALF_SEND;
      o.topk_weights = q->w; /* the dispatch's weights: the whole operation's result */
    }
    CHECK_CUDA(cudaSetDevice(q->device));
    CHECK_G(combine ? graphep_combine(q->engine, &o, q->stream) : graphep_dispatch(q->engine, &d, q->stream));
  }
  for (int i = 0; ops == OPS_HALVES && i < run->world; ++i) {
    CHECK_CUDA(cudaSetDevice(run->r[i].device));
    CHECK_G(graphep_receive(run->r[i].engine, run->r[i].stream));
  }
}

/* dispatch on every rank -> read back and check each layout, the host expert -> combine. */
static void eager_round(run_t* run, const graphep_dispatch_args_t* da, const graphep_combine_args_t* ca, ops_t ops) {
  new_inputs(run);
  enqueue_ops(run, da, ca, 0, ops);
  sync_all(run);
  reference_layouts(run);
  for (int i = 0; i < run->world; ++i) {
    rank_t* q = &run->r[i];
    for (int j = 0; ops == OPS_HALVES && j < L; ++j) {
      q->exp_stats[j] += (unsigned long long)(q->ref_counts[j] + q->ref_dropped[j]);
    }
    check_layout(run, i);
    const expert_input_t in = {run->fp8, run->capacity, q->lay.first_local_expert, q->hb_x, q->hb_sc,
                               q->hb_offsets, q->hb_counts};
    host_expert(&in, q->hy);
    CHECK_CUDA(cudaMemcpyAsync(target_of(run, q), q->hy, (size_t)run->capacity * H * 2, cudaMemcpyHostToDevice,
                               q->stream));
  }
  enqueue_ops(run, da, ca, 1, ops);
  sync_all(run);
  check_outputs(run, EXPERT_SCALED);
}

typedef enum { VARIANT_IDENTITY, VARIANT_MEMSET_IDENTITY, VARIANT_HOST, NUM_VARIANTS } variant_t;
static const char* const kVariantNames[] = {"identity expert", "memset + identity expert", "host expert nodes"};

/* Captures rank q's expert graph of variant v. */
static cudaGraph_t capture_expert(run_t* run, rank_t* q, variant_t v) {
  const size_t cap = (size_t)run->capacity;
  void* target = target_of(run, q);
  cudaGraph_t g = NULL;
  CHECK_CUDA(cudaSetDevice(q->device));
  CHECK_CUDA(cudaStreamBeginCapture(q->stream, cudaStreamCaptureModeThreadLocal));
  if (v == VARIANT_MEMSET_IDENTITY) CHECK_CUDA(cudaMemsetAsync(target, 0, cap * H * 2, q->stream));
  if (v != VARIANT_HOST) {
    CHECK_CUDA(cudaMemcpyAsync(target, q->lay.recv_x, cap * H * 2, cudaMemcpyDeviceToDevice, q->stream));
  } else {
    CHECK_CUDA(cudaMemcpyAsync(q->pin_x, q->lay.recv_x, cap * H * run->x_bytes, cudaMemcpyDeviceToHost, q->stream));
    if (run->fp8) {
      CHECK_CUDA(cudaMemcpyAsync(q->pin_sc, q->lay.recv_scales, cap * SC * sizeof(float), cudaMemcpyDeviceToHost,
                                 q->stream));
    }
    CHECK_CUDA(cudaMemcpyAsync(q->pin_offsets, q->lay.expert_offsets, (L + 1) * sizeof(int), cudaMemcpyDeviceToHost,
                               q->stream));
    CHECK_CUDA(cudaMemcpyAsync(q->pin_counts, q->lay.expert_counts, L * sizeof(int), cudaMemcpyDeviceToHost,
                               q->stream));
    CHECK_CUDA(cudaLaunchHostFunc(q->stream, host_expert_node, &q->node));
    CHECK_CUDA(cudaMemcpyAsync(target, q->pin_y, cap * H * 2, cudaMemcpyHostToDevice, q->stream));
  }
  CHECK_CUDA(cudaStreamEndCapture(q->stream, &g));
  return g;
}

/* MoeGraphs over every rank, the expert child graph swapped between variants; every replay on
 * fresh inputs, its layout and outputs checked. */
static void graph_rounds(run_t* run, const graphep_dispatch_args_t* da, const graphep_combine_args_t* ca) {
  const size_t cap = (size_t)run->capacity;
  graphep_graph_t graphs[MAX_RANKS];
  const int first = run->fp8 ? VARIANT_HOST : VARIANT_IDENTITY; /* identity needs bf16 rows */
  for (int i = 0; i < run->world; ++i) {
    rank_t* q = &run->r[i];
    CHECK_CUDA(cudaSetDevice(q->device));
    CHECK_CUDA(cudaMallocHost(&q->pin_x, cap * H * run->x_bytes));
    CHECK_CUDA(cudaMallocHost(&q->pin_sc, cap * SC * sizeof(float)));
    CHECK_CUDA(cudaMallocHost(&q->pin_offsets, (L + 1) * sizeof(int)));
    CHECK_CUDA(cudaMallocHost(&q->pin_counts, L * sizeof(int)));
    CHECK_CUDA(cudaMallocHost(&q->pin_y, cap * H * 2));
    const expert_input_t in = {run->fp8, run->capacity, q->lay.first_local_expert, q->pin_x, (const float*)q->pin_sc,
                               (const int*)q->pin_offsets, (const int*)q->pin_counts};
    q->node.in = in;
    q->node.y = (uint16_t*)q->pin_y;
    q->node.calls = 0;
  }
  int host_replays = 0;
  for (int v = first; v < NUM_VARIANTS; ++v) {
    for (int i = 0; i < run->world; ++i) {
      cudaGraph_t experts = capture_expert(run, &run->r[i], (variant_t)v);
      if (v == first) {
        CHECK_G(graphep_graph_create(run->r[i].engine, &da[i], &ca[i], experts, &graphs[i]));
      } else {
        CHECK_G(graphep_graph_set_experts(graphs[i], experts));
      }
      CHECK_CUDA(cudaGraphDestroy(experts)); /* the MoeGraph keeps a copy */
    }
    for (int replay = 0; replay < 2; ++replay) {
      set_label(run, "graph, %s, replay %d", kVariantNames[v], replay);
      new_inputs(run);
      for (int i = 0; i < run->world; ++i) {
        CHECK_CUDA(cudaSetDevice(run->r[i].device));
        CHECK_G(graphep_graph_launch(graphs[i], run->r[i].stream));
      }
      sync_all(run);
      reference_layouts(run);
      for (int i = 0; i < run->world; ++i) check_layout(run, i);
      check_outputs(run, v == VARIANT_HOST ? EXPERT_SCALED : EXPERT_IDENTITY);
      host_replays += v == VARIANT_HOST;
    }
  }
  for (int i = 0; i < run->world; ++i) {
    rank_t* q = &run->r[i];
    EXPECT(q->node.calls == host_replays, "%s: rank %d host expert node ran %d times in %d replays", run->label, i,
           q->node.calls, host_replays);
    CHECK_G(graphep_graph_destroy(graphs[i]));
    CHECK_CUDA(cudaFreeHost(q->pin_x));
    CHECK_CUDA(cudaFreeHost(q->pin_sc));
    CHECK_CUDA(cudaFreeHost(q->pin_offsets));
    CHECK_CUDA(cudaFreeHost(q->pin_counts));
    CHECK_CUDA(cudaFreeHost(q->pin_y));
  }
}

/* The version handling of graphep_engine_layout and the new calls' argument checks, on one engine. */
static void abi_checks(graphep_engine_t engine, const graphep_layout_t* full) {
  int path = -1;
  graphep_status_t s = graphep_engine_path(engine, NULL);
  EXPECT(s == GRAPHEP_INVALID_ARGUMENT && strstr(graphep_last_error(), "path is NULL") != NULL,
         "graphep_engine_path(engine, NULL): %s \"%s\"", graphep_status_name(s), graphep_last_error());
  s = graphep_engine_path(NULL, &path);
  EXPECT(s == GRAPHEP_INVALID_ARGUMENT && strstr(graphep_last_error(), "engine is NULL") != NULL && path == -1,
         "graphep_engine_path(NULL, &path): %s \"%s\"", graphep_status_name(s), graphep_last_error());
  EXPECT(full->struct_size == sizeof(graphep_layout_t), "layout struct_size %zu on return, expected %zu",
         full->struct_size, sizeof(graphep_layout_t));
  /* A version-1 caller: its struct ends before expert_dropped, which must stay as it was. */
  const size_t v1 = offsetof(graphep_layout_t, expert_dropped);
  static const int sentinel = 0;
  graphep_layout_t old = GRAPHEP_LAYOUT_INIT;
  old.struct_size = v1;
  old.expert_dropped = &sentinel;
  CHECK_G(graphep_engine_layout(engine, &old));
  EXPECT(old.struct_size == v1 && old.expert_dropped == &sentinel && old.recv_x == full->recv_x &&
             old.first_local_expert == full->first_local_expert && old.capacity == full->capacity,
         "a version-1 layout (struct_size %zu): struct_size %zu on return, expert_dropped %s", v1, old.struct_size,
         old.expert_dropped == &sentinel ? "kept" : "overwritten");
  /* A version-4 caller: its struct ends before expert_source_ranges, left as it was. */
  const size_t v4 = offsetof(graphep_layout_t, expert_source_ranges);
  static const long long sentinel4 = 0;
  graphep_layout_t old4 = GRAPHEP_LAYOUT_INIT;
  old4.struct_size = v4;
  old4.expert_source_ranges = &sentinel4;
  CHECK_G(graphep_engine_layout(engine, &old4));
  EXPECT(old4.struct_size == v4 && old4.expert_source_ranges == &sentinel4 && old4.scales_buffer == NULL &&
             old4.row_expert_weights == full->row_expert_weights && old4.expert_dropped == full->expert_dropped,
         "a version-4 layout (struct_size %zu): struct_size %zu on return, expert_source_ranges %s", v4,
         old4.struct_size, old4.expert_source_ranges == &sentinel4 ? "kept" : "overwritten");
  graphep_layout_t small = GRAPHEP_LAYOUT_INIT;
  small.struct_size = v1 - 8;
  s = graphep_engine_layout(engine, &small);
  EXPECT(s == GRAPHEP_INVALID_ARGUMENT && strstr(graphep_last_error(), "struct_size=") != NULL,
         "a layout of struct_size %zu: %s \"%s\"", v1 - 8, graphep_status_name(s), graphep_last_error());
}

/* The active-rank mask through the C ABI: every rank sets the same mask, the last rank left out,
 * for one eager dispatch + combine of fresh inputs (their results are not checked), then puts
 * every rank back. Each rank's status (version 7) counts, per destination, the entries of its live
 * tokens that went to a rank outside the mask (on the left-out rank: every valid entry), with no
 * device error. An engine that takes no mask (the throughput path over the movers) refuses it with
 * GRAPHEP_NOT_SUPPORTED, naming the movers. */
static void mask_step(run_t* run, const graphep_dispatch_args_t* da, const graphep_combine_args_t* ca) {
  const int R = run->world, out = R - 1, per = run->experts / R;
  if (R < 2) return;
  const unsigned all = (1u << R) - 1u, mask = all & ~(1u << out);
  set_label(run, "active-rank mask");
  CHECK_CUDA(cudaSetDevice(run->r[0].device));
  const graphep_status_t s = graphep_set_active_ranks(run->r[0].engine, mask, run->r[0].stream);
  if (s == GRAPHEP_NOT_SUPPORTED) {
    EXPECT(strstr(graphep_last_error(), "movers") != NULL, "%s: the refusal does not name the movers: \"%s\"",
           run->label, graphep_last_error());
    const graphep_status_t b = graphep_engine_barrier(run->r[0].engine, run->r[0].stream);  /* version 9 */
    EXPECT(b == GRAPHEP_NOT_SUPPORTED && strstr(graphep_last_error(), "movers") != NULL,
           "%s: the barrier over the movers: %s \"%s\"", run->label, graphep_status_name(b), graphep_last_error());
    return;
  }
  CHECK_G(s);
  for (int i = 1; i < R; ++i) {
    CHECK_CUDA(cudaSetDevice(run->r[i].device));
    CHECK_G(graphep_set_active_ranks(run->r[i].engine, mask, run->r[i].stream));
  }
  unsigned long long before[MAX_RANKS][MAX_RANKS];
  for (int i = 0; i < R; ++i) {
    graphep_moe_status_t st = GRAPHEP_MOE_STATUS_INIT;
    CHECK_G(graphep_engine_status(run->r[i].engine, &st));
    for (int d = 0; d < R; ++d) before[i][d] = st.masked_entries[d];
  }
  new_inputs(run);
  enqueue_ops(run, da, ca, 0, OPS_WHOLE);
  enqueue_ops(run, da, ca, 1, OPS_WHOLE);
  sync_all(run);
  for (int i = 0; i < R; ++i) {
    const rank_t* q = &run->r[i];
    unsigned long long want[MAX_RANKS] = {0};
    for (int n = 0; n < q->T * K; ++n) {
      const long long e = q->hid[n];
      if (e < 0 || e >= run->experts) continue;
      const int d = (int)(e / per);
      if (i == out || d == out) ++want[d];
    }
    graphep_moe_status_t st = GRAPHEP_MOE_STATUS_INIT;
    CHECK_G(graphep_engine_status(q->engine, &st));
    EXPECT(st.struct_size == sizeof st && !st.device_error, "%s: rank %d status size %zu, device error %d (%s)",
           run->label, i, st.struct_size, st.device_error, graphep_last_error());
    for (int d = 0; d < R; ++d) {
      EXPECT(st.masked_entries[d] - before[i][d] == want[d], "%s: rank %d masked_entries[%d] grew by %llu, expected %llu",
             run->label, i, d, st.masked_entries[d] - before[i][d], want[d]);
    }
  }
  for (int i = 0; i < R; ++i) {
    CHECK_CUDA(cudaSetDevice(run->r[i].device));
    CHECK_G(graphep_set_active_ranks(run->r[i].engine, all, run->r[i].stream));
  }
  /* Every rank back, then a device barrier of every rank (version 9): it completes, no failure. */
  for (int i = 0; i < R; ++i) {
    CHECK_CUDA(cudaSetDevice(run->r[i].device));
    CHECK_G(graphep_engine_barrier(run->r[i].engine, run->r[i].stream));
  }
  sync_all(run);
  for (int i = 0; i < R; ++i) {
    graphep_moe_status_t st = GRAPHEP_MOE_STATUS_INIT;
    CHECK_G(graphep_engine_status(run->r[i].engine, &st));
    EXPECT(!st.device_error, "%s: rank %d: a device error after the barrier (%s)", run->label, i, graphep_last_error());
  }
}

static void run_config(graphep_comm_t comm, const char* comm_name, int latency_peers, const run_cfg_t* c,
                       int abi) {
  int world = 0, local = 0;
  CHECK_G(graphep_comm_world_size(comm, &world));
  CHECK_G(graphep_comm_local_ranks(comm, &local));
  if (local != world || world > MAX_RANKS) {
    EXPECT(0, "%s: %d local ranks of %d: the reference needs every rank in this process", comm_name, local, world);
    return;
  }
  run_t run;
  memset(&run, 0, sizeof run);
  run.cfg = c;
  run.comm_name = comm_name;
  run.world = world;
  run.experts = L * world;
  run.fp8 = c->dtype == GRAPHEP_DTYPE_FP8_E4M3;
  run.x_bytes = run.fp8 ? 1 : 2;
  /* The worst case: T_max x world x min(K, L) rows plus each expert's alignment padding. */
  run.capacity = c->capacity_per_rank > 0
                     ? (long long)c->capacity_per_rank * world
                     : (long long)T_MAX * world * (K < L ? K : L) + (long long)L * (c->alignment - 1);
  set_label(&run, "setup");

  graphep_moe_config_t cfg = GRAPHEP_MOE_CONFIG_INIT;
  cfg.max_tokens_per_rank = T_MAX;
  cfg.hidden = H;
  cfg.num_experts = run.experts;
  cfg.top_k = K;
  cfg.dispatch_dtype = c->dtype;
  cfg.recv_capacity = c->capacity_per_rank > 0 ? run.capacity : 0;
  cfg.expert_alignment = c->alignment;
  cfg.strict = c->strict;
  cfg.path = c->path;
  graphep_engine_t engines[MAX_RANKS];
  CHECK_G(graphep_engine_create_all(comm, &cfg, engines, local));

  run.r = (rank_t*)calloc((size_t)world, sizeof(rank_t));
  const size_t cap = (size_t)run.capacity;
  for (int i = 0; i < world; ++i) {
    rank_t* q = &run.r[i];
    q->engine = engines[i];
    graphep_layout_t lay = GRAPHEP_LAYOUT_INIT;
    CHECK_G(graphep_engine_layout(q->engine, &lay));
    q->lay = lay;
    EXPECT(lay.capacity == run.capacity && lay.hidden == H && lay.num_local_experts == L &&
               lay.first_local_expert == i * L,
           "%s: rank %d layout (capacity %lld, hidden %d, local experts %d, first %d), expected (%lld, %d, %d, %d)",
           run.label, i, lay.capacity, lay.hidden, lay.num_local_experts, lay.first_local_expert, run.capacity, H, L,
           i * L);
    EXPECT(lay.recv_x != NULL && lay.expert_offsets != NULL && lay.expert_counts != NULL &&
               lay.expert_dropped != NULL && lay.row_src_rank != NULL && lay.row_src_token != NULL &&
               lay.row_topk_slot != NULL && lay.row_weight != NULL && lay.num_recv_rows != NULL &&
               lay.expert_totals != NULL && lay.expert_output != NULL && (lay.recv_scales != NULL) == run.fp8,
           "%s: rank %d layout pointers (recv_scales %p for %s)", run.label, i, (void*)lay.recv_scales,
           run.fp8 ? "fp8" : "bf16");
    /* Version 5: expert-major on either path; H a multiple of 128: a scales buffer on bf16 engines too. */
    EXPECT(lay.expert_source_ranges != NULL && lay.scales_buffer != NULL &&
               (!run.fp8 || lay.scales_buffer == lay.recv_scales),
           "%s: rank %d layout expert_source_ranges %p, scales_buffer %p (recv_scales %p)", run.label, i,
           (const void*)lay.expert_source_ranges, (void*)lay.scales_buffer, (void*)lay.recv_scales);
    if (lay.capacity != run.capacity) exit(1); /* every buffer below is sized by it */
    int path = -1;
    CHECK_G(graphep_engine_path(q->engine, &path));
    const int expected = c->path != GRAPHEP_PATH_AUTO ? c->path
                         : latency_peers         ? GRAPHEP_PATH_LATENCY /* T_max <= 256 */
                                                    : GRAPHEP_PATH_THROUGHPUT;
    EXPECT(path == expected, "%s: rank %d path %d, expected %d", run.label, i, path, expected);
    if (abi && i == 0) abi_checks(q->engine, &lay);

    struct cudaPointerAttributes attr;
    CHECK_CUDA(cudaPointerGetAttributes(&attr, lay.recv_x)); /* the engine's device */
    q->device = attr.device;
    CHECK_CUDA(cudaSetDevice(q->device));
    CHECK_CUDA(cudaStreamCreateWithFlags(&q->stream, cudaStreamNonBlocking));
    CHECK_CUDA(cudaMalloc(&q->x, sizeof q->hx));
    CHECK_CUDA(cudaMalloc(&q->idx, sizeof q->hid));
    CHECK_CUDA(cudaMalloc((void**)&q->w, sizeof q->hw));
    CHECK_CUDA(cudaMalloc((void**)&q->n, sizeof(int)));
    CHECK_CUDA(cudaMalloc(&q->out, (size_t)T_MAX * H * 2));
    if (c->caller_output) CHECK_CUDA(cudaMalloc(&q->expert_out, cap * H * 2));
    if (c->halves) {
      CHECK_CUDA(cudaMalloc((void**)&q->stats, L * sizeof(int)));
      CHECK_CUDA(cudaMemset(q->stats, 0, L * sizeof(int)));
      CHECK_CUDA(cudaDeviceSynchronize()); /* landed before the rank's non-blocking stream uses it */
    }
    q->ref_valid = (unsigned char*)malloc(cap);
    q->ref_src = (int*)malloc(cap * sizeof(int));
    q->ref_tok = (int*)malloc(cap * sizeof(int));
    q->ref_slot = (int*)malloc(cap * sizeof(int));
    q->ref_w = (float*)malloc(cap * sizeof(float));
    q->hb_x = (uint8_t*)malloc(cap * H * run.x_bytes);
    q->hb_sc = (float*)malloc(cap * SC * sizeof(float));
    q->hb_src = (int*)malloc(cap * sizeof(int));
    q->hb_tok = (int*)malloc(cap * sizeof(int));
    q->hb_slot = (int*)malloc(cap * sizeof(int));
    q->hb_w = (float*)malloc(cap * sizeof(float));
    q->hy = (uint16_t*)malloc(cap * H * 2);
    if (!q->ref_valid || !q->ref_src || !q->ref_tok || !q->ref_slot || !q->ref_w || !q->hb_x || !q->hb_sc ||
        !q->hb_src || !q->hb_tok || !q->hb_slot || !q->hb_w || !q->hy) {
      fprintf(stderr, "host allocation failed\n");
      exit(1);
    }
  }
  graphep_dispatch_args_t da[MAX_RANKS];
  graphep_combine_args_t ca[MAX_RANKS];
  for (int i = 0; i < world; ++i) {
    graphep_dispatch_args_t d = GRAPHEP_DISPATCH_ARGS_INIT;
    d.x = run.r[i].x;
    d.topk_idx = run.r[i].idx;
    d.index_type = c->index_type;
    d.topk_weights = run.r[i].w;
    d.num_tokens = run.r[i].n;
    da[i] = d;
    graphep_combine_args_t o = GRAPHEP_COMBINE_ARGS_INIT;
    o.expert_output = c->caller_output ? run.r[i].expert_out : NULL;
    o.out = run.r[i].out;
    ca[i] = o;
  }

  if (c->halves) {
    set_label(&run, "refusals");
    graphep_status_t s = graphep_receive(run.r[0].engine, run.r[0].stream);
    EXPECT(s == GRAPHEP_INVALID_ARGUMENT && strstr(graphep_last_error(), "no send half") != NULL,
           "%s: graphep_receive with nothing pending: %s \"%s\"", run.label, graphep_status_name(s),
           graphep_last_error());
    graphep_dispatch_args_t d = da[0];
    d.half = GRAPHEP_HALF_SEND;
    graphep_graph_t g = NULL;
    s = graphep_graph_create(run.r[0].engine, &d, &ca[0], NULL, &g);
    EXPECT(s == GRAPHEP_INVALID_ARGUMENT && strstr(graphep_last_error(), "whole operations") != NULL,
           "%s: a MoeGraph of send halves: %s \"%s\"", run.label, graphep_status_name(s), graphep_last_error());
  }
  for (int round = 0; round < c->rounds; ++round) {
    const ops_t ops = !c->halves ? OPS_WHOLE : round == 0 ? OPS_V4_STRUCTS : OPS_HALVES;
    set_label(&run, "eager round %d%s", round, kOpsNames[ops]);
    eager_round(&run, da, ca, ops);
  }
  for (int i = 0; c->halves && i < world; ++i) {
    rank_t* q = &run.r[i];
    int stats[L];
    CHECK_CUDA(cudaSetDevice(q->device));
    CHECK_CUDA(cudaMemcpy(stats, q->stats, sizeof stats, cudaMemcpyDeviceToHost));
    for (int j = 0; j < L; ++j) {
      EXPECT((unsigned long long)stats[j] == q->exp_stats[j], "%s: rank %d recv_stats[%d] = %d, expected %llu",
             run.label, i, j, stats[j], q->exp_stats[j]);
    }
  }
  if (c->graphs) graph_rounds(&run, da, ca);
  set_label(&run, "status");
  check_status(&run);
  mask_step(&run, da, ca);
  if (c->skew) {
    unsigned long long dropped = 0;
    for (int i = 0; i < world; ++i) dropped += run.r[i].exp_dropped;
    EXPECT(dropped > 0, "%s: no row was dropped: the run does not test the overflow", run.label);
  }

  for (int i = 0; i < world; ++i) {
    rank_t* q = &run.r[i];
    CHECK_CUDA(cudaSetDevice(q->device));
    CHECK_CUDA(cudaFree(q->x));
    CHECK_CUDA(cudaFree(q->idx));
    CHECK_CUDA(cudaFree(q->w));
    CHECK_CUDA(cudaFree(q->n));
    CHECK_CUDA(cudaFree(q->out));
    if (q->expert_out != NULL) CHECK_CUDA(cudaFree(q->expert_out));
    if (q->stats != NULL) CHECK_CUDA(cudaFree(q->stats));
    CHECK_CUDA(cudaStreamDestroy(q->stream));
    CHECK_G(graphep_engine_destroy(q->engine));
    /* The host arrays allocated with the rank (above). */
    void* host[] = {q->ref_valid, q->ref_src, q->ref_tok, q->ref_slot, q->ref_w, q->hb_x,
                    q->hb_sc, q->hb_src, q->hb_tok, q->hb_slot, q->hb_w, q->hy};
    for (size_t k = 0; k < sizeof host / sizeof host[0]; ++k) free(host[k]);
  }
  free(run.r);
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void run_all(graphep_comm_t comm, const char* comm_name, int latency_peers) {
  for (size_t i = 0; i < sizeof kRuns / sizeof kRuns[0]; ++i) {
    if (kRuns[i].path == GRAPHEP_PATH_LATENCY && !latency_peers) {
      printf("%s / %s: skipped (the latency path needs every peer on one GPU or over NVLink)\n", comm_name, kRuns[i].name);
      continue;
    }
    const double t0 = now_s();
    run_config(comm, comm_name, latency_peers, &kRuns[i], i == 0);
    printf("%s / %s: %.2f s\n", comm_name, kRuns[i].name, now_s() - t0);
  }
}

static void argument_errors(graphep_comm_t comm) {
  graphep_moe_config_t cfg = GRAPHEP_MOE_CONFIG_INIT;
  cfg.max_tokens_per_rank = 8;
  cfg.hidden = 7; /* not a multiple of 8 */
  cfg.num_experts = 4;
  cfg.top_k = 2;
  graphep_engine_t engines[MAX_RANKS];
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
  cfg.hidden = 128;
  cfg.path = 3;
  s = graphep_engine_create_all(comm, &cfg, engines, local);
  EXPECT(s == GRAPHEP_INVALID_ARGUMENT && strstr(graphep_last_error(), "path=3") != NULL, "path=3: %s \"%s\"",
         graphep_status_name(s), graphep_last_error());
  s = graphep_dispatch(NULL, NULL, 0);
  EXPECT(s == GRAPHEP_INVALID_ARGUMENT, "NULL engine: status %s", graphep_status_name(s));
}

/* --- Strict mode's trap, in a child process --------------------------------------------------- */

/* The child: one rank, a strict engine, an id of 999. The trap kills the CUDA context: the first
 * call to see it reports a CUDA error, and the child exits STRICT_CHILD_TRAPPED. */
static int strict_child(void) {
  alarm(STRICT_CHILD_LIMIT_S); /* never outlive the parent's patience */
  const int dev[1] = {0};
  graphep_comm_t comm = NULL;
  CHECK_G(graphep_comm_create_local_group(dev, 1, &comm));
  graphep_moe_config_t cfg = GRAPHEP_MOE_CONFIG_INIT;
  cfg.max_tokens_per_rank = T_MAX;
  cfg.hidden = H;
  cfg.num_experts = L;
  cfg.top_k = K;
  cfg.strict = 1;
  graphep_engine_t engine = NULL;
  CHECK_G(graphep_engine_create_all(comm, &cfg, &engine, 1));
  static uint16_t x[T_MAX * H];
  static int32_t ids[T_MAX * K];
  static float w[T_MAX * K];
  for (int i = 0; i < T_MAX * K; ++i) {
    ids[i] = i % L;
    w[i] = 0.5f;
  }
  ids[3 * K + 1] = 999;
  const int T = T_MAX;
  void *dx, *di, *dw, *dn, *dout;
  CHECK_CUDA(cudaMalloc(&dx, sizeof x));
  CHECK_CUDA(cudaMalloc(&di, sizeof ids));
  CHECK_CUDA(cudaMalloc(&dw, sizeof w));
  CHECK_CUDA(cudaMalloc(&dn, sizeof T));
  CHECK_CUDA(cudaMalloc(&dout, sizeof x));
  CHECK_CUDA(cudaMemcpy(dx, x, sizeof x, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(di, ids, sizeof ids, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dw, w, sizeof w, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dn, &T, sizeof T, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaDeviceSynchronize()); /* landed: the non-blocking stream below is not ordered after the copies */
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  graphep_dispatch_args_t d = GRAPHEP_DISPATCH_ARGS_INIT;
  d.x = dx;
  d.topk_idx = di;
  d.topk_weights = (const float*)dw;
  d.num_tokens = (const int*)dn;
  graphep_combine_args_t c = GRAPHEP_COMBINE_ARGS_INIT;
  c.out = dout;
  graphep_status_t s = graphep_dispatch(engine, &d, stream);
  if (s == GRAPHEP_SUCCESS) s = graphep_combine(engine, &c, stream);
  if (s == GRAPHEP_CUDA_ERROR) {
    printf("strict child: %s: %s (the trap, as expected)\n", graphep_status_name(s), graphep_last_error());
    return STRICT_CHILD_TRAPPED;
  }
  if (s != GRAPHEP_SUCCESS) {
    fprintf(stderr, "strict child: %s: %s\n", graphep_status_name(s), graphep_last_error());
    return 1;
  }
  const cudaError_t e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) {
    printf("strict child: %s: %s (the trap, as expected)\n", cudaGetErrorName(e), cudaGetErrorString(e));
    return STRICT_CHILD_TRAPPED;
  }
  fprintf(stderr, "strict child: topk_idx 999 did not trap a strict engine\n");
  return 0;
}

/* Re-executes this binary as the strict child and requires it to die of the trap, in time. */
static void strict_trap_in_child(const char* argv0) {
  char self[4096];
  const ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  if (len > 0) {
    self[len] = '\0';
  } else {
    snprintf(self, sizeof self, "%s", argv0);
  }
  char* const args[] = {self, (char*)STRICT_CHILD_ARG, NULL};
  pid_t pid = 0;
  fflush(stdout);
  fflush(stderr);
  const int rc = posix_spawn(&pid, self, NULL, NULL, args, environ);
  if (rc != 0) {
    EXPECT(0, "strict child: posix_spawn(%s): %s", self, strerror(rc));
    return;
  }
  int status = 0;
  const struct timespec tick = {0, 50 * 1000 * 1000};
  for (int waited = 0;; ++waited) {
    const pid_t w = waitpid(pid, &status, WNOHANG);
    if (w == pid) break;
    if (w < 0 && errno != EINTR) {
      EXPECT(0, "strict child: waitpid: %s", strerror(errno));
      return;
    }
    if (waited > (STRICT_CHILD_LIMIT_S + 10) * 20) {
      kill(pid, SIGKILL);
      (void)waitpid(pid, &status, 0);
      EXPECT(0, "strict child: still running after %d s (a hang): killed", STRICT_CHILD_LIMIT_S + 10);
      return;
    }
    nanosleep(&tick, NULL);
  }
  if (WIFEXITED(status)) {
    EXPECT(WEXITSTATUS(status) == STRICT_CHILD_TRAPPED, "strict child: exit status %d, expected %d (the trap)",
           WEXITSTATUS(status), STRICT_CHILD_TRAPPED);
  } else {
    EXPECT(0, "strict child: killed by signal %d, expected exit status %d (the trap)",
           WIFSIGNALED(status) ? WTERMSIG(status) : -1, STRICT_CHILD_TRAPPED);
  }
}

/* --- main --------------------------------------------------------------------------------------- */

/* GRAPHEP_EXPECT_GPUS: -1 when unset or empty, else the count; exits 1 on a value that is not one. */
static long expected_gpus(void) {
  const char* v = getenv(EXPECT_GPUS_VAR);
  if (v == NULL || *v == '\0') return -1;
  char* end = NULL;
  errno = 0;
  const long n = strtol(v, &end, 10);
  if (end == v || *end != '\0' || errno != 0 || n < 0 || n > 4096) {
    fprintf(stderr, "FAILED: %s='%s' is not a GPU count (an integer 0..4096)\n", EXPECT_GPUS_VAR, v);
    exit(1);
  }
  return n;
}

/* No usable GPU: a skip, or a failure when GRAPHEP_EXPECT_GPUS says there is one. */
static int no_gpu(long expected, const char* why) {
  if (expected >= 1) {
    fprintf(stderr, "FAILED: needs 1 GPU: %s, but %s=%ld\n", why, EXPECT_GPUS_VAR, expected);
    return 1;
  }
  printf("SKIP: needs 1 GPU: %s (graphep %s)\n", why, graphep_version());
  return SKIP;
}

/* The memory query from C, before any engine exists (no GPU needed): a latency-path figure for AUTO
 * on a config that fits it, the throughput path's larger heap with staging for THROUGHPUT. */
static void memory_query(void) {
  graphep_moe_config_t cfg = GRAPHEP_MOE_CONFIG_INIT;
  cfg.max_tokens_per_rank = 64;
  cfg.hidden = 1024;
  cfg.num_experts = 16;
  cfg.top_k = 4;
  graphep_moe_memory_t a = GRAPHEP_MOE_MEMORY_INIT, t = GRAPHEP_MOE_MEMORY_INIT;
  CHECK_G(graphep_memory_requirements(&cfg, 2, &a));
  cfg.path = GRAPHEP_PATH_THROUGHPUT;
  CHECK_G(graphep_memory_requirements(&cfg, 2, &t));
  EXPECT(a.path == GRAPHEP_PATH_LATENCY && t.path == GRAPHEP_PATH_THROUGHPUT, "memory query paths %d, %d", a.path,
         t.path);
  EXPECT(a.symmetric_heap_bytes > 0 && a.private_bytes > 0 && t.symmetric_heap_bytes > 0 && t.private_bytes > 0,
         "memory query: zero bytes");
}

int main(int argc, char** argv) {
  if (argc > 1 && strcmp(argv[1], STRICT_CHILD_ARG) == 0) return strict_child();
  EXPECT(GRAPHEP_C_API_VERSION == 9 && graphep_api_version() == GRAPHEP_C_API_VERSION,
         "API version: header %d, library %d, expected 9", GRAPHEP_C_API_VERSION, graphep_api_version());
  memory_query();
  if (failures != 0) return 1; /* checked without a GPU too */
  const long expected = expected_gpus();
  char why[256];
  int devices = 0;
  cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess) {
    snprintf(why, sizeof why, "cudaGetDeviceCount: %s", cudaGetErrorName(e));
    return no_gpu(expected, why);
  }
  if (devices == 0) return no_gpu(expected, "found 0");
  if ((e = cudaSetDevice(0)) != cudaSuccess || (e = cudaFree(NULL)) != cudaSuccess) {
    snprintf(why, sizeof why, "GPU 0 unusable: %s (%s)", cudaGetErrorName(e), cudaGetErrorString(e));
    return no_gpu(expected, why);
  }
  const double start = now_s();

  /* A local group: two emulated ranks on GPU 0 (load/store peers: AUTO picks LATENCY). */
  const int local_devices[2] = {0, 0};
  graphep_comm_t comm = NULL;
  CHECK_G(graphep_comm_create_local_group(local_devices, 2, &comm));
  argument_errors(comm);
  run_all(comm, "local group", 1);
  CHECK_G(graphep_comm_destroy(comm));

  /* Caller-owned NCCL communicators: one rank per visible GPU (NCCL allows one rank per device). */
  const int n = devices < MAX_RANKS ? devices : MAX_RANKS;
  if (n < 2 && expected >= 2) {
    fprintf(stderr, "FAILED: the adopted-NCCL run needs 2 GPUs, found %d, but %s=%ld\n", devices, EXPECT_GPUS_VAR,
            expected);
    return 1;
  }
  int devlist[MAX_RANKS];
  int peers = 1;
  for (int i = 0; i < n; ++i) {
    devlist[i] = i;
    for (int j = 0; j < n; ++j) {
      /* The latency path's peers: P2P with native atomics (NVLink), not PCIe (its 128-byte lines). */
      int can = 1;
      if (i != j) CHECK_CUDA(cudaDeviceCanAccessPeer(&can, i, j));
      if (i != j && can) CHECK_CUDA(cudaDeviceGetP2PAttribute(&can, cudaDevP2PAttrNativeAtomicSupported, i, j));
      peers &= can != 0;
    }
  }
  ncclComm_t nccl[MAX_RANKS];
  const ncclResult_t nr = ncclCommInitAll(nccl, n, devlist);
  if (nr != ncclSuccess) {
    fprintf(stderr, "FAILED: ncclCommInitAll over %d GPUs: %s\n", n, ncclGetErrorString(nr));
    return 1;
  }
  CHECK_G(graphep_comm_adopt_nccl(nccl, n, &comm));
  char name[64];
  snprintf(name, sizeof name, "adopted NCCL, %d GPU(s)", n);
  run_all(comm, name, peers);
  CHECK_G(graphep_comm_destroy(comm));
  for (int i = 0; i < n; ++i) ncclCommDestroy(nccl[i]);

  strict_trap_in_child(argv[0]);

  if (failures != 0) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  printf("C API: all checks passed (%.1f s)\n", now_s() - start);
  return 0;
}
