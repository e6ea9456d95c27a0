// Calibrates compute-sanitizer racecheck on the shared-memory patterns that it reports in the
// latency MoE kernels (moe_latency.cu: lastBlock's `last`, the expand loop's `failed`,
// blockExclusiveScan's total). In each, warp 0 (or thread 0, after an atomic or a poll) writes a
// shared word, the CTA passes __syncthreads(), and every thread reads it: correct CUDA. The
// variants add, one at a time, what else those kernels do, to find what the tool reacts to:
//   plain    : the pattern alone, one launch
//   named    : the CTA's 128-thread groups also synchronise on named barriers (bar.sync 1+g, 128)
//   streams  : the plain kernel launched on 4 streams at once (as emulated ranks share one GPU)
//   all      : named barriers, 4 streams
// Usage: graphep-racecheck-probe VARIANT   (under compute-sanitizer --tool racecheck; exit 0 = results right)
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

namespace {

constexpr int kThreads = 512, kCtas = 8, kRounds = 4;

template <bool kNamed>
__global__ void __launch_bounds__(kThreads) probe(unsigned* counter, int* out) {
  __shared__ bool last;
  __shared__ int groupWord[kThreads / 128];
  const int tid = static_cast<int>(threadIdx.x), group = tid / 128;
  int acc = 0;
  for (int round = 0; round < kRounds; ++round) {
    if (kNamed) {  // a group-private exchange on the group's named barrier
      asm volatile("bar.sync %0, %1;" ::"r"(1 + group), "r"(128) : "memory");
      if (tid % 128 == 0) groupWord[group] = round + group;
      asm volatile("bar.sync %0, %1;" ::"r"(1 + group), "r"(128) : "memory");
      acc += groupWord[group];
    }
    __syncthreads();
    if (tid == 0) last = atomicAdd(counter, 1u) % 2u == 0u;  // as lastBlock
    __syncthreads();
    acc += last ? 1 : 2;
    __syncthreads();  // every thread has read it before thread 0 rewrites it
  }
  out[blockIdx.x * kThreads + tid] = acc;
}

}  // namespace

int main(int argc, char** argv) {
  const char* v = argc > 1 ? argv[1] : "plain";
  const bool named = std::strcmp(v, "named") == 0 || std::strcmp(v, "all") == 0;
  const int streams = std::strcmp(v, "streams") == 0 || std::strcmp(v, "all") == 0 ? 4 : 1;
  if (!named && streams == 1 && std::strcmp(v, "plain") != 0) {
    std::fprintf(stderr, "unknown variant %s (plain, named, streams, all)\n", v);
    return 2;
  }
  unsigned* counter[4];
  int* out[4];
  cudaStream_t s[4];
  for (int i = 0; i < streams; ++i) {
    cudaMalloc(&counter[i], sizeof(unsigned));
    cudaMemset(counter[i], 0, sizeof(unsigned));
    cudaMalloc(&out[i], kCtas * kThreads * sizeof(int));
    cudaStreamCreateWithFlags(&s[i], cudaStreamNonBlocking);
  }
  for (int i = 0; i < streams; ++i) {
    if (named) probe<true><<<kCtas, kThreads, 0, s[i]>>>(counter[i], out[i]);
    else probe<false><<<kCtas, kThreads, 0, s[i]>>>(counter[i], out[i]);
  }
  cudaError_t e = cudaDeviceSynchronize();
  if (e == cudaSuccess) e = cudaGetLastError();
  // Every thread saw its CTA's value of `last` each round: the sum per CTA is uniform.
  long bad = 0;
  static int h[kCtas * kThreads];
  for (int i = 0; i < streams && e == cudaSuccess; ++i) {
    cudaMemcpy(h, out[i], sizeof(h), cudaMemcpyDeviceToHost);
    for (int c = 0; c < kCtas; ++c) {
      for (int t = 0; t < kThreads; ++t) bad += h[c * kThreads + t] != h[c * kThreads];
    }
  }
  std::printf("%s: %s, %ld threads disagree with their CTA\n", v, cudaGetErrorString(e), bad);
  return e == cudaSuccess && bad == 0 ? 0 : 1;
}
