// The MoE engine's plan and its sizing (engine/moe/plan.hpp): sizes, heap placement, the local
// carve, and the capacities and memory a config needs.
#include "engine/moe/plan.hpp"

#include <algorithm>
#include <limits>

#include "engine/env.hpp"
#include "engine/error.hpp"
#include "engine/heap_layout.hpp"
#include "engine/moe/cta_plan.hpp"
#include "engine/node_map.hpp"
#include "kernels/moe/moe.h"

namespace graphep {
namespace moe_setup {

// Whether a config fits the latency path's kernels (routing held in shared memory).
bool latencyFits(const MoeConfig& c, int R) {
  return c.maxTokensPerRank <= kMoeLatencyMaxTokens &&
         static_cast<long long>(c.maxTokensPerRank) * c.topK <= kMoeLatencyMaxEntries &&
         moeLatencySmem(c.maxTokensPerRank, c.topK, c.numExperts, R).bytes <= kMoeLatencyMaxSmem;
}

MoeSizes moeSizes(const MoeConfig& cfg, int R, bool nodeAware) {
  const bool fp8 = cfg.dispatchType == DType::kFp8E4m3;
  const std::size_t payloadBytes = moePayloadBytes(cfg.hidden, fp8);
  const std::size_t forwardBytes = nodeAware ? static_cast<std::size_t>(R) * 4 : 0;  // a hop record's [R] indices
  const int L = cfg.numExperts / R;
  return MoeSizes{static_cast<std::size_t>(R), static_cast<std::size_t>(cfg.maxTokensPerRank),
                  static_cast<std::size_t>(cfg.hidden) * 2, payloadBytes,
                  alignUp(payloadBytes + moeMetaBytes(cfg.topK) + forwardBytes, 16),
                  moeCountMsgBytes(nodeAware ? L + 1 : L), moeDirectMsgBytes(L, cfg.maxTokensPerRank, R),
                  moeLatencyRecordBytes(cfg.hidden, fp8, cfg.topK), moeLatencyMetaOff(cfg.hidden, fp8, cfg.topK), nodeAware};
}

MoePath preferredPath(const MoeConfig& cfg, int R) {
  return cfg.path != MoePath::kThroughput && latencyFits(cfg, R) ? MoePath::kLatency : MoePath::kThroughput;
}

PathHeap pathHeap(MoePath path, const MoeSizes& z, const MoeConfig& cfg) {
  PathHeap h;
  BumpAllocator a(SIZE_MAX);  // offsets in the user region, the same on every rank
  const std::size_t W = moeRouteWords(static_cast<int>(z.T));
  if (path == MoePath::kLatency) {
    h.llRec = a.carve("llRec", 2 * z.R * z.T, z.llRecBytes, 256);
    h.llCnt = a.carve("llCnt", 2 * z.R, z.cntMsgBytes, 256);
    // The combine's partials as 128-byte tagged lines ([2][R][T] slots, kernels/moe/latency.cu
    // partialLines): a quarter more than their bf16 rows.
    h.llComb = a.carve("llComb", 2 * z.R * z.T, moeLatencyPartialBytes(cfg.hidden), 256);
    h.llFlag = a.carve("llFlag", z.R, 4, 256);
    h.llCombArrive = a.carve("llCombArrive", z.R, 4, 256);
    // The combine's top-k weights from each source ([2][R][T][K] tagged u64 words: the fp32 weight
    // and its step's tag, kernels/moe/latency.cu combineWeightsOf).
    h.llCombW = a.carve("llCombW", 2 * z.R * z.T * static_cast<std::size_t>(cfg.topK), 8, 256);
    // The dispatch's send CTAs' starts from each source ([2][R][kMoeMaxPlacedCtas] u64).
    h.llPlaced = a.carve("llPlaced", 2 * z.R * kMoeMaxPlacedCtas, 8, 256);
  } else {
    // The records and partials, then the direct dispatch's [2][R] count messages, [R] flags and
    // [R][W] block flags for the records and for the partials, its [R] acknowledgements of the
    // records and of the partials, and the partials' [R][T][kMoeMaxValues] fp32 values
    // (kernels/moe/direct.cu; a few KB and 64 B per slot, also when the movers carry the dispatch).
    h.recRecv = a.carve("recRecv", z.R * z.T, z.recBytes, 4096);
    h.combRecv = a.carve("combRecv", z.R * z.T, z.rowBytes, 4096);
    h.llCnt = a.carve("llCnt", 2 * z.R, z.directMsgBytes, 256);
    h.llFlag = a.carve("llFlag", z.R, 4, 256);
    h.llBlock = a.carve("llBlock", z.R * W, 4, 256);
    h.llCombBlock = a.carve("llCombBlock", z.R * W, 4, 256);
    h.llDispAck = a.carve("llDispAck", z.R, 4, 256);
    h.llCombAck = a.carve("llCombAck", z.R, 4, 256);
    h.llCombVal = a.carve("llCombVal", z.R * z.T * kMoeMaxValues, 4, 256);
    if (z.nodeAware) {
      h.fwdRecv = a.carve("fwdRecv", z.R * z.T, z.recBytes, 4096);
      h.nodePartial = a.carve("nodePartial", z.R * z.T, z.rowBytes, 4096);
      h.nodeReady = a.carve("nodeReady", z.R, 4, 256);
      h.nodeForwarded = a.carve("nodeForwarded", z.R, 4, 256);
      h.nodeReduced = a.carve("nodeReduced", z.R, 4, 256);
      h.nodeSummed = a.carve("nodeSummed", z.R, 4, 256);
    }
  }
  h.llBarrier = a.carve("llBarrier", z.R, 4, 256);  // the device barrier's [R] pair counts (both paths)
  h.heap.numRanks = static_cast<int>(z.R);
  h.heap.userBytes = alignUp(a.used(), 4096);
  // HeapConfig::validate's limit, met here first so that the refusal names the caller's fields.
  GRAPHEP_REQUIRE(h.heap.userBytes <= kMaxUserBytes, Status::kInvalidArgument,
                  "MoeConfig needs a %zu-byte symmetric heap (maxTokensPerRank=%lld, hidden=%d, topK=%d, world size "
                  "%lld), past the heap's limit of %zu bytes: lower maxTokensPerRank or hidden",
                  h.heap.userBytes, static_cast<long long>(z.T), cfg.hidden, cfg.topK, static_cast<long long>(z.R),
                  kMaxUserBytes);
  h.heap.moverSlotBytes = path == MoePath::kThroughput ? kEngineSlotBytes : 0;
  if (cfg.smBudget > 0) h.heap.moverBlocks = cfg.smBudget;
  h.heap.counterStart = cfg.counterStart;
  return h;
}

MoverOptions engineMoverOptions(const MoeSizes& z) {
  MoverOptions mo;  // every exchange moves fixed slots (bindExchanges): NCCL peers need no stage
  mo.fixedSlotBytes = z.T * std::max(z.recBytes, z.rowBytes);
  return mo;
}

LocalCarve carveLocal(const MoeConfig& cfg, const MoeSizes& z, std::size_t cap, bool throughput) {
  // recv_x holds the config's type; a bf16 engine's rows have room for fp8 ones (H bytes of 2H),
  // and the scales are there whenever H allows fp8 (1/64 of a bf16 recv_x): one engine serves
  // both types.
  const bool fp8 = cfg.dispatchType == DType::kFp8E4m3;
  const bool scales = cfg.hidden % 128 == 0;
  const std::size_t T = z.T, Rs = z.R, H = static_cast<std::size_t>(cfg.hidden);
  const std::size_t L = static_cast<std::size_t>(cfg.numExperts) / Rs;
  // Every region 256-aligned; an empty one still takes a byte, so no two regions share an offset.
  BumpAllocator a(SIZE_MAX);
  auto carve = [&](const char* name, std::size_t bytes) { return a.carve(name, std::max<std::size_t>(bytes, 1), 1, 256); };
  LocalCarve o{};
  o.status = carve("status", sizeof(MoeDeviceStatus));
  o.live = carve("live", sizeof(std::int32_t));
  o.pending = carve("pending", sizeof(std::uint32_t));
  o.tokRank = carve("tokRank", T * Rs * 4);
  // Throughput path only (the latency path routes in shared memory and writes peers directly).
  o.entry = carve("entry", throughput ? T * static_cast<std::size_t>(cfg.topK) * 4 : 0);
  o.expertCount = carve("expertCount", throughput ? static_cast<std::size_t>(cfg.numExperts) * 4 : 0);
  o.rankCount = carve("rankCount", throughput ? Rs * 4 : 0);
  const std::size_t W = moeRouteWords(cfg.maxTokensPerRank), Es = static_cast<std::size_t>(cfg.numExperts);
  o.routeWords = W;
  o.routeZero = ((Es + 2 * Rs) * W + Es * W + 1) * 4;  // bits (experts, ranks, nodes), counts, the duplicate flag
  o.routeBits = carve("routeBits", throughput ? o.routeZero : 0);
  o.routePrefix = carve("routePrefix", throughput ? (Es + 2 * Rs) * W * 4 : 0);
  o.recSend = carve("recSend", throughput ? Rs * T * z.recBytes : 0);
  o.cntSend = carve("cntSend", throughput ? Rs * z.cntMsgBytes : 0);
  o.cntRecv = carve("cntRecv", throughput ? Rs * z.cntMsgBytes : 0);
  o.rankTok = carve("rankTok", throughput ? Rs * T * 4 : 0);  // the movers path's pack: the token of each record
  o.arrays = carve("arrays", throughput ? moeExchangeTableWords(Rs) * 8 : 0);  // EngineExchanges (bind.cpp)
  o.recvRows = carve("recvRows", Rs * 4);
  o.srcBase = carve("srcBase", Rs * L * 4);
  o.offsets = carve("offsets", (L + 1) * 4);
  o.counts = carve("counts", L * 4);
  o.dropped = carve("dropped", L * 4);
  o.numRows = carve("numRows", 4);
  o.totals = carve("totals", L * 8);
  o.recvX = carve("recvX", cap * (fp8 ? H : z.rowBytes));
  o.scales = carve("scales", scales ? cap * (H / 128) * 4 : 0);
  o.rowRank = carve("rowRank", cap * 4);
  o.rowToken = carve("rowToken", cap * 4);
  o.rowSlot = carve("rowSlot", cap * 4);
  o.rowWeight = carve("rowWeight", cap * 4);
  o.y = carve("y", cap * z.rowBytes);
  o.combSend = carve("combSend", throughput ? Rs * T * z.rowBytes : 0);
  o.combValSend = carve("combValSend", throughput ? Rs * T * kMoeMaxValues * 4 : 0);  // the direct combine's staged values
  const bool rankMajor = cfg.receiveLayout == ReceiveLayout::kRankMajor;
  const std::size_t K = static_cast<std::size_t>(cfg.topK);
  o.rankOffsets = carve("rankOffsets", rankMajor ? (Rs + 1) * 4 : 0);
  o.rowExperts = carve("rowExperts", rankMajor ? cap * K * 4 : 0);
  o.rowExpertWeights = carve("rowExpertWeights", rankMajor ? cap * K * 4 : 0);
  o.sourceRanges = carve("sourceRanges", rankMajor ? 0 : L * Rs * 8);
  o.llSteps = carve("llSteps", 2 * 4);  // dispatch and combine steps and last-CTA counters (latency and direct kernels)
  o.llDone = carve("llDone", 4 * 4);  // the last-CTA counters, then the dispatch receive's item claims (one per step parity)
  o.llMask = carve("llMask", 3 * 4);  // the active-rank mask, the last dispatch's, a latency send half's
  o.llExpected = carve("llExpected", 2 * Rs * 4);  // latency: the partial arrivals expected [R]; direct: the steps shared [2][R]
  o.llShrink = carve("llShrink", !throughput && cfg.shrinkOnTimeout ? 2 * 4 * 4 : 0);  // shrink on timeout
  // Latency: a combine send half's sources left to its receive half, a word per send CTA (at most
  // the SM budget, latencySendCtas).
  o.llDeferred = carve("llDeferred", throughput ? 0 : static_cast<std::size_t>(latencySendCtasBound(cfg.smBudget)) * 4);
  // A count message of zeros (the block is zeroed at setup) for a rank outside the mask: the direct
  // path reads it (the latency receive zeroes its shared copy of the words instead); sized as
  // either path's message, so that the plan does not depend on the path.
  o.llZeroMsg = carve("llZeroMsg", std::max(z.cntMsgBytes, z.directMsgBytes));
  o.llBarrier = carve("llBarrier", Rs * 4);  // the device barrier's pair counts (Engine::barrier)
  o.nodeTokens = carve("nodeTokens", throughput && z.nodeAware ? Rs * T * 4 : 0);
  o.nodeRecords = carve("nodeRecords", throughput && z.nodeAware ? Rs * 4 : 0);
  o.tokenNodeIndex = carve("tokenNodeIndex", throughput && z.nodeAware ? T * Rs * 4 : 0);
  o.nodeSeen = carve("nodeSeen", throughput && z.nodeAware ? kMoeNodeSignals * Rs * 4 : 0);
  o.combArrive = carve("combArrive", throughput ? Rs * W * 4 : 0);  // the direct combine's block arrivals and flags
  o.combReady = carve("combReady", throughput ? Rs * W * 4 : 0);
  constexpr std::size_t kStamps = kMoeStampWords * static_cast<std::size_t>(MoeKernel::kCount);
  o.timeline = carve("timeline", cfg.profile ? (kStamps + kMoeTraceWords) * 8 : 0);
  o.bytes = a.used();
  return o;
}

long long batchedRowsPerExpert(const MoeConfig& cfg, int worldSize) {
  return cfg.rowsPerExpert > 0 ? cfg.rowsPerExpert : static_cast<long long>(worldSize) * cfg.maxTokensPerRank;
}

}  // namespace moe_setup

using namespace moe_setup;

long long Engine::worstCaseCapacity(const MoeConfig& cfg, int worldSize) {
  const long long localExperts = cfg.numExperts / std::max(worldSize, 1);
  const long long perToken = std::min<long long>(cfg.topK, localExperts);
  return static_cast<long long>(cfg.maxTokensPerRank) * worldSize * perToken +
         localExperts * (cfg.expertAlignment - 1);
}

long long Engine::receiveCapacity(const MoeConfig& cfg, int worldSize) {
  if (cfg.receiveLayout == ReceiveLayout::kRankMajor) {  // one row per (source token, this rank)
    return static_cast<long long>(std::max(worldSize, 1)) * cfg.maxTokensPerRank;
  }
  if (cfg.receiveLayout == ReceiveLayout::kBatched) {
    const long long L = std::max(cfg.numExperts / std::max(worldSize, 1), 1);
    const long long rows = batchedRowsPerExpert(cfg, worldSize);
    // Saturated rather than wrapped: validate refuses anything at or above 2^31 by name.
    return rows > std::numeric_limits<long long>::max() / L ? std::numeric_limits<long long>::max() : L * rows;
  }
  return cfg.recvCapacity > 0 ? cfg.recvCapacity : worstCaseCapacity(cfg, worldSize);
}

MoeMemory Engine::memoryRequirements(const MoeConfig& cfg, int worldSize) {
  validate(cfg, worldSize);
  MoeMemory m;
  m.path = preferredPath(cfg, worldSize);
  const bool throughput = m.path == MoePath::kThroughput;
  const bool nodeAware = throughput && nodeAwareExpected(worldSize, static_cast<int>(env::kEmulatedNodes.get()),
                                                         env::kNodeAware.get());
  const MoeSizes z = moeSizes(cfg, worldSize, nodeAware);
  const long long capacity = receiveCapacity(cfg, worldSize);
  m.symmetricHeapBytes = heapBytes(pathHeap(m.path, z, cfg).heap);
  m.privateBytes = carveLocal(cfg, z, static_cast<std::size_t>(capacity), throughput).bytes;
  m.ncclStagingBytes = throughput ? Movers::remoteStageBytes(engineMoverOptions(z), worldSize) : 0;
  return m;
}

}  // namespace graphep
