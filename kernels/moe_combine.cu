// MoE combine kernel family (see kernels/moe.h): reduce (per received record, the weighted sum of
// its expert rows, fp32) and final (per token, the sum of the partials that came back, fp32);
// launchers below. Both write bf16 rounded once from fp32.
#include <cuda_bf16.h>

#include "kernels/common/moe.cuh"

namespace graphep {
namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ void addBf16x8(float (&acc)[8], uint4 v, float w) {
  const auto* h = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
  for (int k = 0; k < 8; ++k) acc[k] = __fmaf_rn(w, __bfloat162float(h[k]), acc[k]);
}

__device__ __forceinline__ uint4 toBf16x8(const float (&acc)[8]) {
  uint4 v;
  auto* h = reinterpret_cast<__nv_bfloat16*>(&v);
#pragma unroll
  for (int k = 0; k < 8; ++k) h[k] = __float2bfloat16_rn(acc[k]);
  return v;
}

// Grid: R * maxTokens CTAs, one per (source, received record).
__global__ void __launch_bounds__(kThreads) moeCombineReduceKernel(const __grid_constant__ MoeParams p) {
  const int s = static_cast<int>(blockIdx.x / static_cast<unsigned>(p.maxTokens));
  const int i = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.maxTokens));
  if (s >= p.numRanks || i >= p.recvRows[s]) return;
  const std::uint64_t record = static_cast<std::uint64_t>(s) * p.maxTokens + i;
  const char* rec = p.recRecv + record * p.recBytes;
  const auto* hdr = reinterpret_cast<const MoeRecordHeader*>(rec + p.payloadBytes);
  const auto* slots = reinterpret_cast<const MoeRecordSlot*>(rec + p.payloadBytes + sizeof(MoeRecordHeader));
  const int nslots = hdr->nslots < p.topK ? hdr->nslots : p.topK;
  const std::uint64_t vecs = static_cast<std::uint64_t>(p.hidden) / 8;  // 16-byte vectors per row
  auto* out = reinterpret_cast<uint4*>(p.combSend) + record * vecs;
  for (std::uint64_t c = threadIdx.x; c < vecs; c += kThreads) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int sl = 0; sl < nslots; ++sl) {
      const MoeRecordSlot slot = slots[sl];
      if (slot.localExpert < 0 || slot.localExpert >= p.localExperts) continue;
      const long long pos = static_cast<long long>(p.srcBase[s * p.localExperts + slot.localExpert]) + slot.index;
      if (pos < 0 || pos >= p.capacity) continue;  // dropped at dispatch (counted there)
      addBf16x8(acc, reinterpret_cast<const uint4*>(p.y)[static_cast<std::uint64_t>(pos) * vecs + c], slot.weight);
    }
    out[c] = toBf16x8(acc);
  }
}

// Grid: maxTokens CTAs, one per token; tokens past the live count exit.
__global__ void __launch_bounds__(kThreads) moeCombineFinalKernel(const __grid_constant__ MoeParams p) {
  const int t = static_cast<int>(blockIdx.x);
  if (t >= *p.liveTokens) return;
  const std::uint64_t vecs = static_cast<std::uint64_t>(p.hidden) / 8;
  const auto* back = reinterpret_cast<const uint4*>(p.combRecv);
  auto* out = reinterpret_cast<uint4*>(p.out) + static_cast<std::uint64_t>(t) * vecs;
  for (std::uint64_t c = threadIdx.x; c < vecs; c += kThreads) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int r = 0; r < p.numRanks; ++r) {
      const int i = p.tokRankIdx[static_cast<std::uint64_t>(t) * p.numRanks + r];
      if (i < 0) continue;
      addBf16x8(acc, back[(static_cast<std::uint64_t>(r) * p.maxTokens + i) * vecs + c], 1.0f);
    }
    out[c] = toBf16x8(acc);
  }
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
