// MoE dispatch layout kernel family (see kernels/moe.h): pack (records and count messages), offsets
// (expert offsets and per-source bases from the received count messages) and expand (records into
// recv_x grouped by local expert); launchers below.
#include "kernels/common/moe.cuh"

namespace graphep {
namespace {

constexpr int kThreads = 128;  // pack / expand: one CTA per record
constexpr int kOffsetsThreads = 256;

// Grid: maxTokens + 1 CTAs. CTA t < T writes token t's record for every rank it goes to; the last
// CTA writes the count messages and the movers' send counts (it runs whatever T is).
__global__ void __launch_bounds__(kThreads) moePackKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kPack);
  const int tid = static_cast<int>(threadIdx.x);
  if (blockIdx.x == gridDim.x - 1) {
    const std::uint64_t rowBytes = static_cast<std::uint64_t>(p.hidden) * 2;
    for (int r = tid; r < p.numRanks; r += kThreads) {
      const std::uint64_t rows = p.rankCount[r];
      p.dispSendCounts[r] = rows * p.recBytes;
      p.combRecvCounts[r] = rows * rowBytes;
      auto* msg = reinterpret_cast<std::uint64_t*>(p.cntSend + static_cast<std::uint64_t>(r) * p.cntMsgBytes);
      msg[0] = rows;
      for (int j = 0; j < p.localExperts; ++j) msg[1 + j] = p.expertCount[r * p.localExperts + j];
    }
    return;
  }
  const int t = static_cast<int>(blockIdx.x);
  if (t >= *p.liveTokens) return;
  __shared__ char* dst[kMaxRanks];
  __shared__ int dstRank[kMaxRanks];
  __shared__ int n;
  if (tid == 0) {
    n = 0;
    for (int r = 0; r < p.numRanks; ++r) {
      const int i = p.tokRankIdx[static_cast<std::uint64_t>(t) * p.numRanks + r];
      if (i < 0) continue;
      dst[n] = p.recSend + (static_cast<std::uint64_t>(r) * p.maxTokens + i) * p.recBytes;
      dstRank[n++] = r;
    }
  }
  __syncthreads();
  const std::int32_t* entryIdx = p.entryIdx + static_cast<std::uint64_t>(t) * p.topK;
  moeWriteRecords(p, t, dst, dstRank, n, [&](int k) { return entryIdx[k]; }, MoeGroup{tid, kThreads, 0});
}

// One CTA: the receive layout from the received count messages (moePublishLayout), and the
// movers' receive counts of the records and send counts of the combine partials.
__global__ void __launch_bounds__(kOffsetsThreads) moeOffsetsKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kOffsets);
  __shared__ std::int32_t counts[kMoeMaxLocalExperts];
  __shared__ std::int32_t offsets[kMoeMaxLocalExperts + 1];
  const int tid = static_cast<int>(threadIdx.x);
  auto msg = [&](int q) {
    return reinterpret_cast<const std::uint64_t*>(p.cntRecv + static_cast<std::uint64_t>(q) * p.cntMsgBytes);
  };
  moeExpertOffsets(p, msg, counts, offsets, tid, kOffsetsThreads);
  moePublishLayout(p, msg, counts, offsets, tid, kOffsetsThreads);
  __syncthreads();  // recvRows is written above
  const std::uint64_t rowBytes = static_cast<std::uint64_t>(p.hidden) * 2;
  for (int q = tid; q < p.numRanks; q += kOffsetsThreads) {
    const std::uint64_t rows = static_cast<std::uint64_t>(p.recvRows[q]);
    p.dispRecvCounts[q] = rows * p.recBytes;
    p.combSendCounts[q] = rows * rowBytes;
  }
}

// Grid: R * maxTokens CTAs, one per (source, record); records past the source's count exit. Each
// slot of a record puts a copy of its row at srcBase[source][expert] + index (dropped and counted
// past the capacity).
__global__ void __launch_bounds__(kThreads) moeExpandKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kExpand);
  const int tid = static_cast<int>(threadIdx.x);
  const int s = static_cast<int>(blockIdx.x / static_cast<unsigned>(p.maxTokens));
  const int i = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.maxTokens));
  if (s >= p.numRanks || i >= p.recvRows[s]) return;
  const char* rec = p.recRecv + (static_cast<std::uint64_t>(s) * p.maxTokens + i) * p.recBytes;
  __shared__ MoeSlotStage stage;
  moeExpandRecord(p, s, rec, p.srcBase + s * p.localExperts, stage, MoeGroup{tid, kThreads, 0});
}

}  // namespace

cudaError_t launchMoePack(const MoeParams& p, cudaStream_t stream) {
  moePackKernel<<<static_cast<unsigned>(p.maxTokens) + 1, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launchMoeOffsets(const MoeParams& p, cudaStream_t stream) {
  moeOffsetsKernel<<<1, kOffsetsThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launchMoeExpand(const MoeParams& p, cudaStream_t stream) {
  const unsigned long long blocks = static_cast<unsigned long long>(p.numRanks) * p.maxTokens;
  if (blocks == 0 || blocks > 0x7fffffffull) return cudaErrorInvalidValue;
  moeExpandKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t preloadMoeDispatchKernels() {
  cudaFuncAttributes a{};
  for (const void* f : {reinterpret_cast<const void*>(moePackKernel),
                        reinterpret_cast<const void*>(moeOffsetsKernel),
                        reinterpret_cast<const void*>(moeExpandKernel)}) {
    const cudaError_t e = cudaFuncGetAttributes(&a, f);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace graphep
