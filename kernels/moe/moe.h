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

#include <graphep/types.hpp>

#include "kernels/common/pipe.h"
#include "kernels/common/sync_handle.h"

namespace graphep {

inline constexpr int kMoeMaxTopK = 16;
inline constexpr int kMoeMaxLocalExperts = 1024;

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
};

// MoeParams::pending, set by each operation's last kernel: bit 0 between a dispatch and a combine
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
  // The throughput path's direct dispatch (kernels/moe/direct.cu), after route: quantise (fp8),
  // send, receive (layout + expand), and the receive's two phases: this rank's own rows, the
  // peers' records.
  kDirectQuantize, kDirectSend, kDirectReceive, kDirectOwn, kDirectPeers,
  // Its combine: reduce (the peers' partials, staged), send (into the sources' slots), final
  // (own partials + sum).
  kDirectCombineReduce, kDirectCombineSend, kDirectCombineFinal,
  kCombineReduce, kCombineFinal,
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

struct MoeParams {
  // Shape. topK, fp8 and payloadBytes are the dispatch's own (DispatchArgs.topK, .input): at most
  // the config's top-k, and a record slot holds the config's largest record (recBytes).
  std::int32_t rank, numRanks, hidden, topK, numExperts, localExperts, maxTokens;
  std::int32_t fp8;        // dispatch in fp8 e4m3 (records carry fp8 tiles)
  std::int32_t int64Ids;   // topkIdx holds int64
  std::int32_t alignment;  // per-expert row alignment of recv_x
  std::int32_t strict;     // trap after counting bad input
  std::int64_t capacity;   // rows of recv_x
  // Batched receive layout: rows per local expert (expert j's rows start at j x batchedRows, and an
  // expert keeps its first batchedRows rows); 0: expert-major (rows packed, aligned).
  std::int64_t batchedRows;
  // Rank-major receive layout: one row per record (source token, this rank), sources one after
  // another (rankOffsets [R + 1]), each row's top-k local experts and weights (rowExperts,
  // rowExpertWeights [capacity][topK], -1 / 0 where a slot's expert is not here).
  std::int32_t rankMajor;
  std::int32_t* rankOffsets;
  void* rowExperts;          // int32, or int64 with rowExperts64 (a caller's output for int64 ids)
  std::int32_t rowExperts64;
  float* rowExpertWeights;
  // Rank-major: rows of recvX / recvScales / row metadata this dispatch may write (the caller's
  // DispatchOutputs.rows, or the capacity); a row past it is dropped and counted.
  std::int64_t outRows;
  // [R][R] or nullptr (the direct dispatch): [i][j] = records ranks 0 .. i send to rank j.
  std::int32_t* rankPrefix;
  std::uint64_t recBytes, payloadBytes, cntMsgBytes;
  std::uint64_t directMsgBytes;  // moeDirectMsgBytes (the direct dispatch's count messages)

  // Inputs (dispatch).
  const void* x;             // [T, H] bf16, or e4m3 bytes with fp8Input
  const void* topkIdx;       // [T, K] int32 / int64; nullptr with topK 0 (tokenInRank routing alone)
  const float* topkWeights;  // [T, K]
  const int* numTokens;      // device scalar
  // [T, R] bytes or nullptr: a token goes to rank r when tokenInRank[t][r] != 0 (its top-k entries
  // whose expert lives on such a rank become its slots there, the others are left out); nullptr:
  // to the ranks of its top-k experts.
  const std::uint8_t* tokenInRank;
  // Engine-quantised fp8: the scales' form (MoeScaleFormat: fp32, fp32 powers of two, or UE8M0
  // exponent bytes in recvScales as [rows][H / 128] bytes). Latency path.
  std::int32_t scaleFormat;
  // [E_local] or nullptr: each local expert's rows of this dispatch (kept or dropped) are added.
  std::int32_t* recvStats;
  // x holds e4m3 bytes quantised by the caller, with fp32 scales xScales[t * scaleTokenStride +
  // j * scaleHiddenStride] for values [128 j, 128 j + 128) (the direct dispatch packs them).
  std::int32_t fp8Input;
  const float* xScales;
  std::int64_t scaleTokenStride, scaleHiddenStride;

