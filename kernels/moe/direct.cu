// MoE direct dispatch kernel family (see kernels/moe/moe.h), launchers below: the throughput path's
// dispatch when every peer is reached by load/store. No pack pass and no
// movers: the sender stores each token's record straight into every destination's receive slot.
//
//   send     (grid.budgetCtas CTAs, the SM budget) after route: the CTAs split the destinations'
//            count messages (with the live count and, per block of 32 tokens, the index of its
//            first record), each posted with its flag (the pair's steps + 1, below) before any payload; then CTA c
//            takes blocks c, c + G, ...: each group reads one token's row once and writes its
//            record into every peer's slot [this rank][index] (index from route's routing.tokenRankIndex),
//            and the block's flag is posted to every peer after a system fence.
//   receive  (MoeParams::grid.epilogueCtas CTAs, one per SM; launched as the send's programmatic
//            dependent, so it starts on the SMs the send leaves free while the send runs) every
//            CTA waits for every count flag and derives the layout (CTA 0 publishes it); then it
//            expands this rank's own tokens straight from x (the caller's e4m3 rows included), or
//            for fp8 from bf16 from the quantise kernel's tiles (the send writes no record to its
//            own rank: the receive writes the metadata the combine reads), then each peer's
//            records as the blocks' flags arrive, a block's 32 spread over 8 CTAs (a record per
//            group); the last CTA advances the step.
//   combine  reduce (epilogueCtas CTAs) reduces each peer's records into a local staging, a block
//            of 32 spread over 8 CTAs, marking each block ready; send (grid.budgetCtas CTAs, the reduce's
//            programmatic dependent) copies each ready block straight into the peer's partial
//            slots and flags it there; final (epilogueCtas CTAs, the send's programmatic
//            dependent) reduces the own rows and sums each token's partials in rank order.
//
// Count messages alternate by the parity of the pair's steps; the records have one slot per (source, index),
// the same region the movers' path uses, and so do the partials. So that dispatch -> dispatch and
// combine -> combine never overwrite what a peer still reads, a send writes into a peer only after
// that peer's acknowledgement of the previous operation (llDispAck: the receive has expanded this
// rank's records; llCombAck: the final has summed this rank's partials), which the peer's last CTA
// posts. In the usual dispatch -> combine -> dispatch order the acknowledgement has long arrived:
// a source writes its records of dispatch s + 1 only after its combine s received every
// destination's partials, which each destination sends after reading the records of dispatch s.
// Flags and acknowledgements only grow (mod 2^32). Under the active-rank mask (peers.live) a rank
// outside it is sent nothing and waited for by no one, and its entries are dropped in the route;
// so that a rank left out of steps finds its pair's flags in step when put back, every flag and
// acknowledgement between ranks q and r is the count of the steps both took part in + 1
// (direct.shared, pairSteps), not the step + 1; the count messages alternate by that count's parity.
// With every rank in every step the two are equal.
#include "kernels/common/launch.h"
#include "kernels/moe/peer.cuh"

