// MoE combine kernel family (see kernels/moe.h): reduce (per received record, the weighted sum of
// its expert rows, fp32) and final (per token, the sum of the partials that came back, fp32);
// launchers below. Both write bf16 rounded once from fp32.
#include "kernels/common/moe.cuh"

namespace graphep {
namespace {

constexpr int kThreads = 128;

// Grid: R * maxTokens CTAs, one per (source, received record).
__global__ void __launch_bounds__(kThreads) moeCombineReduceKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kCombineReduce);
  const int s = static_cast<int>(blockIdx.x / static_cast<unsigned>(p.maxTokens));
  const int i = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.maxTokens));
  if (s >= p.numRanks || i >= p.recvRows[s]) return;
  const std::uint64_t record = static_cast<std::uint64_t>(s) * p.maxTokens + i;
  __shared__ MoeSlotStage stage;
  moeReduceRecord(p, p.recRecv + record * p.recBytes, p.srcBase + s * p.localExperts,
                  p.combSend + record * static_cast<std::uint64_t>(p.hidden) * 2, stage,
                  MoeGroup{static_cast<int>(threadIdx.x), kThreads, 0});
}

// Grid: maxTokens CTAs, one per token; tokens past the live count exit.
__global__ void __launch_bounds__(kThreads) moeCombineFinalKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kCombineFinal);
  const int t = static_cast<int>(blockIdx.x);
  if (t >= *p.liveTokens) return;
  const std::uint64_t rowBytes = static_cast<std::uint64_t>(p.hidden) * 2;
  __shared__ const uint4* parts[kMaxRanks];
  moeFinalToken(
      p, t,
      [&](int r) -> const char* {
        const int i = p.tokRankIdx[static_cast<std::uint64_t>(t) * p.numRanks + r];
        return i < 0 ? nullptr : p.combRecv + (static_cast<std::uint64_t>(r) * p.maxTokens + i) * rowBytes;
      },
      parts, MoeGroup{static_cast<int>(threadIdx.x), kThreads, 0});
}

}  // namespace

cudaError_t launchMoeCombineReduce(const MoeParams& p, cudaStream_t stream) {
  const unsigned long long blocks = static_cast<unsigned long long>(p.numRanks) * p.maxTokens;
  if (blocks == 0 || blocks > 0x7fffffffull) return cudaErrorInvalidValue;
  moeCombineReduceKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launchMoeCombineFinal(const MoeParams& p, cudaStream_t stream) {
  moeCombineFinalKernel<<<static_cast<unsigned>(p.maxTokens), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t preloadMoeCombineKernels() {
  cudaFuncAttributes a{};
  cudaError_t e = cudaFuncGetAttributes(&a, moeCombineReduceKernel);
  return e != cudaSuccess ? e : cudaFuncGetAttributes(&a, moeCombineFinalKernel);
}

}  // namespace graphep
