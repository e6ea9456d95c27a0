// MoE dispatch layout kernel family (see kernels/moe/moe.h): pack (records and count messages), offsets
// (expert offsets and per-source bases from the received count messages) and expand (records into
// recv_x grouped by local expert); launchers below.
#include "kernels/moe/common.cuh"

namespace graphep {
namespace {

constexpr int kThreads = kMoeThreads;  // pack / expand: kGroups records per CTA at a time
constexpr int kGroups = kThreads / kMoeGroupThreads;
constexpr int kOffsetsThreads = 256;

// Grid: p.ctas CTAs. Each group writes one token's record for every rank it goes to (the row read
// once) at a time; the last CTA also writes the count messages and the movers' send counts.
__global__ void __launch_bounds__(kThreads) moePackKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kPack);
  __shared__ char* dst[kGroups][kMaxRanks];
  __shared__ int dstRank[kGroups][kMaxRanks];
  __shared__ int ndst[kGroups];
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
  }
  const MoeGroupSlice gs = moeGroupSlice();
  const int T = *p.liveTokens;
  for (int t = gs.first; t < T; t += gs.stride) {
    if (gs.g.tid == 0) {
      int n = 0;
      for (int r = 0; r < p.numRanks; ++r) {
        const int i = p.tokRankIdx[static_cast<std::uint64_t>(t) * p.numRanks + r];
        if (i < 0) continue;
        dst[gs.group][n] = p.recSend + (static_cast<std::uint64_t>(r) * p.maxTokens + i) * p.recBytes;
        dstRank[gs.group][n++] = r;
      }
      ndst[gs.group] = n;
    }
    gs.g.sync();
    const std::int32_t* entryIdx = p.entryIdx + static_cast<std::uint64_t>(t) * p.topK;
    moeWriteRecords(p, t, dst[gs.group], dstRank[gs.group], ndst[gs.group], [&](int k) { return entryIdx[k]; },
                    gs.g, ndst[gs.group]);
    gs.g.sync();  // dst is rewritten for the next token
  }
}

// One CTA: the receive layout from the received count messages (moeComputeLayout, the
// per-(source, expert) bases straight into p.srcBase; moePublishLayout), and the movers' receive
// counts of the records and send counts of the combine partials.
__global__ void __launch_bounds__(kOffsetsThreads) moeOffsetsKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kOffsets);
  __shared__ std::int32_t counts[kMoeMaxLocalExperts];
  __shared__ std::int32_t offsets[kMoeMaxLocalExperts + 1];
  __shared__ MoeLayoutScratch<kOffsetsThreads> scratch;
  const int tid = static_cast<int>(threadIdx.x);
  auto msg = [&](int q) {
    return reinterpret_cast<const std::uint64_t*>(p.cntRecv + static_cast<std::uint64_t>(q) * p.cntMsgBytes);
  };
  moeComputeLayout<kOffsetsThreads>(p, msg, counts, offsets, p.srcBase, scratch);
  moePublishLayout<kOffsetsThreads>(p, msg, counts, offsets, p.srcBase, scratch);
  __syncthreads();  // recvRows is written above
  const std::uint64_t rowBytes = static_cast<std::uint64_t>(p.hidden) * 2;
  for (int q = tid; q < p.numRanks; q += kOffsetsThreads) {
    const std::uint64_t rows = static_cast<std::uint64_t>(p.recvRows[q]);
    p.dispRecvCounts[q] = rows * p.recBytes;
    p.combSendCounts[q] = rows * rowBytes;
  }
}

// Grid: p.ctas CTAs; each group expands one received record at a time (source-major). Each slot of
// a record puts a copy of its row at srcBase[source][expert] + index (dropped and counted past the
// capacity).
__global__ void __launch_bounds__(kThreads) moeExpandKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kExpand);
  __shared__ MoeSlotStage stage[kGroups];
  const MoeGroupSlice gs = moeGroupSlice();
  if (blockIdx.x == 0 && threadIdx.x == 0) *p.pending = kMoeDispatched | kMoePendingCombine;  // the dispatch's last kernel
  for (int s = 0; s < p.numRanks; ++s) {
    const char* recs = p.recRecv + static_cast<std::uint64_t>(s) * p.maxTokens * p.recBytes;
    const long long rankBase = p.rankMajor ? p.rankOffsets[s] : -1;  // rank-major: the source's first row
    for (int i = gs.first; i < p.recvRows[s]; i += gs.stride) {
      moeExpandRecord(p, s, recs + static_cast<std::uint64_t>(i) * p.recBytes, p.srcBase + s * p.localExperts,
                      stage[gs.group], gs.g, p.rankMajor ? rankBase + i : -1);
    }
  }
}

}  // namespace

cudaError_t launchMoePack(const MoeParams& p, cudaStream_t stream) {
  if (p.ctas < 1) return cudaErrorInvalidValue;
  moePackKernel<<<static_cast<unsigned>(p.ctas), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launchMoeOffsets(const MoeParams& p, cudaStream_t stream) {
  moeOffsetsKernel<<<1, kOffsetsThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launchMoeExpand(const MoeParams& p, cudaStream_t stream) {
  if (p.ctas < 1) return cudaErrorInvalidValue;
  moeExpandKernel<<<static_cast<unsigned>(p.ctas), kThreads, 0, stream>>>(p);
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