namespace graphep {
namespace {

constexpr int kThreads = kMoeThreads;
constexpr int kGroups = kThreads / kMoeGroupThreads;
constexpr int kBlockTokens = 32;  // the tokens of one route word: the unit of progress
// The blocks that `tokens` records (at least 0) fill, the last one part-full: a block is a route word.
__host__ __device__ inline int blocksOf(int tokens) { return static_cast<int>(moeRouteWords(tokens)); }
constexpr int kBlockParts = kBlockTokens / kGroups;  // the receive's items per block: a record per group
static_assert(kBlockTokens == 32, "a block is the tokens of one route word (moeRouteWords)");
static_assert(kBlockTokens % kGroups == 0, "a block's records split evenly over a CTA's groups");
constexpr int kSendWarps = kThreads / 32;  // the dispatch send's groups: a warp per token
static_assert(kMaxRanks <= 32, "the send resolves a token's destinations one per lane");

// Source `src`'s count message of the step's parity in rank `rank`'s heap (moeDirectMsgBytes).
__device__ __forceinline__ std::uint64_t* directMsg(const MoeParams& p, int rank, int parity, int src) {
  return reinterpret_cast<std::uint64_t*>(p.peers.userRegions[rank] + p.peers.countMsgsOff +
                                          (static_cast<std::uint64_t>(parity) * p.shape.numRanks + src) * p.direct.msgBytes);
}
// Its u32 tail: {T, first[0 .. W]}.
__device__ __forceinline__ std::uint32_t* directTail(const MoeParams& p, int rank, int parity, int src) {
  return reinterpret_cast<std::uint32_t*>(reinterpret_cast<char*>(directMsg(p, rank, parity, src)) +
                                          moeCountMsgBytes(p.shape.localExperts));
}

// Record slot `i` of source `src` in rank `rank`'s heap (staging.recordRecv: [R][maxTokens][recordBytes]).
__device__ __forceinline__ char* directRecord(const MoeParams& p, int rank, int src, int i) {
  return p.peers.userRegions[rank] + p.peers.recordsOff + (static_cast<std::uint64_t>(src) * p.shape.maxTokens + i) * p.shape.recordBytes;
}

// Rank `rank`'s flag for source `src`'s block w.
__device__ __forceinline__ std::uint32_t* directBlockFlag(const MoeParams& p, int rank, int src, int w) {
  return reinterpret_cast<std::uint32_t*>(p.peers.userRegions[rank] + p.direct.recordFlagsOff) +
         static_cast<std::uint64_t>(src) * moeRouteWords(p.shape.maxTokens) + w;
}

// The steps of operation `op` (0 dispatch, 1 combine) that this rank and rank q both took part in
// (direct.shared): the base of every flag and acknowledgement between the two. Advanced only by
// the operation's last CTA, once every reader of this launch is done.
__device__ __forceinline__ std::uint32_t pairSteps(const MoeParams& p, int op, int q) {
  return p.direct.shared[op * p.shape.numRanks + q];
}

// The last CTA of an operation (op 0: the dispatch's receive, 1: the combine's final), once every
// CTA's reads of the peers' memory are ordered before it: thread q < R acknowledges to peer q in
// `live` (the pair's steps + 1: the peer may write its next operation's slots) and advances the
// pair's steps (the dispatch counts this rank's own too: its count message to itself).
__device__ inline void finishPairs(const MoeParams& p, int op, std::uint32_t live, std::uint64_t acksOff) {
  const int q = static_cast<int>(threadIdx.x);
  if (q >= p.shape.numRanks || !isLive(live, q) || (op == 1 && q == p.shape.rank)) return;
  std::uint32_t* shared = p.direct.shared + op * p.shape.numRanks + q;
  const std::uint32_t n = *shared;
  if (q != p.shape.rank) {
    ptx::fenceAcqRelSys();
    ptx::stReleaseSys(peerCounter(p, q, acksOff) + p.shape.rank, n + 1u);
  }
  *shared = n + 1u;
}

// Partial slot `i` from destination `dst` in rank `rank`'s heap (movers.partialRecv: [R][maxTokens][2H]).
__device__ __forceinline__ char* directPartial(const MoeParams& p, int rank, int dst, int i) {
  return p.peers.userRegions[rank] + p.peers.partialsOff + (static_cast<std::uint64_t>(dst) * p.shape.maxTokens + i) * p.shape.hidden * 2;
}

// Rank `rank`'s flag for destination `dst`'s partials of records [32 w, 32 w + 32).
__device__ __forceinline__ std::uint32_t* directCombineFlag(const MoeParams& p, int rank, int dst, int w) {
  return reinterpret_cast<std::uint32_t*>(p.peers.userRegions[rank] + p.direct.partialFlagsOff) +
         static_cast<std::uint64_t>(dst) * moeRouteWords(p.shape.maxTokens) + w;
}

// The u32 word of rankCount[0] (the records per destination) in a count message's tail (moeDirectMsgBytes).
__device__ __forceinline__ int directRankCountWord(const MoeParams& p) {
  return static_cast<int>(moeDirectRankCountWord(p.shape.maxTokens));
}

// Partial values (CombineArgs.rowValues) of record `i` from destination `dst` in rank `rank`'s heap
// ([R][maxTokens][kMoeMaxValues] fp32), and the local staging of peer s's values of record i.
__device__ __forceinline__ float* directValues(const MoeParams& p, int rank, int dst, int i) {
  return reinterpret_cast<float*>(p.peers.userRegions[rank] + p.direct.valuesOff) +
         (static_cast<std::uint64_t>(dst) * p.shape.maxTokens + i) * kMoeMaxValues;
}
__device__ __forceinline__ float* directStagedValues(const MoeParams& p, int s, int i) {
  return p.direct.valueStage + (static_cast<std::uint64_t>(s) * p.shape.maxTokens + i) * kMoeMaxValues;
}

// The fp8 row of token t, in its wire tiles (staging.recordStage, unused otherwise by the direct dispatch,
// holds [T][payloadBytes], quantised by the quantise kernel); nullptr for bf16 and for the caller's
// e4m3 rows (input.xIsFp8), which the send and the own expansion read as they are.
__device__ __forceinline__ const char* directWire(const MoeParams& p, int t) {
  return p.shape.fp8 && !p.input.xIsFp8 ? p.staging.recordStage + static_cast<std::uint64_t>(t) * p.shape.payloadBytes : nullptr;
}

// fp8 from bf16 (epilogueCtas CTAs, before the send): each group quantises one live row at a time
// into its wire tiles, so that the send only copies bytes and the receive's own rows need no
// quantiser. Not launched for the caller's e4m3 rows.
__global__ void __launch_bounds__(kThreads) moeDirectQuantizeKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kDirectQuantize);
  const MoeGroupSlice gs = moeGroupSlice();
  const int T = *p.routing.liveTokens;
  for (int t = gs.first; t < T; t += gs.stride) {
    char* out = p.staging.recordStage + static_cast<std::uint64_t>(t) * p.shape.payloadBytes;
    moeQuantizeRow(p, static_cast<const char*>(p.input.x) + static_cast<std::uint64_t>(t) * p.shape.hidden * 2, &out, 1, gs.g);
  }
}

// The flags (the pair's steps of operation `op` + 1) of the blocks an operation leaves empty, at
// every peer q in `live`: blocks [used(q), W) of this rank's records (or partials) there, spread
// over the grid's threads; flag(p, q, this rank, w) names one.
template <typename Used, typename Flag>
__device__ inline void postEmptyBlocks(const MoeParams& p, int op, std::uint32_t live, Used used, Flag flag) {
  const int W = static_cast<int>(moeRouteWords(p.shape.maxTokens)), R = p.shape.numRanks;
  const int first = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x), all = static_cast<int>(gridDim.x * blockDim.x);
  for (int n = first; n < R * W; n += all) {
    const int q = n / W, w = n % W;
    if (q != p.shape.rank && isLive(live, q) && w >= used(q)) {
      ptx::stReleaseSys(flag(p, q, p.shape.rank, w), pairSteps(p, op, q) + 1u);
    }
  }
}

