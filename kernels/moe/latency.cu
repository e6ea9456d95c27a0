// MoE latency-path kernel family (see kernels/moe/moe.h), launchers below: one kernel per operation,
// graphep::moe_latency::dispatchKernel and combineKernel, each a send part on G = grid.budgetCtas CTAs (the
// SM budget) and a receive part on E = epilogueCtas CTAs beside them (CTAs [G, G + E)), so the
// receive starts at once on SMs of its own and the expansion is not held to the budget. A launch
// runs both parts (no launch gap and no completion wait between them), or one of them: the send
// half, and later the receive half (Engine::receive; DeepEP's return_recv_hook), the same kernel. No count round trip before the payload. A CTA of kMoeLatencyThreads works on kGroups
// records (or tokens) at once, one per group of kMoeGroupThreads. Every CTA first waits for the
// stream's last kernel (griddepcontrol.wait: each launch is that kernel's programmatic dependent);
// only the receive part waits for other ranks, and the send part never waits for anything of its
// own operation but the combine weights (below), posted by every source before it reduces.
//
//   dispatch  send     every send CTA routes all T x K entries in shared memory (a bit per token for
//                      each expert and each destination: indices are popcounts); the CTAs split
//                      the destinations' count messages, each word carrying the step's tag
//                      beside its count (moeTaggedCount: no fence, no flag), before any payload;
//                      then each CTA writes the metadata of its share of the records for this
//                      rank (no payload: the receiver reads those rows from x) and adds 1 to
//                      this rank's arrival counter for itself; then each group writes one
//                      token's record, read once, into every peer's slot
//                      [parity][this rank][index]; each CTA then adds 1 to every peer's arrival
//                      counter for this rank.
//            receive  every receive CTA waits for every count word's tag, derives the layout (CTA 0
//                      publishes it) and expands each source's records as soon as that source's G
//                      send CTAs have arrived (its own rank first, their rows from x); the last
//                      CTA of the launch advances the step.
//   combine   send     with combine-time weights, each send CTA first writes its share of the
//                      destinations' weights (this rank's tokens' top-k weights at each token's
//                      record index) and posts their flag; each group then reduces one record
//                      received from a peer (sum of weight x y over its slots; the weights of the
//                      record's source, waited for, or the dispatch's) straight into the
//                      source's slot [parity][this rank][index]; each CTA then adds 1 to the
//                      combine arrival counter for this rank of every peer it reduced. A send
//                      half alone waits for no weights: it looks once, and leaves a source whose
//                      weights are not there to the receive half (latency.deferred[cta]).
//            receive  in a receive half after such a send half, receive CTA j first stands in
//                      for send CTAs j, j + E, ...: it waits for each deferred source's weights,
//                      reduces that share and arrives for it (combineSend, standIn); then each
//                      group reduces this rank's own records into its own partial slots (no
//                      wait), every CTA waits for G arrivals from every peer and each group sums
//                      one token's partials in rank order; the last CTA advances the step.
//
// Buffers alternate by the step's parity. A rank can only start dispatch s + 2 after its combine
// s + 1 received every destination's partials, which each destination sends after its own
// combine s: so a destination has finished with slot parity s before any source writes it again
// (in any order of operations: each send starts after its previous receive, which waited for
// every peer's previous send, which started after that peer's receive before it). A send half
// and its receive half keep the order: no operation of the engine comes between them
// (Engine::receive). Counters only grow (mod 2^32): flags reach step + 1, arrival counters grow
// by G in each step both ranks take part in (latency.expected keeps that count per rank).
//
// The active-rank mask (peers.live, the same on every rank in each step: the caller's promise):
// every rank still runs every operation and advances its steps, so steps and parities stay in
// lockstep; a rank outside the mask is sent nothing, its entries count as masked, and no one waits
// for it; a rank outside its own mask does nothing but advance. The parity argument above holds
// between any two ranks through the last step both took part in: writes into a rank's slots happen
// only in steps it takes part in, and each such step's send starts after the writer's previous
// receive among the ranks of that step.
#include "kernels/common/launch.h"
#include "kernels/moe/peer.cuh"

