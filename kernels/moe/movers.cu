// The movers path's MoE kernels (see kernels/moe/moe.h): where some peer is reached through NCCL,
// or ranks share a GPU, the throughput path moves records and partials with the alltoallv movers
// between these kernels.
//   dispatch  pack (records and count messages), offsets (expert offsets and per-source bases from
//             the received count messages), expand (records into recv_x grouped by local expert);
//   combine   reduce (per received record, the weighted sum of its expert rows, fp32) and final
//             (per token, the sum of the partials that came back, fp32), bf16 rounded once.
// Node-aware (MoeNodeParams, kernels/moe/node.cuh): pack also writes the hop records for the other
// nodes' landing ranks, expand and reduce read another node's sources' records where a landing
// rank forwarded them (and reduce writes their partials for it to sum), and final takes a remote
// node's one partial; the forwards and sums themselves are kernels/moe/node.cu's.
// Pack, expand, reduce and final only read and write this GPU's memory (the movers carry the bytes),
// so they run on p.grid.epilogueCtas CTAs, the SMs the communication budget leaves free, as the
// direct path's quantise, receive, reduce and final do; offsets is one CTA.
// Launchers below.
#include "kernels/common/launch.h"
#include "kernels/moe/common.cuh"
#include "kernels/moe/node.cuh"

