// MoE routing kernel family (see kernels/moe.h), its launcher below.
//
// Grid: E + R CTAs. CTA e < E scans the flattened [T, K] ids for expert e: each matching entry gets
// its index among them (entry order = token-major, so rows stay in token order) and the CTA writes
// the count. CTA E + r scans the tokens for those with at least one valid expert on rank r: each
// gets its index in rank r's record list (-1 otherwise), and the CTA writes the count. CTA 0 also
// clamps the live token count and counts invalid ids.
#include <cub/block/block_scan.cuh>

#include "kernels/common/moe.cuh"

namespace graphep {
namespace {

constexpr int kThreads = 512;
constexpr int kItems = 8;  // consecutive entries per thread per pass
using Scan = cub::BlockScan<int, kThreads>;

__device__ bool tokenGoesTo(const MoeParams& p, int t, int r) {
  for (int k = 0; k < p.topK; ++k) {
    const long long id = moeReadId(p, static_cast<std::uint64_t>(t) * p.topK + k);
    if (moeValidId(p, id) && id / p.localExperts == r) return true;
  }
  return false;
}

__global__ void __launch_bounds__(kThreads) moeRouteKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kRoute);
  __shared__ typename Scan::TempStorage temp;
  const int tid = static_cast<int>(threadIdx.x);
  const int T = moeLiveTokens(p, blockIdx.x == 0 && tid == 0);
  // One pass of kThreads * kItems entries: pred(i) for i < n; returns through `assign` the index of
  // each matching entry (running + its rank among the matches) and advances `running`.
  int running = 0;
  auto scanPass = [&](std::uint64_t base, std::uint64_t n, auto pred, auto assign) {
    bool hit[kItems];
    int c = 0;
#pragma unroll
    for (int u = 0; u < kItems; ++u) {
      const std::uint64_t i = base + static_cast<std::uint64_t>(tid) * kItems + u;
      hit[u] = i < n && pred(i);
      c += hit[u] ? 1 : 0;
    }
    int off = 0, agg = 0;
    Scan(temp).ExclusiveSum(c, off, agg);
    int idx = running + off;
#pragma unroll
    for (int u = 0; u < kItems; ++u) {
      const std::uint64_t i = base + static_cast<std::uint64_t>(tid) * kItems + u;
      if (i < n) assign(i, hit[u] ? idx : -1);
      if (hit[u]) ++idx;
    }
    running += agg;
    __syncthreads();  // temp is reused by the next pass
  };

  const int E = p.numExperts;
  if (static_cast<int>(blockIdx.x) < E) {
    const long long e = blockIdx.x;
    const std::uint64_t n = static_cast<std::uint64_t>(T) * p.topK;
    for (std::uint64_t base = 0; base < n; base += kThreads * kItems) {
      scanPass(
          base, n, [&](std::uint64_t i) { return moeReadId(p, i) == e; },
          [&](std::uint64_t i, int idx) {
            if (idx >= 0) p.entryIdx[i] = idx;
          });
    }
    if (tid == 0) p.expertCount[e] = static_cast<std::uint32_t>(running);
    if (blockIdx.x == 0) {
      for (std::uint64_t i = tid; i < n; i += kThreads) {
        const long long id = moeReadId(p, i);
        if (id < -1 || id >= E) {
          moeReportInvalidId(p, id, static_cast<int>(i / p.topK), static_cast<int>(i % p.topK));
        }
      }
    }
  } else {
    const int r = static_cast<int>(blockIdx.x) - E;
    for (std::uint64_t base = 0; base < static_cast<std::uint64_t>(T); base += kThreads * kItems) {
      scanPass(
          base, static_cast<std::uint64_t>(T),
          [&](std::uint64_t t) { return tokenGoesTo(p, static_cast<int>(t), r); },
          [&](std::uint64_t t, int idx) { p.tokRankIdx[t * p.numRanks + r] = idx; });
    }
    if (tid == 0) p.rankCount[r] = static_cast<std::uint32_t>(running);
  }
}

}  // namespace

cudaError_t launchMoeRoute(const MoeParams& p, cudaStream_t stream) {
  if (p.numExperts < 1 || p.numRanks < 1 || p.topK < 1 || p.topK > kMoeMaxTopK) {
    return cudaErrorInvalidValue;
  }
  moeRouteKernel<<<p.numExperts + p.numRanks, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t preloadMoeRouteKernels() {
  cudaFuncAttributes a{};
  return cudaFuncGetAttributes(&a, moeRouteKernel);
}

}  // namespace graphep
