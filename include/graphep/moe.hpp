// MoE expert parallelism: the Engine (docs/DESIGN.md §5). An Engine is one rank's view of a group of
// ranks that share experts: experts are partitioned contiguously (expert e lives on rank
// e / (numExperts / worldSize)). dispatch() sends every token to the ranks that hold its top-k
// experts and lays the received rows out grouped by local expert; combine() brings the expert
// outputs home and reduces them with the top-k weights.
//
// Setup (create) is collective and never capturable. dispatch() and combine() are capturable:
// they never synchronise with the host, read device memory back or allocate, and every size they
// bake into a graph is the configured maximum, so one captured graph serves any live token count.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <graphep/comm.hpp>
#include <graphep/types.hpp>

namespace graphep {

enum class DType : std::uint8_t {
  kBf16 = 0,
  // e4m3 with one fp32 scale per 128 values, quantised on the fly. Per 128-value tile: scale =
  // max(amax, 448 x 2^-126) / 448 (1 for an all-zero tile; the floor keeps 1 / scale finite), each
  // value e4m3(x * (1 / scale)) in fp32, rounded to nearest even and saturating at +-448
  // (Fp8Scales: the scales' other forms). A token's row is quantised once per dispatch and every
  // destination rank receives the same bytes (on the latency path the own rank re-quantises it
  // from x with the same arithmetic: the same bytes).
  kFp8E4m3 = 1,
};

enum class IndexType : std::uint8_t { kInt32 = 0, kInt64 = 1 };

// How dispatch and combine move data (docs/DESIGN.md §5).
enum class MoePath : std::uint8_t {
  kAuto = 0,        // latency when maxTokensPerRank <= 256 and every peer is on this GPU or over NVLink
  kLatency = 1,     // decode: records written straight into per-source slots, their counts ahead
                    // of them, a sender and a receiver per operation (maxTokensPerRank <= 256,
                    // maxTokensPerRank * topK <= 4096, peers on this GPU or over NVLink only:
                    // its 128-byte payload lines need stores that land whole, not PCIe)
  kThroughput = 2,  // prefill: counts first, then the pipelined alltoallv movers
};

// How dispatch lays out the rows a rank receives (DispatchLayout), on either path; combine takes
// the expert outputs in the same layout.
enum class ReceiveLayout : std::uint8_t {
  kExpertMajor = 0,  // rows grouped by local expert, packed (each expert's first row aligned):
                     // what m-grouped contiguous GEMMs take
  kBatched = 1,      // [E_local, rowsPerExpert, H]: expert j's rows start at j x rowsPerExpert,
                     // the per-expert counts on the device (masked / batched GEMMs)
  kRankMajor = 2,    // one row per (source token, this rank), sources one after another, each
                     // row's top-k local experts and weights: the fewest bytes, for grouped GEMMs
                     // that gather rows; the experts sum a row's slots (weights applied) into its
                     // one output row, and combine sums those rows over the ranks
};

// The names graphep's messages, graphep-bench and the tests use: "auto", "latency", "throughput";
// "expert-major", "batched", "rank-major" ("?" for a value outside the enum).
const char* name(MoePath path);
const char* name(ReceiveLayout layout);

struct MoeConfig {
  int maxTokensPerRank = 0;  // T_max: rows of x per dispatch at most
  int hidden = 0;            // H: a multiple of 8 (of 128 for fp8), at most 65536
  int numExperts = 0;        // E: a multiple of the world size
  int topK = 0;              // K: 1 .. min(E, 16)
  DType dispatchType = DType::kBf16;
  // Rows of recv_x per rank, expert-major (the other layouts size themselves: leave 0). 0:
  // Engine::worstCaseCapacity, T_max * worldSize * min(K, E / worldSize) + (E / worldSize) *
  // (expertAlignment - 1). Every (token, slot) that names a local expert is a row, repeats
  // included, so rows can still be dropped when topK > E / worldSize, tokens name one expert in
  // several slots and more than T_max * worldSize * (E / worldSize) rows arrive. Smaller values
  // are allowed; rows past the capacity are dropped and counted.
  long long recvCapacity = 0;
  int expertAlignment = 1;  // each local expert's rows start at a multiple of this (expert-major)
  ReceiveLayout receiveLayout = ReceiveLayout::kExpertMajor;
  // kBatched: rows per local expert (recvCapacity stays 0; the capacity is E_local x this). 0:
  // worldSize x T_max (every token once; a token naming one expert in several slots can pass it);
  // rows past it are dropped and counted. A decode-sized layout:
  // the engine refuses by name one whose buffers do not fit the device.
  long long rowsPerExpert = 0;
  // CTAs (SMs) each engine kernel may use, those epilogueSms sets aside: on the throughput path
  // the CTAs of each routing / layout / reduce / send kernel and the data movers' channels per
  // peer (0: on the direct dispatch the CTAs that carry the link as measured at setup, or with
  // ranks sharing a GPU a sixth of each rank's share of it, which also caps a budget; else one
  // per SM; the movers' channels by message size, at most 32); on the latency path the combine's
  // send CTAs (the dispatch sends on every CTA of its launch) (0: 64; lowered when ranks share a
  // GPU, so that all their CTAs are resident at once).
  int smBudget = 0;
  // CTAs of the receiving side, which runs beside the senders (smBudget).
  // Throughput path with the direct dispatch (every peer by load/store): the
  // dispatch's fp8 quantise and receive (layout + expansion), the combine's reduce and final;
  // this many, at most the SM count (0: the SMs the send leaves free, or every SM when it leaves
  // fewer than half), rounded down to a multiple of the epilogue cluster size
  // (GRAPHEP_EPILOGUE_CLUSTER). The movers' throughput path: the CTAs of pack, expand, combine
  // reduce and final, chosen the same way (no clusters). Latency path: the
  // receive part of each dispatch and combine launch; this many (0: one per SM; ranks sharing a
  // GPU: as many as the senders), at most the CTAs the GPU holds at once less the senders (ranks
  // sharing a GPU: half of their share), at least 1.
  int epilogueSms = 0;
  // Trap (kill the kernel) on bad input instead of counting it.
  bool strict = false;
  MoePath path = MoePath::kAuto;
  // Every engine kernel stamps its span (first CTA in, last CTA out) for Engine::timeline():
  // diagnostics, a few atomics per CTA.
  bool profile = false;
  // Initial value of every monotonic device counter (flags, steps, arrival counts) of this engine
  // and its movers. Tests start it just below 2^32 so replays cross the wrap; 0 otherwise.
  std::uint32_t counterStart = 0;
  // Latency path only (DeepEP's shrink mode): a wait on a peer that has not arrived when its
  // timeout (GRAPHEP_TIMEOUT_MS) ends masks that peer instead of failing the engine, and the
  // operation goes on among the others, its results exact for them: the peer's count message,
  // its combine weights or all of its partials never came. It is cleared from the active-rank
  // mask (the next operations leave it out from the start) and reported in
  // MoeStatus::shrunkRanks. A peer whose records came in part still fails the engine (recover).
  // A late peer that comes back after being masked is not detected (as with recover).
  bool shrinkOnTimeout = false;
};

// One kernel's (or kernel phase's) span over the operations since Engine::resetTimeline(), in
// microseconds from the earliest stamp (MoeConfig.profile), and the mean time one CTA spent in it
// (waits included): meaningful over graph replays too, where the span covers every replay.
struct MoeKernelSpan {
  const char* kernel;
  double startUs;
  double endUs;
  double meanCtaUs;
  unsigned long long samples;  // CTA executions counted
  // The span in the GPU's global timer (ns): comparable across engines and kernels of one GPU.
  unsigned long long startNs, endNs;
};

// One latency-path operation's events (MoeConfig.profile): ns[e] the GPU's global timer (ns; 0:
// not reached) at event e, a MoeTraceEvent (include/graphep/types.hpp says what each is).
struct MoeStepTrace {
  bool combine = false;
  unsigned long long ns[static_cast<int>(MoeTraceEvent::kCount)] = {};
  unsigned long long at(MoeTraceEvent e) const { return ns[static_cast<int>(e)]; }
};

// The direct path's block flags as this rank holds them (Engine::directBlockFlags, diagnostics).
// W = blocksPerRank = ceil(maxTokensPerRank / 32). records[q * W + w]: source q's flag for its
// records of tokens [32 w, 32 w + 32) here; partials[q * W + w]: destination q's flag for its
// partials of this rank's records [32 w, 32 w + 32) here; each the step after the operation that
// last posted it. dispatchStep / combineStep: this rank's step counters, the step after its last
// dispatch / combine. After every operation every peer's flags equal them, the flags of the
// blocks that operation left empty included (none falls behind: 2^31 steps behind, a flag would
// read as ahead in the wrap-safe comparison of a wait).
struct DirectBlockFlags {
  int blocksPerRank = 0;
  std::uint32_t dispatchStep = 0, combineStep = 0;
  std::vector<std::uint32_t> records, partials;
  // [R][blocksPerRank], local: the combine's reduce marks each peer's block of partials ready for
  // this rank's send (the combine step + 1), every block every combine.
  std::vector<std::uint32_t> partialsReady;
  // [2][R]: the dispatches (row 0) and combines (row 1) this rank and rank q both took part in
  // (the active-rank mask), from counterStart. The flags from q equal them after every operation
  // q took part in (the steps themselves while no mask left anyone out).
  std::vector<std::uint32_t> pairSteps;
};

// What a dispatch's x holds and how its rows travel (DispatchArgs.input).
enum class DispatchInput : std::uint8_t {
  kConfig = 0,       // x bf16, sent as MoeConfig.dispatchType
  kBf16 = 1,         // x bf16, sent as bf16 (not on an engine whose dispatchType is fp8: its records
                     // have room for fp8 rows only)
  kFp8Quantize = 2,  // x bf16, quantised by the engine as DType::kFp8E4m3 says (once per token,
                     // the same bytes to every destination rank)
  kFp8 = 3,          // x e4m3 bytes [T, H] quantised by the caller, with DispatchArgs.xScales: sent
                     // as they are
};

// The fp8 scales of an engine-quantised dispatch (DispatchArgs.scaleFormat). Not kFloat: latency
// path. The values are quantised with the scale each form holds.
enum class Fp8Scales : std::uint8_t {
  kFloat = 0,  // fp32, max(amax, 448 x 2^-126) / 448 per 128 values (1 for an all-zero tile)
  kPow2 = 1,   // fp32, that scale rounded up to a power of two (DeepEP's round_scale)
  kUe8m0 = 2,  // those powers of two as their biased exponent bytes (UE8M0), recvScales then holds
               // [rows][H / 128] bytes: four per int32, value 4w + i in byte i (DeepEP's use_ue8m0)
};

// Which part of an operation a call enqueues (DispatchArgs.half, CombineArgs.half). Latency path.
enum class MoeHalf : std::uint8_t {
  kWhole = 0,  // one kernel: the send, then the receive in the same launch
  kSend = 1,   // the send half alone; Engine::receive() enqueues the receive half later (the
               // stream may run other work between them, e.g. the other micro-batch's GEMMs)
};

// The caller's own buffers for one dispatch's received rows, instead of the engine's (rank-major
// layout, throughput path with every peer by load/store). Every pointer is
// optional (nullptr: the engine's buffer, or not written); the rows go where they would in the
// engine's (source rank, then source token order). A row at or past `rows` is dropped and counted
// (MoeStatus.droppedRows); the published layout (DispatchLayout.numRecvRows, rankOffsets) still
// counts it.
struct DispatchOutputs {
  void* recvX = nullptr;               // [rows, H] bf16, or e4m3 bytes for an fp8 dispatch
  float* recvScales = nullptr;         // fp8: [rows, H / 128]
  void* rowExperts = nullptr;          // [rows, topK]: local expert per slot (-1: not here), int32 or
                                       // int64 as DispatchArgs.indexType
  float* rowExpertWeights = nullptr;   // [rows, topK]: its weight (0 where the slot is -1)
  int* rowSrcRank = nullptr;           // [rows]
  int* rowSrcToken = nullptr;          // [rows]
  int* rankPrefixMatrix = nullptr;     // [R, R]: [i][j] = rows ranks 0 .. i send to rank j
  long long rows = 0;                  // rows of the buffers above (0: the engine's capacity)
};

struct DispatchArgs {
  const void* x = nullptr;             // [T, H] bf16 (e4m3 bytes with kFp8), 16-byte aligned
  const void* topkIdx = nullptr;       // [T, K] global expert ids, -1 = none
  IndexType indexType = IndexType::kInt32;
  const float* topkWeights = nullptr;  // [T, K]
  const int* numTokens = nullptr;      // device scalar: the live T (clamped to [0, T_max])
  // Columns of topkIdx / topkWeights in this dispatch, at most MoeConfig.topK (0: MoeConfig.topK;
  // with tokenInRank, 0 and topkIdx nullptr: no slots), the same on every rank of one dispatch (a
  // record's slots, and the combine's weights, are read with the receiving rank's). The
  // engine-owned rowExperts / rowExpertWeights views then have this many columns.
  int topK = 0;
  // [T, R] bytes (bool) or nullptr: route token t to rank r when tokenInRank[t][r] != 0 (DeepEP's
  // is_token_in_rank); its top-k entries whose expert lives on such a rank become its slots there,
  // the others are left out. nullptr: to the ranks of its top-k experts. Rank-major layout,
  // throughput path.
  const bool* tokenInRank = nullptr;
  DispatchInput input = DispatchInput::kConfig;
  // kFp8: fp32 scales, value j of token t scaled by xScales[t * scaleTokenStride + (j / 128) *
  // scaleHiddenStride] (0 and 0: H / 128 and 1, row-major). Direct dispatch only (every peer by
  // load/store).
  const float* xScales = nullptr;
  long long scaleTokenStride = 0;
  long long scaleHiddenStride = 0;
  // kFp8Quantize (or kConfig on an fp8 engine): the scales' form. Not kFloat: latency path.
  Fp8Scales scaleFormat = Fp8Scales::kFloat;
  // [E_local] int32 or nullptr: each local expert's rows of this dispatch (kept or dropped) are
  // added to it on the device (DeepEP's cumulative_local_expert_recv_stats); rank-major: its
  // (row, slot) entries, as expertCounts.
  int* recvStats = nullptr;
  MoeHalf half = MoeHalf::kWhole;
  DispatchOutputs outputs;
};

// Views of one rank's dispatch output, device memory owned by the engine. The pointers are set at
// setup and fixed for the engine's life, recvScales aside (each dispatch call sets it: scalesBuffer
// for an fp8 dispatch, nullptr for bf16). What they point to (expertOutput aside: the experts'
// rows) is the last dispatch's output: valid once that dispatch has run on its stream, until the
// next dispatch runs (a combine leaves it as it is).
// Expert-major and batched: rows of recv_x are grouped by local expert: expert j's rows are
// [expertOffsets[j], expertOffsets[j] + expertCounts[j]), each expert's first row a multiple of
// MoeConfig.expertAlignment (expert-major) or j x rowsPerExpert (batched: expertOffsets[j] is that,
// whatever arrives); within an expert, rows come in (source rank, source token, top-k slot)
// order. Alignment padding rows and a batched expert's unused rows are not written.
//
// Batched overflow: an expert keeps its first rowsPerExpert rows and drops the rest (counted as
// below); the other experts are unaffected.
//
// Overflow: when more rows arrive than the capacity holds, the rows whose place would be at or past
// it are dropped: the last rows of the last experts in the order above (each expert keeps a prefix
// of its list). The views describe only the rows that exist: expertOffsets[j] <= capacity,
// expertOffsets[j] + expertCounts[j] <= capacity, numRecvRows <= capacity; expertDropped[j] says
// how many of expert j's rows were dropped by this dispatch, MoeStatus.droppedRows counts them all,
// and combine adds nothing for them (their tokens' outputs sum the kept rows only). An expert that
// reads and writes exactly its documented rows never leaves [0, capacity).
struct DispatchLayout {
  void* recvX = nullptr;              // [capacity, H] bf16 or e4m3
  float* recvScales = nullptr;        // fp8: [capacity, H / 128]; bf16: nullptr (set by each dispatch)
  // The engine's scales buffer, [capacity, H / 128] fp32 (or bytes, Fp8Scales::kUe8m0), there
  // whenever H is a multiple of 128 whatever MoeConfig.dispatchType is: a bf16 engine's fp8
  // dispatch writes e4m3 rows into recvX ([capacity, H] bytes) and their scales here. Fixed for
  // the engine's life (recvScales points to it after an fp8 dispatch).
  float* scalesBuffer = nullptr;
  const int* expertOffsets = nullptr; // [E_local + 1]: first row of each expert, then the end
  const int* expertCounts = nullptr;  // [E_local]: rows of each expert (kept)
  const int* expertDropped = nullptr; // [E_local]: rows of each expert dropped by this dispatch
  const int* rowSrcRank = nullptr;    // [capacity]
  const int* rowSrcToken = nullptr;   // [capacity]
  const int* rowTopkSlot = nullptr;   // [capacity]
  const float* rowWeight = nullptr;   // [capacity]
  const int* numRecvRows = nullptr;   // device scalar: rows received and kept (padding excluded)
  // [E_local]: rows routed to each local expert (kept or dropped) since the engine was created:
  // the demand, for load balancing. Rank-major: its (row, slot) entries, as expertCounts.
  const unsigned long long* expertTotals = nullptr;
  // [capacity, H] bf16, engine-owned: where experts may write their outputs for combine.
  void* expertOutput = nullptr;
  long long capacity = 0;
  ReceiveLayout receiveLayout = ReceiveLayout::kExpertMajor;
  long long rowsPerExpert = 0;  // batched: rows of each expert's block; expert-major, rank-major: 0
  // Rank-major (nullptr otherwise): the first row of each source's records, then the end ([R + 1]:
  // rows [rankOffsets[q], rankOffsets[q + 1]) came from rank q, in its token order); per row, the
  // local expert of each top-k slot (-1: that slot's expert is not on this rank, or the slot is
  // unused) and its weight (0 where the expert is -1) ([capacity][K], K the dispatch's topK).
  // rowSrcRank / rowSrcToken describe each row; rowTopkSlot is -1 and rowWeight 0.
  // expertCounts[j] counts the (row, slot) entries of expert j, expertOffsets their packed prefix
  // (what a gathering grouped GEMM sizes itself by). The capacity, R x T_max, holds every row a
  // dispatch can bring, so expertDropped is 0; only rows past DispatchOutputs.rows are dropped
  // (MoeStatus.droppedRows). expertOutput (and combine's input): one row per received row, the
  // weighted sum over the row's local slots.
  const int* rankOffsets = nullptr;
  // Expert-major and batched (nullptr for rank-major): [E_local][R], the rows of expert j that came
  // from rank q as begin << 32 | count, begin counted from the expert's first row (DeepEP's
  // low-latency layout_range); only kept rows are counted.
  const long long* expertSourceRanges = nullptr;
  const int* rowExperts = nullptr;
  const float* rowExpertWeights = nullptr;
  int hidden = 0;
  int numLocalExperts = 0;
  int firstLocalExpert = 0;  // global id of local expert 0
};

struct CombineArgs {
  // [expertOutputRows, H] bf16 in the dispatch layout; nullptr: the layout's expertOutput.
  const void* expertOutput = nullptr;
  void* out = nullptr;  // [T_max, H] bf16; rows [0, T) of the matching dispatch are written
  // Rows of expertOutput (0: the capacity): a combine may take the [n, H] rows a dispatch filled.
  // A row the layout needs past them adds nothing and is counted (MoeStatus.missingCombineRows).
  long long expertOutputRows = 0;
  // Rank-major layout on the direct path (DeepEP's combined top-k weights): fp32 [rows][numValues]
  // per received row, summed over the token's destination ranks into outValues [T][numValues]
  // exactly as the rows are (fp32, ascending rank). nullptr: none.
  const float* rowValues = nullptr;
  float* outValues = nullptr;
  int numValues = 0;  // 1 .. 16 with rowValues
  // [T, K] fp32 (K: the dispatch's topK) or nullptr: the top-k weights to reduce with, in place of
  // the dispatch's (DeepEP's low-latency combine takes them here). Latency path, expert-major or
  // batched; each home rank sends its tokens' weights to their destinations ahead of the sums.
  const float* topkWeights = nullptr;
  // kSend with topkWeights: the send half waits for no peer; a peer's records whose weights are not
  // there yet are reduced by the receive half (Engine::receive), which then reads expertOutput and
  // topkWeights: keep both unchanged until the receive half has run.
  MoeHalf half = MoeHalf::kWhole;
};

// Bad input the device counted (docs/DESIGN.md §5): nothing was written out of bounds. Each rank
// counts what its own kernels found: an id or a live count in the rank that dispatched it, a
// dropped row in the rank that received it, a missing row in the rank whose combine needed it.
struct MoeStatus {
  // Entries of this rank's topkIdx with an id outside [-1, E): skipped (counted here only, not by
  // the rank the id would name).
  unsigned long long invalidExpertIds = 0;
  // Rows this rank received past its capacity, a batched expert's block or DispatchOutputs.rows:
  // not written (counted here only, not by the rank that sent them).
  unsigned long long droppedRows = 0;
  // This rank's dispatches whose live count (*numTokens) was outside [0, T_max].
  unsigned long long clampedTokenCounts = 0;
  long long firstInvalidId = 0;             // valid when invalidExpertIds > 0
  int firstInvalidToken = -1;               // its token and slot in this rank's topkIdx
  int firstInvalidSlot = -1;
  int firstClampedCount = 0;                // valid when clampedTokenCounts > 0
  // Operation order. Dispatch -> dispatch and combine -> combine are defined: a dispatch replaces
  // the last one (its layout, and what combine serves), a combine serves the last dispatch again
  // (the same result for the same expert outputs). unpairedDispatches stays 0 (kept for
  // compatibility); unpairedCombines counts combines before the engine's first dispatch, which
  // have nothing to combine (strict mode traps).
  unsigned long long unpairedDispatches = 0;
  unsigned long long unpairedCombines = 0;
  // Expert-output rows a combine needed past CombineArgs.expertOutputRows: they added nothing.
  unsigned long long missingCombineRows = 0;
  // maskedEntries[r]: (token, k) entries of this rank's dispatches whose expert lives on rank r
  // while r was outside the active-rank mask (all of them while this rank was outside it): not
  // sent (Engine::setActiveRanks). Not a problem: ok() does not count them.
  std::array<unsigned long long, kMaxRanks> maskedEntries{};
  // The ranks (bit r) that a wait timed out on and MoeConfig::shrinkOnTimeout masked. Not a
  // problem: ok() does not count them; describe() names them.
  std::uint32_t shrunkRanks = 0;
  std::string deviceError;                  // a timeout or protocol error, "" when none
  bool ok() const {
    return invalidExpertIds == 0 && droppedRows == 0 && clampedTokenCounts == 0 && unpairedDispatches == 0 &&
           unpairedCombines == 0 && missingCombineRows == 0 && deviceError.empty();
  }
  std::string describe() const;  // one line per problem, "ok" when none
};

// Device memory one rank's Engine allocates, known before anything is allocated
// (Engine::memoryRequirements), so a serving stack can size its KV cache around it.
struct MoeMemory {
  MoePath path = MoePath::kAuto;     // the path the figures are for (never kAuto)
  std::size_t symmetricHeapBytes = 0;  // the symmetric heap (Engine::symmetricHeapBytes())
  // The engine's local buffers, one allocation (Engine::privateBytes()): recv_x and its scales, the
  // row metadata, the expert outputs, routing and exchange scratch.
  std::size_t privateBytes = 0;
  // NCCL staging beside the heap: 0 on both paths (the throughput path's exchanges to peers
  // reached through NCCL move fixed slots of the heap in place). Kept for the ABI's layout.
  std::size_t ncclStagingBytes = 0;
};

// What Engine::checkHealth found.
struct HealthReport {
  bool ok = true;
  std::string message;  // "" when ok; otherwise what the rank waits for, or the device's error
};

// DeepEP's get_dispatch_layout: per-rank and per-expert token counts and the token-in-rank mask of
// a top-k routing, on the device. Not collective, needs no engine; capturable (one memset node and
// one kernel, no host sync). Ids outside [0, numExperts) are no expert.
struct TokenLayoutArgs {
  const void* topkIdx = nullptr;       // [numTokens, topK] global expert ids, -1 = none
  IndexType indexType = IndexType::kInt32;
  int numTokens = 0;                   // 0 .. 2^30
  int topK = 0;                        // 1 .. 16
  int numExperts = 0;                  // a multiple of numRanks, at most 1024 per rank: expert e lives on rank e / (E / R)
  int numRanks = 0;                    // 1 .. 32
  int* tokensPerRank = nullptr;        // [numRanks]: tokens with an expert on each rank
  int* tokensPerExpert = nullptr;      // [numExperts]: entries naming each expert
  bool* tokenInRank = nullptr;         // [numTokens, numRanks]
};
// Throws graphep::Error naming a bad argument. Enqueued on `stream` (the pointers' device current).
void tokenLayout(const TokenLayoutArgs& args, cudaStream_t stream);

// The active-rank mask naming every rank of a world of `worldSize` (Engine::setActiveRanks).
constexpr std::uint32_t allRanksMask(int worldSize) { return worldSize >= 32 ? ~0u : (1u << worldSize) - 1u; }

class Engine {
 public:
  // Collective over `comm`: one Engine per local rank of this process (local-rank order).
  static std::vector<std::unique_ptr<Engine>> createAll(Communicator& comm, const MoeConfig& cfg);
  // Collective, for a process that drives exactly one rank.
  static std::unique_ptr<Engine> create(Communicator& comm, const MoeConfig& cfg);
  // Throws graphep::Error naming the first bad field; createAll calls it.
  static void validate(const MoeConfig& cfg, int worldSize);
  // The default expert-major receive capacity (rows): T_max x worldSize x min(K, E / worldSize) +
  // (E / worldSize) x (expertAlignment - 1). It holds every row unless tokens repeat an expert id
  // (MoeConfig.recvCapacity says when rows can still be dropped).
  static long long worstCaseCapacity(const MoeConfig& cfg, int worldSize);
  // The rows of recv_x an engine with this config holds: expert-major, recvCapacity or
  // worstCaseCapacity; batched, E_local x rowsPerExpert (0: worldSize x T_max); rank-major,
  // worldSize x T_max (one row per source token).
  static long long receiveCapacity(const MoeConfig& cfg, int worldSize);
  // Device memory per rank of an engine with this config, from the code that sizes createAll's
  // allocations; validates first. cfg.path kAuto: the latency path when the config fits it (what
  // createAll picks when every peer has load/store access, e.g. GPUs of one NVLink node), else the
  // throughput path; pass kThroughput for a group with peers reached only through NCCL. The
  // throughput path's node-aware exchange (GRAPHEP_EMULATED_NODES, GRAPHEP_NODE_AWARE=on) holds
  // larger records and a forwarding area: counted where the settings ask for it (with
  // GRAPHEP_NODE_AWARE=on, an upper bound when the ranks turn out to be on one machine).
  static MoeMemory memoryRequirements(const MoeConfig& cfg, int worldSize);

  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  int rank() const;
  int worldSize() const;
  int device() const;  // this rank's CUDA device
  MoePath path() const;  // the path chosen at setup (never kAuto)
  const MoeConfig& config() const;
  // Bytes of this rank's symmetric heap (staging, flags and the receive buffers peers write).
  std::size_t symmetricHeapBytes() const;
  // Bytes of this rank's local buffers (MoeMemory.privateBytes).
  std::size_t privateBytes() const;

