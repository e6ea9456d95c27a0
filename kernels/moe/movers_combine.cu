// MoE combine kernel family (see kernels/moe/moe.h): reduce (per received record, the weighted sum of
// its expert rows, fp32) and final (per token, the sum of the partials that came back, fp32);
// launchers below. Both write bf16 rounded once from fp32.
#include "kernels/moe/common.cuh"

namespace graphep {
namespace {

constexpr int kThreads = kMoeThreads;  // kGroups records (tokens) per CTA at a time
constexpr int kGroups = kThreads / kMoeGroupThreads;

// Grid: p.grid.budgetCtas CTAs; each group reduces one received record at a time (source-major).
__global__ void __launch_bounds__(kThreads) moeCombineReduceKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kCombineReduce);
  __shared__ MoeSlotStage stage[kGroups];
  const MoeGroupSlice gs = moeGroupSlice();
  if (blockIdx.x == 0 && threadIdx.x == 0) moeCheckPairing(p, false);
  const std::uint64_t rowBytes = static_cast<std::uint64_t>(p.shape.hidden) * 2;
  for (int s = 0; s < p.shape.numRanks; ++s) {
    const long long rankBase = p.layout.rankMajor ? p.layout.rankOffsets[s] : -1;  // rank-major: the source's first row
    for (int i = gs.first; i < p.layout.sourceRecords[s]; i += gs.stride) {
      const std::uint64_t record = static_cast<std::uint64_t>(s) * p.shape.maxTokens + i;
      moeReduceRecord(p, p.staging.recordRecv + record * p.shape.recordBytes, p.layout.sourceBase + s * p.shape.localExperts,
                      p.staging.partialStage + record * rowBytes, stage[gs.group], gs.g, p.layout.rankMajor ? rankBase + i : -1);
    }
  }
}

// Grid: p.grid.budgetCtas CTAs; each group sums one token's partials at a time.
__global__ void __launch_bounds__(kThreads) moeCombineFinalKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kCombineFinal);
  __shared__ const uint4* parts[kGroups][kMaxRanks];
  const MoeGroupSlice gs = moeGroupSlice();
  if (blockIdx.x == 0 && threadIdx.x == 0) *p.state.pending &= kMoeDispatched;  // the combine's last kernel
  const std::uint64_t rowBytes = static_cast<std::uint64_t>(p.shape.hidden) * 2;
  const int T = *p.routing.liveTokens;
  for (int t = gs.first; t < T; t += gs.stride) {
    moeFinalToken(
        p, t,
        [&](int r) -> const char* {
          const int i = p.routing.tokenRankIndex[static_cast<std::uint64_t>(t) * p.shape.numRanks + r];
          return i < 0 ? nullptr : p.movers.partialRecv + (static_cast<std::uint64_t>(r) * p.shape.maxTokens + i) * rowBytes;
        },
        parts[gs.group], gs.g);
  }
}

}  // namespace

cudaError_t launchMoeCombineReduce(const MoeParams& p, cudaStream_t stream) {
  if (p.grid.budgetCtas < 1) return cudaErrorInvalidValue;
  moeCombineReduceKernel<<<static_cast<unsigned>(p.grid.budgetCtas), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launchMoeCombineFinal(const MoeParams& p, cudaStream_t stream) {
  if (p.grid.budgetCtas < 1) return cudaErrorInvalidValue;
  moeCombineFinalKernel<<<static_cast<unsigned>(p.grid.budgetCtas), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t preloadMoeCombineKernels() {
  cudaFuncAttributes a{};
  cudaError_t e = cudaFuncGetAttributes(&a, moeCombineReduceKernel);
  return e != cudaSuccess ? e : cudaFuncGetAttributes(&a, moeCombineFinalKernel);
}

}  // namespace graphep