namespace graphep {
namespace {

constexpr int kThreads = kMoeThreads;  // kGroups records (tokens) per CTA at a time
constexpr int kGroups = kThreads / kMoeGroupThreads;
constexpr int kOffsetsThreads = 256;

__device__ inline bool moeTakesSource(MoeSources sources, int s, int rank) {
  return (sources == MoeSources::kOwn) == (s == rank);
}

// Records of list indices [range.first, range.end) of a list of n: how many.
__device__ inline int moeInRange(MoeRange range, long long n) {
  const long long hi = n < range.end ? n : range.end;
  return hi > range.first ? static_cast<int>(hi - range.first) : 0;
}

// Chunk j's share of a list of n entries, in bytes of `unit` each (MoeMoverParams: chunk j holds
// list indices [j * chunkRecords, (j + 1) * chunkRecords)).
__device__ inline std::uint64_t moeChunkBytes(const MoeParams& p, int j, long long n, std::uint64_t unit) {
  return static_cast<std::uint64_t>(moeInRange(moeChunk(p.movers, j, p.shape.maxTokens), n)) * unit;
}

// Grid: p.grid.epilogueCtas CTAs. Each group writes one record at a time: list index i of a
// destination r of `sources` within `range`, token rankTokens[r][i] (its row read once per
// destination), into recordStage[r][i]. The first peers' launch's last CTA also writes the count
// messages and every chunk's send counts of records and receive counts of partials.
__global__ void __launch_bounds__(kThreads) moePackKernel(const __grid_constant__ MoeParams p, MoeSources sources,
                                                          MoeRange range) {
  const MoeStamp stamp(p, MoeKernel::kPack);
  const int tid = static_cast<int>(threadIdx.x), R = p.shape.numRanks;
  if (sources == MoeSources::kPeers && range.first == 0 && blockIdx.x == gridDim.x - 1) {
    const std::uint64_t rowBytes = static_cast<std::uint64_t>(p.shape.hidden) * 2;
    for (int r = tid; r < R; r += kThreads) {
      const std::uint32_t rows = p.routing.rankRecords[r], sent = moeRecordsTo(p, r);
      for (int j = 0; j < p.movers.chunks; ++j) {
        p.movers.recordSendBytes[j * R + r] = moeChunkBytes(p, j, sent, p.shape.recordBytes);
        p.movers.partialRecvBytes[j * R + r] = moeChunkBytes(p, j, sent, rowBytes);  // what comes back per record sent
      }
      auto* msg = reinterpret_cast<std::uint64_t*>(p.movers.countSend + static_cast<std::uint64_t>(r) * p.shape.countMsgBytes);
      msg[0] = rows;
      for (int j = 0; j < p.shape.localExperts; ++j) msg[1 + j] = p.routing.expertEntries[r * p.shape.localExperts + j];
      if (p.node.aware) msg[1 + p.shape.localExperts] = moeOtherNode(p, r) ? sent : 0u;  // hop records to r
    }
  }
  int total = 0;
  for (int r = 0; r < R; ++r) {
    if (moeTakesSource(sources, r, p.shape.rank)) total += moeInRange(range, moeRecordsTo(p, r));
  }
  const MoeGroupSlice gs = moeGroupSlice();
  for (int m = gs.first; m < total; m += gs.stride) {
    int r = 0, i = m;  // item m: the destinations' records in rank order
    for (; r < R; ++r) {
      if (!moeTakesSource(sources, r, p.shape.rank)) continue;
      const int n = moeInRange(range, moeRecordsTo(p, r));
      if (i < n) break;
      i -= n;
    }
    i += range.first;
    char* dst = p.staging.recordStage + (static_cast<std::uint64_t>(r) * p.shape.maxTokens + i) * p.shape.recordBytes;
    // Index i of r's list, or (another node: r its landing rank there) hop record i of r's node.
    const bool hop = moeOtherNode(p, r);
    const int node = p.node.nodeOf[r];
    const int t = hop ? p.node.nodeTokens[static_cast<std::uint64_t>(node) * p.shape.maxTokens + i]
                      : p.routing.rankTokens[static_cast<std::uint64_t>(r) * p.shape.maxTokens + i];
    const int dstRank = hop ? kMoeHopRecord : r;
    const std::int32_t* entryIdx = p.routing.entryIndex + static_cast<std::uint64_t>(t) * p.shape.topK;
    moeWriteRecords(p, t, &dst, &dstRank, 1, [&](int k) { return entryIdx[k]; }, gs.g, 1);
    if (hop) {  // each rank's index of the token, for the landing rank to forward it
      std::int32_t* fwd = moeHopForwards(p, dst);
      for (int q = gs.g.tid; q < R; q += gs.g.nthreads) {
        fwd[q] = p.node.nodeOf[q] == node ? p.routing.tokenRankIndex[static_cast<std::uint64_t>(t) * R + q] : -1;
      }
    }
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
  const int R = p.shape.numRanks;
  for (int q = tid; q < R; q += kOffsetsThreads) {
    const int rows = p.layout.sourceRecords[q];
    const int carried = moeOtherNode(p, q) ? moeHopRecordsIn(p, msg(q)) : rows;  // another node's: its hop records
    for (int j = 0; j < p.movers.chunks; ++j) {
      p.movers.recordRecvBytes[j * R + q] = moeChunkBytes(p, j, carried, p.shape.recordBytes);
      p.movers.partialSendBytes[j * R + q] = moeChunkBytes(p, j, carried, rowBytes);  // a partial per record carried
    }
  }
}

// Source s's records: a peer's where the record exchange put them, this rank's own where pack wrote
// them (the exchange does not copy them: AllToAllvArgs::skipOwnBlock), a source's on another node
// (node-aware) where its landing rank on this node forwarded them.
__device__ inline const char* moeSourceRecords(const MoeParams& p, int s) {
  const char* base = s == p.shape.rank      ? p.staging.recordStage
                     : moeOtherNode(p, s) ? p.peers.userRegions[p.shape.rank] + p.node.fwdRecvOff
                                          : p.staging.recordRecv;
  return base + static_cast<std::uint64_t>(s) * p.shape.maxTokens * p.shape.recordBytes;
}

// Grid: p.grid.epilogueCtas CTAs; each group expands one record of `sources` within `range` at a
// time (source-major).
// Each slot of a record puts a copy of its row at layout.sourceBase[source][expert] + index (dropped
// and counted past the capacity).
__global__ void __launch_bounds__(kThreads) moeExpandKernel(const __grid_constant__ MoeParams p, MoeSources sources,
                                                            MoeRange range) {
  const MoeStamp stamp(p, MoeKernel::kExpand);
  __shared__ MoeSlotStage stage[kGroups];
  const MoeGroupSlice gs = moeGroupSlice();
  if (blockIdx.x == 0 && threadIdx.x == 0) *p.state.pending = kMoeDispatched | kMoePendingCombine;  // the dispatch's last kernel
  for (int s = 0; s < p.shape.numRanks; ++s) {
    if (!moeTakesSource(sources, s, p.shape.rank)) continue;
    const char* recs = moeSourceRecords(p, s);
    const long long rankBase = p.layout.rankMajor ? p.layout.rankOffsets[s] : -1;  // rank-major: the source's first row
    const int end = range.first + moeInRange(range, p.layout.sourceRecords[s]);
    for (int i = range.first + gs.first; i < end; i += gs.stride) {
      moeExpandRecord(p, s, recs + static_cast<std::uint64_t>(i) * p.shape.recordBytes, p.layout.sourceBase + s * p.shape.localExperts,
                      stage[gs.group], gs.g, p.layout.rankMajor ? rankBase + i : -1);
    }
  }
}

// ---- combine ----------------------------------------------------------------------------------

// Where this rank's partials of source s's records go: partialStage, or (node-aware) for a source on
// another node its nodePartial slots, which the landing rank of s on this node sums.
__device__ inline char* moePartialOf(const MoeParams& p, int s) {
  return moeOtherNode(p, s) ? p.peers.userRegions[p.shape.rank] + p.node.nodePartialOff : p.staging.partialStage;
}

// Grid: p.grid.epilogueCtas CTAs; each group reduces one record of `sources` within `range` at a
// time (source-major), into partialStage[source][record] (moePartialOf). The first launch of the peers' records
// checks the pairing.
__global__ void __launch_bounds__(kThreads) moeCombineReduceKernel(const __grid_constant__ MoeParams p,
                                                                   MoeSources sources, MoeRange range) {
  const MoeStamp stamp(p, MoeKernel::kCombineReduce);
  __shared__ MoeSlotStage stage[kGroups];
  const MoeGroupSlice gs = moeGroupSlice();
  if (blockIdx.x == 0 && threadIdx.x == 0 && sources != MoeSources::kOwn && range.first == 0) moeCheckPairing(p, false);
  const std::uint64_t rowBytes = static_cast<std::uint64_t>(p.shape.hidden) * 2;
  for (int s = 0; s < p.shape.numRanks; ++s) {
    if (!moeTakesSource(sources, s, p.shape.rank)) continue;
    const long long rankBase = p.layout.rankMajor ? p.layout.rankOffsets[s] : -1;  // rank-major: the source's first row
    const char* recs = moeSourceRecords(p, s);
    const int end = range.first + moeInRange(range, p.layout.sourceRecords[s]);
    for (int i = range.first + gs.first; i < end; i += gs.stride) {
      const std::uint64_t record = static_cast<std::uint64_t>(s) * p.shape.maxTokens + i;
      moeReduceRecord(p, recs + static_cast<std::uint64_t>(i) * p.shape.recordBytes, p.layout.sourceBase + s * p.shape.localExperts,
                      moePartialOf(p, s) + record * rowBytes, stage[gs.group], gs.g, p.layout.rankMajor ? rankBase + i : -1);
    }
  }
}

// Grid: p.grid.epilogueCtas CTAs; each group sums one token's partials at a time, tokens `range`
// (token t's partial from rank r sits at list index tokenRankIndex[t][r] <= t: in chunk t's
// exchange or an earlier one).
__global__ void __launch_bounds__(kThreads) moeCombineFinalKernel(const __grid_constant__ MoeParams p, MoeRange range) {
  const MoeStamp stamp(p, MoeKernel::kCombineFinal);
  __shared__ const uint4* parts[kGroups][kMaxRanks];
  const MoeGroupSlice gs = moeGroupSlice();
  if (blockIdx.x == 0 && threadIdx.x == 0) *p.state.pending &= kMoeDispatched;  // the combine's last kernel
  const std::uint64_t rowBytes = static_cast<std::uint64_t>(p.shape.hidden) * 2;
  const int end = range.first + moeInRange(range, *p.routing.liveTokens);
  for (int t = range.first + gs.first; t < end; t += gs.stride) {
    moeFinalToken(
        p, t,
        [&](int r) -> const char* {
          if (moeOtherNode(p, r)) {  // node-aware: the node's one partial, from its landing rank, at the hop index
            const int m = p.node.nodeOf[r];
            const int j = p.node.landing[m] == r ? p.node.tokenNodeIndex[static_cast<std::uint64_t>(t) * p.shape.numRanks + m] : -1;
            return j < 0 ? nullptr : p.movers.partialRecv + (static_cast<std::uint64_t>(r) * p.shape.maxTokens + j) * rowBytes;
          }
          const int i = p.routing.tokenRankIndex[static_cast<std::uint64_t>(t) * p.shape.numRanks + r];
          // This rank's own partials stay where reduce wrote them (the exchange skips the own block).
          const char* base = r == p.shape.rank ? p.staging.partialStage : p.movers.partialRecv;
          return i < 0 ? nullptr : base + (static_cast<std::uint64_t>(r) * p.shape.maxTokens + i) * rowBytes;
        },
        parts[gs.group], gs.g);
  }
}

}  // namespace

cudaError_t launchMoePack(const MoeParams& p, MoeSources sources, MoeRange range, cudaStream_t stream) {
  return launchGrid(__func__, "grid.epilogueCtas", p.grid.epilogueCtas, kThreads, stream, moePackKernel, p, sources,
                    range);
}

cudaError_t launchMoeOffsets(const MoeParams& p, cudaStream_t stream) {
  moeOffsetsKernel<<<1, kOffsetsThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launchMoeExpand(const MoeParams& p, MoeSources sources, MoeRange range, cudaStream_t stream) {
  return launchGrid(__func__, "grid.epilogueCtas", p.grid.epilogueCtas, kThreads, stream, moeExpandKernel, p, sources,
                    range);
}

cudaError_t launchMoeCombineReduce(const MoeParams& p, MoeSources sources, MoeRange range, cudaStream_t stream) {
  return launchGrid(__func__, "grid.epilogueCtas", p.grid.epilogueCtas, kThreads, stream, moeCombineReduceKernel, p,
                    sources, range);
}

cudaError_t launchMoeCombineFinal(const MoeParams& p, MoeRange range, cudaStream_t stream) {
  return launchGrid(__func__, "grid.epilogueCtas", p.grid.epilogueCtas, kThreads, stream, moeCombineFinalKernel, p,
                    range);
}

cudaError_t preloadMoeMoversKernels() {
  return preloadKernels(moePackKernel, moeOffsetsKernel, moeExpandKernel, moeCombineReduceKernel, moeCombineFinalKernel);
}

}  // namespace graphep