  // Routing scratch (local).
  std::int32_t* liveTokens;   // [1] the clamped live count of the last dispatch
  std::int32_t* tokRankIdx;   // [maxTokens, R]: index in the rank's list or -1
  std::int32_t* entryIdx;     // [maxTokens, K]: index within the expert's list from this rank
  std::uint32_t* expertCount; // [E]: this rank's entries per expert
  std::uint32_t* rankCount;   // [R]: this rank's records per destination
  // Throughput routing (kernels/moe/route.cu), W = ceil(maxTokens / 32) words per row. Zeroed
  // before every dispatch (routeZeroBytes from routeBits): routeBits [E + R][W] (a bit per token
  // holding the expert / going to the rank), routeCount [E][W] (entries per expert per 32 tokens),
  // routeDup [1] (some token holds an expert twice). Then routePrefix [E + R][W]: entries (tokens)
  // before each 32-token block.
  std::uint32_t* routeBits;
  std::uint32_t* routeCount;
  std::uint32_t* routeDup;
  std::uint32_t* routePrefix;
  std::uint64_t routeZeroBytes;
  // CTAs of the throughput path's kernels (kMoeThreads each; the SM budget, or the SM count), the
  // same on every rank (the direct dispatch's arrival counters count them).
  std::int32_t ctas;
  // CTAs of the direct path's epilogue kernels (kernels/moe/direct.cu: fp8 quantise, receive,
  // combine reduce, combine final): by default the SMs the SM budget leaves free. They only touch
  // local memory, so they are not held to the SM budget.
  std::int32_t epilogueCtas;
  // The cluster size of the direct epilogues' launches (receive, combine reduce, combine final):
  // epilogueCtas is a multiple of it. Chosen at setup (moeDirectEpilogueFits); nothing in the
  // kernels depends on it.
  std::int32_t epilogueCluster;

  // Records and count messages.
  char* recSend;              // [R][maxTokens][recBytes] (local)
  const char* recRecv;        // [R][maxTokens][recBytes] (this rank's heap: peers write it)
  char* cntSend;              // [R][cntMsgBytes]
  const char* cntRecv;        // [R][cntMsgBytes]

  // Movers' device count arrays (bytes): dispatch records and combine partials.
  std::uint64_t* dispSendCounts;
  std::uint64_t* dispRecvCounts;
  std::uint64_t* combSendCounts;
  std::uint64_t* combRecvCounts;

  // Dispatch layout (local).
  std::int32_t* recvRows;      // [R]: records received from each source
  std::int32_t* srcBase;       // [R][E_local]: first row of (source, expert) in recv_x
  std::int32_t* expertOffsets; // [E_local + 1]
  std::int32_t* expertCounts;  // [E_local]: rows kept (offsets + counts stay within the capacity)
  std::int32_t* expertDropped; // [E_local]: rows past the capacity, dropped (this dispatch)
  std::int32_t* numRecvRows;   // [1]: rows kept
  // Expert-major / batched, or nullptr: [E_local][R] kept rows of (expert j, source q) as
  // begin << 32 | count, begin from the expert's first row.
  std::int64_t* sourceRanges;
  unsigned long long* expertTotals;  // [E_local], cumulative
  char* recvX;                 // [capacity, H] bf16 or fp8
  float* recvScales;           // [capacity, H / 128] (fp8)
  std::int32_t* rowSrcRank;    // [capacity]
  std::int32_t* rowSrcToken;
  std::int32_t* rowTopkSlot;
  float* rowWeight;

  // Combine.
  const char* y;               // [yRows, H] bf16 expert outputs
  std::int64_t yRows;          // rows of y; a row the layout places past them adds nothing (counted)
  // Rank-major on the direct path, or nullptr: fp32 [yRows][numValues] per received row, summed
  // over the destination ranks into outValues [T][numValues] like the rows (fp32, rank order),
  // staged in combValSend [R][maxTokens][kMoeMaxValues] and landing in the heap's llCombValOff
  // region of the same shape.
  const float* rowValues;
  float* outValues;
  std::int32_t numValues;
  float* combValSend;
  char* combSend;              // [R][maxTokens][H] bf16 partials (local)
  const char* combRecv;        // [R][maxTokens][H] bf16 partials (this rank's heap)
  char* out;                   // [T, H] bf16
  // Latency path, or nullptr: [T][topK] fp32 top-k weights given to the combine, in place of the
  // dispatch's. Each source sends its tokens' weights to their destinations ahead of the sums:
  // llCombWOff [2][R][maxTokens][topK(config)] fp32 (by the combine step's parity; [.][q][i]: the
  // weights of source q's record i), flagged by llCombWFlagOff [R] (u32 monotonic: combine step + 1).
  const float* combineWeights;

