// MoE latency-path kernel family (see kernels/moe/moe.h), launchers below: one kernel per operation,
// graphep::moe_latency::dispatchKernel and combineKernel, on G + E CTAs (G = grid.budgetCtas, the
// SM budget; E = epilogueCtas). A launch runs both parts (no launch gap and no completion wait
// between them), or one of them: the send half, and later the receive half (Engine::receive;
// DeepEP's return_recv_hook), the same kernel. The dispatch's send part is CTAs [0, G) and its
// receive part CTAs [G, G + E) where the receivers' first items take every item the capacity
// allows, else every CTA sends, then receives (a receive half alone: E receivers and G helpers
// that take part only once every count word is in, dispatchReceive); the combine's send part is
// CTAs [0, G) and its receive part CTAs [G, G + E). Either way a receive that has its own CTAs
// starts at once on SMs of its own. No count round trip before the payload. Every CTA first waits
// for the stream's last kernel (griddepcontrol.wait; in a captured graph each launch is that
// kernel's programmatic dependent); only the receive waits for other ranks, and the send never
// waits for anything of its own operation but the combine weights (below), posted by every source
// before it reduces.
//
//   dispatch  send     every send CTA routes all T x K entries in shared memory (a bit per token
//                      for each expert and each destination: indices are popcounts); the CTAs split
//                      the destinations' count messages, each word carrying the step's tag beside
//                      its count (moeTaggedCount: no fence, no flag), before any payload; then warp
//                      items over every sending warp write each token's record into every peer's
//                      slot [parity][this rank][index] as tagged lines: (token, 512 values), read
//                      once, its payload as 128-byte lines (each lane's 16 bytes a piece, the
//                      step's tag word last); its metadata as flagged lines, each 8 bytes beside the
//                      tag, an item of its own where every item has a warp, else chunk 0's (no
//                      fence, no arrival counter); this rank's own slot among them.
//            receive  every receiving CTA waits for every count word's tag (kept in shared memory)
//                      and derives the layout (the first publishes it and expands nothing); warp
//                      items (record, chunk; this rank's own first), one per expanding warp and
//                      then, where some are left over, claimed from a counter, expand every
//                      source's records, each item as soon as its own lines carry the step's tag,
//                      and keep each record's plain metadata for the combine; the last CTA of the
//                      launch advances the step. A receive half alone runs on G + E CTAs: E
//                      receivers as above and G helpers that take part only once every sender has
//                      started (dispatchReceive).
//   combine   send     with combine-time weights, each send CTA first writes its share of the
//                      destinations' weights (this rank's tokens' top-k weights at each token's
//                      record index), each a word carrying the step's tag beside the weight (no
//                      fence, no flag); each group then reduces one record received from a peer
//                      (sum of weight x y over its slots; the weights of the record's source,
//                      its words waited for, or the dispatch's) straight into the
//                      source's slot [parity][this rank][index], as 128-byte lines carrying the
//                      step's tag (kernels/moe/lines.cuh: no fence, no flag); each CTA then adds
//                      1 (relaxed: the lines carry their own order) to the combine arrival counter
//                      for this rank of every peer it reduced. A send
//                      half alone waits for no weights: it looks once, and leaves a source whose
//                      weights are not there to the receive half (latency.deferred[cta]).
//            receive  in a receive half after such a send half, receive CTA j first stands in
//                      for send CTAs j, j + E, ...: it waits for each deferred source's weights,
//                      reduces that share and arrives for it (combineSend, standIn); then each
//                      group reduces this rank's own records into its own partial slots (no
//                      wait); each group (8 warps where every token has one) sums one token's
//                      partials in rank order, a warp a chunk, two (chunk, rank) loads in flight,
//                      each chunk once its lines from every rank carry the step's tag; every CTA
//                      waits for G arrivals from every peer (after the sums; with shrink on
//                      timeout before them, masking a peer that never comes); the last CTA
//                      advances the step.
//
// Buffers alternate by the step's parity. A rank can only start dispatch s + 2 after its combine
// s + 1 received every destination's arrivals, which each destination posts after its own
// combine s: so a destination has finished with slot parity s before any source writes it again
// (in any order of operations: each send starts after its previous receive, which waited for
// every peer's previous send (the dispatch: its count words; the combine: its arrivals), which
// started after that peer's receive before it). A send half
// and its receive half keep the order: no operation of the engine comes between them
// (Engine::receive). The dispatch's lines and count words carry moeCountTag(step), which the
// same parity's last step never carried. Counters only grow (mod 2^32): flags reach step + 1, the
// combine's arrival counters grow by G in each step both ranks take part in (latency.expected
// keeps that count per rank).
//
// The active-rank mask (peers.live, the same on every rank in each step: the caller's promise):
// every rank still runs every operation and advances its steps, so steps and parities stay in
// lockstep; a rank outside the mask is sent nothing, its entries count as masked, and no one waits
// for it; a rank outside its own mask does nothing but advance. The parity argument above holds
// between any two ranks through the last step both took part in: writes into a rank's slots happen
// only in steps it takes part in, and each such step's send starts after the writer's previous
// receive among the ranks of that step.
#include "kernels/common/launch.h"
#include "kernels/moe/lines.cuh"
#include "kernels/moe/peer.cuh"

