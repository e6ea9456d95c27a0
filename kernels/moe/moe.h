// MoE dispatch / combine, device half (engine/moe/ is the host half; docs/DESIGN.md §5).
//
// Throughput path, per rank, in stream order (every size fixed at capture, every count read from
// device memory when the kernels run, so one captured graph serves any live token count):
//
//   dispatch  route     per-expert and per-rank counts, each (token, k) entry's index within its
//                       expert's list and each token's index within a destination rank's list
//                       (a token goes to a rank once, however many of its experts live there)
//             pack      one record per (token, destination rank): the row (bf16, or fp8 e4m3 tiles
//                       with per-128 scales made by the produce hook) and its metadata; the count
//                       messages and the send counts of the movers
//             alltoallv count messages (staged), then records (zero-copy into the peer's heap)
//             offsets   expert offsets (with alignment padding), per-(source, expert) bases, the
//                       receive counts of the movers, cumulative per-expert totals; the published
//                       views clamped to the capacity (kernels/moe/common.cuh, moePublishLayout)
//             expand    records -> recv_x grouped by local expert, plus per-row source/weight
//   combine   reduce    per received record: sum over its slots of weight * y[row], fp32, to bf16
//             alltoallv partials back to their source ranks (zero-copy)
//             final     out[t] = sum over destination ranks of the partials, fp32, to bf16
//
// Bad input never writes out of bounds: ids outside [-1, E) are skipped and counted, rows past the
// capacity are dropped and counted, a live count above the maximum is clamped and counted
// (MoeDeviceStatus); strict mode traps after counting.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include <graphep/types.hpp>

#include "kernels/common/pipe.h"
#include "kernels/common/sync_handle.h"