__global__ void __launch_bounds__(kThreads) moeDirectSendKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kDirectSend);
  __shared__ char* dst[kSendWarps][kMaxRanks];
  __shared__ int dstRank[kSendWarps][kMaxRanks];
  const int tid = static_cast<int>(threadIdx.x), R = p.shape.numRanks, L = p.shape.localExperts;
  const int E = p.shape.numExperts, W = static_cast<int>(moeRouteWords(p.shape.maxTokens));
  const std::uint32_t live = dispatchMask(p);  // the ranks taking part (the route dropped the others' entries)
  ptx::launchDependents();  // the receive may start on the SMs this grid leaves free
  const int T = *p.routing.liveTokens, blocks = blocksOf(T);
  // Count messages first (they travel ahead of the payload): CTA c takes ranks c, c + G, ...
  const std::uint64_t rowBytes = static_cast<std::uint64_t>(p.shape.hidden) * 2;
  for (int r = static_cast<int>(blockIdx.x); r < R; r += static_cast<int>(gridDim.x)) {
    if (!isLive(live, r)) {  // outside the mask: sent nothing (the same r in every thread)
      if (tid == 0) p.movers.partialRecvBytes[r] = 0;
      continue;
    }
    const int parity = static_cast<int>(pairSteps(p, 0, r) & 1u);
    std::uint64_t* msg = directMsg(p, r, parity, p.shape.rank);
    std::uint32_t* tail = directTail(p, r, parity, p.shape.rank);
    for (int j = tid; j < L; j += kThreads) msg[1 + j] = p.routing.expertEntries[r * L + j];
    for (int w = tid; w <= blocks; w += kThreads) tail[1 + w] = w < W ? p.routing.blockPrefix[(E + r) * W + w] : p.routing.rankRecords[r];
    for (int q = tid; q < R; q += kThreads) tail[directRankCountWord(p) + q] = p.routing.rankRecords[q];  // the whole row
    if (tid == 0) {
      msg[0] = p.routing.rankRecords[r];
      tail[0] = static_cast<std::uint32_t>(T);
      p.movers.partialRecvBytes[r] = p.routing.rankRecords[r] * rowBytes;  // the combine's partials from rank r
    }
    __syncthreads();
    if (tid == 0) flagPost(peerCounter(p, r, p.peers.countFlagsOff) + p.shape.rank, pairSteps(p, 0, r) + 1u);
  }
  // The records of the previous dispatch have been read by every peer (its acknowledgement: at
  // once in the usual order, see the header): only then are its slots rewritten. A failed wait is
  // recorded; the peers' waits for this dispatch's blocks report too.
  if (!waitEveryRank(p, p.direct.dispatchAcksOff, 0u, WaitSite::kMoeDispatchAck, true, live, p.direct.shared)) return;
  // A warp per token (16 tokens in flight per CTA: the per-token reads of routing and metadata
  // overlap across them). Blocks of 32 tokens, CTA c taking blocks c, c + G, ... in order; each
  // block's flag posted to every peer once its records are written.
  const int warp = tid / 32, lane = tid % 32;
  const MoeGroup g{lane, 32, 0};
  for (int w = static_cast<int>(blockIdx.x); w < blocks; w += static_cast<int>(gridDim.x)) {
    for (int t = w * kBlockTokens + warp; t < min(T, (w + 1) * kBlockTokens); t += kSendWarps) {
      // Lane r < R: destination r's index of the token (R <= kMaxRanks = 32), the peers only (the
      // receive takes this rank's own rows from x), compacted in rank order.
      const int i = lane < R ? p.routing.tokenRankIndex[static_cast<std::uint64_t>(t) * R + lane] : -1;
      const bool to = i >= 0 && lane != p.shape.rank && isLive(live, lane);  // (the route left -1 for the others)
      const unsigned m = __ballot_sync(0xffffffffu, to);
      if (to) {
        const int at = __popc(m & ((1u << lane) - 1u));
        dst[warp][at] = directRecord(p, lane, p.shape.rank, i);
        dstRank[warp][at] = lane;
      }
      __syncwarp();
      const int n = __popc(m);
      if (n > 0) {
        const std::int32_t* entryIdx = p.routing.entryIndex + static_cast<std::uint64_t>(t) * p.shape.topK;
        moeWriteRecords(p, t, dst[warp], dstRank[warp], n, [&](int k) { return entryIdx[k]; }, g, n, directWire(p, t));
      }
      __syncwarp();  // dst is rewritten for the next token
    }
    __threadfence_system();  // every thread's records, before the flags
    __syncthreads();
    if (tid < R && tid != p.shape.rank && isLive(live, tid)) {
      ptx::stReleaseSys(directBlockFlag(p, tid, p.shape.rank, w), pairSteps(p, 0, tid) + 1u);
    }
  }
  // The blocks this dispatch leaves empty get their flag too, so that every flag keeps pace with
  // the step: a flag left as it was since the last dispatch that filled its block would, 2^31
  // steps later, read as ahead of the step in the wrap-safe comparison, and a receive would take
  // stale records. No receive waits for these blocks in this dispatch (it reads this rank's T
  // first) and none of a previous dispatch can still be waiting for one (that dispatch's sender,
  // this rank's previous kernel, posted its flags before this one started).
  postEmptyBlocks(p, 0, live, [&](int) { return blocks; }, directBlockFlag);
}