  // Capturable. Enqueues routing, the count exchange and the data exchange on `stream` (on this
  // rank's device); every rank of the group must call it. A dispatch may follow a dispatch: it
  // replaces the last one (its layout, and what combine serves).
  const DispatchLayout& dispatch(const DispatchArgs& args, cudaStream_t stream);
  // Capturable. Returns the expert outputs of the last dispatch to their source ranks and reduces
  // them. Expert-major and batched: out[t] = sum over the token's kept slots k of w[t][k] *
  // y(row of (t, k)), w the dispatch's topkWeights (CombineArgs.topkWeights when given; 1 where a
  // latency-path dispatch had none).
  // Arithmetic: each destination rank sums its slots of the token in fp32 (fused multiply-adds in
  // ascending slot order, from 0) and rounds the partial to bf16 (it crosses the link in bf16); the
  // home rank sums the partials in fp32 in ascending rank order and rounds once to bf16. A token
  // whose experts all live on one rank is that rank's partial, bit for bit; otherwise the result
  // carries two bf16 roundings (each within 2^-8 relative: of each partial, and of the sum).
  // Rank-major: the experts have applied the weights and summed a row's slots; combine computes
  // out[t] = sum over the ranks r that received token t of y(t's row on r), in fp32 in ascending
  // rank order, rounded once to bf16. A combine may follow a combine: it serves the last dispatch
  // again.
  void combine(const CombineArgs& args, cudaStream_t stream);
  // Capturable. The receive half of the last dispatch or combine enqueued with MoeHalf::kSend, on
  // `stream` (the same or another stream ordered after the send half). Every rank calls it. No
  // other dispatch or combine of this engine may be enqueued between a send half and its receive.
  void receive(cudaStream_t stream);

