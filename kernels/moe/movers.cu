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
#include "kernels/moe/peer.cuh"

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

// Whether rank r is on another node than this rank's, under the node-aware dispatch.
__device__ inline bool moeOtherNode(const MoeParams& p, int r) {
  return p.node.aware != 0 && p.node.nodeOf[r] != p.node.nodeOf[p.shape.rank];
}

// The records this rank's records exchange carries to rank r: its list for r, or, for a rank on
// another node (node-aware), the hop list of r's node where r is this rank's landing rank there
// (none to the node's other ranks).
__device__ inline std::uint32_t moeRecordsTo(const MoeParams& p, int r) {
  if (!moeOtherNode(p, r)) return p.routing.rankRecords[r];
  const int m = p.node.nodeOf[r];
  return p.node.landing[m] == r ? p.node.nodeRecords[m] : 0u;
}

// A count message's word of hop records (node-aware: after the per-expert counts), clamped.
__device__ inline int moeHopRecordsIn(const MoeParams& p, const std::uint64_t* msg) {
  const std::uint64_t n = msg[1 + p.shape.localExperts];
  return static_cast<int>(n < static_cast<std::uint64_t>(p.shape.maxTokens) ? n : p.shape.maxTokens);
}

// The hop records source s sent this rank to forward (none from this node's ranks).
__device__ inline int moeHopRecordsFrom(const MoeParams& p, int s) {
  const auto* msg = reinterpret_cast<const std::uint64_t*>(p.movers.countRecv + static_cast<std::uint64_t>(s) * p.shape.countMsgBytes);
  return moeOtherNode(p, s) ? moeHopRecordsIn(p, msg) : 0;
}

