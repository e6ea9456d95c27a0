// MoE token layout kernel family (see kernels/moe/moe.h), its launcher below: DeepEP's
// get_dispatch_layout. One grid-stride kernel over the tokens, one thread per token: its top-k ids
// counted per expert, its destination ranks (a bit per rank, R <= 32) written to the token-in-rank
// mask and counted per rank. The counts go through a per-CTA histogram in shared memory (experts
// and ranks) when it fits, then one atomic per nonzero bin into the zeroed outputs.
#include "kernels/common/launch.h"
#include "kernels/moe/common.cuh"

namespace graphep {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxCtas = 1024;
// Experts and ranks up to this count take the shared-memory histogram ((E + R) x 4 bytes: at most
// the 48 KiB a launch may take without opting in).
constexpr int kSharedBins = 12 * 1024;

__global__ void __launch_bounds__(kThreads) moeTokenLayoutKernel(const __grid_constant__ MoeTokenLayoutParams p) {
  extern __shared__ int bins[];  // [E] per expert, then [R] per rank (when shared)
  const int E = p.numExperts, R = p.numRanks, K = p.topK, L = E / R, tid = static_cast<int>(threadIdx.x);
  const bool shared = E + R <= kSharedBins;
  int* perExpert = shared ? bins : p.tokensPerExpert;
  int* perRank = shared ? bins + E : p.tokensPerRank;
  if (shared) {
    for (int i = tid; i < E + R; i += kThreads) bins[i] = 0;
    __syncthreads();
  }
  for (int t = static_cast<int>(blockIdx.x) * kThreads + tid; t < p.numTokens; t += static_cast<int>(gridDim.x) * kThreads) {
    std::uint32_t ranks = 0;
    for (int k = 0; k < K; ++k) {
      const std::uint64_t n = static_cast<std::uint64_t>(t) * K + k;
      const long long id = p.int64Ids ? static_cast<const long long*>(p.topkIdx)[n]
                                      : static_cast<long long>(static_cast<const int*>(p.topkIdx)[n]);
      if (id < 0 || id >= E) continue;  // -1: none; anything else outside [0, E): no expert
      atomicAdd(&perExpert[id], 1);
      ranks |= 1u << (id / L);
    }
    for (int r = 0; r < R; ++r) {
      const bool in = (ranks >> r) & 1u;
      p.tokenInRank[static_cast<std::uint64_t>(t) * R + r] = in ? 1 : 0;
      if (in) atomicAdd(&perRank[r], 1);
    }
  }
  if (shared) {
    __syncthreads();
    for (int i = tid; i < E + R; i += kThreads) {
      if (bins[i] != 0) atomicAdd(i < E ? &p.tokensPerExpert[i] : &p.tokensPerRank[i - E], bins[i]);
    }
  }
}

}  // namespace

cudaError_t launchMoeTokenLayout(const MoeTokenLayoutParams& p, cudaStream_t stream) {
  GRAPHEP_LAUNCH_REQUIRE(p.numRanks >= 1 && p.numRanks <= 32, "numRanks %d (1 to 32)", p.numRanks);
  GRAPHEP_LAUNCH_REQUIRE(p.numExperts >= p.numRanks && p.numExperts % p.numRanks == 0,
                         "numExperts %d (a multiple of numRanks %d)", p.numExperts, p.numRanks);
  GRAPHEP_LAUNCH_REQUIRE(p.topK >= 1 && p.numTokens >= 0, "topK %d (at least 1), numTokens %d (at least 0)", p.topK,
                         p.numTokens);
  cudaError_t e = cudaMemsetAsync(p.tokensPerRank, 0, static_cast<std::size_t>(p.numRanks) * 4, stream);
  if (e == cudaSuccess) e = cudaMemsetAsync(p.tokensPerExpert, 0, static_cast<std::size_t>(p.numExperts) * 4, stream);
  if (e != cudaSuccess || p.numTokens == 0) return e;
  const int ctas = std::min((p.numTokens + kThreads - 1) / kThreads, kMaxCtas);
  const bool shared = p.numExperts + p.numRanks <= kSharedBins;
  const std::size_t smem = shared ? static_cast<std::size_t>(p.numExperts + p.numRanks) * 4 : 0;
  moeTokenLayoutKernel<<<static_cast<unsigned>(ctas), kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t preloadMoeTokenLayoutKernels() { return preloadKernels(moeTokenLayoutKernel); }

}  // namespace graphep