namespace graphep {
namespace moe_latency {
namespace {

constexpr int kThreads = kMoeLatencyThreads;
constexpr int kGroups = kThreads / kMoeGroupThreads;

__device__ __forceinline__ std::uint64_t llSlot(const MoeParams& p, int parity, int src, int i,
                                                std::uint64_t bytes) {
  return ((static_cast<std::uint64_t>(parity) * p.shape.numRanks + src) * p.shape.maxTokens + i) * bytes;
}

// Set bits of bits[0 .. W) below bit t.
__device__ __forceinline__ int popcBelow(const std::uint32_t* bits, int t) {
  int c = 0;
  for (int w = 0; w < (t >> 5); ++w) c += __popc(bits[w]);
  if ((t & 31) != 0) c += __popc(bits[t >> 5] & ((1u << (t & 31)) - 1u));
  return c;
}

// The CTAs of one part of a launch: this CTA's index among them and their number (the send part
// is CTAs [0, G), the receive part CTAs [0, epilogueCtas)).
struct Part {
  int cta, ctas;
};

// The thread of a CTA that announces it to the last peer (arriveAtEveryPeer): the send's end.
__device__ __forceinline__ int lastArriver(const MoeParams& p) {
  return p.shape.rank == p.shape.numRanks - 1 ? p.shape.numRanks - 2 : p.shape.numRanks - 1;
}

// The launch's last CTA, once the operation's receive is done: the arrivals the next step waits
// for grow by G from each rank that took part in this one (op 0: the dispatch, whose own records
// this rank always counts; 1: the combine, whose own entry nothing arrives at or waits on).
__device__ __forceinline__ void advanceExpected(const MoeParams& p, int op, std::uint32_t live) {
  std::uint32_t* expected = p.latency.expected + op * p.shape.numRanks;
  for (int q = 0; q < p.shape.numRanks; ++q) {
    if (isLive(live, q) || (op == 0 && q == p.shape.rank)) expected[q] += static_cast<std::uint32_t>(p.grid.budgetCtas);
  }
}

// Shrink on timeout (MoeConfig::shrinkOnTimeout; p.latency.shrink, else nullptr): operation op's
// words {masked by the receive part, barrier count, barrier generation, masked by the send part},
// or nullptr. A wait on rank q that times out masks q (maskAfterTimeout) instead of failing. The
// send part records its ranks apart, so that no send CTA changes the set the receive CTAs settle on.
__device__ __forceinline__ std::uint32_t* shrinkWords(const MoeParams& p, int op) {
  return p.latency.shrink != nullptr ? p.latency.shrink + 4 * op : nullptr;
}

// The receive part's CTAs meet here after their waits, so that each reads the same ranks masked
// by the receive (every CTA's timeouts are recorded before it arrives), and leave them out of the
// rest of the operation. The CTAs are resident together (the CTA plan); the meeting is bounded
// like any wait. Every thread gets the ranks to leave out.
__device__ std::uint32_t settleMasked(const MoeParams& p, std::uint32_t* words, int ctas, WaitSite site) {
  __syncthreads();  // every thread's timeouts recorded
  bool failed = false;
  if (threadIdx.x == 0) {
    const std::uint32_t gen = ptx::ldAcquireSys(words + 2);  // read before arriving: this meeting's generation
    ptx::fenceAcqRelSys();
    if (atomicAdd(words + 1, 1u) == static_cast<std::uint32_t>(ctas) - 1u) {
      words[1] = 0;  // every CTA counted: ready for the next operation
      flagPost(words + 2, gen + 1u);
    } else {
      failed = !flagWait(p.peers.sync, words + 2, gen + 1u, p.shape.rank, site);
    }
  }
  __syncthreads_or(failed);  // every thread past the meeting (a failed one is recorded)
  return ptx::ldAcquireSys(words);
}

// The operation's ranks once the ranks masked after a timeout are left out (finishing CTA: every
// CTA is done), and its words made ready for the next operation.
__device__ __forceinline__ std::uint32_t settledLive(const MoeParams& p, int op, std::uint32_t live) {
  std::uint32_t* words = shrinkWords(p, op);
  if (words == nullptr) return live;
  const std::uint32_t out = live & ~(words[0] | words[3]);
  words[0] = 0;
  words[3] = 0;
  return out;
}

// --- dispatch ---------------------------------------------------------------------------------

__device__ void dispatchSend(const MoeParams& p, char* sm, Part part, std::uint32_t live) {
  const MoeLatencySmem lay = moeLatencySmem(p.shape.maxTokens, p.shape.topK, p.shape.numExperts, p.shape.numRanks);
  auto* ids = reinterpret_cast<std::int32_t*>(sm + lay.ids);         // [T_max * K], -1: none
  auto* weights = reinterpret_cast<float*>(sm + lay.weights);        // [T_max * K]
  auto* expBits = reinterpret_cast<std::uint32_t*>(sm + lay.expBits);  // [E][W]: tokens per expert
  auto* dstBits = reinterpret_cast<std::uint32_t*>(sm + lay.dstBits);  // [R][W]: tokens per rank
  __shared__ int dup;
  __shared__ char* dsts[kGroups][kMaxRanks];
  __shared__ int dstRanks[kGroups][kMaxRanks];
  __shared__ int ndst[kGroups];

  const int tid = static_cast<int>(threadIdx.x);
  const int K = p.shape.topK, R = p.shape.numRanks, L = p.shape.localExperts, E = p.shape.numExperts;
  const int W = (p.shape.maxTokens + 31) / 32;
  const MoeGroupSlice gs = moeGroupSlice(part.cta, part.ctas);
  const int group = gs.group, firstItem = gs.first, items = gs.stride;
  const MoeGroup g = gs.g;
  const std::uint32_t step = p.peers.steps[0];
  const int parity = static_cast<int>(step & 1u);
  const int T = moeLiveTokens(p, part.cta == 0 && tid == 0);
  bool anyDup = false;
  // Entries of expert e before token t (and before slot k of t): a popcount unless some token
  // holds an expert twice, then an exact count over the tokens holding e.
  auto entriesBefore = [&](int e, int t, int k) {
    const std::uint32_t* bits = expBits + e * W;
    if (!anyDup) return popcBelow(bits, t);
    int c = 0;
    for (int u = 0; u < t; ++u) {
      if ((bits[u >> 5] >> (u & 31)) & 1u) {
        for (int kk = 0; kk < K; ++kk) c += ids[u * K + kk] == e;
      }
    }
    for (int kk = 0; kk < k; ++kk) c += ids[t * K + kk] == e;
    return c;
  };
  {
    const MoeStamp stamp(p, MoeKernel::kLatencyDispatch);
    if (part.cta == 0 && tid == 0) moeCheckPairing(p, true);
    for (int w = tid; w < (E + R) * W; w += kThreads) expBits[w] = 0;  // and dstBits
    if (tid == 0) dup = 0;
    __syncthreads();
    // Route every entry (invalid ids: -1 here, counted by CTA 0).
    for (int e = tid; e < T * K; e += kThreads) {
      const long long id = moeReadId(p, static_cast<std::uint64_t>(e));
      const bool known = moeValidId(p, id);
      if (!known && id != -1 && part.cta == 0) moeReportInvalidId(p, id, e / K, e % K);
      const bool valid = known && isLive(live, static_cast<int>(id / L));  // its rank takes part
      if (known && !valid && part.cta == 0) atomicAdd(&p.state.status->maskedEntries[id / L], 1ull);
      ids[e] = valid ? static_cast<std::int32_t>(id) : -1;
      weights[e] = moeWeightOf(p, static_cast<std::uint64_t>(e));
      if (valid) {
        const int t = e / K;
        const std::uint32_t bit = 1u << (t & 31);
        if (atomicOr(&expBits[id * W + (t >> 5)], bit) & bit) dup = 1;  // the token holds it twice
        atomicOr(&dstBits[(id / L) * W + (t >> 5)], bit);
      }
    }
    __syncthreads();
    anyDup = dup != 0;
    // Count messages first (they travel ahead of the payload): CTA c takes ranks c, c + G, ...
    // Each word carries its count tagged with the step (moeTaggedCount), stored whole, so the
    // receiver waits on the words themselves: no fence, no flag to order them by. The flag is
    // still stored after them (the CTA's barrier between), for checkHealth's account of a stall
    // alone (nothing waits on it).
    for (int r = part.cta; r < R; r += part.ctas) {
      if (!isLive(live, r)) continue;  // the same r in every thread
      auto* msg = reinterpret_cast<std::uint64_t*>(p.peers.userRegions[r] + p.peers.countMsgsOff +
                                                   (static_cast<std::uint64_t>(parity) * R + p.shape.rank) * p.shape.countMsgBytes);
      for (int j = tid; j < L; j += kThreads) ptx::stRelaxedSys64(msg + 1 + j, moeTaggedCount(step, entriesBefore(r * L + j, T, 0)));
      if (tid == 0) ptx::stRelaxedSys64(msg, moeTaggedCount(step, popcBelow(dstBits + r * W, T)));
      __syncthreads();
      if (tid == 0) {
        ptx::stRelaxedSys(peerCounter(p, r, p.peers.countFlagsOff) + p.shape.rank, step + 1u);
        moeTrace(p, 0, step, MoeTraceEvent::kPosted, 0, true);
      }
    }
    // Each token's index in each destination's list, for the combine of this dispatch.
    if (part.cta == part.ctas - 1) {
      for (int n = tid; n < T * R; n += kThreads) {
        const int t = n / R, r = n % R;
        const bool goes = (dstBits[r * W + (t >> 5)] >> (t & 31)) & 1u;
        p.routing.tokenRankIndex[n] = goes ? popcBelow(dstBits + r * W, t) : -1;
      }
    }
  }
  {
    const MoeStamp stamp(p, MoeKernel::kLatencyRecords);
    // This rank's own records first, their metadata alone (the receiver reads their rows from x),
    // a warp per token from the routing in shared memory; then this CTA's arrival at this rank
    // (GPU scope: its receiver runs on this GPU), so that the receiver expands them while the
    // peers' records are written below.
    {
      const int warp = tid / 32, lane = tid % 32, warps = kThreads / 32, me = p.shape.rank;
      for (int t = part.cta * warps + warp; t < T; t += part.ctas * warps) {
        if (!((dstBits[me * W + (t >> 5)] >> (t & 31)) & 1u)) continue;  // uniform across the warp
        char* rec = p.peers.userRegions[me] + p.peers.recordsOff + llSlot(p, parity, me, popcBelow(dstBits + me * W, t), p.shape.recordBytes);
        moeWriteRecordMeta(
            p, t, &rec, &me, 1, [&](int k) { return entriesBefore(ids[t * K + k], t, k); },
            lane < K ? ids[t * K + lane] : -1, lane < K ? weights[t * K + lane] : 0.f, lane);
      }
      __syncthreads();
      if (tid == 0) {
        __threadfence();  // the CTA's metadata (ordered before by the barrier), then the count
        atomicAdd(peerCounter(p, me, p.latency.recordArrivalsOff) + me, 1u);
      }
    }
    // The peers' records: one token per group, its row read once for every peer. Every group of
    // the CTA goes round the same number of times (one past the last token idles through its
    // barriers): compute-sanitizer racecheck mis-orders a CTA-wide shared-memory exchange whose
    // writer's group has passed its named barrier more often than the reader's (a false RAW
    // hazard; tools/racecheck_probe.cu, docs/RELIABILITY.md); the receiver keeps the same rule.
    // At few tokens the groups left over share a token's row: item t x C + c is chunk c of token
    // t, the C groups of a token acting as one group of C x kMoeGroupThreads threads over its row
    // (moeWriteRecords synchronises none of them; chunk 0 writes the metadata).
    const int C = moeRecordChunks(items, T, p.shape.hidden);
    for (int base = firstItem - group; base < T * C; base += items) {
      const int item = base + group, t = item / C, c = item % C;
      if (g.tid == 0 && item < T * C) {
        int n = 0;
        for (int r = 0; r < R; ++r) {
          if (r == p.shape.rank || !((dstBits[r * W + (t >> 5)] >> (t & 31)) & 1u)) continue;
          dsts[group][n] = p.peers.userRegions[r] + p.peers.recordsOff + llSlot(p, parity, p.shape.rank, popcBelow(dstBits + r * W, t), p.shape.recordBytes);
          dstRanks[group][n++] = r;
        }
        ndst[group] = n;
      }
      g.sync();
      if (item < T * C && ndst[group] > 0) {
        const MoeGroup chunk{c * g.nthreads + g.tid, C * g.nthreads, g.barrier};  // never synchronised
        moeWriteRecords(p, t, dsts[group], dstRanks[group], ndst[group],
                        [&](int k) { return entriesBefore(ids[t * K + k], t, k); }, chunk, ndst[group]);
      }
      g.sync();  // dsts is rewritten for the next item
    }
  }
  arriveAtEveryPeer(p, p.latency.recordArrivalsOff, live);  // this CTA's records, to every peer taking part
  if (tid == lastArriver(p)) moeTrace(p, 0, step, MoeTraceEvent::kSent, 0, true);
}

// Source q's count message of the step's parity in this rank's heap.
__device__ __forceinline__ const std::uint64_t* latencyMsg(const MoeParams& p, int parity, int q) {
  return reinterpret_cast<const std::uint64_t*>(p.peers.userRegions[p.shape.rank] + p.peers.countMsgsOff +
                                                (static_cast<std::uint64_t>(parity) * p.shape.numRanks + q) * p.shape.countMsgBytes);
}

// Every thread of the CTA: waits until each word of every live source's count message of this
// step carries its tag (moeCountTag, the sender's moeTaggedCount). A source whose words do not
// come is masked (shrink on timeout: `masked`, the receive's word; a thread skips the words of a
// source already masked, so that a dead source costs one timeout, not one per round of words) or
// reported. True when every live source's message came (the same in every thread).
__device__ bool waitTaggedCounts(const MoeParams& p, int parity, std::uint32_t step, std::uint32_t live, std::uint32_t* masked) {
  const int words = 1 + p.shape.localExperts, R = p.shape.numRanks;
  const std::uint32_t tag = moeCountTag(step);
  bool failed = false;
  for (int n = static_cast<int>(threadIdx.x); n < R * words; n += kThreads) {
    const int q = n / words;
    if (!isLive(live, q) || (masked != nullptr && isLive(ptx::ldRelaxedSys(masked), q))) continue;
    const std::uint64_t* word = latencyMsg(p, parity, q) + n % words;
    const bool ok = boundedPoll(
        p.peers.sync,
        [&](std::uint32_t* v) {
          *v = static_cast<std::uint32_t>(ptx::ldRelaxedSys64(word) >> 32);
          return *v == tag;
        },
        tag, q, WaitSite::kMoeDispatch, word, false, masked != nullptr);
    if (!ok && masked != nullptr) {
      maskAfterTimeout(p, masked, q);  // shrink on timeout: masked, not an error
    } else if (!ok) {
      failed = true;
    }
  }
  return __syncthreads_or(failed) == 0;
}

__device__ void dispatchReceive(const MoeParams& p, Part part, std::uint32_t live) {
  __shared__ MoeReceiveSmem<kThreads, kGroups> sm;
  const int tid = static_cast<int>(threadIdx.x), R = p.shape.numRanks;
  const MoeGroupSlice gs = moeGroupSlice(part.cta, part.ctas);
  const std::uint32_t step = p.peers.steps[0];
  const int parity = static_cast<int>(step & 1u);
  const std::uint32_t G = static_cast<std::uint32_t>(p.grid.budgetCtas);  // every send CTA, this step
  // A source outside the mask sent nothing: its message reads as zeros, so the layout leaves it out.
  // Shrink on timeout: a source whose count message never came is left out like one outside the mask.
  auto msgOf = [&](int q) { return isLive(live, q) ? latencyMsg(p, parity, q) : p.peers.zeroMsg; };
  std::uint32_t* masked = shrinkWords(p, 0);  // the dispatch's (the receive part's ranks first), or nullptr
  bool layoutOk = false;
  {
    const MoeStamp stamp(p, MoeKernel::kLatencyReceive);
    const bool counted = waitTaggedCounts(p, parity, step, live, masked);
    if (part.cta == part.ctas - 1 && tid == 0) moeTrace(p, 0, step, MoeTraceEvent::kLayout);
    if (masked != nullptr) live &= ~settleMasked(p, masked, part.ctas, WaitSite::kMoeDispatch);
    if (counted) moeComputeReceiveLayout<kThreads, kGroups>(p, msgOf, part.cta == 0, sm);  // CTA 0 publishes
    layoutOk = counted;
  }
  {
    const MoeStamp stamp(p, MoeKernel::kLatencyExpand);
    if (layoutOk) {
      // Each source's records once its G send CTAs have arrived, this rank's own first. The
      // records of every source, in this order, are dealt to the receive groups one per CTA in
      // turn (group-major: consecutive records on different SMs), from CTA 1 (CTA 0 publishes the
      // layout): group slot n takes records n - 1, n - 1 + stride, ... So a source's records do
      // not queue behind the earlier sources' in the same groups: at few tokens this rank's own
      // records and each peer's are expanded side by side.
      // At few records, the groups left over share each record's row (C chunks per record,
      // moeRecordChunks): item j x C + c is chunk c of record j.
      const int stride = gs.stride, slot = gs.group * part.ctas + part.cta;
      const long long mineAt = (slot + stride - 1) % stride;  // this group's items: mineAt (mod stride)
      long long records = 0;
      for (int q = 0; q < R; ++q) records += moeMsgRecords(p, msgOf(q));
      const int C = moeRecordChunks(stride, records, p.shape.hidden);
      long long before = 0;  // items of the sources before this one
      for (int k = 0; k < R; ++k) {
        const int s = (p.shape.rank + k) % R;
        const bool failed = tid == 0 && isLive(live, s) &&
                            !flagWait(p.peers.sync, peerCounter(p, p.shape.rank, p.latency.recordArrivalsOff) + s,
                                      p.latency.expected[s] + G, s, WaitSite::kMoeDispatch);
        if (__syncthreads_or(failed) != 0) break;  // thread 0's verdict, to every thread
        if (part.cta == 0 && tid == 0) {
          moeTrace(p, 0, step, k == R - 1 ? MoeTraceEvent::kArrived0 : MoeTraceEvent::kOwnArrived0);
        }
        // After this CTA's last wait on another rank, not before: the stream's next kernel (the
        // next operation, or a caller's programmatic dependent) may then be placed while this one
        // only expands. Placed earlier, it could hold the SMs that another engine's or another
        // rank's send part needs while this receive waits for it (a cycle across GPUs).
        if (k == R - 1) ptx::launchDependents();
        if (k == R - 1 && part.cta == part.ctas - 1 && tid == 0) moeTrace(p, 0, step, MoeTraceEvent::kArrived);
        moeSourceBases<kThreads>(p, msgOf, sm.offsets, s, sm.base);
        __syncthreads();
        const int rows = moeMsgRecords(p, msgOf(s));
        const long long rankBase = p.layout.rankMajor ? moeRankBase(p, msgOf, s) : -1;  // rank-major: its first row
        // Every group goes round equally (an idle one through the same barriers): base is
        // rewritten for the next source after the __syncthreads below.
        const long long items = static_cast<long long>(rows) * C;
        for (long long round = before / stride * stride; round < before + items; round += stride) {
          const long long item = round + mineAt;
          const bool mine = item >= before && item < before + items;
          const int i = mine ? static_cast<int>((item - before) / C) : rows;
          const MoeChunk chunk{mine ? static_cast<int>((item - before) % C) : 0, C};
          const char* rec = p.peers.userRegions[p.shape.rank] + p.peers.recordsOff + llSlot(p, parity, s, i, p.shape.recordBytes);
          if (i < rows && s == p.shape.rank) {  // its metadata alone: the row comes from x
            moeExpandOwnRecord(p, rec, sm.base, sm.stages[gs.group], gs.g, p.layout.rankMajor ? rankBase + i : -1, chunk);
          } else if (i < rows) {
            moeExpandRecord(p, s, rec, sm.base, sm.stages[gs.group], gs.g, p.layout.rankMajor ? rankBase + i : -1, chunk);
          } else {
            moeIdleRecord(gs.g);
          }
        }
        __syncthreads();
        before += items;
        if (k == 0 && part.cta == 0 && tid == 0) moeTrace(p, 0, step, MoeTraceEvent::kOwnDone0);
      }
    }
  }
  if (tid == 0) moeTrace(p, 0, step, MoeTraceEvent::kReceived, 0, true);
}

// The send part's first CTA: its start and the end of its wait for the stream's last kernel.
__device__ __forceinline__ void traceStart(const MoeParams& p, int op, Part send, std::uint64_t entered) {
  if (send.cta == 0 && threadIdx.x == 0 && p.state.timeline != nullptr) {
    const std::uint32_t step = p.peers.steps[op];
    moeTrace(p, op, step, MoeTraceEvent::kEnter, entered);
    moeTrace(p, op, step, MoeTraceEvent::kReady);
  }
}

// The part of this launch that this CTA runs (cta -1: none). Both parts: CTAs [0, G) send and
// CTAs [G, G + E) receive, as two kernels would (the receive starts at once, on its own SMs);
// one part: every CTA runs it.
__device__ __forceinline__ Part sendPart(const MoeParams& p) {
  const bool sends = (p.latency.phase & kMoeLatencySend) != 0 && static_cast<int>(blockIdx.x) < p.grid.budgetCtas;
  return Part{sends ? static_cast<int>(blockIdx.x) : -1, p.grid.budgetCtas};
}
__device__ __forceinline__ Part receivePart(const MoeParams& p) {
  const int first = (p.latency.phase & kMoeLatencySend) != 0 ? p.grid.budgetCtas : 0;
  const bool receives = (p.latency.phase & kMoeLatencyReceive) != 0 && static_cast<int>(blockIdx.x) >= first;
  return Part{receives ? static_cast<int>(blockIdx.x) - first : -1, p.grid.epilogueCtas};
}

__global__ void __launch_bounds__(kThreads) dispatchKernel(const __grid_constant__ MoeParams p) {
  extern __shared__ int4 smemRaw[];
  const std::uint64_t entered = p.state.timeline != nullptr ? ptx::globalTimerNs() : 0;
  // The stream's last kernel (often the last operation, which lets it be placed early) has
  // finished and its memory is visible: nothing of this step is read before.
  ptx::gridDependencyWait();
  const Part send = sendPart(p), receive = receivePart(p);
  // A receive half uses its send half's mask (a caller's kernel may have changed the mask word
  // between the halves); the send half leaves it.
  const bool sends = (p.latency.phase & kMoeLatencySend) != 0;
  const std::uint32_t live = sends ? dispatchMask(p) : *p.latency.halfLive;
  if (sends && (p.latency.phase & kMoeLatencyReceive) == 0 && blockIdx.x == 0 && threadIdx.x == 0) *p.latency.halfLive = live;
  traceStart(p, 0, send, entered);
  if (send.cta >= 0) dispatchSend(p, reinterpret_cast<char*>(smemRaw), send, live);
  if (receive.cta >= 0) dispatchReceive(p, receive, live);
  if ((p.latency.phase & kMoeLatencyReceive) != 0 && lastBlock(&p.peers.lastCtaCounters[0]) && threadIdx.x == 0) {
    moeTrace(p, 0, p.peers.steps[0], MoeTraceEvent::kDone);
    // Every CTA read the step and the expected arrivals before lastBlock's barrier.
    p.peers.steps[0] = p.peers.steps[0] + 1u;
    const std::uint32_t settled = settledLive(p, 0, live);  // less the ranks masked after a timeout
    advanceExpected(p, 0, settled);
    *p.peers.dispatchLive = settled;  // its combine's mask
    *p.state.pending = kMoeDispatched | kMoePendingCombine;
  }
}

// --- combine ----------------------------------------------------------------------------------

// Source q's top-k weights of its record i, in this rank's heap (CombineArgs.topkWeights).
__device__ __forceinline__ const float* combineWeightsOf(const MoeParams& p, int parity, int q, int i) {
  return reinterpret_cast<const float*>(p.peers.userRegions[p.shape.rank] + p.latency.weightsOff) +
         ((static_cast<std::uint64_t>(parity) * p.shape.numRanks + q) * p.shape.maxTokens + i) * p.shape.topK;
}

// Thread 0 waits (bounded, its own timeout even after another wait of this rank failed) for
// source s's combine-time weights of combine step cstep. False (in every thread) when they never
// came: s is then masked (shrink on timeout, `masked` non-null) or the timeout recorded.
__device__ __forceinline__ bool waitCombineWeights(const MoeParams& p, int s, std::uint32_t cstep, std::uint32_t* masked) {
  const bool failed = threadIdx.x == 0 && !flagWait(p.peers.sync, peerCounter(p, p.shape.rank, p.latency.weightFlagsOff) + s,
                                                    cstep + 1u, s, WaitSite::kMoeCombineWeights, nullptr, true,
                                                    masked != nullptr);
  if (failed && masked != nullptr) maskAfterTimeout(p, masked, s);  // shrink on timeout: masked, not an error
  return __syncthreads_or(failed) == 0;
}

// The records of the last dispatch from peer source s that slice gs (a send CTA's groups) takes,
// each reduced (sum of weight x y over its slots; the source's combine-time weights when
// `weighted`, else the dispatch's) straight into s's partial slot [cparity][this rank][index].
__device__ __forceinline__ void reduceSourceShare(const MoeParams& p, int s, const MoeGroupSlice& gs, MoeSlotStage& stage, bool weighted,
                                  int cparity, int dparity) {
  const std::uint64_t rowBytes = static_cast<std::uint64_t>(p.shape.hidden) * 2;
  const int rows = p.layout.sourceRecords[s];
  const long long rankBase = p.layout.rankMajor ? p.layout.rankOffsets[s] : -1;  // rank-major: the source's first row
  for (int i = gs.first; i < rows; i += gs.stride) {
    moeReduceRecord(p, p.peers.userRegions[p.shape.rank] + p.peers.recordsOff + llSlot(p, dparity, s, i, p.shape.recordBytes),
                    p.layout.sourceBase + s * p.shape.localExperts,
                    p.peers.userRegions[s] + p.peers.partialsOff + llSlot(p, cparity, p.shape.rank, i, rowBytes), stage, gs.g,
                    p.layout.rankMajor ? rankBase + i : -1, weighted ? combineWeightsOf(p, cparity, s, i) : nullptr);
  }
}

// Send CTA part.cta's work of a combine. `standIn`: a receive CTA of the receive half after a send
// half, standing in for send CTA part.cta, which left sources to it (latency.deferred[part.cta]):
// their records only, waiting for their weights, and its arrivals at them (each source counts G
// arrivals a step either way); no weights are posted again.
// `gaveUp` (a stand-in's, carried over the send CTAs it stands in for; uniform): the sources whose
// weights it waited for in vain, not waited for again (one timeout per dead source, not one per
// send CTA), and left out of its receive's wait for their partials.
__device__ void combineSend(const MoeParams& p, Part part, std::uint32_t live, bool standIn, std::uint32_t& gaveUp) {
  __shared__ MoeSlotStage stages[kGroups];
  const int tid = static_cast<int>(threadIdx.x);
  const MoeGroupSlice gs = moeGroupSlice(part.cta, part.ctas);
  const int R = p.shape.numRanks, K = p.shape.topK;
  const std::uint32_t cstep = p.peers.steps[1];
  const int cparity = static_cast<int>(cstep & 1u);
  // The records of the last dispatch (whose receive advanced the dispatch step past them).
  const int dparity = static_cast<int>((p.peers.steps[0] - 1u) & 1u);
  const std::uint32_t left = standIn ? p.latency.deferred[part.cta] : live;  // the sources to reduce (uniform)
  if (standIn && left == 0) return;
  const MoeStamp stamp(p, MoeKernel::kLatencyCombine);
  if (part.cta == 0 && tid == 0 && !standIn) moeCheckPairing(p, false);
  const bool weighted = p.combine.topkWeights != nullptr;
  if (weighted && !standIn) {
    // This rank's tokens' weights to each destination, at the token's record index there, before
    // any wait: CTA c takes destinations c, c + G, ...
    const int T = *p.routing.liveTokens;
    for (int r = part.cta; r < R; r += part.ctas) {
      if (r == p.shape.rank || !isLive(live, r)) continue;  // the same r in every thread
      auto* dst = reinterpret_cast<float*>(p.peers.userRegions[r] + p.latency.weightsOff) +
                  (static_cast<std::uint64_t>(cparity) * R + p.shape.rank) * p.shape.maxTokens * K;
      for (int e = tid; e < T * K; e += kThreads) {
        const int t = e / K, i = p.routing.tokenRankIndex[static_cast<std::uint64_t>(t) * R + r];
        if (i >= 0) dst[static_cast<std::uint64_t>(i) * K + e % K] = p.combine.topkWeights[e];
      }
      __syncthreads();
      if (tid == 0) flagPost(peerCounter(p, r, p.latency.weightFlagsOff) + p.shape.rank, cstep + 1u);
    }
    if (tid == 0) moeTrace(p, 1, cstep, MoeTraceEvent::kPosted, 0, true);
  }
  // The peers' records only (their partials cross the link): the receive part reduces this rank's
  // own records. A send half alone (DeepEP's return_recv_hook) never waits for a peer: the records
  // of a source whose weights are not there yet are left to the receive half (standIn).
  const bool alone = (p.latency.phase & kMoeLatencyReceive) == 0;
  std::uint32_t unserved = 0;  // sources whose weights never came (the same in every thread)
  std::uint32_t deferred = 0;  // sources left to the receive half (the same in every thread)
  // Shrink on timeout: the send part's ranks in words[3]; a stand-in is a receive CTA and masks in
  // the receive's words[0], before the receive CTAs' meeting, so that every receive CTA leaves out
  // the same ranks.
  std::uint32_t* words = shrinkWords(p, 1);
  std::uint32_t* masked = words != nullptr ? words + (standIn ? 0 : 3) : nullptr;
  for (int k = 1; k < R; ++k) {
    const int s = (p.shape.rank + k) % R;
    if (!isLive(left, s)) continue;  // outside the mask: no records to reduce, nothing to send it
    if (isLive(gaveUp, s)) {  // a stand-in that waited for its weights in vain already
      unserved |= 1u << s;
      continue;
    }
    if (weighted && alone) {
      // One look at the source's weights flag, no wait.
      const std::uint32_t* flag = peerCounter(p, p.shape.rank, p.latency.weightFlagsOff) + s;
      if (__syncthreads_or(tid == 0 && ptx::counterReached(ptx::ldAcquireSys(flag), cstep + 1u)) == 0) {
        deferred |= 1u << s;
        continue;
      }
    } else if (weighted && !waitCombineWeights(p, s, cstep, masked)) {
      // Recorded (the engine enters its failed state), or masked. The other sources' records are still
      // reduced and announced, so the survivors' counters stay in step with each other once the
      // failed source is masked (Engine::recover); the failed source gets no arrival from this
      // CTA (its partials were not written), so its own wait fails and reports instead of
      // summing an old slot.
      unserved |= 1u << s;
      if (standIn) gaveUp |= 1u << s;
      continue;
    }
    reduceSourceShare(p, s, gs, stages[gs.group], weighted, cparity, dparity);
  }
  if (alone && tid == 0) p.latency.deferred[part.cta] = deferred;  // read by the receive half (the next kernel)
  arriveAtEveryPeer(p, p.latency.partialArrivalsOff, left & ~unserved & ~deferred);
  if (!standIn && tid == lastArriver(p)) moeTrace(p, 1, cstep, MoeTraceEvent::kSent, 0, true);
}

// `skip`: with shrink on timeout, the peers this CTA does not wait for (its stand-in gave up on
// their weights and masked them in words[0]: every receive CTA leaves them out after the meeting).
// Without it a stand-in's failure is recorded and the waits below return at once.
__device__ void combineReceive(const MoeParams& p, Part part, std::uint32_t live, std::uint32_t skip) {
  __shared__ const uint4* parts[kGroups][kMaxRanks];
  __shared__ MoeSlotStage stages[kGroups];
  const MoeGroupSlice gs = moeGroupSlice(part.cta, part.ctas);
  const int R = p.shape.numRanks;
  const std::uint32_t cstep = p.peers.steps[1];
  const int cparity = static_cast<int>(cstep & 1u);
  const int dparity = static_cast<int>((p.peers.steps[0] - 1u) & 1u);  // the last dispatch's records
  const std::uint64_t rowBytes = static_cast<std::uint64_t>(p.shape.hidden) * 2;
  const int T = *p.routing.liveTokens;
  {
    const MoeStamp stamp(p, MoeKernel::kLatencyCombineOwn);
    // This rank's own records, reduced into its own partial slots while the send part reduces the
    // peers' (no wait: the records, y and the weights are this rank's). Each group takes the same
    // tokens below, so its own barrier orders these partials before its sums.
    for (int t = gs.first; t < T; t += gs.stride) {
      const int i = p.routing.tokenRankIndex[static_cast<std::uint64_t>(t) * R + p.shape.rank];
      if (i >= 0) {
        moeReduceRecord(p, p.peers.userRegions[p.shape.rank] + p.peers.recordsOff + llSlot(p, dparity, p.shape.rank, i, p.shape.recordBytes),
                        p.layout.sourceBase + p.shape.rank * p.shape.localExperts,
                        p.peers.userRegions[p.shape.rank] + p.peers.partialsOff + llSlot(p, cparity, p.shape.rank, i, rowBytes), stages[gs.group],
                        gs.g, p.layout.rankMajor ? p.layout.rankOffsets[p.shape.rank] + i : -1,
                        p.combine.topkWeights != nullptr ? p.combine.topkWeights + static_cast<std::uint64_t>(t) * p.shape.topK
                                                    : nullptr);
      }
    }
  }
  {
    const MoeStamp stamp(p, MoeKernel::kLatencyCombineReceive);
    // Every peer destination's G send CTAs, this step (the destinations taking part).
    // Shrink on timeout: a destination whose partials never came all is masked, and every CTA
    // leaves the same ranks out of the sums.
    std::uint32_t* masked = shrinkWords(p, 1);
    const bool arrived = waitEveryRank(p, p.latency.partialArrivalsOff, static_cast<std::uint32_t>(p.grid.budgetCtas),
                                       WaitSite::kMoeCombine, true, masked != nullptr ? live & ~skip : live, p.latency.expected + R,
                                       masked);
    if (masked != nullptr) live &= ~settleMasked(p, masked, part.ctas, WaitSite::kMoeCombine);
    if (arrived) {
      ptx::launchDependents();  // after the last wait on another rank, as in the dispatch receive
      if (part.cta == part.ctas - 1 && threadIdx.x == 0) moeTrace(p, 1, cstep, MoeTraceEvent::kArrived);
      if (part.cta == 0 && threadIdx.x == 0) moeTrace(p, 1, cstep, MoeTraceEvent::kArrived0);
      for (int t = gs.first; t < T; t += gs.stride) {
        moeFinalToken(
            p, t,
            [&](int r) -> const char* {
              const int i = p.routing.tokenRankIndex[static_cast<std::uint64_t>(t) * R + r];
              // A rank outside the mask (recover may shrink it after the dispatch) adds nothing.
              return i < 0 || !isLive(live, r) ? nullptr
                                               : p.peers.userRegions[p.shape.rank] + p.peers.partialsOff + llSlot(p, cparity, r, i, rowBytes);
            },
            parts[gs.group], gs.g);
      }
    }
  }
  if (threadIdx.x == 0) moeTrace(p, 1, cstep, MoeTraceEvent::kReceived, 0, true);
}

__global__ void __launch_bounds__(kThreads) combineKernel(const __grid_constant__ MoeParams p) {
  const std::uint64_t entered = p.state.timeline != nullptr ? ptx::globalTimerNs() : 0;
  ptx::gridDependencyWait();  // as the dispatch: the stream's last kernel has finished
  const Part send = sendPart(p), receive = receivePart(p);
  const std::uint32_t live = *p.peers.dispatchLive;  // the mask of the dispatch it combines
  traceStart(p, 1, send, entered);
  // The send part; or, in the receive half after a send half with combine-time weights, receive
  // CTA j stands in for send CTAs j, j + E, ... (the sources they left to it), before any wait on
  // the peers' partials (a peer's receive may be doing the same for this rank). One call site:
  // a second inlined copy of the send spilled the whole operation's receive (1.1-1.5 us a combine).
  const bool standIn = send.cta < 0 && (p.latency.phase & kMoeLatencySend) == 0 && p.combine.topkWeights != nullptr;
  std::uint32_t gaveUp = 0;
  for (Part as{standIn ? receive.cta : send.cta, p.grid.budgetCtas}; as.cta >= 0 && as.cta < as.ctas;
       as.cta += standIn ? receive.ctas : as.ctas) {
    combineSend(p, as, live, standIn, gaveUp);
  }
  if (receive.cta >= 0) combineReceive(p, receive, live, gaveUp);
  if ((p.latency.phase & kMoeLatencyReceive) != 0 && lastBlock(&p.peers.lastCtaCounters[1]) && threadIdx.x == 0) {
    moeTrace(p, 1, p.peers.steps[1], MoeTraceEvent::kDone);
    p.peers.steps[1] = p.peers.steps[1] + 1u;
    advanceExpected(p, 1, settledLive(p, 1, live));  // less the ranks masked after a timeout
    *p.state.pending &= kMoeDispatched;
  }
}

// CTAs of one launch: the parts it runs, side by side.
int launchCtas(const MoeParams& p) {
  return ((p.latency.phase & kMoeLatencySend) != 0 ? p.grid.budgetCtas : 0) + ((p.latency.phase & kMoeLatencyReceive) != 0 ? p.grid.epilogueCtas : 0);
}

// The parts, their CTAs and the paths' limits, refused for `launcher`.
cudaError_t checkLaunch(const char* launcher, const MoeParams& p) {
  if (p.latency.phase < kMoeLatencySend || p.latency.phase > (kMoeLatencySend | kMoeLatencyReceive)) {
    return refuseLaunch(launcher, "latency.phase %d (send 1, receive 2, both 3)", p.latency.phase);
  }
  if (p.grid.budgetCtas < 1 || p.grid.epilogueCtas < 1) {
    return refuseLaunch(launcher, "grid.budgetCtas %d send CTAs, grid.epilogueCtas %d receive CTAs (at least 1 each)",
                        p.grid.budgetCtas, p.grid.epilogueCtas);
  }
  return moeCheckLimits(launcher, p);
}

}  // namespace
}  // namespace moe_latency

cudaError_t launchMoeLatencyDispatch(const MoeParams& p, cudaStream_t stream) {
  using namespace moe_latency;
  const MoeLatencySmem lay = moeLatencySmem(p.shape.maxTokens, p.shape.topK, p.shape.numExperts, p.shape.numRanks);
  if (const cudaError_t e = checkLaunch(__func__, p); e != cudaSuccess) return e;
  GRAPHEP_LAUNCH_REQUIRE(p.shape.maxTokens <= kMoeLatencyMaxTokens, "maxTokens %d (at most %d on the latency path)",
                         p.shape.maxTokens, kMoeLatencyMaxTokens);
  GRAPHEP_LAUNCH_REQUIRE(p.shape.maxTokens * p.shape.topK <= kMoeLatencyMaxEntries,
                         "maxTokens x topK = %d (at most %d on the latency path)", p.shape.maxTokens * p.shape.topK,
                         kMoeLatencyMaxEntries);
  GRAPHEP_LAUNCH_REQUIRE(lay.bytes <= kMoeLatencyMaxSmem, "the send's routing needs %u bytes of shared memory (at most %u)",
                         lay.bytes, kMoeLatencyMaxSmem);
  cudaLaunchAttribute attrs[2];
  cudaLaunchConfig_t cfg = moeLaunchConfig(launchCtas(p), kThreads, 1, true, stream, attrs);
  cfg.dynamicSmemBytes = (p.latency.phase & kMoeLatencySend) != 0 ? lay.bytes : 0;
  return cudaLaunchKernelEx(&cfg, dispatchKernel, p);
}

cudaError_t launchMoeLatencyCombine(const MoeParams& p, cudaStream_t stream) {
  using namespace moe_latency;
  if (const cudaError_t e = checkLaunch(__func__, p); e != cudaSuccess) return e;
  cudaLaunchAttribute attrs[2];
  const cudaLaunchConfig_t cfg = moeLaunchConfig(launchCtas(p), kThreads, 1, true, stream, attrs);
  return cudaLaunchKernelEx(&cfg, combineKernel, p);
}

cudaError_t preloadMoeLatencyKernels() {
  cudaError_t e = cudaFuncSetAttribute(moe_latency::dispatchKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(kMoeLatencyMaxSmem));
  return e != cudaSuccess ? e : preloadKernels(moe_latency::combineKernel);
}

cudaError_t moeLatencyCtasPerSm(std::uint32_t smemBytes, int* ctas) {
  int dispatch = 0, combine = 0;
  cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&dispatch, moe_latency::dispatchKernel,
                                                                moe_latency::kThreads, smemBytes);
  if (e != cudaSuccess) return e;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&combine, moe_latency::combineKernel, moe_latency::kThreads, 0);
  if (e != cudaSuccess) return e;
  *ctas = dispatch < combine ? dispatch : combine;
  return cudaSuccess;
}

}  // namespace graphep
