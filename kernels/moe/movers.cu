// The movers path's MoE kernels (see kernels/moe/moe.h): where some peer is reached through NCCL,
// or ranks share a GPU, the throughput path moves records and partials with the alltoallv movers
// between these kernels.
//   dispatch  pack (records and count messages), offsets (expert offsets and per-source bases from
//             the received count messages), expand (records into recv_x grouped by local expert);
//   combine   reduce (per received record, the weighted sum of its expert rows, fp32) and final
//             (per token, the sum of the partials that came back, fp32), bf16 rounded once.
// Pack, expand, reduce and final only read and write this GPU's memory (the movers carry the bytes),
// so they run on p.grid.epilogueCtas CTAs, the SMs the communication budget leaves free, as the
// direct path's quantise, receive, reduce and final do; offsets is one CTA.
// Launchers below.
#include "kernels/common/launch.h"
#include "kernels/moe/common.cuh"

namespace graphep {
namespace {

constexpr int kThreads = kMoeThreads;  // kGroups records (tokens) per CTA at a time
constexpr int kGroups = kThreads / kMoeGroupThreads;
constexpr int kOffsetsThreads = 256;

// Grid: p.grid.epilogueCtas CTAs. Each group writes one token's record for every rank it goes to (the row read
// once) at a time; the last CTA also writes the count messages and the movers' send counts.
__global__ void __launch_bounds__(kThreads) moePackKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kPack);
  __shared__ char* dst[kGroups][kMaxRanks];
  __shared__ int dstRank[kGroups][kMaxRanks];
  __shared__ int ndst[kGroups];
  const int tid = static_cast<int>(threadIdx.x);
  if (blockIdx.x == gridDim.x - 1) {
    const std::uint64_t rowBytes = static_cast<std::uint64_t>(p.shape.hidden) * 2;
    for (int r = tid; r < p.shape.numRanks; r += kThreads) {
      const std::uint64_t rows = p.routing.rankRecords[r];
      p.movers.recordSendBytes[r] = rows * p.shape.recordBytes;
      p.movers.partialRecvBytes[r] = rows * rowBytes;
      auto* msg = reinterpret_cast<std::uint64_t*>(p.movers.countSend + static_cast<std::uint64_t>(r) * p.shape.countMsgBytes);
      msg[0] = rows;
      for (int j = 0; j < p.shape.localExperts; ++j) msg[1 + j] = p.routing.expertEntries[r * p.shape.localExperts + j];
    }
  }
  const MoeGroupSlice gs = moeGroupSlice();
  const int T = *p.routing.liveTokens;
  for (int t = gs.first; t < T; t += gs.stride) {
    if (gs.g.tid == 0) {
      int n = 0;
      for (int r = 0; r < p.shape.numRanks; ++r) {
        const int i = p.routing.tokenRankIndex[static_cast<std::uint64_t>(t) * p.shape.numRanks + r];
        if (i < 0) continue;
        dst[gs.group][n] = p.staging.recordStage + (static_cast<std::uint64_t>(r) * p.shape.maxTokens + i) * p.shape.recordBytes;
        dstRank[gs.group][n++] = r;
      }
      ndst[gs.group] = n;
    }
    gs.g.sync();
    const std::int32_t* entryIdx = p.routing.entryIndex + static_cast<std::uint64_t>(t) * p.shape.topK;
    moeWriteRecords(p, t, dst[gs.group], dstRank[gs.group], ndst[gs.group], [&](int k) { return entryIdx[k]; },
                    gs.g, ndst[gs.group]);
    gs.g.sync();  // dst is rewritten for the next token
  }
}

// One CTA: the receive layout from the received count messages (moeComputeLayout, the
// per-(source, expert) bases straight into p.layout.sourceBase; moePublishLayout), and the movers' receive
// counts of the records and send counts of the combine partials.
__global__ void __launch_bounds__(kOffsetsThreads) moeOffsetsKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kOffsets);
  __shared__ std::int32_t counts[kMoeMaxLocalExperts];
  __shared__ std::int32_t offsets[kMoeMaxLocalExperts + 1];
  __shared__ MoeLayoutScratch<kOffsetsThreads> scratch;
  const int tid = static_cast<int>(threadIdx.x);
  auto msg = [&](int q) {
    return reinterpret_cast<const std::uint64_t*>(p.movers.countRecv + static_cast<std::uint64_t>(q) * p.shape.countMsgBytes);
  };
  moeComputeLayout<kOffsetsThreads>(p, msg, counts, offsets, p.layout.sourceBase, scratch);
  moePublishLayout<kOffsetsThreads>(p, msg, counts, offsets, p.layout.sourceBase, scratch);
  __syncthreads();  // layout.sourceRecords is written above
  const std::uint64_t rowBytes = static_cast<std::uint64_t>(p.shape.hidden) * 2;
  for (int q = tid; q < p.shape.numRanks; q += kOffsetsThreads) {
    const std::uint64_t rows = static_cast<std::uint64_t>(p.layout.sourceRecords[q]);
    p.movers.recordRecvBytes[q] = rows * p.shape.recordBytes;
    p.movers.partialSendBytes[q] = rows * rowBytes;
  }
}

