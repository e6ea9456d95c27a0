// MoE routing kernel family of the throughput path (see kernels/moe/moe.h), its launcher below. Three
// grid-stride kernels of p.grid.budgetCtas CTAs after a memset of the scratch:
//
//   bits    every (token, k) entry: its bit in the expert's row and in the destination rank's row,
//           its count in the expert's 32-token block; invalid ids counted; CTA 0 clamps the live
//           token count. With tokenInRank, the ranks' rows come from the mask instead, and an
//           entry counts only where the mask sends its token to its expert's rank. Entries that
//           would be sent to a rank outside the active-rank mask are dropped and counted
//           (maskedEntries), and no rank row of such a rank gets a bit (with token-in-rank routing
//           alone, topK 0, there are no entries to count).
//   prefix  one warp per row: entries (tokens, for rank rows) before each 32-token block (a CUB
//           warp scan per 32 blocks), and the row's total (expertCount, rankCount).
//   assign  each entry's index within its expert's entries from this rank (token-major order, so
//           rows stay in token order): the block's prefix plus the entries before it in the block
//           (a popcount, or an exact count when some token holds an expert twice); each token's
//           index in each destination rank's record list, or -1.
// The node-aware dispatch (p.node.aware) adds a row per node after the ranks' (a token's bit where
// it goes to some rank of the node), its prefix and total (nodeRecords), and each node's hop list
// (nodeTokens): the tokens going there, in token order, and each token's index there
// (tokenNodeIndex, for the combine's final).
#include <cub/warp/warp_scan.cuh>

#include "kernels/common/launch.h"
#include "kernels/moe/common.cuh"

namespace graphep {
namespace {

constexpr int kThreads = kMoeThreads;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ int gridThread() { return static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); }
__device__ __forceinline__ int gridThreads() { return static_cast<int>(gridDim.x * blockDim.x); }

__global__ void __launch_bounds__(kThreads) moeRouteBitsKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kRoute);
  if (blockIdx.x == 0 && threadIdx.x == 0) moeCheckPairing(p, true);
  const int T = moeLiveTokens(p, blockIdx.x == 0 && threadIdx.x == 0);
  const int W = static_cast<int>(moeRouteWords(p.shape.maxTokens)), E = p.shape.numExperts, K = p.shape.topK, R = p.shape.numRanks;
  const std::uint32_t live = dispatchMask(p);  // the active-rank mask (the direct path; every rank on the movers')
  if (p.input.tokenInRank != nullptr) {  // the destinations, from the token-in-rank mask
    for (int n = gridThread(); n < T * R; n += gridThreads()) {
      const int t = n / R;
      if (p.input.tokenInRank[n] != 0 && isLive(live, n % R)) {
        atomicOr(&p.routing.bits[(E + n % R) * W + (t >> 5)], 1u << (t & 31));
        if (p.node.aware) atomicOr(&p.routing.bits[(E + R + p.node.nodeOf[n % R]) * W + (t >> 5)], 1u << (t & 31));
      }
    }
  }
  for (int i = gridThread(); i < T * K; i += gridThreads()) {
    const long long id = moeReadId(p, static_cast<std::uint64_t>(i));
    if (!moeValidId(p, id)) {
      if (id != -1) moeReportInvalidId(p, id, i / K, i % K);
      continue;
    }
    const int t = i / K, w = t >> 5;
    if (!moeEntryRouted(p, t, id)) continue;  // the token-in-rank mask does not send the token to its expert's rank
    if (!isLive(live, static_cast<int>(id / p.shape.localExperts))) {  // its rank is outside the active-rank mask
      atomicAdd(&p.state.status->maskedEntries[id / p.shape.localExperts], 1ull);
      continue;
    }
    const std::uint32_t bit = 1u << (t & 31);
    if (atomicOr(&p.routing.bits[id * W + w], bit) & bit) atomicExch(p.routing.duplicate, 1u);
    atomicAdd(&p.routing.blockCounts[id * W + w], 1u);
    if (p.input.tokenInRank == nullptr) {
      const int r = static_cast<int>(id / p.shape.localExperts);
      atomicOr(&p.routing.bits[(E + r) * W + w], bit);
      if (p.node.aware) atomicOr(&p.routing.bits[(E + R + p.node.nodeOf[r]) * W + w], bit);
    }
  }
}