__global__ void __launch_bounds__(kThreads) moeDirectReceiveKernel(const __grid_constant__ MoeParams p) {
  __shared__ MoeReceiveSmem<kThreads, kGroups> sm;
  const int tid = static_cast<int>(threadIdx.x), R = p.shape.numRanks;
  const std::uint32_t step = p.peers.steps[0];
  const std::uint32_t live = dispatchMask(p);
  // Source q's count message and tail, of the parity of the pair's steps; a source outside the
  // mask sent none: its message reads as zeros (the layout leaves it out), its tail is not read.
  auto parityOf = [&](int q) { return static_cast<int>(pairSteps(p, 0, q) & 1u); };
  auto msgOf = [&](int q) {
    return isLive(live, q) ? static_cast<const std::uint64_t*>(directMsg(p, p.shape.rank, parityOf(q), q)) : p.peers.zeroMsg;
  };
  const MoeGroupSlice gs = moeGroupSlice();
  {
    const MoeStamp stamp(p, MoeKernel::kDirectReceive);
    if (moeReceiveLayout<kThreads, kGroups>(p, msgOf, blockIdx.x == 0, sm, live, p.direct.shared)) {
      if (blockIdx.x == 0) {  // beside the published layout: the movers' counts, the rank prefix matrix
        __syncthreads();  // layout.sourceRecords is written above
        const std::uint64_t rowBytes = static_cast<std::uint64_t>(p.shape.hidden) * 2;
        for (int q = tid; q < R; q += kThreads) p.movers.partialSendBytes[q] = static_cast<std::uint64_t>(p.layout.sourceRecords[q]) * rowBytes;
        if (p.layout.rankPrefix != nullptr) {  // [i][j]: records ranks 0 .. i send to rank j (every source's row)
          for (int j = tid; j < R; j += kThreads) {
            std::int32_t sum = 0;
            for (int i = 0; i < R; ++i) {
              if (isLive(live, i)) sum += static_cast<std::int32_t>(__ldcg(directTail(p, p.shape.rank, parityOf(i), i) + directRankCountWord(p) + j));
              p.layout.rankPrefix[i * R + j] = sum;
            }
          }
        }
      }
      // This rank's own tokens straight from x (no record: the send kernel skips this rank; their
      // metadata is written here for the combine), overlapping the peers' transfers.
      {
        const MoeStamp own(p, MoeKernel::kDirectOwn);
        moeSourceBases<kThreads>(p, msgOf, sm.offsets, p.shape.rank, sm.base);
        __syncthreads();
        const int T = *p.routing.liveTokens;
        const long long rankBase = p.layout.rankMajor ? moeRankBase(p, msgOf, p.shape.rank) : -1;  // rank-major: own first row
        for (int t = gs.first; t < T; t += gs.stride) {
          const int i = p.routing.tokenRankIndex[static_cast<std::uint64_t>(t) * R + p.shape.rank];
          if (i >= 0) {
            moeExpandOwnToken(p, t, directRecord(p, p.shape.rank, p.shape.rank, i), sm.base, sm.stages[gs.group], gs.g, directWire(p, t),
                              p.layout.rankMajor ? rankBase + i : -1);
          }
        }
        __syncthreads();  // base is rewritten for the next source
      }
      // Each peer's records as their blocks' flags arrive. A block's records are spread over
      // kBlockParts CTAs, one record per group (item m: block m / kBlockParts, part m % kBlockParts;
      // CTA b takes items b, b + G, ...), so that the blocks of the send's last round, which land
      // as it ends, are expanded by many CTAs at once: one CTA per block left an ~85 us tail at
      // 4096 tokens (run 71's timeline).
      const MoeStamp peers(p, MoeKernel::kDirectPeers);
      bool ok = true;
      for (int k = 1; k < R && ok; ++k) {
        const int s = (p.shape.rank + k) % R;
        if (!isLive(live, s)) continue;  // outside the mask: no records (the same s in every thread)
        const std::uint32_t* tail = directTail(p, p.shape.rank, parityOf(s), s);
        const std::uint32_t sentT = __ldcg(tail);  // a peer's live count is at most maxTokens
        const int T = static_cast<int>(sentT < static_cast<std::uint32_t>(p.shape.maxTokens) ? sentT : p.shape.maxTokens);
        const int blocks = blocksOf(T);
        moeSourceBases<kThreads>(p, msgOf, sm.offsets, s, sm.base);
        __syncthreads();
        const long long rankBase = p.layout.rankMajor ? moeRankBase(p, msgOf, s) : -1;  // rank-major: s's first row
        for (int m = static_cast<int>(blockIdx.x); m < blocks * kBlockParts; m += static_cast<int>(gridDim.x)) {
          const int w = m / kBlockParts;
          const bool failed = tid == 0 && !flagWait(p.peers.sync, directBlockFlag(p, p.shape.rank, s, w),
                                                    pairSteps(p, 0, s) + 1u, s, WaitSite::kMoeDispatch);
          if (__syncthreads_or(failed) != 0) {  // thread 0's verdict, to every thread
            ok = false;
            break;
          }
          // A block of 32 tokens has at most 32 records for this rank, [first, end) (the route's
          // prefix counts one bit per token), so the kBlockParts x kGroups items cover it.
          const int first = static_cast<int>(min(__ldcg(tail + 1 + w), static_cast<std::uint32_t>(p.shape.maxTokens)));
          const int end = static_cast<int>(min(__ldcg(tail + 2 + w), static_cast<std::uint32_t>(p.shape.maxTokens)));
          const int i = first + (m % kBlockParts) * kGroups + gs.group;
          if (i < end) {
            moeExpandRecord(p, s, directRecord(p, p.shape.rank, s, i), sm.base, sm.stages[gs.group], gs.g,
                            p.layout.rankMajor ? rankBase + i : -1);
          }
        }
        __syncthreads();  // base is rewritten for the next source
      }
    }
  }
  // The send grid (launched before this one, which may have started early) has completed and its
  // memory is visible: what follows in the stream sees a finished dispatch.
  ptx::gridDependencyWait();
  if (lastBlock(&p.peers.lastCtaCounters[0])) {
    if (tid == 0) {
      p.peers.steps[0] = step + 1u;
      *p.peers.dispatchLive = live;  // its combine's mask
      *p.state.pending = kMoeDispatched | kMoePendingCombine;  // the dispatch's last kernel
    }
    // Every CTA's reads of the peers' records are ordered before this (lastBlock): the peers in
    // the mask may write their next dispatch's records.
    finishPairs(p, 0, live, p.direct.dispatchAcksOff);
  }
}