  // Capturable. The active-rank mask (bit r: rank r takes part; allRanksMask(worldSize) at setup),
  // written on `stream` in stream order (a stream-memory write: no host synchronisation, no
  // recapture; a captured write replays with the value given). The latency path and the direct
  // throughput path (every peer by load/store; Engine::directBlockFlags); the
  // throughput path over the movers refuses any mask but every rank. Each dispatch reads the mask
  // once and its combine uses the same; every rank must give the same mask for the same step (a
  // dispatch and the combine that follows), no mask may come between a send half and its
  // receive, and across a mask change each dispatch is followed by its combine before the next
  // dispatch (dispatch -> dispatch is ordered only among the ranks that took part in both: a rank
  // left out of the first could still be reading the slots the second writes). A rank outside the
  // mask is sent nothing and waited for by no one: the entries routed to its experts are dropped
  // and counted per rank (MoeStatus.maskedEntries), the layout describes only the rows of the ranks
  // in the mask, and combine adds nothing for them. A rank outside its own mask takes part in
  // nothing (an empty layout; combine writes zeros) but keeps its steps in lockstep, so it can be
  // put back in the mask later. Refused: bits of ranks >= worldSize, or no rank.
  void setActiveRanks(std::uint32_t mask, cudaStream_t stream);
  // The mask's device word (u32, local to this rank's GPU), for a caller's kernel that changes it
  // in stream order (as DeepEP's low_latency_update_mask_buffer does); nullptr on the throughput
  // path over the movers. The same rules as setActiveRanks.
  std::uint32_t* activeRanksDevice() const;
  // Back to service among the survivors, after a bounded wait named a peer that died or stalled
  // (status().deviceError; failed() is true): synchronises this rank's device (the failed
  // operation's kernels have returned: every wait is bounded), clears the status and the failed
  // state, and writes `mask` (this rank in it, the named peer out) as setActiveRanks does, also
  // for the combine of the last dispatch. Every survivor calls it with the same mask before its
  // next operation, after enqueueing the same operations as the other survivors since their last
  // good step (replaying the same graph does; a rank that stopped enqueueing early enqueues the
  // missing ones first: their waits fail at once); graphs captured before keep working (nothing
  // is recaptured). The failed operation's results are lost; the next dispatch
  // and combine are exact for the ranks in the mask. Not setup-free: it synchronises, so call it
  // outside captures. Several ranks of one process on one GPU: recover every one of them before
  // enqueueing work on any (the synchronisation would otherwise wait for a recovered rank's kernel
  // that waits for a rank not yet recovered). Refused: the throughput path over the movers (no mask), and an
  // engine whose operation stopped part-way or failed between a send half and its receive (its own
  // counters are out of step: create a new engine). Not recoverable, and not detected: a peer that
  // dies while its stores into this rank's memory are in flight, or one that stalls and resumes
  // after the mask left it out (its late stores land in slots the survivors reuse); leave such a
  // peer's process stopped.
  void recover(std::uint32_t mask, cudaStream_t stream);
  // A device barrier among the ranks of the active-rank mask, enqueued on `stream` (one kernel;
  // capturable, replayable forever: each pair of ranks counts the barriers both took part in):
  // it returns on each rank once every rank of the mask has reached it, and the writes each rank
  // enqueued before it are visible to the others' work after it. A rank outside its own mask
  // takes part in nothing. A peer that does not come within GRAPHEP_TIMEOUT_MS is named (status,
  // failed state, as every bounded wait), or with MoeConfig::shrinkOnTimeout masked
  // (MoeStatus::shrunkRanks) while the barrier completes among the others: DeepEP's
  // clean_low_latency_buffer in its shrink mode (the combine of a dispatch before it leaves the
  // rank out too). Every rank of the mask makes the same barrier calls in the same order between
  // the same operations; a rank left out by the mask and put back is in step, but one masked
  // after a timeout is not to be put back (its late post is not detected). Refused: the
  // throughput path over the movers (no load/store peers), and a send half waiting for its receive.
  void barrier(cudaStream_t stream);