  MoeDeviceStatus* status;
  // 1 between a dispatch and its combine (set by the dispatch's last kernel, cleared by the
  // combine's): an operation that finds it in the wrong state is counted (MoeDeviceStatus).
  std::uint32_t* pending;

  // Latency path (kernels/moe/latency.cu; the direct dispatch, kernels/moe/direct.cu, uses llRecOff
  // for its [R][maxTokens][recBytes] records (recRecv), llCnt for [2][R] messages of
  // directMsgBytes, llFlag, llSteps, llDone as described here, llBlockOff: u32 monotonic flags
  // [R][ceil(maxTokens / 32)], source q's records of tokens [32 w, 32 w + 32) have landed: step + 1;
  // and its combine llCombOff for the [R][maxTokens][2H] partials (combRecv) and llCombBlockOff:
  // flags [R][ceil(maxTokens / 32)], destination q's partials of records [32 w, 32 w + 32) have
  // landed: combine step + 1). Regions of every rank's symmetric user region, at the
  // same offsets on every rank: llRec [2][R][maxTokens][recBytes] records from each source,
  // llCnt [2][R][cntMsgBytes] their count messages, llComb [2][R][maxTokens][H] bf16 partials from
  // each destination; u32 monotonic counters [R]: llFlag (source q's count message of step s has
  // landed: s + 1), llArrive (CTAs of source q whose records have landed: G per step), llCombArrive
  // (CTAs of peer destination q whose partials have landed: G per step; a rank's own slot is never
  // posted, its receiver reducing its own records).
  // [2]: by the parity of the operation's step, so consecutive operations never share a buffer.
  // The direct path's acknowledgements, u32 monotonic [R] in the waiting (writing) rank's heap:
  // llDispAckOff[q] = step + 1 once destination q has expanded this rank's records of dispatch
  // `step`, llCombAckOff[q] = step + 1 once source q has summed this rank's partials of combine
  // `step`; a dispatch (combine) writes into q only after q's ack of the previous one, so
  // dispatch -> dispatch and combine -> combine never overwrite what a peer still reads.
  char* peerUser[kMaxRanks];  // every rank's user region as this rank sees it (its own included)
  std::uint64_t llRecOff, llCntOff, llCombOff, llFlagOff, llArriveOff, llCombArriveOff, llBlockOff, llCombBlockOff;
  std::uint64_t llDispAckOff, llCombAckOff, llCombValOff, llCombWOff, llCombWFlagOff;
  // Latency path: the parts of the operation this launch runs (kMoeLatencySend | kMoeLatencyReceive).
  std::int32_t llPhase;
  std::uint32_t* llSteps;     // local [2]: dispatch and combine steps (monotonic)
  std::uint32_t* llDone;      // local [2]: last-CTA counters of the dispatch's and the combine's last kernels
  // Direct combine, local [R][routeWords(maxTokens)]: the reduce's CTAs done with a block of a
  // peer's records (the last resets it), and the block's ready flag (step + 1) for the send.
  std::uint32_t* combArrive;
  std::uint32_t* combReady;
  // G: CTAs of each latency sender, the same on every rank (the arrival counters count them). When
  // ranks share a GPU, all their senders and receivers must fit at once (a receiver may spin while
  // another rank's sender waits for room).
  std::int32_t llCtas;
  SyncHandle sync;            // bounded waits (timeout, error record)

  // [kMoeStampWords * MoeKernel::kCount] then the step trace [kMoeTraceWords], or nullptr (profiling off)
  unsigned long long* timeline;
};

// Threads per CTA of the throughput path's kernels (groups of 128 threads work on one item each).
inline constexpr int kMoeThreads = 512;
inline constexpr int kMoeGroupThreads = 128;

__host__ __device__ inline std::uint32_t moeRouteWords(int maxTokens) {
  return (static_cast<std::uint32_t>(maxTokens) + 31u) / 32u;
}