// Source s's records: a peer's where the record exchange put them, this rank's own where pack wrote
// them (the exchange does not copy them: AllToAllvArgs::skipOwnBlock).
__device__ inline const char* moeSourceRecords(const MoeParams& p, int s) {
  const char* base = s == p.shape.rank ? p.staging.recordStage : p.staging.recordRecv;
  return base + static_cast<std::uint64_t>(s) * p.shape.maxTokens * p.shape.recordBytes;
}

__device__ inline bool moeTakesSource(MoeSources sources, int s, int rank) {
  return (sources == MoeSources::kOwn) == (s == rank);
}

// Grid: p.grid.epilogueCtas CTAs; each group expands one record of `sources` at a time (source-major).
// Each slot of a record puts a copy of its row at layout.sourceBase[source][expert] + index (dropped
// and counted past the capacity).
__global__ void __launch_bounds__(kThreads) moeExpandKernel(const __grid_constant__ MoeParams p, MoeSources sources) {
  const MoeStamp stamp(p, MoeKernel::kExpand);
  __shared__ MoeSlotStage stage[kGroups];
  const MoeGroupSlice gs = moeGroupSlice();
  if (blockIdx.x == 0 && threadIdx.x == 0) *p.state.pending = kMoeDispatched | kMoePendingCombine;  // the dispatch's last kernel
  for (int s = 0; s < p.shape.numRanks; ++s) {
    if (!moeTakesSource(sources, s, p.shape.rank)) continue;
    const char* recs = moeSourceRecords(p, s);
    const long long rankBase = p.layout.rankMajor ? p.layout.rankOffsets[s] : -1;  // rank-major: the source's first row
    for (int i = gs.first; i < p.layout.sourceRecords[s]; i += gs.stride) {
      moeExpandRecord(p, s, recs + static_cast<std::uint64_t>(i) * p.shape.recordBytes, p.layout.sourceBase + s * p.shape.localExperts,
                      stage[gs.group], gs.g, p.layout.rankMajor ? rankBase + i : -1);
    }
  }
}

// ---- combine ----------------------------------------------------------------------------------

// Grid: p.grid.epilogueCtas CTAs; each group reduces one record of `sources` at a time (source-major),
// into partialStage[source][record]. The launch of the peers' records checks the pairing.
__global__ void __launch_bounds__(kThreads) moeCombineReduceKernel(const __grid_constant__ MoeParams p, MoeSources sources) {
  const MoeStamp stamp(p, MoeKernel::kCombineReduce);
  __shared__ MoeSlotStage stage[kGroups];
  const MoeGroupSlice gs = moeGroupSlice();
  if (blockIdx.x == 0 && threadIdx.x == 0 && sources != MoeSources::kOwn) moeCheckPairing(p, false);
  const std::uint64_t rowBytes = static_cast<std::uint64_t>(p.shape.hidden) * 2;
  for (int s = 0; s < p.shape.numRanks; ++s) {
    if (!moeTakesSource(sources, s, p.shape.rank)) continue;
    const long long rankBase = p.layout.rankMajor ? p.layout.rankOffsets[s] : -1;  // rank-major: the source's first row
    const char* recs = moeSourceRecords(p, s);
    for (int i = gs.first; i < p.layout.sourceRecords[s]; i += gs.stride) {
      const std::uint64_t record = static_cast<std::uint64_t>(s) * p.shape.maxTokens + i;
      moeReduceRecord(p, recs + static_cast<std::uint64_t>(i) * p.shape.recordBytes, p.layout.sourceBase + s * p.shape.localExperts,
                      p.staging.partialStage + record * rowBytes, stage[gs.group], gs.g, p.layout.rankMajor ? rankBase + i : -1);
    }
  }
}

// Grid: p.grid.epilogueCtas CTAs; each group sums one token's partials at a time.
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
          // This rank's own partials stay where reduce wrote them (the exchange skips the own block).
          const char* base = r == p.shape.rank ? p.staging.partialStage : p.movers.partialRecv;
          return i < 0 ? nullptr : base + (static_cast<std::uint64_t>(r) * p.shape.maxTokens + i) * rowBytes;
        },
        parts[gs.group], gs.g);
  }
}

}  // namespace

cudaError_t launchMoePack(const MoeParams& p, cudaStream_t stream) {
  return launchGrid(__func__, "grid.epilogueCtas", p.grid.epilogueCtas, kThreads, stream, moePackKernel, p);
}

cudaError_t launchMoeOffsets(const MoeParams& p, cudaStream_t stream) {
  moeOffsetsKernel<<<1, kOffsetsThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launchMoeExpand(const MoeParams& p, MoeSources sources, cudaStream_t stream) {
  return launchGrid(__func__, "grid.epilogueCtas", p.grid.epilogueCtas, kThreads, stream, moeExpandKernel, p, sources);
}

cudaError_t launchMoeCombineReduce(const MoeParams& p, MoeSources sources, cudaStream_t stream) {
  return launchGrid(__func__, "grid.epilogueCtas", p.grid.epilogueCtas, kThreads, stream, moeCombineReduceKernel, p,
                    sources);
}

cudaError_t launchMoeCombineFinal(const MoeParams& p, cudaStream_t stream) {
  return launchGrid(__func__, "grid.epilogueCtas", p.grid.epilogueCtas, kThreads, stream, moeCombineFinalKernel, p);
}

cudaError_t preloadMoeMoversKernels() {
  return preloadKernels(moePackKernel, moeOffsetsKernel, moeExpandKernel, moeCombineReduceKernel, moeCombineFinalKernel);
}

}  // namespace graphep