  // The layout views: the same object dispatch() returns, its pointers fixed from setup (recvScales
  // as of the last dispatch call), their contents the last dispatch's (see DispatchLayout).
  const DispatchLayout& layout() const;

  // Diagnostics, not a run path: synchronises this rank's device. A device error (a timed-out
  // wait) puts the engine in its failed state.
  MoeStatus status() const;
  // The emulated network (tests: GRAPHEP_EMULATED_NODES=N splits the ranks into N nodes of
  // consecutive ranks, and the engines run the throughput path over the movers): the bytes this
  // rank's operations sent each rank on another node since setup or resetNetworkBytes(), [world
  // size], counted on the device where the exchanges move them; all zero without emulated nodes.
  // Diagnostics, not a run path: synchronises this rank's device.
  std::vector<std::uint64_t> networkBytes() const;
  void resetNetworkBytes();
  // Host watchdog, not a run path, and it never synchronises the device: waits up to `timeout`
  // for the work enqueued so far on `stream` (this rank's operations, eager or in graphs) to
  // finish. If it does not, or the device recorded an error, the engine enters its failed state
  // and the report says what this rank waits for. Latency path: which peer's flag or arrival
  // counter is short of the step. Any path: the device's error record.
  HealthReport checkHealth(cudaStream_t stream, std::chrono::milliseconds timeout);
  // After a failure (a device error seen by status() or checkHealth, or a stall found by
  // checkHealth) dispatch and combine refuse new work with kRemoteError; destroy the engine (its
  // destruction does not wait on peers) and create a new one.
  bool failed() const;
  void clearStatus();
  // The kernels that ran since the last resetTimeline() (MoeConfig.profile; empty otherwise), in
  // launch order of the engine's kernels, each once: run one operation between the two calls to
  // read its timeline. Synchronises this rank's device.
  std::vector<MoeKernelSpan> timeline() const;
  // The latency path's last operations, one event trace each (MoeConfig.profile; empty otherwise
  // or on the throughput path), oldest first. Synchronises this rank's device.
  std::vector<MoeStepTrace> stepTrace() const;
  // The direct path's block flags and step counters in this rank's memory (DirectBlockFlags);
  // blocksPerRank 0 and nothing else unless this engine dispatches by direct stores (the
  // throughput path, every peer by load/store). Synchronises this
  // rank's device.
  DirectBlockFlags directBlockFlags() const;
  void resetTimeline();

  struct Impl;

 private:
  explicit Engine(std::unique_ptr<Impl> impl);
  // Shared with the MoeGraphs built over this engine: destroying the Engine while one still
  // exists keeps its buffers (and the symmetric heap) alive until the last graph goes.
  std::shared_ptr<Impl> impl_;
  friend class MoeGraph;
};

}  // namespace graphep