// The combine's work items: the blocks of 32 record indices of every peer's records, peers in
// rank order after this one, the peers in the dispatch's mask `dlive` only (Engine::recover may
// shrink it after the dispatch laid out a rank now left out); item n is block w of peer s.
struct CombineBlock {
  int s, w;
};
__device__ inline int combineBlocksOf(const MoeParams& p, int s, std::uint32_t dlive) {
  return isLive(dlive, s) ? blocksOf(p.layout.sourceRecords[s]) : 0;
}
__device__ inline CombineBlock combineBlock(const MoeParams& p, int n, std::uint32_t dlive) {
  const int R = p.shape.numRanks;
  int s = (p.shape.rank + 1) % R;
  for (;;) {
    const int blocks = combineBlocksOf(p, s, dlive);
    if (n < blocks) return CombineBlock{s, n};
    n -= blocks;
    s = (s + 1) % R;
  }
}
__device__ inline int combineBlocks(const MoeParams& p, std::uint32_t dlive) {
  int items = 0;
  for (int k = 1; k < p.shape.numRanks; ++k) items += combineBlocksOf(p, (p.shape.rank + k) % p.shape.numRanks, dlive);
  return items;
}

// Peer s's partial of record i, staged locally for the send (staging.partialStage, unused otherwise by the
// direct path: [R][maxTokens][2H], so a block's 32 partials are contiguous).
__device__ __forceinline__ char* directStaged(const MoeParams& p, int s, int i) {
  return p.staging.partialStage + (static_cast<std::uint64_t>(s) * p.shape.maxTokens + i) * p.shape.hidden * 2;
}

// Combine, first kernel (epilogueCtas CTAs; the send, launched next, takes the SMs it leaves free): the peers' records
// reduced into the local staging, each group one record (weight x y[row], fp32, bf16 once), a
// block's 32 records spread over kBlockParts CTAs as in the receive; the last CTA of a block to
// finish it marks the block ready (direct.partialReady = step + 1) for the send, and every block
// without records is marked at once. The reads of the expert
// rows (every record's up to topK rows) run here on every free SM, not on the SM budget.
__global__ void __launch_bounds__(kThreads) moeDirectCombineReduceKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kDirectCombineReduce);
  __shared__ MoeSlotStage stages[kGroups];
  const int tid = static_cast<int>(threadIdx.x);
  if (blockIdx.x == 0 && tid == 0) moeCheckPairing(p, false);
  const std::uint32_t cstep = p.peers.steps[1];
  const std::uint32_t dlive = *p.peers.dispatchLive;  // the mask of the dispatch it combines
  ptx::launchDependents();  // the send starts on the SMs of the budget at once
  const MoeGroupSlice gs = moeGroupSlice();
  const int W = static_cast<int>(moeRouteWords(p.shape.maxTokens));
  const int items = combineBlocks(p, dlive);
  // Every peer's block without records this step is ready too (nothing to reduce): no block's
  // flag falls behind the step. One left unposted for 2^31 combines (a source's count staying
  // below it) would read as ready when used again, the send's comparison being by signed distance,
  // and its unreduced partials would be sent. The send waits for no such block this step.
  const int R = p.shape.numRanks;
  for (int k = static_cast<int>(blockIdx.x * blockDim.x) + tid; k < R * W; k += static_cast<int>(gridDim.x * blockDim.x)) {
    const int s = k / W, w = k % W;
    if (s != p.shape.rank && w >= combineBlocksOf(p, s, dlive)) {
      ptx::stReleaseSys(p.direct.partialReady + k, cstep + 1u);
    }
  }
  for (int m = static_cast<int>(blockIdx.x); m < items * kBlockParts; m += static_cast<int>(gridDim.x)) {
    const CombineBlock b = combineBlock(p, m / kBlockParts, dlive);
    const int i = b.w * kBlockTokens + (m % kBlockParts) * kGroups + gs.group;
    if (i < p.layout.sourceRecords[b.s]) {
      const long long rankRow = p.layout.rankMajor ? p.layout.rankOffsets[b.s] + i : -1;
      moeReduceRecord(p, p.staging.recordRecv + (static_cast<std::uint64_t>(b.s) * p.shape.maxTokens + i) * p.shape.recordBytes,
                      p.layout.sourceBase + b.s * p.shape.localExperts, directStaged(p, b.s, i), stages[gs.group], gs.g, rankRow);
      if (p.combine.rowValues != nullptr && gs.g.tid < p.combine.numValues) {  // rank-major: the row's values as they are
        directStagedValues(p, b.s, i)[gs.g.tid] =
            rankRow < p.combine.expertOutputRows ? p.combine.rowValues[rankRow * p.combine.numValues + gs.g.tid] : 0.f;
      }
    }
    // lastBlock's form over the block's kBlockParts CTAs, without its verdict's broadcast (a CTA
    // barrier per item): only thread 0 acts on it. The partials are local staging, read by this
    // GPU's send kernel.
    __syncthreads();  // every group's partial of this item is written
    if (tid == 0) {
      __threadfence();  // the CTA's partials, before its arrival
      std::uint32_t* arrive = p.direct.partialArrivals + b.s * W + b.w;
      if (atomicAdd(arrive, 1u) == kBlockParts - 1u) {  // the block's last part: reset, then ready
        *arrive = 0u;
        __threadfence();  // every part's partials (seen through the arrivals) before the flag
        ptx::stReleaseSys(p.direct.partialReady + b.s * W + b.w, cstep + 1u);
      }
    }
  }
}