// The hop records that landed here, in source order (forward and node-sum take them alike): how
// many, and item m's source s, its index j in s's hop list and the record (recordRecv[s][j]).
__device__ inline int moeHopRecordsHere(const MoeParams& p) {
  int total = 0;
  for (int s = 0; s < p.shape.numRanks; ++s) total += moeHopRecordsFrom(p, s);
  return total;
}
struct MoeHopItem {
  int source, index;
  const char* record;
};
__device__ inline MoeHopItem moeHopItem(const MoeParams& p, int m) {
  int s = 0, j = m;
  for (; s < p.shape.numRanks; ++s) {
    const int n = moeHopRecordsFrom(p, s);
    if (j < n) break;
    j -= n;
  }
  return MoeHopItem{s, j, p.staging.recordRecv + (static_cast<std::uint64_t>(s) * p.shape.maxTokens + j) * p.shape.recordBytes};
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
    if (moeOtherNode(p, r)) {  // hop record i of r's node, for r to forward
      const int node = p.node.nodeOf[r];
      const int t = p.node.nodeTokens[static_cast<std::uint64_t>(node) * p.shape.maxTokens + i];
      const std::int32_t* entryIdx = p.routing.entryIndex + static_cast<std::uint64_t>(t) * p.shape.topK;
      const int hop = kMoeHopRecord;
      moeWriteRecords(p, t, &dst, &hop, 1, [&](int k) { return entryIdx[k]; }, gs.g, 1);
      auto* fwd = reinterpret_cast<std::int32_t*>(dst + p.shape.payloadBytes + moeMetaBytes(p.shape.topK));
      for (int q = gs.g.tid; q < R; q += gs.g.nthreads) {
        fwd[q] = p.node.nodeOf[q] == node ? p.routing.tokenRankIndex[static_cast<std::uint64_t>(t) * R + q] : -1;
      }
      continue;
    }
    const int t = p.routing.rankTokens[static_cast<std::uint64_t>(r) * p.shape.maxTokens + i];
    const std::int32_t* entryIdx = p.routing.entryIndex + static_cast<std::uint64_t>(t) * p.shape.topK;
    moeWriteRecords(p, t, &dst, &r, 1, [&](int k) { return entryIdx[k]; }, gs.g, 1);
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

// ---- the node-aware dispatch's forwards (MoeNodeParams) ----------------------------------------

// One hop record `hop` of source s (on another node) to each destination of this node it names:
// its payload copied to every one, and each one's metadata (the slots whose experts live there,
// as moeWriteRecordMeta writes them for a record sent directly). The group's shared arrays hold
// the destinations.
__device__ void moeForwardRecord(const MoeParams& p, int s, const char* hop, char** dsts, int* dstRanks, int* ndst,
                                 const MoeGroup& g) {
  const int R = p.shape.numRanks, T = p.shape.maxTokens;
  if (g.tid == 0) {
    const auto* fwd = reinterpret_cast<const std::int32_t*>(hop + p.shape.payloadBytes + moeMetaBytes(p.shape.topK));
    int n = 0;
    for (int q = 0; q < R; ++q) {
      const int i = fwd[q];
      if (((p.node.nodeMask >> q) & 1u) == 0 || i < 0 || i >= T) continue;  // not this node's, or not going there
      dsts[n] = p.peers.userRegions[q] + p.node.fwdRecvOff +
                (static_cast<std::uint64_t>(s) * T + static_cast<std::uint64_t>(i)) * p.shape.recordBytes;
      dstRanks[n++] = q;
    }
    *ndst = n;
  }
  g.sync();
  const int n = *ndst;
  const auto* src = reinterpret_cast<const uint4*>(hop);
  const int vecs = static_cast<int>(p.shape.payloadBytes / 16);
  for (int c0 = g.tid; c0 < vecs; c0 += g.nthreads * kMoeUnroll) {
    uint4 v[kMoeUnroll];
#pragma unroll
    for (int u = 0; u < kMoeUnroll; ++u) {
      if (c0 + u * g.nthreads < vecs) v[u] = src[c0 + u * g.nthreads];
    }
    for (int d = 0; d < n; ++d) {
      auto* out = reinterpret_cast<uint4*>(dsts[d]);
#pragma unroll
      for (int u = 0; u < kMoeUnroll; ++u) {
        if (c0 + u * g.nthreads < vecs) out[c0 + u * g.nthreads] = v[u];
      }
    }
  }
  if (g.tid < 32) {  // lane k: the hop record's slot k
    const int k = g.tid;
    const MoeRecordHeader head = *moeRecordHeader(p, hop);
    const bool has = k < head.nslots && k < p.shape.topK;
    const MoeRecordSlot slot = has ? moeRecordSlots(p, hop)[k] : MoeRecordSlot{-1, 0, 0.f, 0};
    for (int d = 0; d < n; ++d) {
      const bool here = has && slot.localExpert / p.shape.localExperts == dstRanks[d];
      const unsigned m = __ballot_sync(0xffffffffu, here);
      if (here) {
        auto* slots = reinterpret_cast<MoeRecordSlot*>(dsts[d] + p.shape.payloadBytes + sizeof(MoeRecordHeader));
        slots[__popc(m & ((1u << k) - 1u))] =
            MoeRecordSlot{slot.localExpert % p.shape.localExperts, slot.index, slot.weight, slot.k};
      }
      if (k == 0) *reinterpret_cast<MoeRecordHeader*>(dsts[d] + p.shape.payloadBytes) = MoeRecordHeader{head.token, __popc(m), {0, 0}};
    }
  }
  g.sync();  // the shared destinations are rewritten for the group's next record
}

// Grid: p.grid.epilogueCtas CTAs; each group forwards one hop record at a time, those of every
// source on another node whose landing rank this is (their count in its count message), in
// source order.
__global__ void __launch_bounds__(kThreads) moeForwardKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kForward);
  __shared__ char* dsts[kGroups][kMaxRanks];
  __shared__ int dstRanks[kGroups][kMaxRanks];
  __shared__ int ndst[kGroups];
  const MoeGroupSlice gs = moeGroupSlice();
  const int total = moeHopRecordsHere(p);
  for (int m = gs.first; m < total; m += gs.stride) {
    const MoeHopItem hop = moeHopItem(p, m);
    moeForwardRecord(p, hop.source, hop.record, dsts[gs.group], dstRanks[gs.group], &ndst[gs.group], gs.g);
  }
}

// Grid: p.grid.epilogueCtas CTAs; each group sums one hop record's partials at a time (those
// forward wrote), in the forward's order: the partials of the record at each destination q of this
// node (its nodePartial slot [source][index], read in q's heap), fp32 in rank order, bf16 out into
// partialStage[source][hop index], for the partials exchange to carry home.
__global__ void __launch_bounds__(kThreads) moeNodeSumKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kNodeSum);
  __shared__ const uint4* parts[kGroups][kMaxRanks];
  const MoeGroupSlice gs = moeGroupSlice();
  const int R = p.shape.numRanks, T = p.shape.maxTokens;
  const std::uint64_t rowBytes = static_cast<std::uint64_t>(p.shape.hidden) * 2;
  const int total = moeHopRecordsHere(p);
  for (int m = gs.first; m < total; m += gs.stride) {
    const MoeHopItem hop = moeHopItem(p, m);
    const int s = hop.source, j = hop.index;
    const auto* fwd = reinterpret_cast<const std::int32_t*>(hop.record + p.shape.payloadBytes + moeMetaBytes(p.shape.topK));
    gs.g.sync();  // the group's previous readers of `parts` are done
    if (gs.g.tid == 0) {
      int n = 0;
      for (int q = 0; q < R; ++q) {
        const int i = fwd[q];
        if (((p.node.nodeMask >> q) & 1u) == 0 || i < 0 || i >= T) continue;
        parts[gs.group][n++] = reinterpret_cast<const uint4*>(p.peers.userRegions[q] + p.node.nodePartialOff +
                                                              (static_cast<std::uint64_t>(s) * T + i) * rowBytes);
      }
      for (int q = n; q < R; ++q) parts[gs.group][q] = nullptr;
    }
    gs.g.sync();
    int n = 0;
    while (n < R && parts[gs.group][n] != nullptr) ++n;
    moeWeightedSum(
        p, n, [&](int i) { return parts[gs.group][i]; }, [](int) { return 1.0f; },
        reinterpret_cast<uint4*>(p.staging.partialStage + (static_cast<std::uint64_t>(s) * T + j) * rowBytes), gs.g);
  }
}