// Launchers (each returns the launch error) and setup-time kernel loading, one family per file:
// kernels/moe/route.cu, kernels/moe/movers_dispatch.cu (pack, offsets, expand), kernels/moe/movers_combine.cu.
// Route: zeroes the routing scratch (a memset node) and runs bits -> prefix -> assign.
cudaError_t launchMoeRoute(const MoeParams& p, cudaStream_t stream);
cudaError_t preloadMoeRouteKernels();
cudaError_t launchMoePack(const MoeParams& p, cudaStream_t stream);
cudaError_t launchMoeOffsets(const MoeParams& p, cudaStream_t stream);
cudaError_t launchMoeExpand(const MoeParams& p, cudaStream_t stream);
cudaError_t preloadMoeDispatchKernels();
// Direct dispatch (every peer load/store, each rank on a GPU of its own): route, then send (ctas
// CTAs) and receive (epilogueCtas CTAs).
// fp8: every live row quantised once, on epilogueCtas CTAs, into recSend ([T][payloadBytes]).
cudaError_t launchMoeDirectQuantize(const MoeParams& p, cudaStream_t stream);
cudaError_t launchMoeDirectSend(const MoeParams& p, cudaStream_t stream);
cudaError_t launchMoeDirectReceive(const MoeParams& p, cudaStream_t stream);
// Its combine: reduce (epilogueCtas CTAs), send (ctas CTAs), final (epilogueCtas CTAs).
cudaError_t launchMoeDirectCombineReduce(const MoeParams& p, cudaStream_t stream);
cudaError_t launchMoeDirectCombineSend(const MoeParams& p, cudaStream_t stream);
cudaError_t launchMoeDirectCombineFinal(const MoeParams& p, cudaStream_t stream);
cudaError_t preloadMoeDirectKernels();
// Setup: whether the GPU can place clusters of `cluster` (2 or more) CTAs of each clustered direct epilogue
// kernel (receive, combine reduce, combine final) in a grid of `ctas` (a multiple of it). An error
// of the query itself (a size the GPU does not support) reads as "does not fit".
cudaError_t moeDirectEpilogueFits(int cluster, int ctas, bool* fits);
cudaError_t launchMoeCombineReduce(const MoeParams& p, cudaStream_t stream);
cudaError_t launchMoeCombineFinal(const MoeParams& p, cudaStream_t stream);
cudaError_t preloadMoeCombineKernels();
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

// Latency path: one kernel per operation (kernels/moe/latency.cu): G = llCtas CTAs send and
// epilogueCtas CTAs beside them receive; a launch runs the send, the receive or both
// (MoeParams::llPhase). Dynamic shared memory moeLatencySmem(...).bytes when it sends.
inline constexpr int kMoeLatencyMaxTokens = 256;
inline constexpr int kMoeLatencyMaxEntries = 4096;  // tokens x top-k
inline constexpr int kMoeLatencyThreads = 512;
inline constexpr std::uint32_t kMoeLatencyMaxSmem = 96u << 10;
inline constexpr std::int32_t kMoeLatencySend = 1;
inline constexpr std::int32_t kMoeLatencyReceive = 2;

// MoeParams::scaleFormat (graphep::Fp8Scales).
inline constexpr std::int32_t kMoeScaleFloat = 0;
inline constexpr std::int32_t kMoeScalePow2 = 1;
inline constexpr std::int32_t kMoeScaleUe8m0 = 2;

// Byte offsets of the latency dispatch sender's dynamic shared memory: the routing (ids, their
// weights, a bit per token for each expert and for each destination rank). The receive layout is
// in static shared memory.
struct MoeLatencySmem {
  std::uint32_t ids, weights, expBits, dstBits, bytes;
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
  o.bytes = (o.dstBits + R * W * 4u + 15u) & ~15u;
  return o;
}

// The launch of p.llPhase's parts of a dispatch / combine (G + epilogueCtas CTAs for both), the
// programmatic dependent of the stream's last kernel.
cudaError_t launchMoeLatencyDispatch(const MoeParams& p, cudaStream_t stream);
cudaError_t launchMoeLatencyCombine(const MoeParams& p, cudaStream_t stream);
// Loads the two kernels and allows them the largest dynamic shared memory.
cudaError_t preloadMoeLatencyKernels();
// CTAs of the latency kernels (the lower of the two) that fit on one SM.
cudaError_t moeLatencyCtasPerSm(std::uint32_t smemBytes, int* ctas);

}  // namespace graphep