// Combine, send (grid.budgetCtas CTAs, the SM budget; the reduce kernel's programmatic dependent): each ready
// block of staged partials copied straight into the peer's partial slots [this rank][index] (one
// contiguous span of up to 32 x 2H bytes per block), then after a system fence the block's flag
// (step + 1) stored at that peer. CTA c takes blocks c, c + G, ... in the reduce's order.
__global__ void __launch_bounds__(kThreads) moeDirectCombineSendKernel(const __grid_constant__ MoeParams p) {
  const int tid = static_cast<int>(threadIdx.x);
  const std::uint32_t cstep = p.peers.steps[1];
  const std::uint32_t dlive = *p.peers.dispatchLive;
  const int W = static_cast<int>(moeRouteWords(p.shape.maxTokens));
  const int items = combineBlocks(p, dlive);
  {
  const MoeStamp stamp(p, MoeKernel::kDirectCombineSend);  // the span ends before the wait below
  // The final kernel may start on the SMs the reduce leaves; after the stamp, so that the final's
  // span never starts before this one's (with few CTAs, as on ranks sharing a GPU, it could).
  ptx::launchDependents();
  for (int n = static_cast<int>(blockIdx.x); n < items; n += static_cast<int>(gridDim.x)) {
    const CombineBlock b = combineBlock(p, n, dlive);
    // The block is reduced here, and the peer has summed this rank's partials of the previous
    // combine (its acknowledgement: at once in the usual order), so its slots may be rewritten.
    const bool failed =
        tid == 0 && (!flagWait(p.peers.sync, p.direct.partialReady + b.s * W + b.w, cstep + 1u, b.s, WaitSite::kMoeCombineStaged) ||
                     !flagWait(p.peers.sync, peerCounter(p, p.shape.rank, p.direct.combineAcksOff) + b.s,
                               pairSteps(p, 1, b.s), b.s, WaitSite::kMoeCombineAck));
    if (__syncthreads_or(failed) != 0) break;  // recorded; the peer's wait for this block reports too
    const int first = b.w * kBlockTokens;
    const int rows = min(kBlockTokens, p.layout.sourceRecords[b.s] - first);
    // A block's partials are whole 16-byte vectors at both ends, counted in int: this loop, not
    // copyBytes, whose 64-bit indexing and byte tail raise this kernel's spills from 20 B to 76 B
    // (ptxas, sm_90a, 512 threads).
    const auto* src = reinterpret_cast<const uint4*>(directStaged(p, b.s, first));
    auto* dst = reinterpret_cast<uint4*>(directPartial(p, b.s, p.shape.rank, first));
    const int vecs = rows * (p.shape.hidden / 8);
    for (int c0 = tid; c0 < vecs; c0 += kThreads * kMoeUnroll) {
      uint4 v[kMoeUnroll];
#pragma unroll
      for (int u = 0; u < kMoeUnroll; ++u) {
        if (c0 + u * kThreads < vecs) v[u] = __ldcg(src + c0 + u * kThreads);
      }
#pragma unroll
      for (int u = 0; u < kMoeUnroll; ++u) {
        if (c0 + u * kThreads < vecs) dst[c0 + u * kThreads] = v[u];
      }
    }
    if (p.combine.rowValues != nullptr) {  // the block's values: kMoeMaxValues floats per record, contiguous
      const auto* vsrc = reinterpret_cast<const uint4*>(directStagedValues(p, b.s, first));
      auto* vdst = reinterpret_cast<uint4*>(directValues(p, b.s, p.shape.rank, first));
      for (int c = tid; c < rows * (kMoeMaxValues / 4); c += kThreads) vdst[c] = __ldcg(vsrc + c);
    }
    __threadfence_system();  // every thread's partials, before the flag
    __syncthreads();
    if (tid == 0) ptx::stReleaseSys(directCombineFlag(p, b.s, p.shape.rank, b.w), pairSteps(p, 1, b.s) + 1u);
  }
  // The blocks this combine leaves empty at each source (past its records here) get their flag
  // too, as the dispatch's do: no flag falls behind the step.
  postEmptyBlocks(
      p, 1, dlive, [&](int q) { return combineBlocksOf(p, q, dlive); }, directCombineFlag);
  }
  ptx::gridDependencyWait();  // the reduce has completed: this grid ends after it
}