// Node peer signal `which`'s counters (MoeNodeParams) and the wait's site.
__device__ inline std::uint64_t moeNodeSignalOff(const MoeParams& p, int which) {
  return which == kMoeNodeReady       ? p.node.readyOff
         : which == kMoeNodeForwarded ? p.node.forwardedOff
         : which == kMoeNodeReduced   ? p.node.reducedOff
                                      : p.node.summedOff;
}

// One CTA of 32 threads: thread q posts (+1, system-scope release) signal `which` into node peer
// q's counter for this rank (arriveAtEveryPeer), after everything the stream ran before.
__global__ void __launch_bounds__(32) moeNodePostKernel(const __grid_constant__ MoeParams p, int which) {
  arriveAtEveryPeer(p, moeNodeSignalOff(p, which), p.node.nodeMask);
}

// One CTA of 32 threads: thread q waits, bounded, until node peer q's post of `which` reaches one
// more than this rank has seen (seen[which][q]), then counts it.
__global__ void __launch_bounds__(32) moeNodeWaitKernel(const __grid_constant__ MoeParams p, int which) {
  std::uint32_t* seen = p.node.seen + which * p.shape.numRanks;
  const WaitSite site = which == kMoeNodeReady       ? WaitSite::kMoeNodeReady
                        : which == kMoeNodeForwarded ? WaitSite::kMoeNodeForwarded
                        : which == kMoeNodeReduced   ? WaitSite::kMoeNodeReduced
                                                     : WaitSite::kMoeNodeSummed;
  const bool ok = waitEveryRank(p, moeNodeSignalOff(p, which), 1u, site, true, p.node.nodeMask, seen);
  const int q = static_cast<int>(threadIdx.x);
  if (ok && q < p.shape.numRanks && q != p.shape.rank && ((p.node.nodeMask >> q) & 1u) != 0) seen[q] += 1u;
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

cudaError_t launchMoeNodePost(const MoeParams& p, int which, cudaStream_t stream) {
  GRAPHEP_LAUNCH_REQUIRE(p.node.aware != 0, "node.aware %d (the node-aware dispatch only)", p.node.aware);
  GRAPHEP_LAUNCH_REQUIRE(which >= 0 && which < kMoeNodeSignals, "signal %d (0 to %d)", which, kMoeNodeSignals - 1);
  moeNodePostKernel<<<1, 32, 0, stream>>>(p, which);
  return cudaGetLastError();
}

cudaError_t launchMoeNodeWait(const MoeParams& p, int which, cudaStream_t stream) {
  GRAPHEP_LAUNCH_REQUIRE(p.node.aware != 0, "node.aware %d (the node-aware dispatch only)", p.node.aware);
  GRAPHEP_LAUNCH_REQUIRE(which >= 0 && which < kMoeNodeSignals, "signal %d (0 to %d)", which, kMoeNodeSignals - 1);
  moeNodeWaitKernel<<<1, 32, 0, stream>>>(p, which);
  return cudaGetLastError();
}

cudaError_t launchMoeForward(const MoeParams& p, cudaStream_t stream) {
  return launchGrid(__func__, "grid.epilogueCtas", p.grid.epilogueCtas, kThreads, stream, moeForwardKernel, p);
}

cudaError_t launchMoeNodeSum(const MoeParams& p, cudaStream_t stream) {
  return launchGrid(__func__, "grid.epilogueCtas", p.grid.epilogueCtas, kThreads, stream, moeNodeSumKernel, p);
}

cudaError_t preloadMoeMoversKernels() {
  return preloadKernels(moePackKernel, moeOffsetsKernel, moeExpandKernel, moeCombineReduceKernel, moeCombineFinalKernel,
                        moeForwardKernel, moeNodeSumKernel, moeNodePostKernel, moeNodeWaitKernel);
}

}  // namespace graphep
