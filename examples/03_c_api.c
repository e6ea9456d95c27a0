/* 03_c_api: graphep from C. Two ranks (two GPUs, or two emulated ranks on one), an engine each, a
 * MoeGraph per rank whose expert slot is the caller's own child graph (here the identity expert,
 * one copy), replayed with new routing each step; the output checked against out[t] = sum_k w x[t].
 *
 *   ./build/examples/03_c_api
 *
 * Exit code 0: correct; 1: a mismatch or an error (the message names it); 77: no GPU. */
#include <graphep/graphep.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define T 16
#define H 256
#define K 2
#define RANKS 2

#define OK(call)                                                                                        \
  do {                                                                                                  \
    graphep_status_t s_ = (call);                                                                       \
    if (s_ != GRAPHEP_SUCCESS) {                                                                        \
      fprintf(stderr, "%s failed: %s: %s\n", #call, graphep_status_name(s_), graphep_last_error());     \
      return 1;                                                                                         \
    }                                                                                                   \
  } while (0)
#define CUDA(call)                                                                 \
  do {                                                                             \
    cudaError_t e_ = (call);                                                       \
    if (e_ != cudaSuccess) {                                                       \
      fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(e_));           \
      return 1;                                                                    \
    }                                                                              \
  } while (0)

static float bf16_to_float(unsigned short b) {
  unsigned int u = (unsigned int)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

int main(void) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
    printf("03_c_api: no GPU: nothing to run\n");
    return 77;
  }
  const int devices[RANKS] = {0, gpus > 1 ? 1 : 0};
  graphep_comm_t comm = NULL;
  OK(graphep_comm_create_local_group(devices, RANKS, &comm));

  graphep_moe_config_t cfg = GRAPHEP_MOE_CONFIG_INIT;
  cfg.max_tokens_per_rank = T;
  cfg.hidden = H;
  cfg.num_experts = 4 * RANKS;
  cfg.top_k = K;
  graphep_engine_t engines[RANKS];
  OK(graphep_engine_create_all(comm, &cfg, engines, RANKS));

  static unsigned short x[RANKS][T * H], out[T * H];
  static int ids[RANKS][T * K];
  static float w[RANKS][T * K];
  void *dx[RANKS], *dids[RANKS], *dw[RANKS], *dn[RANKS], *dout[RANKS];
  cudaStream_t stream[RANKS];
  graphep_graph_t graph[RANKS];
  cudaGraph_t expert[RANKS];
  for (int r = 0; r < RANKS; ++r) {
    CUDA(cudaSetDevice(devices[r]));
    CUDA(cudaStreamCreateWithFlags(&stream[r], cudaStreamNonBlocking));
    for (int i = 0; i < T * H; ++i) x[r][i] = (unsigned short)(0x3c00 + (i * 7 + r * 13) % 0x300); /* finite bf16 */
    const int tokens = T;
    CUDA(cudaMalloc(&dx[r], sizeof x[r]));
    CUDA(cudaMalloc(&dids[r], sizeof ids[r]));
    CUDA(cudaMalloc(&dw[r], sizeof w[r]));
    CUDA(cudaMalloc(&dn[r], sizeof(int)));
    CUDA(cudaMalloc(&dout[r], sizeof out));
    /* on the rank's stream, which the graph replays on (it is not ordered after the legacy stream) */
    CUDA(cudaMemcpyAsync(dx[r], x[r], sizeof x[r], cudaMemcpyHostToDevice, stream[r]));
    CUDA(cudaMemcpyAsync(dn[r], &tokens, sizeof(int), cudaMemcpyHostToDevice, stream[r]));
    CUDA(cudaStreamSynchronize(stream[r])); /* `tokens` goes out of scope */

    /* The expert slot: the caller's graph. Here one copy, recv_x -> expert_output. */
    graphep_layout_t lay = GRAPHEP_LAYOUT_INIT;
    OK(graphep_engine_layout(engines[r], &lay));
    CUDA(cudaStreamBeginCapture(stream[r], cudaStreamCaptureModeThreadLocal));
    CUDA(cudaMemcpyAsync(lay.expert_output, lay.recv_x, (size_t)lay.capacity * H * 2, cudaMemcpyDeviceToDevice, stream[r]));
    CUDA(cudaStreamEndCapture(stream[r], &expert[r]));

    graphep_dispatch_args_t da = GRAPHEP_DISPATCH_ARGS_INIT;
    da.x = dx[r];
    da.topk_idx = dids[r];
    da.index_type = GRAPHEP_INDEX_INT32;
    da.topk_weights = (const float*)dw[r];
    da.num_tokens = (const int*)dn[r];
    graphep_combine_args_t ca = GRAPHEP_COMBINE_ARGS_INIT;
    ca.out = dout[r];
    OK(graphep_graph_create(engines[r], &da, &ca, expert[r], &graph[r]));
  }

  int wrong = 0;
  for (int step = 0; step < 10; ++step) {
    for (int r = 0; r < RANKS; ++r) { /* new routing in place, then one launch per rank */
      for (int t = 0; t < T; ++t) {
        ids[r][t * K] = (t + step + r) % cfg.num_experts;
        ids[r][t * K + 1] = (t * 3 + step + 1) % cfg.num_experts == ids[r][t * K] ? -1 : (t * 3 + step + 1) % cfg.num_experts;
        w[r][t * K] = 0.75f;
        w[r][t * K + 1] = 0.25f;
      }
      CUDA(cudaSetDevice(devices[r]));
      /* on the rank's stream: the graph launched on it is not ordered after the legacy stream */
      CUDA(cudaMemcpyAsync(dids[r], ids[r], sizeof ids[r], cudaMemcpyHostToDevice, stream[r]));
      CUDA(cudaMemcpyAsync(dw[r], w[r], sizeof w[r], cudaMemcpyHostToDevice, stream[r]));
    }
    for (int r = 0; r < RANKS; ++r) {
      CUDA(cudaSetDevice(devices[r]));
      OK(graphep_graph_launch(graph[r], stream[r]));
    }
    for (int r = 0; r < RANKS; ++r) {
      CUDA(cudaSetDevice(devices[r]));
      CUDA(cudaStreamSynchronize(stream[r]));
      CUDA(cudaMemcpy(out, dout[r], sizeof out, cudaMemcpyDeviceToHost));
      for (int t = 0; t < T; ++t) {
        const float wsum = w[r][t * K] + (ids[r][t * K + 1] >= 0 ? w[r][t * K + 1] : 0.0f);
        for (int h = 0; h < H; ++h) {
          const float ref = wsum * bf16_to_float(x[r][t * H + h]);
          if (!(fabsf(bf16_to_float(out[t * H + h]) - ref) <= fabsf(ref) / 128.0f + 1e-6f)) ++wrong;
        }
      }
    }
  }
  printf("03_c_api: %d ranks on %d GPU(s), 10 graph replays, %d wrong values: %s\n", RANKS, gpus > 1 ? 2 : 1, wrong,
         wrong == 0 ? "PASS" : "FAIL");

  for (int r = 0; r < RANKS; ++r) {
    CUDA(cudaSetDevice(devices[r]));
    OK(graphep_graph_destroy(graph[r]));
    CUDA(cudaGraphDestroy(expert[r]));
    cudaFree(dx[r]);
    cudaFree(dids[r]);
    cudaFree(dw[r]);
    cudaFree(dn[r]);
    cudaFree(dout[r]);
    cudaStreamDestroy(stream[r]);
    OK(graphep_engine_destroy(engines[r]));
  }
  OK(graphep_comm_destroy(comm));
  return wrong == 0 ? 0 : 1;
}