// Combine, last kernel (epilogueCtas CTAs, the send's programmatic dependent): each group
// takes one token: its partial from this rank's own rows (reduced here from y into the own slot),
// then, once the blocks holding its peers' partials have landed, out[t] = the sum of the partials
// in rank order (fp32, bf16 once): the same arithmetic as the movers' combine.
__global__ void __launch_bounds__(kThreads) moeDirectCombineFinalKernel(const __grid_constant__ MoeParams p) {
  __shared__ MoeSlotStage stages[kGroups];
  __shared__ const uint4* parts[kGroups][kMaxRanks];
  const int tid = static_cast<int>(threadIdx.x), R = p.shape.numRanks;
  const std::uint32_t cstep = p.peers.steps[1];
  const std::uint32_t dlive = *p.peers.dispatchLive;  // the ranks whose partials it sums
  const MoeGroupSlice gs = moeGroupSlice();
  {
    const MoeStamp stamp(p, MoeKernel::kDirectCombineFinal);
    if (p.direct.slowFinalNs != 0) {  // tests only: a lagging reader of the peers' partials
      const std::uint64_t until = ptx::globalTimerNs() + p.direct.slowFinalNs;
      while (ptx::globalTimerNs() < until) {
      }
    }
    const int T = *p.routing.liveTokens;
    for (int t = gs.first; t < T; t += gs.stride) {
      const std::int32_t* idx = p.routing.tokenRankIndex + static_cast<std::uint64_t>(t) * R;
      const int own = idx[p.shape.rank];
      if (own >= 0) {
        moeReduceRecord(p, p.staging.recordRecv + (static_cast<std::uint64_t>(p.shape.rank) * p.shape.maxTokens + own) * p.shape.recordBytes,
                        p.layout.sourceBase + p.shape.rank * p.shape.localExperts, directPartial(p, p.shape.rank, p.shape.rank, own), stages[gs.group],
                        gs.g, p.layout.rankMajor ? p.layout.rankOffsets[p.shape.rank] + own : -1);
      }
      // Lane r < R of the group's first warp waits for destination r's block (a failed wait is
      // recorded; later waits of this rank then return at once, and the status reports it).
      const int r = gs.g.tid;
      if (r < R && r != p.shape.rank && idx[r] >= 0 && isLive(dlive, r)) {
        flagWait(p.peers.sync, directCombineFlag(p, p.shape.rank, r, idx[r] / kBlockTokens), pairSteps(p, 1, r) + 1u, r,
                 WaitSite::kMoeCombine);
      }
      moeFinalToken(
          p, t,
          [&](int q) -> const char* {
            return idx[q] < 0 || !isLive(dlive, q) ? nullptr : directPartial(p, p.shape.rank, q, idx[q]);
          },
          parts[gs.group], gs.g);
      if (p.combine.rowValues != nullptr && gs.g.tid < p.combine.numValues) {  // the values, summed alike (fp32, rank order)
        const int k = gs.g.tid;
        float sum = 0.f;
        for (int q = 0; q < R; ++q) {
          if (idx[q] < 0 || !isLive(dlive, q)) continue;
          if (q == p.shape.rank) {
            const long long row = p.layout.rankOffsets[p.shape.rank] + own;
            sum += row < p.combine.expertOutputRows ? p.combine.rowValues[row * p.combine.numValues + k] : 0.f;
          } else {
            sum += __ldcg(directValues(p, p.shape.rank, q, idx[q]) + k);  // landed with the block's flag
          }
        }
        p.combine.outValues[static_cast<std::uint64_t>(t) * p.combine.numValues + k] = sum;
      }
    }
  }
  ptx::gridDependencyWait();  // the first half has completed: the stream sees a finished combine
  if (lastBlock(&p.peers.lastCtaCounters[1])) {
    if (tid == 0) {
      p.peers.steps[1] = cstep + 1u;
      *p.state.pending &= kMoeDispatched;  // the combine's last kernel
    }
    // Every CTA's reads of the peers' partials are ordered before this (lastBlock): the peers in
    // the dispatch's mask may write their next combine's partials.
    finishPairs(p, 1, dlive, p.direct.combineAcksOff);
  }
}

// The epilogue grid (at least one CTA, whole clusters) and the paths' limits, refused for `launcher`.
cudaError_t checkEpilogue(const char* launcher, const MoeParams& p) {
  if (p.grid.epilogueCtas < 1 || p.grid.epilogueCluster < 1 || p.grid.epilogueCtas % p.grid.epilogueCluster != 0) {
    return refuseLaunch(launcher, "grid.epilogueCtas %d in clusters of %d (at least 1 CTA, whole clusters)",
                        p.grid.epilogueCtas, p.grid.epilogueCluster);
  }
  return moeCheckLimits(launcher, p);
}