namespace graphep {

inline constexpr int kMoeMaxTopK = 16;
inline constexpr int kMoeMaxLocalExperts = 1024;
inline constexpr int kMoeMaxHidden = 65536;  // H: bounds every region's bytes far below 2^64

// Per-rank device status word (engine-owned device memory; Engine::status() reads it).
struct MoeDeviceStatus {
  unsigned long long invalidIds;     // (token, k) entries with an id < -1 or >= E: skipped
  unsigned long long droppedRows;    // received rows past the capacity: not written
  unsigned long long clampedCounts;  // dispatches whose live token count was < 0 or > the maximum
  long long firstInvalidId;          // the first invalid id seen (valid when invalidIds > 0)
  std::int32_t firstInvalidToken;
  std::int32_t firstInvalidSlot;
  std::int32_t firstInvalidSet;      // 0 until the first invalid entry is recorded
  std::int32_t firstClampedCount;    // the first out-of-range live count
  std::uint32_t firstClampedSet;
  std::uint32_t pad;
  unsigned long long unpairedDispatches;  // kept at 0: dispatch -> dispatch is defined (the second replaces the first)
  unsigned long long unpairedCombines;    // combines before the engine's first dispatch (nothing to combine)
  // Combine inputs shorter than the layout (CombineArgs.expertOutputRows): rows past them add nothing.
  unsigned long long missingCombineRows;
  // (token, k) entries of this rank's dispatches whose expert lives on rank r outside the active
  // mask (or all of them while this rank is outside it): not sent, counted by destination rank.
  unsigned long long maskedEntries[kMaxRanks];
  // Ranks (bit r) masked after a wait on them timed out (MoeConfig::shrinkOnTimeout).
  std::uint32_t shrunkRanks;
  std::uint32_t pad2;
};

// MoeParams::state.pending, set by each operation's last kernel: bit 0 between a dispatch and a combine
// (the watchdog's guess at which operation a stall is in), bit 1 once any dispatch has run (a
// combine before it has nothing to combine: counted).
inline constexpr std::uint32_t kMoePendingCombine = 1u;
inline constexpr std::uint32_t kMoeDispatched = 2u;

// Metadata after the payload of every dispatch record (kMoeMetaBytes for topK slots).
struct MoeRecordHeader {
  std::int32_t token;   // source token index
  std::int32_t nslots;  // slots below whose experts live on the destination
  std::int32_t pad[2];
};
struct MoeRecordSlot {
  std::int32_t localExpert;  // expert index on the destination rank
  std::int32_t index;        // the entry's index within that expert's rows from this source
  float weight;              // topk weight
  std::int32_t k;            // top-k slot
};

__host__ __device__ inline std::uint64_t moeMetaBytes(int topK) {
  return sizeof(MoeRecordHeader) + sizeof(MoeRecordSlot) * static_cast<std::uint64_t>(topK);
}
// Payload bytes of one record: bf16 row, or one 144-byte fp8 tile record per 128 values.
__host__ __device__ inline std::uint64_t moePayloadBytes(int hidden, bool fp8) {
  return fp8 ? static_cast<std::uint64_t>(hidden) / kFp8TileValues * kFp8TileWireBytes
             : static_cast<std::uint64_t>(hidden) * 2;
}
// 16-byte pieces of a chunk of 128-byte tagged lines (kernels/moe/lines.cuh) that a warp stores
// in `rounds` rounds of four lines, then a spill line.
__host__ __device__ constexpr int moeLinePieces(int rounds) { return 32 * rounds + 8; }
// The latency path's record slot (kernels/moe/latency.cu): the payload as 128-byte lines, the
// metadata as flagged lines (every 8 bytes of them as a 16-byte line {4 bytes, tag, 4 bytes, tag}),
// both written by the source; then at metaOff the plain metadata (MoeRecordHeader and its slots)
// the combine reads, written by the receiver. The payload goes by chunks of
// kMoeLatencyChunkValues values, each a chunk of lines (kernels/moe/lines.cuh) of
// moeLatencyChunkRounds rounds, lane L's 16-byte share as piece L of its round (fp8: one round,
// the e4m3 bytes, the tiles' scales in the spill line; bf16: two); moeLatencyChunkLines counts
// its 16-byte pieces. The metadata's lines: the header {token, slots}, then per top-k position
// {local expert, index}, {weight, k}.
inline constexpr int kMoeLatencyChunkValues = 512;
__host__ __device__ constexpr int moeLatencyChunkRounds(bool fp8) { return fp8 ? 1 : 2; }
__host__ __device__ constexpr int moeLatencyChunkLines(bool fp8) { return moeLinePieces(moeLatencyChunkRounds(fp8)); }
// The latency combine's partial slot: H bf16 values as chunks of lines of one round (256 values,
// a warp's 16 bytes a lane), 640 bytes a chunk.
inline constexpr int kMoePartialChunkValues = 256;
__host__ __device__ inline std::uint64_t moeLatencyPartialBytes(int hidden) {
  return static_cast<std::uint64_t>((hidden + kMoePartialChunkValues - 1) / kMoePartialChunkValues) * moeLinePieces(1) * 16;
}
__host__ __device__ inline std::uint64_t moeLatencyPayloadLineBytes(int hidden, bool fp8) {
  return static_cast<std::uint64_t>((hidden + kMoeLatencyChunkValues - 1) / kMoeLatencyChunkValues) * moeLatencyChunkLines(fp8) * 16;
}
__host__ __device__ inline std::uint64_t moeLatencyMetaLineBytes(int topK) {
  return 16 * (1 + 2 * static_cast<std::uint64_t>(topK));
}
// The config's largest record (bf16 unless the engine is fp8's alone) and its top-k.
__host__ __device__ inline std::uint64_t moeLatencyMetaOff(int hidden, bool fp8, int topK) {
  return moeLatencyPayloadLineBytes(hidden, fp8) + moeLatencyMetaLineBytes(topK);
}
__host__ __device__ inline std::uint64_t moeLatencyRecordBytes(int hidden, bool fp8, int topK) {
  return (moeLatencyMetaOff(hidden, fp8, topK) + moeMetaBytes(topK) + 127) & ~std::uint64_t{127};
}
// Count message per destination: {rows, count of expert 0 .. E_local-1} as u64, 16-byte multiple.
__host__ __device__ inline std::uint64_t moeCountMsgBytes(int localExperts) {
  return ((1 + static_cast<std::uint64_t>(localExperts)) * 8 + 15) & ~std::uint64_t{15};
}
// The direct dispatch's count message (kernels/moe/direct.cu): the count message, then u32
// {live tokens T, first[0 .. W], rankCount[0 .. R)} with W = ceil(maxTokens / 32): first[w] is the
// index of the first record of tokens >= 32 w (first[ceil(T / 32)] = the records sent), and
// rankCount[r] the records the source sends to rank r (every destination gets the whole row, so
// each rank can form the full rank prefix matrix), 16-byte multiple.
// The u32 word of rankCount[0] in that tail (after T and first[0 .. W]).
__host__ __device__ inline std::uint64_t moeDirectRankCountWord(int maxTokens) {
  return 2 + (static_cast<std::uint64_t>(maxTokens) + 31u) / 32u;
}
__host__ __device__ inline std::uint64_t moeDirectMsgBytes(int localExperts, int maxTokens, int numRanks) {
  return moeCountMsgBytes(localExperts) +
         (((moeDirectRankCountWord(maxTokens) + static_cast<std::uint64_t>(numRanks)) * 4 + 15) & ~std::uint64_t{15});
}

// The direct combine's per-record values (CombineArgs.rowValues): fp32 slots of this many per
// record, whatever numValues is, so that a block's values are one contiguous span.
inline constexpr int kMoeMaxValues = 16;

// Kernels of the engine that can stamp a timeline (MoeConfig.profile): each CTA takes the minimum
// of its entry times and the maximum of its exit times into timeline[2 * kernel], [2 * kernel + 1]
// (global timer, ns), so one launch's span is readable after it (Engine::timeline()).
// Engine::timeline() lists them in this order, which is the order they start in, except that a
// programmatic dependent's phases may start beside its primary's later ones (the latency receive's
// layout beside the send's records).
enum class MoeKernel : int {
  kRoute = 0, kPack, kOffsets, kExpand,
  kForward,  // the node-aware dispatch's forwards of the hop records (kernels/moe/movers.cu)
  // The throughput path's direct dispatch (kernels/moe/direct.cu), after route: quantise (fp8),
  // send, receive (layout + expand), and the receive's two phases: this rank's own rows, the
  // peers' records.
  kDirectQuantize, kDirectSend, kDirectReceive, kDirectOwn, kDirectPeers,
  // Its combine: reduce (the peers' partials, staged), send (into the sources' slots), final
  // (own partials + sum).
  kDirectCombineReduce, kDirectCombineSend, kDirectCombineFinal,
  kCombineReduce,
  kNodeSum,  // the node-aware combine's sums of a node's partials (kernels/moe/movers.cu)
  kCombineFinal,
  // The latency kernels' phases: dispatch (route + count messages, records, layout, expand),
  // combine (the peers' records reduced + sent; the receiver's own records reduced, then the sums).
  kLatencyDispatch, kLatencyRecords, kLatencyReceive, kLatencyExpand, kLatencyCombine,
  kLatencyCombineOwn, kLatencyCombineReceive, kCount
};

// Timeline words per kernel: min entry, max exit (global timer, ns), sum of CTA durations, CTAs.
inline constexpr int kMoeStampWords = 4;

// The latency kernels' step trace (MoeConfig.profile), after the stamps in `timeline`: the global
// timer (ns) at each event of the last kMoeTraceSteps operations of each kind, slot
// [op (0 dispatch, 1 combine)][step % kMoeTraceSteps][event], the events being graphep::MoeTraceEvent
// (include/graphep/types.hpp). One operation's events, unlike the stamps' means, show where its
// time goes: the kernel boundary (the previous kDone to kReady), the send, the peers' signals, the
// receive.
inline constexpr int kMoeTraceSteps = 16;
inline constexpr int kMoeTraceWords = 2 * kMoeTraceSteps * static_cast<int>(MoeTraceEvent::kCount);

// --- MoeParams, grouped by owner ---------------------------------------------------------------
// Each group is written by one place in the engine (engine/moe/bind.cpp at setup unless noted)
// and read by the kernels named beside it. Plain aggregates: MoeParams stays trivially copyable
// and is passed by value as a __grid_constant__ kernel parameter.

// The sizes every kernel reads: the ranks, experts and tokens (setup), and the record format.
// topK, fp8 and payloadBytes are the dispatch's own (Engine::dispatch from DispatchArgs.topK,
// .input): at most the config's top-k, and a record slot (recordBytes) holds the config's
// largest record. The int32 fields lead the struct, contiguous at offset 0: moving them raised
// moeDirectReceiveKernel's spills (ptxas -v); re-check after any reorder.
struct MoeShape {
  std::int32_t rank, numRanks, hidden, topK, numExperts, localExperts, maxTokens;
  std::int32_t fp8;             // the dispatch's records carry fp8 e4m3 tiles
  std::uint64_t recordBytes;    // a record slot (recBytes)
  std::uint64_t payloadBytes;   // moePayloadBytes(hidden, fp8): the dispatch's record payload
  std::uint64_t countMsgBytes;  // moeCountMsgBytes (the movers' and the latency path's count messages)
};

// One dispatch's inputs (Engine::dispatch from DispatchArgs, every path).
struct MoeDispatchInput {
  const void* x;                   // [T, H] bf16, or e4m3 bytes with xIsFp8
  const void* topkIdx;             // [T, K] int32 / int64; nullptr with topK 0 (tokenInRank alone)
  const float* topkWeights;        // [T, K]
  const int* numTokens;            // device scalar
  const std::uint8_t* tokenInRank; // [T, R] bytes or nullptr
  const float* xScales;            // xIsFp8: fp32 scales, xScales[t * scaleTokenStride + j * scaleHiddenStride]
  std::int64_t scaleTokenStride, scaleHiddenStride;
  std::int32_t int64Ids;           // topkIdx holds int64
  std::int32_t xIsFp8;             // x holds caller-quantised e4m3 bytes (direct dispatch)
  std::int32_t scaleFormat;        // MoeScaleFormat of engine-quantised fp8 (latency path)
};

// Routing scratch (local): written by route (kernels/moe/route.cu) or the latency send, read by
// every path. W = moeRouteWords(maxTokens).
struct MoeRouting {
  std::int32_t* liveTokens;      // [1] the clamped live count of the last dispatch
  std::int32_t* tokenRankIndex;  // [maxTokens, R]: index in the rank's record list or -1
  std::int32_t* rankTokens;      // [R, maxTokens]: the token of each index of a rank's record list
                                 // (the movers path's pack reads it), or nullptr
  std::int32_t* entryIndex;      // [maxTokens, K]: index within the expert's entries from this rank
  std::uint32_t* expertEntries;  // [E]: this rank's entries per expert
  std::uint32_t* rankRecords;    // [R]: this rank's records per destination
  std::uint32_t* bits;           // [E + 2R][W]: a bit per token holding the expert / going to the rank / node
  std::uint32_t* blockCounts;    // [E][W]: entries per expert per 32 tokens
  std::uint32_t* duplicate;      // [1]: some token holds an expert twice
  std::uint32_t* blockPrefix;    // [E + 2R][W]: entries (tokens) before each 32-token block
  std::uint64_t zeroBytes;       // bytes from `bits` zeroed before each dispatch (throughput path)
};

// The receive layout: its form (setup), the views a user reads (DispatchLayout's names), and
// the row buffers the expand writes (the engine's, or the caller's DispatchOutputs).
struct MoeLayout {
  std::int64_t capacity;        // rows of recv_x
  std::int64_t rowsPerExpert;   // batched layout: rows per local expert; 0 otherwise
  std::int64_t outputRows;      // rank-major: rows this dispatch may write (DispatchOutputs.rows or capacity)
  std::int32_t* sourceRecords;  // [R]: records received from each source
  std::int32_t* sourceBase;     // [R][E_local]: first row of (source, expert) in recv_x
  std::int32_t* expertOffsets;  // [E_local + 1]
  std::int32_t* expertCounts;   // [E_local]: rows kept
  std::int32_t* expertDropped;  // [E_local]: rows past the capacity (this dispatch)
  std::int32_t* numRecvRows;    // [1]: rows kept
  std::int64_t* expertSourceRanges;   // [E_local][R] begin << 32 | count, or nullptr (rank-major)
  unsigned long long* expertTotals;   // [E_local], cumulative
  std::int32_t* rankOffsets;    // rank-major: [R + 1]
  std::int32_t* rankPrefix;     // [R][R] or nullptr (direct dispatch's DispatchOutputs.rankPrefixMatrix)
  std::int32_t* recvStats;      // [E_local] or nullptr (DispatchArgs.recvStats)
  char* recvX;                  // [capacity, H] bf16 or fp8
  float* recvScales;            // [capacity, H / 128] (fp8)
  std::int32_t* rowSrcRank;     // [capacity]
  std::int32_t* rowSrcToken;
  std::int32_t* rowTopkSlot;
  float* rowWeight;
  void* rowExperts;             // rank-major: [capacity][topK] int32, or int64 with rowExperts64
  float* rowExpertWeights;      // rank-major: [capacity][topK]
  std::int32_t alignment;       // per-expert row alignment of recv_x
  std::int32_t rankMajor;
  std::int32_t rowExperts64;
};

// One combine's arguments (Engine::combine; CombineArgs' names).
struct MoeCombineArgs {
  const char* expertOutput;      // [expertOutputRows, H] bf16 (y)
  std::int64_t expertOutputRows;
  char* out;                     // [T, H] bf16
  const float* topkWeights;      // latency path, or nullptr: [T][topK] weights in place of the dispatch's
  const float* rowValues;        // direct, rank-major, or nullptr: [expertOutputRows][numValues] fp32
  float* outValues;              // [T][numValues]
  std::int32_t numValues;
};

// CTAs (kMoeThreads / kMoeLatencyThreads each). budgetCtas: the SM budget (MoeConfig.smBudget;
// by default the SM count, the link's need, or 24 on the latency path), the same on every rank
// (arrival counters count them): the grid of route, the direct sends, the latency send part (G).
// epilogueCtas: the throughput path's local kernels (the direct epilogues; the movers' pack,
// expand, reduce and final) and the latency receive part (MoeConfig.epilogueSms), in clusters of
// epilogueCluster (direct).
struct MoeGrid {
  std::int32_t budgetCtas;
  std::int32_t epilogueCtas;
  std::int32_t epilogueCluster;
  // The latency kernels: launched as the programmatic dependent of the stream's last kernel (set
  // while the stream is being captured: a graph's kernels run back to back, so each starts while
  // the one before ends; an eager launch is paced by the host, and an early start would only hold
  // its SMs waiting, inside the kernel's own span).
  std::int32_t programmatic;
};

// The throughput path's local staging and this rank's record slots (movers and direct).
struct MoeStaging {
  char* recordStage;       // [R][maxTokens][recordBytes]; direct: [T][payloadBytes] fp8 wire rows
  const char* recordRecv;  // [R][maxTokens][recordBytes] (this rank's heap: peers write it)
  char* partialStage;      // [R][maxTokens][H] bf16 partials (local)
};

// The movers' exchanges (kernels/moe/movers.cu): count messages and the
// alltoallv byte counts of records and partials. Records and partials move in `chunks` exchanges
// (docs/DESIGN.md §5.5): chunk j carries list indices [j * chunkRecords, (j + 1) * chunkRecords)
// of every (source, destination) pair, so pack, exchange and expand (reduce, exchange, final)
// overlap; its byte counts are [j][R] in the four arrays.
inline constexpr int kMoeMaxChunks = 8;
struct MoeMoverParams {
  char* countSend;                  // [R][countMsgBytes]
  const char* countRecv;            // [R][countMsgBytes]
  const char* partialRecv;          // [R][maxTokens][H] bf16 partials (this rank's heap)
  std::uint64_t* recordSendBytes;   // [chunks][R]
  std::uint64_t* recordRecvBytes;
  std::uint64_t* partialSendBytes;
  std::uint64_t* partialRecvBytes;
  std::int32_t chunks;              // 1 .. kMoeMaxChunks
  std::int32_t chunkRecords;        // list indices (and, in final, tokens) per chunk
};

// The node-aware dispatch over the movers (docs/DESIGN.md §5.10; aware 0: the flat scheme). A
// record for a rank on another node crosses the network once per (token, node), to this rank's
// landing rank there, as a hop record: the record with every routed slot (global expert ids in
// MoeRecordSlot::localExpert), then [R] int32, each rank's index of the token in its list from
// this rank (-1: the token does not go there). It travels in the records exchange in the landing
// rank's slot, counted in the count message's word 1 + E_local. The landing rank forwards it by
// load/store into the fwdRecv slot [source][index] of each destination on its node (itself
// included), where expand and the combine's reduce read the records of a source on another node.
// The combine in reverse: each rank reduces such a record into its nodePartial slot [source][index]
// (its heap), the landing rank sums the node's partials of each hop record (fp32 in rank order,
// bf16 out) into partialStage [source][hop index], and the partials exchange sends those home, one
// per (token, node); the final sums a remote node's partial from its landing rank, at the token's
// index in that node's hop list (tokenNodeIndex).
// Four counters per node peer order it (counts, waited in one-CTA kernels): a rank is ready for
// its node's forwards once its dispatch starts (its previous combine has read its fwdRecv); a
// landing rank announces its forwards when written; a rank announces its partials once reduced; a
// landing rank announces it has summed them (the next combine may then overwrite them; the
// counters start one ahead, as if a combine before the first had been summed).
struct MoeNodeParams {
  std::int32_t aware;
  std::int32_t numNodes;
  std::uint32_t nodeMask;         // the ranks of this rank's node (bit q), itself included
  std::int8_t nodeOf[kMaxRanks];  // each rank's node
  std::int8_t landing[kMaxRanks]; // [node]: this rank's landing rank on it (itself on its own)
  std::int32_t* nodeTokens;       // [N][maxTokens]: the token of each index of a node's hop list
  std::uint32_t* nodeRecords;     // [N]: this dispatch's hop records for each node
  std::uint64_t fwdRecvOff;       // [R][maxTokens][recordBytes]: forwarded records of other nodes' sources
  std::uint64_t readyOff;         // u32 [R]: node peer q is ready for this rank's forwards (a count)
  std::uint64_t forwardedOff;     // u32 [R]: node peer q forwarded this rank's records (a count)
  std::uint64_t nodePartialOff;   // [R][maxTokens][H] bf16: partials of other nodes' sources' records
  std::uint64_t reducedOff;       // u32 [R]: node peer q reduced its partials (a count)
  std::uint64_t summedOff;        // u32 [R]: node peer q summed this rank's partials (a count)
  std::int32_t* tokenNodeIndex;   // [maxTokens][R]: a token's index in node m's hop list ([t][m]), or -1
  std::uint32_t* seen;            // local [4][R]: readies, forwards, reductions, sums seen from each node peer
};

// A range [first, end) of record-list indices (pack, expand, reduce) or tokens (final).
struct MoeRange {
  std::int32_t first;
  std::int32_t end;
};

// Chunk j of lists of up to maxTokens entries: [j * chunkRecords, (j + 1) * chunkRecords) within
// maxTokens (the kernels' counts, the engine's launches and its exchange windows all take it here).
__host__ __device__ inline MoeRange moeChunk(const MoeMoverParams& m, int j, int maxTokens) {
  const int first = j * m.chunkRecords, end = first + m.chunkRecords;
  return MoeRange{first, end < maxTokens ? end : maxTokens};
}

// The paths that store into peers' memory (latency, direct): every rank's symmetric user region
// and the offsets of the regions both use, the step counters and the bounded waits. The regions
// (the *Off fields here and in MoeDirectParams / MoeLatencyParams) sit at the same offsets in
// every rank's user region; data regions are doubled, [2] by the parity of the operation's step,
// so consecutive operations never share a buffer; flags and counters are u32 and monotonic (a
// step s posts s + 1, a counter of CTAs grows by G per step), so they replay forever.
struct MoePeers {
  char* userRegions[kMaxRanks];  // every rank's user region as this rank sees it (its own included)
  std::uint64_t recordsOff;      // records from each source
  std::uint64_t countMsgsOff;    // count messages ([2][R], by parity)
  std::uint64_t partialsOff;     // partials from each destination
  std::uint64_t countFlagsOff;   // u32 [R]: source q's count message of step s landed: s + 1 (the latency
                                 // path's messages carry that tag in each word; its flags only tell checkHealth)
  std::uint32_t* steps;          // local [2]: dispatch and combine steps (monotonic)
  // local [3]: last-CTA counters of the dispatch's and combine's last kernels, then the latency
  // dispatch receive's item claims (kMoeItemClaims, one per step parity)
  std::uint32_t* lastCtaCounters;
  SyncHandle sync;               // bounded waits (timeout, error record)
  // The active-rank mask (Engine::setActiveRanks; the latency path and the direct throughput
  // path): bit r, rank r takes part. Each CTA of a dispatch reads it (dispatchMask), and the
  // dispatch leaves the mask it used in dispatchLive for its combine; a rank outside the mask is
  // sent nothing and waited for by no one, and a rank outside its own mask takes part in
  // nothing. Every rank on the mover path. Written in stream order by the caller, and under
  // shrink on timeout cleared bit by bit by a wait that timed out (maskAfterTimeout).
  const std::uint32_t* live;     // local
  std::uint32_t* dispatchLive;   // local: the last dispatch's mask (0 when this rank was out)
  const std::uint64_t* zeroMsg;  // local: a count message of zeros (a rank outside the mask; the direct path's)
  // The device barrier (Engine::barrier, kernels/moe/barrier.cu): u32 [R] in every user region,
  // slot q: the barriers rank q and this rank took part in together, as q posted it; and this
  // rank's count of them per peer (local [R]).
  std::uint64_t barrierOff;
  std::uint32_t* barrierPairs;
};

// The direct path (kernels/moe/direct.cu) alone.
struct MoeDirectParams {
  std::uint64_t msgBytes;           // moeDirectMsgBytes (count message + tail)
  std::uint64_t recordFlagsOff;     // u32 [R][W]: source q's records of block w landed: step + 1
  std::uint64_t partialFlagsOff;    // u32 [R][W]: destination q's partials of block w landed
  std::uint64_t dispatchAcksOff;    // u32 [R]: destination q expanded this rank's records
  std::uint64_t combineAcksOff;     // u32 [R]: source q summed this rank's partials
  std::uint64_t valuesOff;          // [R][maxTokens][kMoeMaxValues] fp32 (CombineArgs.rowValues)
  float* valueStage;                // local [R][maxTokens][kMoeMaxValues]
  std::uint32_t* partialArrivals;   // local [R][W]: reduce CTAs done with a block
  std::uint32_t* partialReady;      // local [R][W]: the block's ready flag (step + 1) for the send
  // Local [2][R]: the steps of each operation (dispatch, combine) this rank and rank q both took
  // part in (the active-rank mask), from counterStart: every flag and acknowledgement between the
  // two is that count + 1, so a rank left out of steps finds its pair's flags in step when put
  // back (equal to the steps while no mask left anyone out).
  std::uint32_t* shared;
  std::uint64_t slowFinalNs;        // tests only (GRAPHEP_SLOW_COMBINE_FINAL): the final's wait before it reads
};

// The latency path (kernels/moe/latency.cu) alone.
struct MoeLatencyParams {
  std::uint64_t metaOff;             // a record slot's plain metadata (moeLatencyMetaOff)
  std::uint64_t partialArrivalsOff;  // u32 [R]: CTAs of destination q that sent their partials (the lines say when they landed)
  std::uint64_t weightsOff;          // u64 [2][R][maxTokens][topK]: combine weights, tagged (moeTaggedCount)
  // u64 [2][R][kMoeMaxPlacedCtas]: send CTA c of source q in step s (parity s & 1) has started:
  // moeTaggedCount(s, the CTAs of q's launch) (a receive half's helpers read them, dispatchReceive)
  std::uint64_t placedOff;
  std::int32_t phase;                // kMoeLatencySend | kMoeLatencyReceive
  std::uint32_t* halfLive;           // local: a dispatch send half's mask (peers.live), for its receive half
  // Local [G]: per send CTA of a combine send half, the sources whose combine-time weights it
  // found missing and left to the receive half (bit q), rewritten by every combine send half.
  std::uint32_t* deferred;
  // Local [R]: the combine's partial arrivals expected so far from each rank: they grow by G only
  // in the steps both ranks took part in, as the counters they are waited on do.
  std::uint32_t* expected;
  // Local [2][4], MoeConfig::shrinkOnTimeout (else nullptr): per operation, the ranks its receive
  // part masked after a timeout, its receive CTAs' meeting (count, generation), and the ranks its
  // send part masked. Zero at setup.
  std::uint32_t* shrink;
};

// Operation state and checks (every path).
struct MoeState {
  MoeDeviceStatus* status;
  std::uint32_t* pending;            // kMoePendingCombine | kMoeDispatched
  unsigned long long* timeline;      // stamps then the step trace, or nullptr (profiling off)
  std::int32_t strict;               // trap after counting bad input
};

struct MoeParams {
  MoeShape shape;
  MoeDispatchInput input;
  MoeRouting routing;
  MoeLayout layout;
  MoeCombineArgs combine;
  MoeGrid grid;
  MoeStaging staging;
  MoeMoverParams movers;
  MoeNodeParams node;
  MoePeers peers;
  MoeDirectParams direct;
  MoeLatencyParams latency;
  MoeState state;
};
static_assert(std::is_trivially_copyable_v<MoeParams>, "MoeParams is a by-value kernel parameter");
static_assert(sizeof(MoeParams) <= 4096, "MoeParams must fit the 4 KiB kernel parameter space");

// Threads per CTA of the throughput path's kernels (groups of 128 threads work on one item each).
inline constexpr int kMoeThreads = 512;
inline constexpr int kMoeGroupThreads = 128;

__host__ __device__ inline std::uint32_t moeRouteWords(int maxTokens) {
  return (static_cast<std::uint32_t>(maxTokens) + 31u) / 32u;
}

// Launchers and setup-time kernel loading, one family per file. Each launcher returns the launch
// error; a parameter it refuses is named in the engine's error (kernels/common/launch.h).
// Route (kernels/moe/route.cu): zeroes the routing scratch (a memset node) and runs bits -> prefix
// -> assign.
cudaError_t launchMoeRoute(const MoeParams& p, cudaStream_t stream);
cudaError_t preloadMoeRouteKernels();
// The movers path (kernels/moe/movers.cu): dispatch pack, offsets, expand; combine reduce, final.
// Which records a pack, an expand or a combine reduce takes: this rank's own (while the peers' are
// exchanged) or its peers'.
enum class MoeSources : std::uint32_t { kOwn, kPeers };
// Pack, expand and reduce take the records of list indices `range` to (from) each rank in
// `sources`; final the tokens of `range`. The first peers' pack (range.first 0) also writes the
// count messages and every chunk's send counts; the first peers' reduce checks the pairing.
cudaError_t launchMoePack(const MoeParams& p, MoeSources sources, MoeRange range, cudaStream_t stream);
cudaError_t launchMoeOffsets(const MoeParams& p, cudaStream_t stream);
cudaError_t launchMoeExpand(const MoeParams& p, MoeSources sources, MoeRange range, cudaStream_t stream);
cudaError_t launchMoeCombineReduce(const MoeParams& p, MoeSources sources, MoeRange range, cudaStream_t stream);
cudaError_t launchMoeCombineFinal(const MoeParams& p, MoeRange range, cudaStream_t stream);
// The node-aware dispatch and combine (kernels/moe/node.cu; MoeNodeParams): one CTA posts one of this rank's four
// signals to every other rank of its node, or waits, bounded, for theirs; forward writes the hop
// records that landed here (every source on another node whose landing rank this is) into the
// fwdRecv slots of their destinations on this node; node-sum sums the node's partials of each of
// those hop records into partialStage. Both on grid.epilogueCtas CTAs.
inline constexpr int kMoeNodeReady = 0;
inline constexpr int kMoeNodeForwarded = 1;
inline constexpr int kMoeNodeReduced = 2;
inline constexpr int kMoeNodeSummed = 3;
inline constexpr int kMoeNodeSignals = 4;
cudaError_t launchMoeNodePost(const MoeParams& p, int which, cudaStream_t stream);
cudaError_t launchMoeNodeWait(const MoeParams& p, int which, cudaStream_t stream);
cudaError_t launchMoeForward(const MoeParams& p, cudaStream_t stream);
cudaError_t launchMoeNodeSum(const MoeParams& p, cudaStream_t stream);
cudaError_t preloadMoeNodeKernels();
cudaError_t preloadMoeMoversKernels();
// The direct path (kernels/moe/direct.cu; every peer load/store):
// route, then send (grid.budgetCtas CTAs) and receive (grid.epilogueCtas CTAs).
// fp8: every live row quantised once, on grid.epilogueCtas CTAs, into staging.recordStage ([T][payloadBytes]).
cudaError_t launchMoeDirectQuantize(const MoeParams& p, cudaStream_t stream);
cudaError_t launchMoeDirectSend(const MoeParams& p, cudaStream_t stream);
cudaError_t launchMoeDirectReceive(const MoeParams& p, cudaStream_t stream);
// Its combine: reduce (grid.epilogueCtas CTAs), send (grid.budgetCtas CTAs), final (grid.epilogueCtas CTAs).
cudaError_t launchMoeDirectCombineReduce(const MoeParams& p, cudaStream_t stream);
cudaError_t launchMoeDirectCombineSend(const MoeParams& p, cudaStream_t stream);
cudaError_t launchMoeDirectCombineFinal(const MoeParams& p, cudaStream_t stream);
cudaError_t preloadMoeDirectKernels();
// Setup: whether the GPU can place clusters of `cluster` (2 or more) CTAs of each clustered direct epilogue
// kernel (receive, combine reduce, combine final) in a grid of `ctas` (a multiple of it). An error
// of the query itself (a size the GPU does not support) reads as "does not fit".
cudaError_t moeDirectEpilogueFits(int cluster, int ctas, bool* fits);
// Setup: CTAs of the direct kernels (the lowest over them) that fit on one SM.
cudaError_t moeDirectCtasPerSm(int* ctas);
// DeepEP's get_dispatch_layout (kernels/moe/token_layout.cu; graphep::tokenLayout): the outputs are
// zeroed (memset nodes) and filled by one kernel.
struct MoeTokenLayoutParams {
  const void* topkIdx;        // [numTokens, topK] int32 / int64
  std::int32_t int64Ids;
  std::int32_t numTokens, topK, numExperts, numRanks;
  std::int32_t* tokensPerRank;    // [numRanks]
  std::int32_t* tokensPerExpert;  // [numExperts]
  std::uint8_t* tokenInRank;      // [numTokens, numRanks]
};
cudaError_t launchMoeTokenLayout(const MoeTokenLayoutParams& p, cudaStream_t stream);
cudaError_t preloadMoeTokenLayoutKernels();

// Latency path: one kernel per operation (kernels/moe/latency.cu; the dispatch's, one per wire
// format and receive layout): a launch runs the send (G = grid.budgetCtas CTAs), the receive or
// both (MoeParams::latency.phase). The combine's send is CTAs [0, G) and its receive
// [G, G + E) of a whole launch (E = epilogueCtas; a receive half alone, E CTAs); the dispatch's
// too where its receivers' first items cover the capacity, else every
// CTA runs each part it holds (a launch with the receive, G + E CTAs; a receive half alone: E
// receivers and G helpers). Dynamic shared memory moeLatencySmem(...).bytes for the dispatch.
inline constexpr int kMoeLatencyMaxTokens = 256;
inline constexpr int kMoeLatencyMaxEntries = 4096;  // tokens x top-k
inline constexpr int kMoeLatencyThreads = 512;
inline constexpr std::uint32_t kMoeLatencyMaxSmem = 96u << 10;
inline constexpr std::int32_t kMoeLatencySend = 1;
inline constexpr std::int32_t kMoeLatencyReceive = 2;
// MoePeers::lastCtaCounters[kMoeItemClaims + P]: the latency dispatch receive's item claims in the
// steps of parity P; the last CTA of a step resets the other parity's (claimed in the step
// before, whose kernel has ended), so that no reset races a claim.
inline constexpr int kMoeItemClaims = 2;
// The send CTAs of a latency dispatch launch that post their start (MoeLatencyParams::placedOff);
// a launch of more posts none past it, and no receive half's helper then takes part.
inline constexpr int kMoeMaxPlacedCtas = 256;

// MoeParams::input.scaleFormat (graphep::Fp8Scales).
inline constexpr std::int32_t kMoeScaleFloat = 0;
inline constexpr std::int32_t kMoeScalePow2 = 1;
inline constexpr std::int32_t kMoeScaleUe8m0 = 2;

// Byte offsets of the latency dispatch's dynamic shared memory: the send's routing (ids, their
// weights, a bit per token for each expert and for each destination rank), the receive's copy of
// every source's count message ([R][1 + E_local] u64) and the first row of each (source, local
// expert) ([R][E_local] = E ints). The layout's scan is in static shared memory.
struct MoeLatencySmem {
  std::uint32_t ids, weights, expBits, dstBits, msgs, srcBase, bytes;
};
__host__ __device__ inline MoeLatencySmem moeLatencySmem(int maxTokens, int topK, int numExperts, int numRanks) {
  const std::uint32_t W = (static_cast<std::uint32_t>(maxTokens) + 31u) / 32u;
  const std::uint32_t E = static_cast<std::uint32_t>(numExperts), R = static_cast<std::uint32_t>(numRanks);
  MoeLatencySmem o{};
  const std::uint32_t entries = static_cast<std::uint32_t>(maxTokens) * static_cast<std::uint32_t>(topK);
  o.ids = 0;
  o.weights = o.ids + entries * 4u;
  o.expBits = o.weights + entries * 4u;
  o.dstBits = o.expBits + E * W * 4u;  // dstBits follows expBits (one zeroing pass clears both)
  o.msgs = (o.dstBits + R * W * 4u + 7u) & ~7u;
  o.srcBase = o.msgs + (R + E) * 8u;
  o.bytes = (o.srcBase + E * 4u + 15u) & ~15u;
  return o;
}

// The launch of p.latency.phase's parts of a dispatch / combine (G + epilogueCtas CTAs for both), the
// programmatic dependent of the stream's last kernel.
cudaError_t launchMoeLatencyDispatch(const MoeParams& p, cudaStream_t stream);
cudaError_t launchMoeLatencyCombine(const MoeParams& p, cudaStream_t stream);
// Loads the seven kernels (the dispatch's six, one per wire format and receive layout, and the
// combine) and allows the dispatch's the largest dynamic shared memory.
cudaError_t preloadMoeLatencyKernels();

// CTAs of the latency kernels (the lowest of the seven) that fit on one SM.
cudaError_t moeLatencyCtasPerSm(std::uint32_t smemBytes, int* ctas);

// kernels/moe/barrier.cu: the device barrier among the ranks of the active-rank mask (one CTA;
// MoePeers::barrierOff and barrierPairs; with p.latency.shrink a peer that does not come within
// the timeout is masked).
cudaError_t launchMoeBarrier(const MoeParams& p, cudaStream_t stream);
cudaError_t preloadMoeBarrierKernels();

}  // namespace graphep