namespace graphep {
namespace moe_latency {
namespace {

constexpr int kThreads = kMoeLatencyThreads;
constexpr int kGroups = kThreads / kMoeGroupThreads;
// The combine sums' wide groups (combineReceive): two per CTA, each two reduce groups, which
// keep their own barriers (no barrier of the wide group's own).
constexpr int kSumThreads = 2 * kMoeGroupThreads;
static_assert(kThreads % kSumThreads == 0 && kSumThreads % kMoeGroupThreads == 0, "wide sum groups: whole reduce groups, whole CTAs");

__device__ __forceinline__ std::uint64_t llSlot(const MoeParams& p, int parity, int src, int i,
                                                std::uint64_t bytes) {
  return ((static_cast<std::uint64_t>(parity) * p.shape.numRanks + src) * p.shape.maxTokens + i) * bytes;
}

// Set bits of bits[0 .. W) below bit t.
__device__ __forceinline__ int popcBelow(const std::uint32_t* bits, int t) {
  int c = 0;
#pragma unroll 1  // at most 8 words: no copies of the body
  for (int w = 0; w < (t >> 5); ++w) c += __popc(bits[w]);
  if ((t & 31) != 0) c += __popc(bits[t >> 5] & ((1u << (t & 31)) - 1u));
  return c;
}

// The receive layout a dispatch kernel is built for (p.layout says which: rankMajor; batched,
// rowsPerExpert > 0; else expert-major): one kernel each, so that a layout's branches in the
// receive's item loop are not code the others fetch.
enum class MoeRecvLayout : int { kExpertMajor = 0, kBatched = 1, kRankMajor = 2 };
inline constexpr int kMoeRecvLayouts = 3;
__host__ __device__ __forceinline__ MoeRecvLayout recvLayoutOf(const MoeParams& p) {
  return p.layout.rankMajor ? MoeRecvLayout::kRankMajor : p.layout.rowsPerExpert > 0 ? MoeRecvLayout::kBatched : MoeRecvLayout::kExpertMajor;
}

// The CTAs of one part of a launch: this CTA's index among them and their number (the combine's
// send part is CTAs [0, G), its receive part CTAs [G, G + epilogueCtas); the dispatch's the same
// where it splits, else each of its parts is every CTA of the launch: dispatchKernel).
struct Part {
  int cta, ctas;
};

// The thread of a CTA that announces it to the last peer (arriveAtEveryPeer): the send's end.
__device__ __forceinline__ int lastArriver(const MoeParams& p) {
  return p.shape.rank == p.shape.numRanks - 1 ? p.shape.numRanks - 2 : p.shape.numRanks - 1;
}

// The combine's last CTA, once its receive is done: the partial arrivals the next step waits for
// grow by G from each rank that took part in this one (this rank's own entry: nothing arrives at
// it or waits on it).
__device__ __forceinline__ void advanceExpected(const MoeParams& p, std::uint32_t live) {
#pragma unroll 1  // over ranks: no copies of the body (code a cold SM fetches)
  for (int q = 0; q < p.shape.numRanks; ++q) {
    if (isLive(live, q)) p.latency.expected[q] += static_cast<std::uint32_t>(p.grid.budgetCtas);
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
//
// A whole launch's CTAs [0, G) send and its CTAs [G, G + E) receive from the start, where the
// receivers' first items cover the capacity; else every CTA sends, then
// receives (dispatchKernel; a send half sends, a receive half receives). The
// payload of a record travels as 128-byte lines, the step's tag word last (the pieces' order under
// "the payload's 128-byte lines" below), each line stored and loaded by eight lanes of one warp
// instruction (a reader that sees its tag word holds
// the line: NCCL's LL128 layout, docs/DESIGN.md); its metadata as flagged lines, each stored whole
// (st.volatile.v4) with the step's tag beside 4 bytes in each 8-byte half (moeLatencyRecordBytes).
// No fence, no arrival counter: each record is expanded as soon as its own lines are there. The receiver keeps the
// plain metadata at the slot's metaOff for the combine. Work goes in warp items of kChunkValues
// values of one record, dealt over the sending warps (the CTAs first), and over the receivers'.

constexpr int kWarps = kThreads / 32;
constexpr int kChunkValues = kMoeLatencyChunkValues;  // bf16: two 16-byte pieces a lane; fp8: four tiles, 8 lanes each
static_assert(kChunkValues == 512, "Share, putLines and shareFromLines hold a chunk as two bf16 pieces or one fp8 tile a lane");
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ int rowChunks(const MoeParams& p) { return (p.shape.hidden + kChunkValues - 1) / kChunkValues; }

// Record slot i of source `src` at `parity` in rank r's heap.
__device__ __forceinline__ char* recordSlot(const MoeParams& p, int r, int parity, int src, int i) {
  return p.peers.userRegions[r] + p.peers.recordsOff + llSlot(p, parity, src, i, p.shape.recordBytes);
}
// A slot seen as a record whose header moeRecordHeader finds at the slot's plain metadata: what
// moeWriteRecordMeta writes and the combine's record helpers read.
__device__ __forceinline__ char* recordView(const MoeParams& p, char* slot) {
  return slot + p.latency.metaOff - p.shape.payloadBytes;
}
template <bool kFp8>
__device__ __forceinline__ uint4* metaLines(const MoeParams& p, char* slot) {
  return reinterpret_cast<uint4*>(slot + moeLatencyPayloadLineBytes(p.shape.hidden, kFp8));
}
// Chunk c's 128-byte lines in a slot, as 16-byte pieces (moeLatencyChunkLines; the pieces' order
// is under "the payload's 128-byte lines" below).
template <bool kFp8>
__device__ __forceinline__ uint4* chunkLines(const MoeParams& p, char* slot, int c) {
  return reinterpret_cast<uint4*>(slot) + static_cast<std::uint64_t>(c) * moeLatencyChunkLines(kFp8);
}

// Polls `at` until it carries `tag`, bounded, and returns the line (not ready: it never came, and
// the timeout is recorded: a record that never lands fails the operation, as a missing count word
// does). Out of line: called only for a line that had not landed when first read.
__device__ __noinline__ uint4 waitLine(const MoeParams& p, const uint4* at, std::uint32_t tag, int src) {
  uint4 v;
  boundedPoll(
      p.peers.sync,
      [&](std::uint32_t* o) {
        v = ptx::ldVolatileV4(at);
        *o = v.y;
        return flaggedLineReady(v, tag);
      },
      tag, src, WaitSite::kMoeDispatch, at);
  return v;
}
// `v` (read from `at`) once it carries `tag`; false when it never came.
__device__ __forceinline__ bool landed(const MoeParams& p, const uint4* at, std::uint32_t tag, int src, uint4& v) {
  if (!flaggedLineReady(v, tag)) v = waitLine(p, at, tag, src);
  return flaggedLineReady(v, tag);
}

// This lane's share of chunk c of a row: bf16, pieces 64c + lane and 64c + 32 + lane (16 bytes, 8
// values each); fp8, tile 4c + lane / 8: its e4m3 bytes [16 sub, 16 sub + 16) (sub = lane % 8) and
// its scale. has[j]: piece j exists (fp8: piece 0 alone; uniform across a tile's 8 lanes).
struct Share {
  uint4 v[2];
  float scale;
  bool has[2];
};
template <bool kFp8>
__device__ __forceinline__ Share emptyShare(const MoeParams& p, int c, int lane) {
  Share s{};
  if (kFp8) {
    s.has[0] = 4 * c + lane / 8 < p.shape.hidden / static_cast<int>(kFp8TileValues);
  } else {
    s.has[0] = 64 * c + lane < p.shape.hidden / 8;
    s.has[1] = 64 * c + 32 + lane < p.shape.hidden / 8;
  }
  return s;
}
// Token t's share as loaded from x: bf16 as it is, the caller's e4m3 bytes and scales
// (input.xIsFp8), or the bf16 values of the lane's 16 values that finishShare quantises to fp8 (the
// engine's tiles). Apart from finishShare so that a warp can issue the load early and use it later.
template <bool kFp8>
__device__ __forceinline__ Share loadShare(const MoeParams& p, int t, int c, int lane) {
  Share s = emptyShare<kFp8>(p, c, lane);
  const std::uint64_t H = static_cast<std::uint64_t>(p.shape.hidden);
  if (kFp8) {
    const int tile = 4 * c + lane / 8, sub = lane % 8;
    if (!s.has[0]) return s;
    if (p.input.xIsFp8) {
      s.v[0] = *reinterpret_cast<const uint4*>(moeCallerFp8Row(p, t) + static_cast<std::uint64_t>(tile) * kFp8TileValues + sub * 16);
      s.scale = moeCallerFp8Scales(p, t)[static_cast<std::int64_t>(tile) * p.input.scaleHiddenStride];
    } else {
      const auto* at = reinterpret_cast<const uint4*>(static_cast<const char*>(p.input.x) + static_cast<std::uint64_t>(t) * H * 2 +
                                                      static_cast<std::uint64_t>(tile) * kFp8TileSrcBytes + sub * 32);
      s.v[0] = at[0];
      s.v[1] = at[1];  // has[1] stays false: the fp8 share is v[0] alone once quantised
    }
    return s;
  }
  const auto* row = reinterpret_cast<const uint4*>(p.input.x) + static_cast<std::uint64_t>(t) * (H / 8);
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    if (s.has[j]) s.v[j] = row[64 * c + 32 * j + lane];
  }
  return s;
}
// The loaded share ready to send: the engine's fp8 tile quantised (8 lanes a tile).
template <bool kFp8>
__device__ __forceinline__ Share finishShare(const MoeParams& p, Share s) {
  if (kFp8 && !p.input.xIsFp8 && s.has[0]) {
    const Fp8TileWide q = Fp8TileWide::quantize(s.v[0], s.v[1], p.input.scaleFormat != kMoeScaleFloat);
    s.v[0] = q.q;
    s.scale = q.scale;
  }
  return s;
}
template <bool kFp8>
__device__ __forceinline__ Share shareFromX(const MoeParams& p, int t, int c, int lane) { return finishShare<kFp8>(p, loadShare<kFp8>(p, t, c, lane)); }

// --- the payload's 128-byte lines ---------------------------------------------------------------
// A chunk as a warp holds it (Share) is a chunk of lines (kernels/moe/lines.cuh): fp8, one round
// (lane L's v[0], the bytes 16 (L % 8) .. of tile L / 8) and the tiles' scales; bf16, two rounds
// (lane L's v[j], piece 64 c + 32 j + L).
template <bool kFp8>
constexpr int kChunkRounds = moeLatencyChunkRounds(kFp8);

// The share's rounds and its spill piece (moe_lines::spillPiece), made once for every rank
// that takes the chunk.
template <bool kFp8>
struct ShareLines {
  uint4 v[kChunkRounds<kFp8>];
  uint4 spill;
};
template <bool kFp8>
__device__ __forceinline__ ShareLines<kFp8> shareLines(const Share& s, int lane) {
  ShareLines<kFp8> l;
#pragma unroll
  for (int r = 0; r < kChunkRounds<kFp8>; ++r) l.v[r] = s.v[r];
  l.spill = moe_lines::spillPiece<kChunkRounds<kFp8>, kFp8>(l.v, s.scale, lane);
  return l;
}
// The share as chunk c's lines of a record slot (every lane of the warp; a partial last chunk's
// zeros too: the reader checks every line's tag).
template <bool kFp8>
__device__ __forceinline__ void putLines(const MoeParams& p, char* slot, int c, int lane, const ShareLines<kFp8>& l, std::uint32_t tag) {
  moe_lines::storeLines<kChunkRounds<kFp8>>(chunkLines<kFp8>(p, slot, c), lane, l.v, l.spill, tag);
}

// The share from chunk c's lines once every one carries `tag` (moe_lines::readLines). False: a
// line never came (recorded).
template <bool kFp8>
__device__ __forceinline__ bool shareFromLines(const MoeParams& p, char* slot, int c, int lane, std::uint32_t tag, int src, Share& s) {
  s = emptyShare<kFp8>(p, c, lane);
  uint4 v[kChunkRounds<kFp8>];
  if (!moe_lines::readLines<kChunkRounds<kFp8>, kFp8>(p.peers.sync, chunkLines<kFp8>(p, slot, c), lane, tag, src,
                                                       WaitSite::kMoeDispatch, v, s.scale)) {
    return false;
  }
#pragma unroll
  for (int r = 0; r < kChunkRounds<kFp8>; ++r) s.v[r] = v[r];
  return true;
}

// Chunk c's lines and the record's metadata lines of a slot, asked for in L2 (lanes 0 and 1: no
// register, no wait): a later load of them (shareFromLines, expandItem) finds them there.
template <bool kFp8>
__device__ __forceinline__ void prefetchItemLines(const MoeParams& p, char* slot, int c, int lane) {
  if (lane == 0) ptx::prefetchL2(chunkLines<kFp8>(p, slot, c), static_cast<std::uint32_t>(moeLatencyChunkLines(kFp8)) * 16u);
  if (lane == 1) ptx::prefetchL2(metaLines<kFp8>(p, slot), static_cast<std::uint32_t>(1 + 2 * p.shape.topK) * 16u);
}

// The share into recv_x at the row of every lane in `kept` (its `row`).
template <bool kFp8>
__device__ __forceinline__ void storeRows(const MoeParams& p, unsigned kept, long long row, int c, int lane, const Share& s) {
  const std::uint64_t H = static_cast<std::uint64_t>(p.shape.hidden);
  for (unsigned m = kept; m != 0; m &= m - 1u) {
    const std::uint64_t r = static_cast<std::uint64_t>(__shfl_sync(kFullMask, row, __ffs(m) - 1));
    if (kFp8) {
      const int tile = 4 * c + lane / 8;
      if (!s.has[0]) continue;
      *reinterpret_cast<uint4*>(p.layout.recvX + r * H + static_cast<std::uint64_t>(tile) * kFp8TileValues + (lane % 8) * 16) = s.v[0];
      if (lane % 8 == 0) moeStoreScale(p, r * (H / kFp8TileValues) + tile, s.scale);
    } else {
      auto* out = reinterpret_cast<uint4*>(p.layout.recvX) + r * (H / 8);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        if (s.has[j]) out[64 * c + 32 * j + lane] = s.v[j];
      }
    }
  }
}

// The recv_x rows of a record from source s (token `token`; lane k < topK holding its slot k, expert
// -1: none), as the lanes holding one (`row`) and their ballot. `meta` (one item per record): each
// row's metadata, the rows past the capacity counted; rank-major: the record's one row (`rankRow`,
// lane 0's) and each top-k slot's local expert and weight.
struct Rows {
  unsigned kept;
  long long row;
};
template <MoeRecvLayout kLayout>
__device__ __forceinline__ Rows recordRows(const MoeParams& p, int s, int token, const MoeRecordSlot& slot, const std::int32_t* srcBase,
                                           long long rankRow, bool meta, int lane) {
  const bool valid = slot.localExpert >= 0 && slot.localExpert < p.shape.localExperts;
  if constexpr (kLayout == MoeRecvLayout::kRankMajor) {
    const bool exists = moeRankRowExists(p, rankRow, true, meta ? lane : 1);
    if (meta && exists) {
      if (lane < p.shape.topK) moeStoreRowSlot(p, rankRow, lane, -1, 0.f);
      __syncwarp();
      if (valid && slot.k >= 0 && slot.k < p.shape.topK) moeStoreRowSlot(p, rankRow, slot.k, slot.localExpert, slot.weight);
      if (lane == 0) {
        p.layout.rowSrcRank[rankRow] = s;
        p.layout.rowSrcToken[rankRow] = token;
        p.layout.rowTopkSlot[rankRow] = -1;
        p.layout.rowWeight[rankRow] = 0.f;
      }
    }
    return Rows{exists ? 1u : 0u, rankRow};
  } else {
    const long long pos = valid ? moeSlotRow(p, srcBase, slot) : -1;
    if (meta && pos >= 0) {
      p.layout.rowSrcRank[pos] = s;
      p.layout.rowSrcToken[pos] = token;
      p.layout.rowTopkSlot[pos] = slot.k;
      p.layout.rowWeight[pos] = slot.weight;
    } else if (meta && valid) {
      moeReportDroppedRow(p, static_cast<long long>(srcBase[slot.localExpert]) + slot.index);
    }
    return Rows{__ballot_sync(kFullMask, pos >= 0), pos};
  }
}

// The CTAs of a part that expand records: every one but CTA 0, which publishes the layout (all of
// them when there is one); cta -1: none.
__device__ __forceinline__ Part itemPart(Part part) {
  return part.ctas == 1 ? part : Part{part.cta - 1, part.ctas - 1};
}

// The routing of this rank's tokens in shared memory (every sending CTA holds all of it).
struct Routing {
  std::int32_t* ids;       // [T_max * K], -1: none
  float* weights;          // [T_max * K]
  std::uint32_t* expBits;  // [E][W]: tokens per expert
  std::uint32_t* dstBits;  // [R][W]: tokens per rank
  int W;                   // words of a bit row: ceil(T_max / 32)
  bool anyDup;
  // Entries of expert e before token t (and before slot k of t): a popcount unless some token
  // holds an expert twice, then an exact count over the tokens holding e.
  __device__ int entriesBefore(int e, int t, int k, int K) const {
    const std::uint32_t* bits = expBits + e * W;
    if (!anyDup) return popcBelow(bits, t);
    int c = 0;
#pragma unroll 1  // the rare path (a token holding an expert twice): no copies of the body
    for (int u = 0; u < t; ++u) {
      if ((bits[u >> 5] >> (u & 31)) & 1u) {
#pragma unroll 1
        for (int kk = 0; kk < K; ++kk) c += ids[u * K + kk] == e;
      }
    }
#pragma unroll 1
    for (int kk = 0; kk < k; ++kk) c += ids[t * K + kk] == e;
    return c;
  }
  __device__ bool goesTo(int r, int t) const { return (dstBits[r * W + (t >> 5)] >> (t & 31)) & 1u; }
};

// Every thread of the CTA: routes the T live tokens' entries (invalid ids: -1, counted by CTA 0;
// entries of a rank outside the mask: -1, counted per rank). Ends with the CTA synchronised.
__device__ Routing routeTokens(const MoeParams& p, char* sm, Part part, std::uint32_t live, int T) {
  const MoeLatencySmem lay = moeLatencySmem(p.shape.maxTokens, p.shape.topK, p.shape.numExperts, p.shape.numRanks);
  __shared__ int dup;
  const int tid = static_cast<int>(threadIdx.x), K = p.shape.topK, R = p.shape.numRanks, L = p.shape.localExperts;
  Routing rt{reinterpret_cast<std::int32_t*>(sm + lay.ids), reinterpret_cast<float*>(sm + lay.weights),
             reinterpret_cast<std::uint32_t*>(sm + lay.expBits), reinterpret_cast<std::uint32_t*>(sm + lay.dstBits),
             (p.shape.maxTokens + 31) / 32, false};
  for (int w = tid; w < (p.shape.numExperts + R) * rt.W; w += kThreads) rt.expBits[w] = 0;  // and dstBits
  if (tid == 0) dup = 0;
  __syncthreads();
  // kBatch entries a thread at a time, every load issued before any is used (one round trip for
  // up to kBatch x kThreads entries; 4 spilled more of the kernel).
  constexpr int kBatch = 2;
  const int entries = T * K;
  for (int e0 = tid; e0 < entries; e0 += kBatch * kThreads) {
    long long ids[kBatch];
    float weights[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int e = e0 + b * kThreads;
      ids[b] = e < entries ? moeReadId(p, static_cast<std::uint64_t>(e)) : -1;
      weights[b] = e < entries ? moeWeightOf(p, static_cast<std::uint64_t>(e)) : 0.f;
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int e = e0 + b * kThreads;
      if (e >= entries) break;
      const long long id = ids[b];
      const bool known = moeValidId(p, id);
      if (!known && id != -1 && part.cta == 0) moeReportInvalidId(p, id, e / K, e % K);
      const bool valid = known && isLive(live, static_cast<int>(id / L));  // its rank takes part
      if (known && !valid && part.cta == 0) atomicAdd(&p.state.status->maskedEntries[id / L], 1ull);
      rt.ids[e] = valid ? static_cast<std::int32_t>(id) : -1;
      rt.weights[e] = weights[b];
      if (valid) {
        const int t = e / K;
        const std::uint32_t bit = 1u << (t & 31);
        if (atomicOr(&rt.expBits[id * rt.W + (t >> 5)], bit) & bit) dup = 1;  // the token holds it twice
        atomicOr(&rt.dstBits[(id / L) * rt.W + (t >> 5)], bit);
      }
    }
  }
  __syncthreads();
  rt.anyDup = dup != 0;
  return rt;
}

// Token t's metadata as flagged lines into the slot of rank r (a warp; lane k < K its slot k):
// the header {token, slots}, then each position's {local expert, index}, {weight, k}, the slots
// whose experts live on r first in slot order, the positions after them empty (expert -1), so
// that the reader polls K fixed positions.
__device__ __forceinline__ void putMetaLines(const MoeParams& p, const Routing& rt, uint4* lines, int r, int t, int lane,
                                             std::uint32_t tag) {
  const int K = p.shape.topK, L = p.shape.localExperts;
  const int id = lane < K ? rt.ids[t * K + lane] : -1;
  const bool here = id >= 0 && id / L == r;
  const unsigned m = __ballot_sync(kFullMask, here);
  const int n = __popc(m);
  if (here) {
    const int at = 1 + 2 * __popc(m & ((1u << lane) - 1u));
    ptx::stVolatileV4(lines + at, flaggedLine(static_cast<std::uint32_t>(id % L), static_cast<std::uint32_t>(rt.entriesBefore(id, t, lane, K)), tag));
    ptx::stVolatileV4(lines + at + 1, flaggedLine(__float_as_uint(rt.weights[t * K + lane]), static_cast<std::uint32_t>(lane), tag));
  }
  if (lane >= n && lane < K) {
    ptx::stVolatileV4(lines + 1 + 2 * lane, flaggedLine(~0u, 0u, tag));
    ptx::stVolatileV4(lines + 2 + 2 * lane, flaggedLine(0u, ~0u, tag));
  }
  if (lane == 31) ptx::stVolatileV4(lines, flaggedLine(static_cast<std::uint32_t>(t), static_cast<std::uint32_t>(n), tag));
}

// The send: routing, count messages, then every record (this rank's own among them).
// `start`: the words the send starts from, loaded together at the kernel's start.
struct SendStart {
  std::uint32_t live;  // the operation's ranks (dispatchMask)
  std::uint32_t step;
  int rawTokens;  // *input.numTokens as read (moeClampTokens)
};
template <bool kFp8>
__device__ void dispatchSend(const MoeParams& p, char* sm, Part part, const SendStart& start) {
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const int K = p.shape.topK, R = p.shape.numRanks, L = p.shape.localExperts, me = p.shape.rank;
  const std::uint32_t live = start.live, step = start.step, tag = moeCountTag(step);
  const int parity = static_cast<int>(step & 1u);
  const MoeStamp stamp(p, MoeKernel::kLatencyDispatch);
  if (part.cta == 0 && tid == 0) moeCheckPairing(p, true);
  const int T = moeClampTokens(p, start.rawTokens, part.cta == 0 && tid == 0);
  // The items (below): a token's metadata lines are an item of their own, warps [0, T), where every
  // item then has a warp (metaItems T), else chunk 0's item writes them too (metaItems 0); the
  // payload items (token, chunk) follow. The warp's first payload item loaded from x now, used
  // after the routing: its round trip runs beside the routing's loads.
  const int chunks = rowChunks(p), gw = warp * part.ctas + part.cta, warps = part.ctas * kWarps;
  const int items = T * chunks, metaItems = T + items <= warps ? T : 0;
  const int firstPayload = gw < metaItems ? items : gw - metaItems;
  const Share first = firstPayload < items ? loadShare<kFp8>(p, firstPayload / chunks, firstPayload % chunks, lane)
                                           : emptyShare<kFp8>(p, 0, lane);
  const Routing rt = routeTokens(p, sm, part, live, T);
  const int W = rt.W;
  // Count messages first (they travel ahead of the payload): CTA c takes ranks c, c + ctas, ...
  // Each word carries its count tagged with the step (moeTaggedCount), stored whole, so the
  // receiver waits on the words themselves: no fence, no flag to order them by. The flag is
  // still stored after them (the CTA's barrier between), for checkHealth's account of a stall
  // alone (nothing waits on it).
#pragma unroll 1  // over ranks: no copies of the body (code a cold SM fetches)
  for (int r = part.cta; r < R; r += part.ctas) {
    if (!isLive(live, r)) continue;  // the same r in every thread
    auto* msg = reinterpret_cast<std::uint64_t*>(p.peers.userRegions[r] + p.peers.countMsgsOff +
                                                 (static_cast<std::uint64_t>(parity) * R + me) * p.shape.countMsgBytes);
    for (int j = tid; j < L; j += kThreads) ptx::stRelaxedSys64(msg + 1 + j, moeTaggedCount(step, rt.entriesBefore(r * L + j, T, 0, K)));
    if (tid == 0) ptx::stRelaxedSys64(msg, moeTaggedCount(step, popcBelow(rt.dstBits + r * W, T)));
    __syncthreads();
    if (tid == 0) {
      ptx::stRelaxedSys(peerCounter(p, r, p.peers.countFlagsOff) + me, step + 1u);
      moeTrace(p, 0, step, MoeTraceEvent::kPosted, 0, true);
    }
  }
  // Each token's index in each destination's list, for the combine of this dispatch.
  if (part.cta == part.ctas - 1) {
    for (int n = tid; n < T * R; n += kThreads) {
      const int t = n / R, r = n % R;
      p.routing.tokenRankIndex[n] = rt.goesTo(r, t) ? popcBelow(rt.dstBits + r * W, t) : -1;
    }
  }
  const MoeStamp records(p, MoeKernel::kLatencyRecords);
  // Every record: a metadata item writes token t's metadata lines into each destination's slot;
  // a payload item (token, chunk) reads its share once (fp8: quantised once) for every rank that
  // takes the token, this one included (its own slot, as lines like a peer's: its receive reads
  // every source's records one way); with no metadata items chunk 0's also writes the metadata.
  // Items go over every warp of the send part, the CTAs first. Apart, the metadata no longer
  // follows chunk 0's payload in the chunk-0 CTAs (every chunks-th CTA where the chunks divide the
  // CTAs), which then ended last while every reader of a record waits for its metadata.
  // Token t's record slot in rank r's heap (its index in r's list).
  const auto slotOf = [&](int r, int t) { return recordSlot(p, r, parity, me, popcBelow(rt.dstBits + r * W, t)); };
  if (gw < metaItems) {
    const int t = gw;
#pragma unroll 1  // over ranks: no copies of the body (code a cold SM fetches)
    for (int r = 0; r < R; ++r) {
      if (rt.goesTo(r, t)) putMetaLines(p, rt, metaLines<kFp8>(p, slotOf(r, t)), r, t, lane, tag);
    }
  }
  for (int item = firstPayload; item < items; item += warps) {
    const int t = item / chunks, c = item % chunks;
    bool any = false;
#pragma unroll 1  // over ranks: no copies of the body (code a cold SM fetches)
    for (int r = 0; r < R; ++r) any = any || rt.goesTo(r, t);
    if (!any) continue;  // uniform across the warp
    const ShareLines<kFp8> s = shareLines<kFp8>(item == firstPayload ? finishShare<kFp8>(p, first) : shareFromX<kFp8>(p, t, c, lane), lane);
#pragma unroll 1  // over ranks: no copies of the body (code a cold SM fetches)
    for (int r = 0; r < R; ++r) {
      if (!rt.goesTo(r, t)) continue;
      char* slot = slotOf(r, t);
      putLines<kFp8>(p, slot, c, lane, s, tag);
      if (c == 0 && metaItems == 0) putMetaLines(p, rt, metaLines<kFp8>(p, slot), r, t, lane, tag);
    }
  }
  if (tid == 0) moeTrace(p, 0, step, MoeTraceEvent::kSent, 0, true);
}

// Source q's count message of the step's parity in this rank's heap.
__device__ __forceinline__ const std::uint64_t* latencyMsg(const MoeParams& p, int parity, int q) {
  return reinterpret_cast<const std::uint64_t*>(p.peers.userRegions[p.shape.rank] + p.peers.countMsgsOff +
                                                (static_cast<std::uint64_t>(parity) * p.shape.numRanks + q) * p.shape.countMsgBytes);
}

// Whether a tagged word (moeTaggedCount: the tag in the high half beside a value) carries `tag`,
// its last read in `seen`. `wait`: polled until it does, bounded (boundedPoll: `peer` and `site`
// name the wait; ownTimeout and quiet as there); else one look, nothing waited for or reported.
__device__ __forceinline__ bool taggedWordIn(const MoeParams& p, const std::uint64_t* word, std::uint32_t tag, bool wait, int peer,
                                             WaitSite site, bool ownTimeout, bool quiet, std::uint64_t& seen) {
  const auto poll = [&](std::uint32_t* v) {
    seen = ptx::ldRelaxedSys64(word);
    *v = static_cast<std::uint32_t>(seen >> 32);
    return *v == tag;
  };
  if (!wait) {
    std::uint32_t v = 0;
    return poll(&v);
  }
  return boundedPoll(p.peers.sync, poll, tag, peer, site, word, ownTimeout, quiet);
}

// Every thread of the CTA: waits until each word of every live source's count message of this
// step carries its tag (moeCountTag, the sender's moeTaggedCount). A source whose words do not
// come is masked (shrink on timeout: `masked`, the receive's word; a thread skips the words of a
// source already masked, so that a dead source costs one timeout, not one per round of words) or
// reported. Each word read goes to copy[q * (1 + E_local) + j] (the receive's layout reads those;
// a source outside the mask or already masked: zeros).
// True when every live source's message came (the same in every thread). `once` (a helper of a
// receive half, masked nullptr): each word read once, nothing waited for or reported; true when
// every word carried its tag.
__device__ bool waitTaggedCounts(const MoeParams& p, int parity, std::uint32_t step, std::uint32_t live, std::uint32_t* masked,
                                 std::uint64_t* copy, bool once = false) {
  const int words = 1 + p.shape.localExperts, R = p.shape.numRanks;
  const std::uint32_t tag = moeCountTag(step);
  bool failed = false;
  for (int n = static_cast<int>(threadIdx.x); n < R * words; n += kThreads) {
    const int q = n / words;
    if (!isLive(live, q) || (masked != nullptr && isLive(ptx::ldRelaxedSys(masked), q))) {
      copy[n] = 0;  // a source left out sent nothing: zeros, so the layout leaves it out
      continue;
    }
    const bool ok = taggedWordIn(p, latencyMsg(p, parity, q) + n % words, tag, !once, q, WaitSite::kMoeDispatch, false,
                                 masked != nullptr, copy[n]);
    if (!ok && masked != nullptr) {
      maskAfterTimeout(p, masked, q);  // shrink on timeout: masked, not an error
    } else if (!ok) {
      failed = true;
    }
  }
  return __syncthreads_or(failed) == 0;
}

// Source q's send CTA c in step `step` (parity) has started: its word, in this rank's heap.
__device__ __forceinline__ std::uint64_t* placedWord(const MoeParams& p, int r, int parity, int q, int c) {
  return reinterpret_cast<std::uint64_t*>(p.peers.userRegions[r] + p.latency.placedOff) +
         (static_cast<std::uint64_t>(parity) * p.shape.numRanks + q) * kMoeMaxPlacedCtas + c;
}

// Every thread of every CTA of a sending launch (a split launch's receivers too: a peer's receive
// half checks every CTA below gridDim), at its start: this CTA has started, told to every rank taking
// part (its word for this rank and this CTA: the step's tag beside the launch's CTAs). Relaxed: it
// orders nothing, it only says the CTA runs.
__device__ __forceinline__ void postPlaced(const MoeParams& p, std::uint32_t step, std::uint32_t live) {
  const int r = static_cast<int>(threadIdx.x), c = static_cast<int>(blockIdx.x);
  if (r < p.shape.numRanks && c < kMoeMaxPlacedCtas && isLive(live, r)) {
    ptx::stRelaxedSys64(placedWord(p, r, static_cast<int>(step & 1u), p.shape.rank, c), moeTaggedCount(step, gridDim.x));
  }
}

// Every thread of a receive half's helper CTA (dispatchReceive), after every count word came:
// whether every send CTA of every live source has started, each word read once (none waited for).
// Then every line this receive waits for comes from a send that runs, and a send waits for nothing.
__device__ bool sendersPlaced(const MoeParams& p, int parity, std::uint32_t step, std::uint32_t live) {
  const std::uint32_t tag = moeCountTag(step);
  bool missing = false;
  for (int n = static_cast<int>(threadIdx.x); n < p.shape.numRanks * kMoeMaxPlacedCtas; n += kThreads) {
    const int q = n / kMoeMaxPlacedCtas, c = n % kMoeMaxPlacedCtas;
    if (!isLive(live, q)) continue;
    const std::uint64_t first = ptx::ldRelaxedSys64(placedWord(p, p.shape.rank, parity, q, 0));
    const std::uint64_t mine = ptx::ldRelaxedSys64(placedWord(p, p.shape.rank, parity, q, c));
    const std::uint32_t ctas = static_cast<std::uint32_t>(first);
    const bool known = static_cast<std::uint32_t>(first >> 32) == tag && ctas <= static_cast<std::uint32_t>(kMoeMaxPlacedCtas);
    missing = missing || !known || (static_cast<std::uint32_t>(c) < ctas && static_cast<std::uint32_t>(mine >> 32) != tag);
  }
  return __syncthreads_or(missing) == 0;
}

// One warp item of the receive: chunk c of record i from source s (this rank's own or a peer's:
// payload and metadata as lines, waited for). Chunk 0 writes the rows' metadata and the record's
// plain metadata, for the combine. False: a line never came.
template <bool kFp8, MoeRecvLayout kLayout>
__device__ bool expandItem(const MoeParams& p, int parity, std::uint32_t tag, int s, int i, int c, const std::int32_t* srcBase,
                           long long rankRow, int lane) {
  const int K = p.shape.topK;
  char* slot = recordSlot(p, p.shape.rank, parity, s, i);
  char* view = recordView(p, slot);
  const uint4* ml = metaLines<kFp8>(p, slot);
  uint4 a = make_uint4(0u, 0u, 0u, 0u), b = a;
  const int at = lane == 31 ? 0 : 1 + 2 * lane;  // lane 31: the header {token, slots}
  if (lane < K || lane == 31) {
    a = ptx::ldVolatileV4(ml + at);
    if (lane < K) b = ptx::ldVolatileV4(ml + at + 1);
  }
  Share share;
  bool ok = shareFromLines<kFp8>(p, slot, c, lane, tag, s, share);
  if (lane < K || lane == 31) ok = ok && landed(p, ml + at, tag, s, a);
  if (lane < K) ok = ok && landed(p, ml + at + 1, tag, s, b);
  if (!__all_sync(kFullMask, ok)) return false;
  const int token = static_cast<int>(__shfl_sync(kFullMask, a.x, 31));
  const int nslots = min(static_cast<int>(__shfl_sync(kFullMask, a.z, 31)), K);
  MoeRecordSlot laneSlot{-1, 0, 0.f, 0};
  if (lane < nslots) {
    laneSlot = MoeRecordSlot{static_cast<std::int32_t>(a.x), static_cast<std::int32_t>(a.z), __uint_as_float(b.x), static_cast<std::int32_t>(b.z)};
  }
  if (c == 0) {  // the combine's copy
    auto* plainSlots = reinterpret_cast<MoeRecordSlot*>(view + p.shape.payloadBytes + sizeof(MoeRecordHeader));
    if (lane < nslots) plainSlots[lane] = laneSlot;
    if (lane == 0) *reinterpret_cast<MoeRecordHeader*>(view + p.shape.payloadBytes) = MoeRecordHeader{token, nslots, {0, 0}};
  }
  const Rows rows = recordRows<kLayout>(p, s, token, laneSlot, srcBase, rankRow, c == 0, lane);
  storeRows<kFp8>(p, rows.kept, rows.row, c, lane, share);
  return true;
}

// Source s's items in the receive (its records x chunks; none from a source left out).
template <class MsgOf>
__device__ __forceinline__ int sourceItems(const MoeParams& p, MsgOf msgOf, std::uint32_t live, int chunks, int s) {
  return isLive(live, s) ? moeMsgRecords(p, msgOf(s)) * chunks : 0;
}

// Item g of the receive's order (every source's items, this rank's own first, then source by
// source from the next rank on): its source s (-1 past the last item) and g made its index among
// s's items.
template <class MsgOf>
__device__ __forceinline__ int itemSource(const MoeParams& p, MsgOf msgOf, std::uint32_t live, int chunks, int& g) {
#pragma unroll 1  // over ranks: no copies of the body (code a cold SM fetches)
  for (int k = 0; k < p.shape.numRanks; ++k) {
    const int s = (p.shape.rank + k) % p.shape.numRanks;
    const int n = sourceItems(p, msgOf, live, chunks, s);
    if (g < n) return s;
    g -= n;
  }
  return -1;
}

// The receive: the layout once every source's count words are in, then every record's chunks.
// `part`: this CTA among the receivers (cta -1: a helper). A split launch's receivers are CTAs [G,
// G + E): they wait for the count words from the launch's start, while CTAs [0, G) send; each send
// CTA then passes through as a helper that waits for the words like a receiver (the whole launch is
// resident: the CTA plan's G + E) and, the receivers' first items taking every item there, finds
// none left. A whole launch that does not split receives on every CTA. A receive half alone runs on
// G + E CTAs, of which CTAs [0, E) are the receivers and the G others helpers that look once
// (`lookOnce`): at the count words and at every send CTA's start (postPlaced), and take part only
// if every one is in: every CTA of every sender's launch has then started, and a send waits for
// nothing, so every line the helper waits for comes without any other kernel's room (a count word
// alone proves only that the one CTA that posts it started). Else it leaves at once: so a receive
// half that waits for a peer holds no more than E CTAs, and another engine's send half on another
// stream keeps its room (the CTA plan's E + G). With shrink on timeout every helper leaves at once:
// a source masked after a timeout is settled among the receivers only. Items: the receivers'
// expanding warps take one each first (item gw, the CTAs first; this rank's own items come first);
// where items are left past those, every expanding warp then claims the next from the launch's
// counter (kMoeItemClaims) until none is left, the next claim asked for beside the current item's
// loads.
template <bool kFp8, MoeRecvLayout kLayout>
__device__ void dispatchReceive(const MoeParams& p, char* smRaw, Part part, bool lookOnce, std::uint32_t live) {
  __shared__ std::int32_t counts[kMoeMaxLocalExperts];
  __shared__ std::int32_t offsets[kMoeMaxLocalExperts + 1];
  __shared__ MoeLayoutScratch<kThreads> scratch;
  const MoeLatencySmem lay = moeLatencySmem(p.shape.maxTokens, p.shape.topK, p.shape.numExperts, p.shape.numRanks);
  auto* srcBase = reinterpret_cast<std::int32_t*>(smRaw + lay.srcBase);  // [R][E_local]
  auto* msgs = reinterpret_cast<std::uint64_t*>(smRaw + lay.msgs);         // [R][1 + E_local]: the count words
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const int R = p.shape.numRanks, L = p.shape.localExperts, me = p.shape.rank;
  const std::uint32_t step = p.peers.steps[0], tag = moeCountTag(step);
  const int parity = static_cast<int>(step & 1u);
  // Every message from the copy in shared memory: a source outside the mask sent nothing, and its
  // words read as zeros there (waitTaggedCounts), so the layout leaves it out.
  auto msgOf = [&](int q) { return MoeSharedMsg{msgs + q * (1 + L)}; };
  std::uint32_t* masked = shrinkWords(p, 0);  // the dispatch's (the receive part's ranks first), or nullptr
  const bool helper = part.cta < 0;
  if (helper && masked != nullptr) return;  // shrink on timeout: the receivers settle a masked source
  const int chunks = rowChunks(p);
  const Part items = helper ? Part{-1, 0} : itemPart(part);  // CTA 0 publishes the layout and expands nothing
  // 32-bit: a source's items are at most maxTokens x chunks, every source's at most R times that.
  const int gw = items.cta >= 0 ? warp * items.ctas + items.cta : -1;
  const int firstClaimed = itemPart(Part{0, part.ctas}).ctas * kWarps;  // the receivers' first items
  // This warp's first item (this rank's own record gw / chunks, its chunk gw % chunks: the first it
  // expands) asked for in L2 before the count words, so that its lines come from memory while
  // they do (a record past this step's count is asked for and never read: nothing else).
  if (gw >= 0 && isLive(live, me) && gw < p.shape.maxTokens * chunks) {
    prefetchItemLines<kFp8>(p, recordSlot(p, me, parity, me, gw / chunks), gw % chunks, lane);
  }
  bool counted = false;
  {
    const MoeStamp stamp(p, MoeKernel::kLatencyReceive);
    counted = waitTaggedCounts(p, parity, step, live, masked, msgs, lookOnce);
    if (lookOnce) counted = counted && sendersPlaced(p, parity, step, live);
    if (helper && !counted) return;  // a sender has not started yet (or a word never came: reported)
    if (part.cta == part.ctas - 1 && tid == 0) moeTrace(p, 0, step, MoeTraceEvent::kLayout);
    if (masked != nullptr) {
      // Shrink on timeout: a source whose count message never came is left out like one outside
      // the mask (its words zeroed: a thread may have read some before the timeout).
      live &= ~settleMasked(p, masked, part.ctas, WaitSite::kMoeDispatch);
      for (int n = tid; n < R * (1 + L); n += kThreads) {
        if (!isLive(live, n / (1 + L))) msgs[n] = 0;
      }
      __syncthreads();
    }
    if (counted) {
      moeComputeOffsets<kThreads, decltype(msgOf), kLayout == MoeRecvLayout::kBatched ? 1 : 0>(p, msgOf, counts, offsets, scratch);
      moeComputeSourceBases<kThreads>(p, msgOf, offsets, srcBase);
      if (part.cta == 0) moePublishLayout<kThreads>(p, msgOf, counts, offsets, srcBase, scratch);  // copies srcBase out
    }
  }
  bool ok = counted;
  if (counted && (helper || items.cta >= 0)) {
    const MoeStamp stamp(p, MoeKernel::kLatencyExpand);
    std::uint32_t* claims = p.peers.lastCtaCounters + kMoeItemClaims + parity;  // this parity's (kMoeItemClaims)
    int total = 0;  // every live source's items
#pragma unroll 1  // over ranks: no copies of the body (code a cold SM fetches)
    for (int q = 0; q < R; ++q) total += sourceItems(p, msgOf, live, chunks, q);
    // Claims only where the receivers' first items leave some over: a claim is an atomic on one
    // word that every expanding warp would otherwise add to at once (L2 serialises them).
    const bool claimable = total > firstClaimed;
    int g = claimable || !helper ? gw : total;
    if (helper && claimable) {  // a helper's first item is claimed
      unsigned first = 0;
      if (lane == 0) first = atomicAdd(claims, 1u);
      g = firstClaimed + static_cast<int>(__shfl_sync(kFullMask, first, 0));
    }
    for (bool own = true; g < total && ok; own = false) {
      unsigned next = 0;
      if (claimable && lane == 0) next = atomicAdd(claims, 1u);  // relaxed: it only hands out items
      int idx = g;
      const int s = itemSource(p, msgOf, live, chunks, idx);
      if (s < 0) break;  // (g < total: not reached)
      const int i = idx / chunks, c = idx % chunks;
      const long long rankRow = kLayout == MoeRecvLayout::kRankMajor ? moeRankBase(p, msgOf, s) + i : -1;
      ok = expandItem<kFp8, kLayout>(p, parity, tag, s, i, c, srcBase + s * L, rankRow, lane);
      // The first expanding CTA's first own item done (the latest of its warps).
      if (own && s == me && items.cta == 0 && lane == 0) moeTrace(p, 0, step, MoeTraceEvent::kOwnDone0, 0, true);
      g = claimable ? firstClaimed + static_cast<int>(__shfl_sync(kFullMask, next, 0)) : total;
    }
  }
  // After this CTA's last wait on another rank, not before: the stream's next kernel (the next
  // operation, or a caller's programmatic dependent) may then be placed while this one ends.
  // Placed earlier, it could hold the SMs that another engine's or another rank's send needs while
  // this receive waits for it (a cycle across GPUs).
  __syncthreads();
  ptx::launchDependents();
  if (tid == 0) {
    moeTrace(p, 0, step, MoeTraceEvent::kArrived, 0, true);
    if (itemPart(part).cta == 0) moeTrace(p, 0, step, MoeTraceEvent::kArrived0);  // the first expanding CTA
    moeTrace(p, 0, step, MoeTraceEvent::kReceived, 0, true);
  }
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
// one part: every CTA runs it. (The combine's parts.)
__device__ __forceinline__ Part sendPart(const MoeParams& p) {
  const bool sends = (p.latency.phase & kMoeLatencySend) != 0 && static_cast<int>(blockIdx.x) < p.grid.budgetCtas;
  return Part{sends ? static_cast<int>(blockIdx.x) : -1, p.grid.budgetCtas};
}
__device__ __forceinline__ Part receivePart(const MoeParams& p) {
  const int first = (p.latency.phase & kMoeLatencySend) != 0 ? p.grid.budgetCtas : 0;
  const bool receives = (p.latency.phase & kMoeLatencyReceive) != 0 && static_cast<int>(blockIdx.x) >= first;
  return Part{receives ? static_cast<int>(blockIdx.x) - first : -1, p.grid.epilogueCtas};
}

// A receiving launch asks L2 at its start for the words its receive reads whatever the step: both
// parities' count messages and the end counter (lastBlock's). A receive half runs after other work
// (DeepEP's hook after a GEMM) that has evicted them: their loads then find them in L2, not
// memory, and the step's own load goes out beside these requests (hints: no register, no wait).
__device__ __forceinline__ void askForReceiveWords(const MoeParams& p) {
  if (blockIdx.x != 0 || threadIdx.x >= 32) return;
  if (threadIdx.x == 0) {
    ptx::prefetchL2(p.peers.userRegions[p.shape.rank] + p.peers.countMsgsOff,
                    static_cast<std::uint32_t>(2 * p.shape.numRanks * p.shape.countMsgBytes));
  } else if (threadIdx.x == 1) {
    const auto at = reinterpret_cast<std::uintptr_t>(&p.peers.lastCtaCounters[0]) & ~std::uintptr_t{15};
    ptx::prefetchL2(reinterpret_cast<const void*>(at), 16u);
  }
}

// A receive half alone (its records landed while other work ran) asks L2 for this rank's record
// slots of the step's parity, every source's, before it waits for the count words: the launch's
// warps split them, one request a warp. Slots past a source's count are asked for and never read.
__device__ __forceinline__ void askForRecords(const MoeParams& p, int parity) {
  if (threadIdx.x % 32 != 0) return;
  const std::uint64_t bytes = static_cast<std::uint64_t>(p.shape.numRanks) * p.shape.maxTokens * p.shape.recordBytes;
  const std::uint64_t warps = static_cast<std::uint64_t>(gridDim.x) * kWarps;
  const std::uint64_t share = ((bytes + warps - 1) / warps + 15) & ~std::uint64_t{15};
  const std::uint64_t from = (static_cast<std::uint64_t>(blockIdx.x) * kWarps + threadIdx.x / 32) * share;
  if (from >= bytes) return;
  const std::uint64_t n = bytes - from < share ? bytes - from : share;
  ptx::prefetchL2(recordSlot(p, p.shape.rank, parity, 0, 0) + from, static_cast<std::uint32_t>(n));
}

// kFp8: p.shape.fp8 (the wire format), and kLayout: recvLayoutOf(p), fixed at compile time: one
// kernel per format and layout, so that none carries another's code (an SM fetches this kernel's
// code cold on every launch).
template <bool kFp8, MoeRecvLayout kLayout>
__global__ void __launch_bounds__(kThreads) dispatchKernel(const __grid_constant__ MoeParams p) {
  extern __shared__ int4 smemRaw[];
  char* sm = reinterpret_cast<char*>(smemRaw);
  const std::uint64_t entered = p.state.timeline != nullptr ? ptx::globalTimerNs() : 0;
  const bool sends = (p.latency.phase & kMoeLatencySend) != 0, receives = (p.latency.phase & kMoeLatencyReceive) != 0;
  if (receives) askForReceiveWords(p);  // hints, before the wait below: nothing is read
  // The stream's last kernel (often the last operation, which lets it be placed early) has
  // finished and its memory is visible: nothing of this step is read before.
  ptx::gridDependencyWait();
  // A split launch: CTAs [0, G) send, then pass through the receive as helpers; CTAs [G, G + E)
  // receive from the start (dispatchReceive). A whole launch that does not split: every CTA sends,
  // then receives. A send half alone: every CTA sends. A receive half alone: CTAs [0, E) receive,
  // the others help, looking once.
  const int b = static_cast<int>(blockIdx.x), G = p.grid.budgetCtas, E = p.grid.epilogueCtas;
  const Part all{b, static_cast<int>(gridDim.x)};
  // The split only where the receivers' first items take every item the capacity allows: else
  // every CTA sends, then receives (the sends' items over every warp, the receive's after them).
  const bool split = sends && receives && p.shape.maxTokens * rowChunks(p) * p.shape.numRanks <= itemPart(Part{0, E}).ctas * kWarps;
  const Part send = split ? Part{b < G ? b : -1, G} : all;
  const Part receivers = !sends ? Part{b < E ? b : -1, E} : split ? Part{b >= G ? b - G : -1, E} : all;
  // A receive half uses its send half's mask (a caller's kernel may have changed the mask word
  // between the halves); the send half leaves it.
  // The send's words, loaded together before anything is stored (one round trip); a receive half
  // reads neither the mask nor the live count (its send half's mask, in halfLive).
  const SendStart start{sends ? dispatchMask(p) : *p.latency.halfLive, p.peers.steps[0], sends ? *p.input.numTokens : 0};
  const std::uint32_t live = start.live;
  if (receives && !sends) askForRecords(p, static_cast<int>(start.step & 1u));
  if (sends && !receives && blockIdx.x == 0 && threadIdx.x == 0) *p.latency.halfLive = live;
  if (sends) {
    traceStart(p, 0, all, entered);
    postPlaced(p, start.step, live);
    if (send.cta >= 0) dispatchSend<kFp8>(p, sm, send, start);
  }
  if (receives) dispatchReceive<kFp8, kLayout>(p, sm, receivers, !sends && receivers.cta < 0, live);
  if (receives && lastBlock(&p.peers.lastCtaCounters[0], p.latency.shrink != nullptr) && threadIdx.x == 0) {
    moeTrace(p, 0, p.peers.steps[0], MoeTraceEvent::kDone);
    // Every CTA read the step before lastBlock's barrier, each value used before it counted
    // (unfenced: lastBlock's `ordered`). The claims reset is the other parity's counter, whose last
    // claims were made in the step before (a kernel boundary ago), so that the next step finds it
    // at 0 with no reset racing a claim of this one. With shrink on timeout lastBlock fences:
    // helpers (a receive half's, a split launch's send CTAs) leave before the receivers' meeting,
    // and the ranks masked in other CTAs are read below.
    const std::uint32_t step = p.peers.steps[0];
    p.peers.steps[0] = step + 1u;
    p.peers.lastCtaCounters[kMoeItemClaims + ((step + 1u) & 1u)] = 0;
    *p.peers.dispatchLive = settledLive(p, 0, live);  // its combine's mask, less the ranks masked after a timeout
    *p.state.pending = kMoeDispatched | kMoePendingCombine;
  }
}

// --- combine ----------------------------------------------------------------------------------

// Source src's partial of its record i at `parity` in rank r's heap: H bf16 values as chunks of
// 128-byte lines of one round (kernels/moe/lines.cuh; moeLatencyPartialBytes), each carrying the
// combine step's tag (moeCountTag), so that the home sums each chunk once its lines are there: no
// fence (the arrivals, relaxed, count the peers' send CTAs only: combineReceive).
__device__ __forceinline__ uint4* partialLines(const MoeParams& p, int r, int parity, int src, int i) {
  return reinterpret_cast<uint4*>(p.peers.userRegions[r] + p.peers.partialsOff +
                                  llSlot(p, parity, src, i, moeLatencyPartialBytes(p.shape.hidden)));
}
// A partial's store (moeReduceRecordTo): vector c into chunk c / 32's lines, every lane of the warp.
struct PartialLinesStore {
  uint4* lines;
  std::uint32_t tag;
  __device__ __forceinline__ void operator()(int c, uint4 v, bool valid) const {
    const uint4 share[1] = {valid ? v : make_uint4(0u, 0u, 0u, 0u)};
    moe_lines::storeLines<1, false>(lines + static_cast<std::uint64_t>(c >> 5) * moeLinePieces(1), static_cast<int>(threadIdx.x % 32),
                                    share, 0.f, tag);
  }
};

// out[t] = the sum over ranks r of token t's partial from r (those with a record of t, in `live`),
// fp32 in rank order, bf16 out, each chunk summed once its lines from every rank carry `tag`.
// `parts` and `ranks`: the shared scratch of `own`, the reduce group of this thread, which builds
// it between two of its own barriers; `g`: the group whose warps split the token's chunks (`own`
// itself, or a wide group of two reduce groups, each with its own copy of the scratch: a group's
// scratch read only by warps that pass its barrier, as in the reduce, keeps racecheck's barrier
// bookkeeping even: run 320). Every thread of `own` calls it for every token (it meets `own`);
// `go` false (a chunk of an earlier token never came): it only meets. False: a chunk never came
// (recorded), or `go` was.
__device__ bool sumPartialLines(const MoeParams& p, int t, std::uint32_t live, int cparity, std::uint32_t tag, const uint4** parts,
                                int* ranks, const MoeGroup& own, const MoeGroup& g, bool go) {
  const int R = p.shape.numRanks;
  own.sync();  // the previous token's readers of `parts` are done
  if (own.tid == 0) {
    int n = 0;
    for (int r = 0; r < R; ++r) {
      const int i = p.routing.tokenRankIndex[static_cast<std::uint64_t>(t) * R + r];
      // A rank outside the mask (recover may shrink it after the dispatch) adds nothing.
      if (i >= 0 && isLive(live, r)) {
        parts[n] = partialLines(p, p.shape.rank, cparity, r, i);
        ranks[n++] = r;
      }
    }
    for (int r = n; r < R; ++r) parts[r] = nullptr;
  }
  own.sync();
  if (!go) return false;
  int n = 0;
  while (n < R && parts[n] != nullptr) ++n;
  const int vecs = p.shape.hidden / 8, lane = g.tid % 32, first = g.tid - lane;  // a warp's 32 vectors: one chunk
  auto* out = reinterpret_cast<uint4*>(p.combine.out) + static_cast<std::uint64_t>(t) * vecs;
  const int chunks = first < vecs ? (vecs - first + g.nthreads - 1) / g.nthreads : 0;  // the warp's: j x nthreads on
  if (n == 0) {  // a token sent nowhere: zeros
    for (int j = 0; j < chunks; ++j) {
      if (g.tid + j * g.nthreads < vecs) out[g.tid + j * g.nthreads] = make_uint4(0u, 0u, 0u, 0u);
    }
    return true;
  }
  // The warp's entries (chunk j, rank i), chunk after chunk and the ranks in order within one, two
  // at a time with their loads in flight together (4 spilled at 512 threads): a chunk's lines
  // from two ranks cross in one round trip, and one accumulator holds the chunk under way (an
  // entry that ends its chunk stores it before the next entry starts the next chunk).
  constexpr int kInFlight = 2;
  float acc[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) acc[k] = 0.f;
  bool ok = true;
  for (int e = 0; ok && e < chunks * n; e += kInFlight) {
    uint4 v[kInFlight][moe_lines::kLoads<1>];
    const uint4* cl[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int f = e + u, j = f / n;
      cl[u] = parts[f % n] + static_cast<std::uint64_t>((first + j * g.nthreads) >> 5) * moeLinePieces(1);
      if (f < chunks * n) moe_lines::loadLines<1>(cl[u], lane, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int f = e + u, j = f / n, i = f % n, c = g.tid + j * g.nthreads;
      if (!ok || f >= chunks * n) continue;
      if (!moe_lines::linesLanded<1>(v[u], lane, tag)) {
        ok = moe_lines::waitLines<1>(p.peers.sync, cl[u], lane, tag, ranks[i], WaitSite::kMoeCombine);
        if (ok) moe_lines::loadLines<1>(cl[u], lane, v[u]);
      }
      if (!ok) continue;
      uint4 share[1];
      float unused = 0.f;
      moe_lines::takeLines<1, false>(v[u], lane, share, unused);
      moeAddBf16x8(acc, share[0], 1.0f);
      if (i == n - 1) {  // the chunk's last rank: stored, the accumulator free for the next chunk
        if (c < vecs) out[c] = moeToBf16x8(acc);
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[k] = 0.f;
      }
    }
  }
  return ok;
}

// Source q's top-k weights of its record i, in this rank's heap (CombineArgs.topkWeights): topK
// tagged words (the weight's bits low, moeCountTag of the combine step high), each stored whole
// by q, so that a reader that sees a word's tag sees its weight (no fence, no flag).
__device__ __forceinline__ const std::uint64_t* combineWeightsOf(const MoeParams& p, int parity, int q, int i) {
  return reinterpret_cast<const std::uint64_t*>(p.peers.userRegions[p.shape.rank] + p.latency.weightsOff) +
         ((static_cast<std::uint64_t>(parity) * p.shape.numRanks + q) * p.shape.maxTokens + i) * p.shape.topK;
}

// Every thread of the CTA: whether every weight word that its group's records of source s will
// read carries the tag of combine step cstep. `wait`: each thread waits for its words (bounded,
// its own timeout even after another wait of this rank failed); a word that never comes masks s
// (shrink on timeout, `masked` non-null) or records the timeout. Else one look, nothing waited
// for. The same answer in every thread.
__device__ __noinline__ bool combineWeightsIn(const MoeParams& p, int s, const MoeGroupSlice& gs, std::uint32_t cstep, std::uint32_t* masked,
                                 bool wait) {
  const std::uint32_t tag = moeCountTag(cstep);
  const int cparity = static_cast<int>(cstep & 1u), K = p.shape.topK, rows = p.layout.sourceRecords[s];
  bool missing = false;
  // Word n of the group's: weight n % K of its record gs.first + (n / K) x gs.stride.
  for (int n = gs.g.tid; !missing; n += gs.g.nthreads) {
    const int i = gs.first + (n / K) * gs.stride;
    if (i >= rows) break;
    std::uint64_t seen = 0;
    missing = !taggedWordIn(p, combineWeightsOf(p, cparity, s, i) + n % K, tag, wait, s, WaitSite::kMoeCombineWeights, true,
                            masked != nullptr, seen);
    if (missing && masked != nullptr) maskAfterTimeout(p, masked, s);  // shrink on timeout: masked, not an error
  }
  return __syncthreads_or(missing) == 0;
}

// The records of the last dispatch from peer source s that slice gs (a send CTA's groups) takes,
// each reduced (sum of weight x y over its slots; the source's combine-time weights when
// `weighted`, else the dispatch's) straight into s's partial slot [cparity][this rank][index].
__device__ __forceinline__ void reduceSourceShare(const MoeParams& p, int s, const MoeGroupSlice& gs, MoeSlotStage& stage, bool weighted,
                                  std::uint32_t cstep, int dparity) {
  const int cparity = static_cast<int>(cstep & 1u), rows = p.layout.sourceRecords[s];
  const long long rankBase = p.layout.rankMajor ? p.layout.rankOffsets[s] : -1;  // rank-major: the source's first row
  for (int i = gs.first; i < rows; i += gs.stride) {
    moeReduceRecordTo<true>(p, recordView(p, recordSlot(p, p.shape.rank, dparity, s, i)), p.layout.sourceBase + s * p.shape.localExperts,
                      stage, gs.g, p.layout.rankMajor ? rankBase + i : -1,
                      weighted ? MoeSlotWeights::taggedWords(combineWeightsOf(p, cparity, s, i)) : MoeSlotWeights{},
                      PartialLinesStore{partialLines(p, s, cparity, p.shape.rank, i), moeCountTag(cstep)});
  }
}

// Before a wait for source s's weights, when they are not there yet: the rows of y that slice gs's
// records of s will read, into L2 (the records' plain metadata with them), so that the wait hides
// their first loads from memory. The first warp of each group, one record at a time: lane k
// resolves slot k's row and asks for it whole. Only rows below combine.expertOutputRows (the
// reduce counts the others); expanded layouts only (combine-time weights are refused with
// rank-major).
__device__ void prefetchSourceRows(const MoeParams& p, int s, const MoeGroupSlice& gs, int dparity, std::uint32_t cstep) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (static_cast<int>(threadIdx.x) % kMoeGroupThreads >= 32) return;  // the group's first warp
  // One look at the slice's first weight word (a hint: the wait after reads them all): there, the
  // weights have most likely come, and the rows are read at once.
  const int rows = p.layout.sourceRecords[s];
  if (gs.first >= rows) return;  // no record of s in the slice
  std::uint64_t seen = 0;
  if (taggedWordIn(p, combineWeightsOf(p, static_cast<int>(cstep & 1u), s, gs.first), moeCountTag(cstep), false, s,
                   WaitSite::kMoeCombineWeights, true, true, seen)) {
    return;
  }
  const std::uint64_t rowBytes = static_cast<std::uint64_t>(p.shape.hidden) * 2;
  const char* y = static_cast<const char*>(p.combine.expertOutput);
  const std::int32_t* srcBase = p.layout.sourceBase + s * p.shape.localExperts;
  for (int i = gs.first; i < rows; i += gs.stride) {
    int4 h;
    const MoeRecordSlot slot = moeLoadLaneSlot(p, recordView(p, recordSlot(p, p.shape.rank, dparity, s, i)), lane, h);
    const long long row = moeSlotRow(p, srcBase, slot);
    if (row >= 0 && row < p.combine.expertOutputRows) ptx::prefetchL2(y + static_cast<std::uint64_t>(row) * rowBytes, static_cast<std::uint32_t>(rowBytes));
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
  const MoeGroupSlice gs = moeGroupSlice(part.cta, part.ctas, true);  // the CTAs first
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
    // any wait: CTA c takes destinations c, c + G, ... Each weight goes as a tagged word
    // (combineWeightsOf), stored whole: the reader waits on the words themselves, so no fence
    // waits here for the stores to land.
    const int T = *p.routing.liveTokens;
#pragma unroll 1  // over ranks: no copies of the body (code a cold SM fetches)
    for (int r = part.cta; r < R; r += part.ctas) {
      if (r == p.shape.rank || !isLive(live, r)) continue;  // the same r in every thread
      auto* dst = reinterpret_cast<std::uint64_t*>(p.peers.userRegions[r] + p.latency.weightsOff) +
                  (static_cast<std::uint64_t>(cparity) * R + p.shape.rank) * p.shape.maxTokens * K;
      for (int e = tid; e < T * K; e += kThreads) {
        const int t = e / K, i = p.routing.tokenRankIndex[static_cast<std::uint64_t>(t) * R + r];
        if (i >= 0) ptx::stRelaxedSys64(dst + static_cast<std::uint64_t>(i) * K + e % K, moeTaggedCount(cstep, __float_as_uint(p.combine.topkWeights[e])));
      }
    }
    if (tid == 0) moeTrace(p, 1, cstep, MoeTraceEvent::kPosted, 0, true);  // thread 0's stores issued
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
#pragma unroll 1  // over ranks: no copies of the body (code a cold SM fetches)
  for (int k = 1; k < R; ++k) {
    const int s = (p.shape.rank + k) % R;
    if (!isLive(left, s)) continue;  // outside the mask: no records to reduce, nothing to send it
    if (isLive(gaveUp, s)) {  // a stand-in that waited for its weights in vain already
      unserved |= 1u << s;
      continue;
    }
    if (weighted && alone) {
      // One look at the source's weights (this CTA's records' words), no wait.
      if (!combineWeightsIn(p, s, gs, cstep, nullptr, false)) {
        deferred |= 1u << s;
        continue;
      }
    } else if (weighted) {
      prefetchSourceRows(p, s, gs, dparity, cstep);  // while the weights cross
      if (!combineWeightsIn(p, s, gs, cstep, masked, true)) {
        // Recorded (the engine enters its failed state), or masked. The other sources' records are still
        // reduced and announced, so the survivors' counters stay in step with each other once the
        // failed source is masked (Engine::recover); the failed source gets no arrival from this
        // CTA and its partials are not written (their lines keep an older step's tag), so its
        // own wait fails and reports instead of summing an old slot.
        unserved |= 1u << s;
        if (standIn) gaveUp |= 1u << s;
        continue;
      }
    }
    reduceSourceShare(p, s, gs, stages[gs.group], weighted, cstep, dparity);
  }
  if (alone && tid == 0) p.latency.deferred[part.cta] = deferred;  // read by the receive half (the next kernel)
  // The partials' lines carry their own order, so no fence: an arrival says only that this CTA
  // sent (what shrink on timeout masks by, and what keeps a peer's later step off a slot parity
  // this rank still reads: combineReceive).
  arriveAtEveryPeer(p, p.latency.partialArrivalsOff, left & ~unserved & ~deferred, false);
  if (!standIn && tid == lastArriver(p)) moeTrace(p, 1, cstep, MoeTraceEvent::kSent, 0, true);
}

// `skip`: with shrink on timeout, the peers this CTA does not wait for (its stand-in gave up on
// their weights and masked them in words[0]: every receive CTA leaves them out after the meeting).
// Without it a stand-in's failure is recorded and the waits below return at once.
__device__ void combineReceive(const MoeParams& p, Part part, std::uint32_t live, std::uint32_t skip) {
  __shared__ const uint4* parts[kGroups][kMaxRanks];
  __shared__ int partRanks[kGroups][kMaxRanks];
  __shared__ MoeSlotStage stages[kGroups];
  const MoeGroupSlice gs = moeGroupSlice(part.cta, part.ctas, true);  // the CTAs first
  const int R = p.shape.numRanks;
  const std::uint32_t cstep = p.peers.steps[1];
  const int cparity = static_cast<int>(cstep & 1u);
  const int dparity = static_cast<int>((p.peers.steps[0] - 1u) & 1u);  // the last dispatch's records
  const std::uint32_t tag = moeCountTag(cstep);
  const int T = *p.routing.liveTokens;
  {
    const MoeStamp stamp(p, MoeKernel::kLatencyCombineOwn);
    // This rank's own records, reduced into its own partial slots (as lines, the peers' way) while
    // the send part reduces the peers' (no wait: the records, y and the weights are this rank's).
    // The sums below read these partials' lines like a peer's, each waited for by its tag: where
    // the sums' groups are wide, a token's own partial is written by one reduce group and summed by
    // warps of another, with no barrier between (each writer ends this phase before it waits).
    for (int t = gs.first; t < T; t += gs.stride) {
      const int i = p.routing.tokenRankIndex[static_cast<std::uint64_t>(t) * R + p.shape.rank];
      if (i >= 0) {
        moeReduceRecordTo<true>(p, recordView(p, recordSlot(p, p.shape.rank, dparity, p.shape.rank, i)),
                          p.layout.sourceBase + p.shape.rank * p.shape.localExperts, stages[gs.group], gs.g,
                          p.layout.rankMajor ? p.layout.rankOffsets[p.shape.rank] + i : -1,
                          p.combine.topkWeights != nullptr ? p.combine.topkWeights + static_cast<std::uint64_t>(t) * p.shape.topK
                                                           : nullptr,
                          PartialLinesStore{partialLines(p, p.shape.rank, cparity, p.shape.rank, i), tag});
      }
    }
  }
  {
    const MoeStamp stamp(p, MoeKernel::kLatencyCombineReceive);
    // Every peer destination's G send CTAs of this step (the destinations taking part) arrive:
    // with shrink on timeout before the sums (a destination whose CTAs never all arrived is
    // masked, and every CTA leaves the same ranks out of the sums); without it after them, so
    // that the sums start as the first lines land. Either way no operation of this rank ends
    // before every peer's send of it did, which keeps each peer's next step on this slot parity
    // after this rank's reads (the buffer reuse above; a peer that sent this rank nothing counts
    // too). Each chunk of the sums waits for its own lines (bounded, naming the rank).
    std::uint32_t* masked = shrinkWords(p, 1);
    const std::uint32_t G = static_cast<std::uint32_t>(p.grid.budgetCtas);
    bool arrived = true;
    if (masked != nullptr) {
      arrived = waitEveryRank(p, p.latency.partialArrivalsOff, G, WaitSite::kMoeCombine, true, live & ~skip, p.latency.expected, masked);
      live &= ~settleMasked(p, masked, part.ctas, WaitSite::kMoeCombine);
    }
    if (arrived) {
      // A token a group: where every token then has one, groups of kSumThreads (a token's chunks
      // over twice the warps: at H 2048 a warp's one chunk, both ranks' lines in one round trip),
      // each half of one a reduce group with its own scratch and barrier; else the reduce's groups.
      const bool wide = T <= (kThreads / kSumThreads) * part.ctas;
      const MoeGroupSlice ss = wide ? moeGroupSlice(part.cta, part.ctas, true, kSumThreads) : gs;
      bool go = true;
      for (int t = ss.first; t < T; t += ss.stride) {
        go = sumPartialLines(p, t, live, cparity, tag, parts[gs.group], partRanks[gs.group], gs.g, ss.g, go);
      }
      const bool summed = __syncthreads_or(!go) == 0;  // a chunk that never came is recorded: no second wait
      arrived = summed && (masked != nullptr ||
                           waitEveryRank(p, p.latency.partialArrivalsOff, G, WaitSite::kMoeCombine, true, live, p.latency.expected));
    }
    if (arrived) {
      ptx::launchDependents();  // after the last wait on another rank, as in the dispatch receive
      if (part.cta == part.ctas - 1 && threadIdx.x == 0) moeTrace(p, 1, cstep, MoeTraceEvent::kArrived);
      if (part.cta == 0 && threadIdx.x == 0) moeTrace(p, 1, cstep, MoeTraceEvent::kArrived0);
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
  if ((p.latency.phase & kMoeLatencyReceive) != 0 && lastBlock(&p.peers.lastCtaCounters[1], p.latency.shrink != nullptr) && threadIdx.x == 0) {
    moeTrace(p, 1, p.peers.steps[1], MoeTraceEvent::kDone);
    // As the dispatch's: every CTA read the step, and the receive CTAs the expected arrivals (threads
    // q < R), each used before it counted; the fence only with shrink on timeout (the ranks the
    // send CTAs masked, words[3]).
    p.peers.steps[1] = p.peers.steps[1] + 1u;
    advanceExpected(p, settledLive(p, 1, live));  // less the ranks masked after a timeout
    *p.state.pending &= kMoeDispatched;
  }
}

// The dispatch kernels, [fp8][recvLayoutOf], each the one a launch of that format and layout runs.
using DispatchKernelFn = void (*)(MoeParams);
constexpr DispatchKernelFn kDispatchKernels[2][kMoeRecvLayouts] = {
    {dispatchKernel<false, MoeRecvLayout::kExpertMajor>, dispatchKernel<false, MoeRecvLayout::kBatched>,
     dispatchKernel<false, MoeRecvLayout::kRankMajor>},
    {dispatchKernel<true, MoeRecvLayout::kExpertMajor>, dispatchKernel<true, MoeRecvLayout::kBatched>,
     dispatchKernel<true, MoeRecvLayout::kRankMajor>}};

// CTAs of one launch: the parts it runs, side by side.
int launchCtas(const MoeParams& p) {
  return ((p.latency.phase & kMoeLatencySend) != 0 ? p.grid.budgetCtas : 0) + ((p.latency.phase & kMoeLatencyReceive) != 0 ? p.grid.epilogueCtas : 0);
}
// The dispatch's: a launch with its receive part takes G + E CTAs (a receive half alone: E
// receivers and G helpers, dispatchReceive), a send half G.
int dispatchCtas(const MoeParams& p) {
  return p.grid.budgetCtas + ((p.latency.phase & kMoeLatencyReceive) != 0 ? p.grid.epilogueCtas : 0);
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
  cudaLaunchConfig_t cfg = moeLaunchConfig(dispatchCtas(p), kThreads, 1, p.grid.programmatic != 0, stream, attrs);
  cfg.dynamicSmemBytes = lay.bytes;
  return cudaLaunchKernelEx(&cfg, kDispatchKernels[p.shape.fp8 ? 1 : 0][static_cast<int>(recvLayoutOf(p))], p);
}

cudaError_t launchMoeLatencyCombine(const MoeParams& p, cudaStream_t stream) {
  using namespace moe_latency;
  if (const cudaError_t e = checkLaunch(__func__, p); e != cudaSuccess) return e;
  cudaLaunchAttribute attrs[2];
  const cudaLaunchConfig_t cfg = moeLaunchConfig(launchCtas(p), kThreads, 1, p.grid.programmatic != 0, stream, attrs);
  return cudaLaunchKernelEx(&cfg, combineKernel, p);
}

cudaError_t preloadMoeLatencyKernels() {
  for (const auto& format : moe_latency::kDispatchKernels) {
    for (const auto kernel : format) {
      const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kMoeLatencyMaxSmem));
      if (e != cudaSuccess) return e;
    }
  }
  return preloadKernels(moe_latency::combineKernel);
}

cudaError_t moeLatencyCtasPerSm(std::uint32_t smemBytes, int* ctas) {
  int fewest = 0;  // over every dispatch kernel and the combine's
  cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fewest, moe_latency::combineKernel, moe_latency::kThreads, 0);
  for (const auto& format : moe_latency::kDispatchKernels) {
    for (const auto kernel : format) {
      int n = 0;
      if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, moe_latency::kThreads, smemBytes);
      if (n < fewest) fewest = n;
    }
  }
  if (e != cudaSuccess) return e;
  *ctas = fewest;
  return cudaSuccess;
}

}  // namespace graphep