// Launches `kernel` (epilogueCtas CTAs, in clusters of epilogueCluster) as the programmatic
// dependent of the stream's last kernel.
cudaError_t launchDependent(const char* launcher, const MoeParams& p, cudaStream_t stream, void (*kernel)(MoeParams)) {
  if (const cudaError_t e = checkEpilogue(launcher, p); e != cudaSuccess) return e;
  cudaLaunchAttribute attrs[2];
  const cudaLaunchConfig_t cfg = moeLaunchConfig(p.grid.epilogueCtas, kThreads, p.grid.epilogueCluster, true, stream, attrs);
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

}  // namespace

cudaError_t launchMoeDirectQuantize(const MoeParams& p, cudaStream_t stream) {
  return launchGrid(__func__, "grid.epilogueCtas", p.grid.epilogueCtas, kThreads, stream, moeDirectQuantizeKernel, p);
}

cudaError_t launchMoeDirectSend(const MoeParams& p, cudaStream_t stream) {
  if (const cudaError_t e = moeCheckLimits(__func__, p); e != cudaSuccess) return e;
  return launchGrid(__func__, "grid.budgetCtas", p.grid.budgetCtas, kThreads, stream, moeDirectSendKernel, p);
}

// Launched as the send's programmatic dependent: its CTAs start while the send runs (the send
// triggers at once), lay out and expand this rank's own rows, and wait for the peers' records by
// their arrival counters, not by stream order.
cudaError_t launchMoeDirectReceive(const MoeParams& p, cudaStream_t stream) {
  return launchDependent(__func__, p, stream, moeDirectReceiveKernel);
}

// The combine's first kernel, on the epilogue CTAs (stream order after the experts: it reads y).
cudaError_t launchMoeDirectCombineReduce(const MoeParams& p, cudaStream_t stream) {
  if (const cudaError_t e = checkEpilogue(__func__, p); e != cudaSuccess) return e;
  cudaLaunchAttribute attrs[2];
  const cudaLaunchConfig_t cfg = moeLaunchConfig(p.grid.epilogueCtas, kThreads, p.grid.epilogueCluster, false, stream, attrs);
  return cudaLaunchKernelEx(&cfg, moeDirectCombineReduceKernel, p);
}

// The reduce's programmatic dependent, on the SM budget: it copies blocks as the reduce marks them.
cudaError_t launchMoeDirectCombineSend(const MoeParams& p, cudaStream_t stream) {
  GRAPHEP_LAUNCH_REQUIRE(p.grid.budgetCtas >= 1, "grid.budgetCtas %d (at least 1)", p.grid.budgetCtas);
  if (const cudaError_t e = moeCheckLimits(__func__, p); e != cudaSuccess) return e;
  cudaLaunchAttribute attrs[2];
  const cudaLaunchConfig_t cfg = moeLaunchConfig(p.grid.budgetCtas, kThreads, 1, true, stream, attrs);
  return cudaLaunchKernelEx(&cfg, moeDirectCombineSendKernel, p);
}

// The first half's programmatic dependent, as the dispatch's receive is the send's.
cudaError_t launchMoeDirectCombineFinal(const MoeParams& p, cudaStream_t stream) {
  return launchDependent(__func__, p, stream, moeDirectCombineFinalKernel);
}

cudaError_t preloadMoeDirectKernels() {
  return preloadKernels(moeDirectQuantizeKernel, moeDirectSendKernel, moeDirectReceiveKernel,
                        moeDirectCombineReduceKernel, moeDirectCombineSendKernel, moeDirectCombineFinalKernel);
}

cudaError_t moeDirectEpilogueFits(int cluster, int ctas, bool* fits) {
  *fits = false;
  GRAPHEP_LAUNCH_REQUIRE(cluster >= 2 && ctas >= cluster && ctas % cluster == 0,
                         "clusters of %d in %d CTAs (at least 2 per cluster, whole clusters)", cluster, ctas);
  cudaLaunchAttribute attrs[2];
  // The cluster shape alone: the query places CTAs, not stream order.
  const cudaLaunchConfig_t cfg = moeLaunchConfig(ctas, kThreads, cluster, false, nullptr, attrs);
  for (void (*k)(MoeParams) : {moeDirectReceiveKernel, moeDirectCombineReduceKernel, moeDirectCombineFinalKernel}) {
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, k, &cfg) != cudaSuccess) {
      (void)cudaGetLastError();  // a size this GPU cannot take: not a sticky error, cleared
      return cudaSuccess;
    }
    if (clusters < 1) return cudaSuccess;
  }
  *fits = true;
  return cudaSuccess;
}

cudaError_t moeDirectCtasPerSm(int* ctas) {
  int lowest = 0;
  for (void (*k)(MoeParams) : {moeDirectQuantizeKernel, moeDirectSendKernel, moeDirectReceiveKernel,
                               moeDirectCombineReduceKernel, moeDirectCombineSendKernel, moeDirectCombineFinalKernel}) {
    int n = 0;
    if (const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k, kThreads, 0); e != cudaSuccess) return e;
    lowest = lowest == 0 || n < lowest ? n : lowest;
  }
  *ctas = lowest;
  return cudaSuccess;
}

}  // namespace graphep