__global__ void __launch_bounds__(kThreads) moeRoutePrefixKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kRoute);
  using WarpScan = cub::WarpScan<std::uint32_t>;
  __shared__ typename WarpScan::TempStorage scan[kWarps];
  const int W = static_cast<int>(moeRouteWords(p.shape.maxTokens)), E = p.shape.numExperts;
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) / 32;
  const int firstWarp = static_cast<int>(blockIdx.x) * kWarps + warp;
  const int rows = E + p.shape.numRanks + (p.node.aware ? p.node.numNodes : 0);  // experts, ranks, nodes
  for (int row = firstWarp; row < rows; row += static_cast<int>(gridDim.x) * kWarps) {
    std::uint32_t carry = 0;
    for (int w0 = 0; w0 < W; w0 += 32) {  // the whole warp, every round (W is the same for all)
      const int w = w0 + lane;
      std::uint32_t v = 0;
      if (w < W) v = row < E ? p.routing.blockCounts[row * W + w] : static_cast<std::uint32_t>(__popc(p.routing.bits[row * W + w]));
      std::uint32_t before = 0, total = 0;
      WarpScan(scan[warp]).ExclusiveSum(v, before, total);
      __syncwarp();  // the scan's storage is reused next round
      if (w < W) p.routing.blockPrefix[row * W + w] = carry + before;
      carry += total;
    }
    if (lane == 0) {
      if (row < E) {
        p.routing.expertEntries[row] = carry;
      } else if (row < E + p.shape.numRanks) {
        p.routing.rankRecords[row - E] = carry;
      } else {
        p.node.nodeRecords[row - E - p.shape.numRanks] = carry;
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads) moeRouteAssignKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kRoute);
  const int T = *p.routing.liveTokens;
  const int W = static_cast<int>(moeRouteWords(p.shape.maxTokens)), E = p.shape.numExperts, K = p.shape.topK, R = p.shape.numRanks;
  const bool dup = *p.routing.duplicate != 0;
  const std::uint32_t live = dispatchMask(p);
  for (int i = gridThread(); i < T * K; i += gridThreads()) {
    const long long id = moeReadId(p, static_cast<std::uint64_t>(i));
    if (!moeValidId(p, id) || !isLive(live, static_cast<int>(id / p.shape.localExperts)) || !moeEntryRouted(p, i / K, id)) continue;
    const int t = i / K, k = i % K, w = t >> 5;
    const std::uint32_t below = p.routing.bits[id * W + w] & ((1u << (t & 31)) - 1u);
    int idx = static_cast<int>(p.routing.blockPrefix[id * W + w]);
    if (!dup) {
      idx += __popc(below);
    } else {  // exact: the entries of this expert in the block's earlier tokens and earlier slots
      for (std::uint32_t m = below; m != 0; m &= m - 1) {  // tokens whose entry of `id` is routed
        const int u = (w << 5) + __ffs(m) - 1;
        for (int kk = 0; kk < K; ++kk) idx += moeReadId(p, static_cast<std::uint64_t>(u) * K + kk) == id;
      }
      for (int kk = 0; kk < k; ++kk) idx += moeReadId(p, static_cast<std::uint64_t>(t) * K + kk) == id;
    }
    p.routing.entryIndex[i] = idx;
  }
  for (int n = gridThread(); n < T * R; n += gridThreads()) {
    const int t = n / R, r = n % R, w = t >> 5;
    const std::uint32_t bits = p.routing.bits[(E + r) * W + w];
    const int i = (bits >> (t & 31)) & 1u
                      ? static_cast<int>(p.routing.blockPrefix[(E + r) * W + w]) + __popc(bits & ((1u << (t & 31)) - 1u))
                      : -1;
    p.routing.tokenRankIndex[n] = i;
    if (i >= 0 && p.routing.rankTokens != nullptr) p.routing.rankTokens[static_cast<std::uint64_t>(r) * p.shape.maxTokens + i] = t;
  }
  const int N = p.node.aware ? p.node.numNodes : 0;
  for (int n = gridThread(); n < T * N; n += gridThreads()) {  // each node's hop list
    const int t = n / N, m = n % N, w = t >> 5;
    const std::uint32_t bits = p.routing.bits[(E + R + m) * W + w];
    const int j = (bits >> (t & 31)) & 1u
                      ? static_cast<int>(p.routing.blockPrefix[(E + R + m) * W + w]) + __popc(bits & ((1u << (t & 31)) - 1u))
                      : -1;
    p.node.tokenNodeIndex[static_cast<std::uint64_t>(t) * R + m] = j;
    if (j >= 0) p.node.nodeTokens[static_cast<std::uint64_t>(m) * p.shape.maxTokens + j] = t;
  }
}

}  // namespace

cudaError_t launchMoeRoute(const MoeParams& p, cudaStream_t stream) {
  // topK 0: routing by tokenInRank alone (no slots).
  GRAPHEP_LAUNCH_REQUIRE(p.shape.numExperts >= 1 && p.shape.numRanks >= 1, "numExperts %d, numRanks %d (at least 1 each)",
                         p.shape.numExperts, p.shape.numRanks);
  GRAPHEP_LAUNCH_REQUIRE(p.shape.topK >= 0 && p.shape.topK <= kMoeMaxTopK, "topK %d (0 to %d)", p.shape.topK, kMoeMaxTopK);
  GRAPHEP_LAUNCH_REQUIRE(p.shape.topK > 0 || p.input.tokenInRank != nullptr, "topK 0 with no tokenInRank routing");
  GRAPHEP_LAUNCH_REQUIRE(p.grid.budgetCtas >= 1, "grid.budgetCtas %d (at least 1)", p.grid.budgetCtas);
  cudaError_t e = cudaMemsetAsync(p.routing.bits, 0, p.routing.zeroBytes, stream);
  if (e != cudaSuccess) return e;
  const unsigned grid = static_cast<unsigned>(p.grid.budgetCtas);
  moeRouteBitsKernel<<<grid, kThreads, 0, stream>>>(p);
  moeRoutePrefixKernel<<<grid, kThreads, 0, stream>>>(p);
  moeRouteAssignKernel<<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t preloadMoeRouteKernels() {
  return preloadKernels(moeRouteBitsKernel, moeRoutePrefixKernel, moeRouteAssignKernel);
}

}  // namespace graphep
