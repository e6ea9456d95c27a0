// The MoE engine's kernel parameters (engine/moe/bind.hpp): one local rank's MoeParams over its
// carved buffers and heap, its counters' start, the throughput path's exchanges, the layout views.
#include "engine/moe/bind.hpp"

#include <cstdint>
#include <utility>
#include <vector>

#include "engine/error.hpp"

namespace graphep {
namespace moe_setup {
namespace {

// The device tables of one alltoallv exchange of the throughput path: byte counts and offsets per
// direction, [R] each; the records' and partials' counts [kMoeMaxChunks][R], one row per chunk
// (MoeMoverParams). The offsets and the count messages' counts are constant (setupExchangeTables);
// the kernels write the record and partial counts of every dispatch.
struct ExchangeTables {
  std::uint64_t* sendCounts;
  std::uint64_t* sendOffsets;
  std::uint64_t* recvCounts;
  std::uint64_t* recvOffsets;
};
// The engine's three exchanges: count messages, records (dispatch), partials (combine).
struct EngineExchanges {
  ExchangeTables counts, records, partials;
};

// The three exchanges' tables in the carved region (LocalCarve.arrays: moeExchangeTableWords(R)
// words); setupExchangeTables writes their constant halves: a count message of cntMsgBytes to and
// from every peer, and every peer's records and partials at a fixed place
// ([peer][maxTokens][record]).
EngineExchanges exchangeTablesAt(char* region, const MoeSizes& z) {
  auto* w = reinterpret_cast<std::uint64_t*>(region);
  auto next = [&](std::size_t countRows) {
    ExchangeTables t{};
    t.sendCounts = w;
    t.sendOffsets = w + countRows * z.R;
    t.recvCounts = t.sendOffsets + z.R;
    t.recvOffsets = t.recvCounts + countRows * z.R;
    w = t.recvOffsets + z.R;
    return t;
  };
  EngineExchanges x;
  x.counts = next(1);
  x.records = next(kMoeMaxChunks);
  x.partials = next(kMoeMaxChunks);
  return x;
}

EngineExchanges setupExchangeTables(char* region, const MoeSizes& z) {
  const EngineExchanges x = exchangeTablesAt(region, z);
  std::vector<std::uint64_t> msgBytes(z.R, z.cntMsgBytes), msgAt(z.R), recAt(z.R), rowAt(z.R);
  for (std::size_t q = 0; q < z.R; ++q) {
    msgAt[q] = q * z.cntMsgBytes;
    recAt[q] = q * z.T * z.recBytes;
    rowAt[q] = q * z.T * z.rowBytes;
  }
  const std::size_t bytes = z.R * sizeof(std::uint64_t);
  GRAPHEP_CUDA_CHECK(cudaMemset(region, 0, moeExchangeTableWords(z.R) * sizeof(std::uint64_t)));
  for (auto [dst, src] : {std::pair{x.counts.sendCounts, &msgBytes}, std::pair{x.counts.sendOffsets, &msgAt},
                          std::pair{x.counts.recvCounts, &msgBytes}, std::pair{x.counts.recvOffsets, &msgAt},
                          std::pair{x.records.sendOffsets, &recAt}, std::pair{x.records.recvOffsets, &recAt},
                          std::pair{x.partials.sendOffsets, &rowAt}, std::pair{x.partials.recvOffsets, &rowAt}}) {
    GRAPHEP_CUDA_CHECK(cudaMemcpy(dst, src->data(), bytes, cudaMemcpyHostToDevice));
  }
  return x;
}

}  // namespace

MoeParams bindParams(const BindPlan& plan, SymmetricHeap& heap, int l, char* block) {
  const MoeConfig& cfg = plan.cfg;
  const MoeSizes& sizes = plan.sizes;
  const PathHeap& ph = plan.ph;
  const LocalCarve& o = plan.carve;
  const bool throughput = plan.throughput;
  const int R = static_cast<int>(sizes.R);
  const std::size_t Rs = sizes.R;
  const int L = cfg.numExperts / R;
  const bool fp8 = cfg.dispatchType == DType::kFp8E4m3;
  const long long capacity = plan.capacity;
  const std::size_t recBytes = sizes.recBytes, cntMsgBytes = sizes.cntMsgBytes;
  const LatencyCtas& lctas = plan.latency;
  const ThroughputCtas& tctas = plan.tput;
  const int llCtas = lctas.send;
  char* b = block;
  char* user = heap.user(l);
  MoeParams p{};
  p.shape.rank = heap.rank(l);
  p.shape.numRanks = R;
  p.shape.hidden = cfg.hidden;
  p.shape.topK = cfg.topK;
  p.shape.numExperts = cfg.numExperts;
  p.shape.localExperts = L;
  p.shape.maxTokens = cfg.maxTokensPerRank;
  p.shape.fp8 = fp8 ? 1 : 0;
  p.layout.alignment = cfg.expertAlignment;
  p.state.strict = cfg.strict ? 1 : 0;
  p.layout.capacity = capacity;
  p.layout.rowsPerExpert = cfg.receiveLayout == ReceiveLayout::kBatched ? batchedRowsPerExpert(cfg, R) : 0;
  p.layout.rankMajor = cfg.receiveLayout == ReceiveLayout::kRankMajor ? 1 : 0;
  p.layout.rankOffsets = p.layout.rankMajor ? reinterpret_cast<std::int32_t*>(b + o.rankOffsets) : nullptr;
  p.layout.rowExperts = p.layout.rankMajor ? reinterpret_cast<std::int32_t*>(b + o.rowExperts) : nullptr;
  p.layout.rowExpertWeights = p.layout.rankMajor ? reinterpret_cast<float*>(b + o.rowExpertWeights) : nullptr;
  p.layout.outputRows = capacity;  // a dispatch's own outputs may lower it (DispatchOutputs.rows)
  p.combine.expertOutputRows = capacity;    // a combine's own input may lower it (CombineArgs.expertOutputRows)
  p.shape.recordBytes = throughput ? recBytes : sizes.llRecBytes;
  p.latency.metaOff = sizes.llMetaOff;
  p.shape.payloadBytes = sizes.payloadBytes;
  p.shape.countMsgBytes = cntMsgBytes;
  p.direct.msgBytes = sizes.directMsgBytes;
  p.state.status = reinterpret_cast<MoeDeviceStatus*>(b + o.status);
  p.routing.liveTokens = reinterpret_cast<std::int32_t*>(b + o.live);
  p.state.pending = reinterpret_cast<std::uint32_t*>(b + o.pending);
  p.routing.tokenRankIndex = reinterpret_cast<std::int32_t*>(b + o.tokRank);
  p.routing.rankTokens = throughput && !plan.direct ? reinterpret_cast<std::int32_t*>(b + o.rankTok) : nullptr;
  p.routing.entryIndex = reinterpret_cast<std::int32_t*>(b + o.entry);
  p.routing.expertEntries = reinterpret_cast<std::uint32_t*>(b + o.expertCount);
  p.routing.rankRecords = reinterpret_cast<std::uint32_t*>(b + o.rankCount);
  p.routing.bits = reinterpret_cast<std::uint32_t*>(b + o.routeBits);
  p.routing.blockCounts = p.routing.bits + (static_cast<std::size_t>(cfg.numExperts) + 2 * Rs) * o.routeWords;
  p.routing.duplicate = p.routing.blockCounts + static_cast<std::size_t>(cfg.numExperts) * o.routeWords;
  p.routing.blockPrefix = reinterpret_cast<std::uint32_t*>(b + o.routePrefix);
  p.routing.zeroBytes = throughput ? o.routeZero : 0;
  if (throughput) {  // the throughput kernels' CTAs: the SM budget, or one per SM
    p.grid.budgetCtas = tctas.comm;
    p.grid.epilogueCtas = tctas.epilogue[static_cast<std::size_t>(l)];
    p.grid.epilogueCluster = tctas.cluster[static_cast<std::size_t>(l)];
  }
  p.staging.recordStage = b + o.recSend;
  p.staging.recordRecv = throughput ? user + ph.recRecv : nullptr;
  p.movers.countSend = b + o.cntSend;
  p.movers.countRecv = b + o.cntRecv;
  const EngineExchanges x = throughput ? setupExchangeTables(b + o.arrays, sizes) : EngineExchanges{};
  p.movers.recordSendBytes = x.records.sendCounts;
  p.movers.recordRecvBytes = x.records.recvCounts;
  p.movers.partialSendBytes = x.partials.sendCounts;
  p.movers.partialRecvBytes = x.partials.recvCounts;
  p.movers.chunks = throughput ? tctas.chunks : 1;
  p.movers.chunkRecords = static_cast<std::int32_t>((sizes.T + p.movers.chunks - 1) / p.movers.chunks);
  p.layout.sourceRecords = reinterpret_cast<std::int32_t*>(b + o.recvRows);
  p.layout.sourceBase = reinterpret_cast<std::int32_t*>(b + o.srcBase);
  p.layout.expertOffsets = reinterpret_cast<std::int32_t*>(b + o.offsets);
  p.layout.expertCounts = reinterpret_cast<std::int32_t*>(b + o.counts);
  p.layout.expertDropped = reinterpret_cast<std::int32_t*>(b + o.dropped);
  p.layout.numRecvRows = reinterpret_cast<std::int32_t*>(b + o.numRows);
  p.layout.expertTotals = reinterpret_cast<unsigned long long*>(b + o.totals);
  p.layout.recvX = b + o.recvX;
  p.layout.recvScales = cfg.hidden % 128 == 0 ? reinterpret_cast<float*>(b + o.scales) : nullptr;
  p.layout.expertSourceRanges = p.layout.rankMajor ? nullptr : reinterpret_cast<std::int64_t*>(b + o.sourceRanges);
  p.layout.rowSrcRank = reinterpret_cast<std::int32_t*>(b + o.rowRank);
  p.layout.rowSrcToken = reinterpret_cast<std::int32_t*>(b + o.rowToken);
  p.layout.rowTopkSlot = reinterpret_cast<std::int32_t*>(b + o.rowSlot);
  p.layout.rowWeight = reinterpret_cast<float*>(b + o.rowWeight);
  p.combine.expertOutput = b + o.y;
  p.staging.partialStage = b + o.combSend;
  p.direct.valueStage = reinterpret_cast<float*>(b + o.combValSend);
  p.movers.partialRecv = throughput ? user + ph.combRecv : nullptr;
  for (int q = 0; q < R; ++q) {
    p.peers.userRegions[q] = q == p.shape.rank ? user : heap.peerUser(l, q);  // nullptr when remote
  }
  p.peers.recordsOff = throughput ? ph.recRecv : ph.llRec;
  p.peers.countMsgsOff = ph.llCnt;
  p.peers.partialsOff = throughput ? ph.combRecv : ph.llComb;
  p.peers.countFlagsOff = ph.llFlag;
  p.latency.partialArrivalsOff = ph.llCombArrive;
  p.direct.recordFlagsOff = ph.llBlock;
  p.direct.partialFlagsOff = ph.llCombBlock;
  p.direct.dispatchAcksOff = ph.llDispAck;
  p.direct.combineAcksOff = ph.llCombAck;
  p.direct.valuesOff = ph.llCombVal;
  p.latency.weightsOff = ph.llCombW;
  p.latency.placedOff = ph.llPlaced;
  p.peers.steps = reinterpret_cast<std::uint32_t*>(b + o.llSteps);
  p.peers.lastCtaCounters = reinterpret_cast<std::uint32_t*>(b + o.llDone);
  p.peers.live = reinterpret_cast<const std::uint32_t*>(b + o.llMask);
  p.peers.dispatchLive = reinterpret_cast<std::uint32_t*>(b + o.llMask) + 1;
  p.peers.zeroMsg = reinterpret_cast<const std::uint64_t*>(b + o.llZeroMsg);
  p.peers.barrierOff = ph.llBarrier;
  p.peers.barrierPairs = reinterpret_cast<std::uint32_t*>(b + o.llBarrier);
  if (throughput) {
    p.direct.shared = reinterpret_cast<std::uint32_t*>(b + o.llExpected);
  } else {
    p.latency.halfLive = reinterpret_cast<std::uint32_t*>(b + o.llMask) + 2;
    p.latency.expected = reinterpret_cast<std::uint32_t*>(b + o.llExpected);
    p.latency.shrink = cfg.shrinkOnTimeout ? reinterpret_cast<std::uint32_t*>(b + o.llShrink) : nullptr;
    p.latency.deferred = reinterpret_cast<std::uint32_t*>(b + o.llDeferred);
  }
  p.direct.partialArrivals = reinterpret_cast<std::uint32_t*>(b + o.combArrive);
  p.direct.partialReady = reinterpret_cast<std::uint32_t*>(b + o.combReady);
  if (!throughput) {  // the latency senders (the SM budget) and receivers
    p.grid.budgetCtas = llCtas;
    p.grid.epilogueCtas = lctas.receive[static_cast<std::size_t>(l)];
    p.grid.epilogueCluster = 1;
  }
  if (throughput && sizes.nodeAware) {  // the node-aware dispatch (MoeNodeParams)
    const NodeMap& nodes = plan.nodes;
    p.node.aware = 1;
    p.node.numNodes = nodes.numNodes;
    p.node.nodeMask = nodes.nodeMask(p.shape.rank);
    for (int q = 0; q < R; ++q) p.node.nodeOf[q] = static_cast<std::int8_t>(nodes.nodeOf[static_cast<std::size_t>(q)]);
    for (int m = 0; m < nodes.numNodes; ++m) p.node.landing[m] = static_cast<std::int8_t>(nodes.landing(p.shape.rank, m));
    p.node.nodeTokens = reinterpret_cast<std::int32_t*>(b + o.nodeTokens);
    p.node.nodeRecords = reinterpret_cast<std::uint32_t*>(b + o.nodeRecords);
    p.node.fwdRecvOff = ph.fwdRecv;
    p.node.readyOff = ph.nodeReady;
    p.node.forwardedOff = ph.nodeForwarded;
    p.node.nodePartialOff = ph.nodePartial;
    p.node.reducedOff = ph.nodeReduced;
    p.node.summedOff = ph.nodeSummed;
    p.node.tokenNodeIndex = reinterpret_cast<std::int32_t*>(b + o.tokenNodeIndex);
    p.node.seen = reinterpret_cast<std::uint32_t*>(b + o.nodeSeen);
  }
  p.peers.sync = heap.syncHandle(l);
  p.state.timeline = cfg.profile ? reinterpret_cast<unsigned long long*>(b + o.timeline) : nullptr;
  return p;
}

void startCounters(const BindPlan& plan, const MoeParams& p, char* user) {
  const MoeConfig& cfg = plan.cfg;
  const PathHeap& ph = plan.ph;
  const bool throughput = plan.throughput;
  const std::size_t Rs = plan.sizes.R;
  const int llCtas = plan.latency.send;
  if (p.node.aware) {  // the node peers' signals, counted from counterStart; the sums one ahead
    const std::vector<std::uint32_t> start(kMoeNodeSignals * Rs, cfg.counterStart), ahead(Rs, cfg.counterStart + 1u);
    for (const std::size_t off : {ph.nodeReady, ph.nodeForwarded, ph.nodeReduced}) {
      GRAPHEP_CUDA_CHECK(cudaMemcpy(user + off, start.data(), Rs * 4, cudaMemcpyHostToDevice));
    }
    GRAPHEP_CUDA_CHECK(cudaMemcpy(user + ph.nodeSummed, ahead.data(), Rs * 4, cudaMemcpyHostToDevice));
    GRAPHEP_CUDA_CHECK(cudaMemcpy(p.node.seen, start.data(), start.size() * 4, cudaMemcpyHostToDevice));
  }
  // Every rank active: the mask and the last dispatch's (the mover path keeps them so).
  const std::uint32_t mask[2] = {allRanksMask(static_cast<int>(Rs)), allRanksMask(static_cast<int>(Rs))};
  GRAPHEP_CUDA_CHECK(cudaMemcpy(const_cast<std::uint32_t*>(p.peers.live), mask, sizeof(mask), cudaMemcpyHostToDevice));
  if (!throughput || plan.direct) {
    // The latency and direct counters start at counterStart (steps, flags, block flags) and
    // G x it (the latency arrivals, G the CTAs that post them).
    const std::uint32_t S = cfg.counterStart, SG = cfg.counterStart * static_cast<std::uint32_t>(llCtas);
    const std::uint32_t steps[2] = {S, S};
    GRAPHEP_CUDA_CHECK(cudaMemcpy(p.peers.steps, steps, sizeof(steps), cudaMemcpyHostToDevice));
    const std::vector<std::uint32_t> flags(Rs, S), arrivals(Rs, SG);
    GRAPHEP_CUDA_CHECK(cudaMemcpy(user + ph.llFlag, flags.data(), Rs * 4, cudaMemcpyHostToDevice));
    // The device barrier: every pair has passed counterStart barriers together.
    GRAPHEP_CUDA_CHECK(cudaMemcpy(user + ph.llBarrier, flags.data(), Rs * 4, cudaMemcpyHostToDevice));
    GRAPHEP_CUDA_CHECK(cudaMemcpy(p.peers.barrierPairs, flags.data(), Rs * 4, cudaMemcpyHostToDevice));
    if (throughput) {
      const std::vector<std::uint32_t> blocks(Rs * moeRouteWords(cfg.maxTokensPerRank), S);
      GRAPHEP_CUDA_CHECK(cudaMemcpy(user + ph.llBlock, blocks.data(), blocks.size() * 4, cudaMemcpyHostToDevice));
      GRAPHEP_CUDA_CHECK(cudaMemcpy(user + ph.llCombBlock, blocks.data(), blocks.size() * 4, cudaMemcpyHostToDevice));
      GRAPHEP_CUDA_CHECK(cudaMemcpy(p.direct.partialReady, blocks.data(), blocks.size() * 4, cudaMemcpyHostToDevice));
      GRAPHEP_CUDA_CHECK(cudaMemset(p.direct.partialArrivals, 0, blocks.size() * 4));
      // The acknowledgements start as if step counterStart - 1 had been read everywhere; every
      // pair has shared counterStart steps of each operation.
      GRAPHEP_CUDA_CHECK(cudaMemcpy(user + ph.llDispAck, flags.data(), Rs * 4, cudaMemcpyHostToDevice));
      GRAPHEP_CUDA_CHECK(cudaMemcpy(user + ph.llCombAck, flags.data(), Rs * 4, cudaMemcpyHostToDevice));
      const std::vector<std::uint32_t> shared(2 * Rs, S);
      GRAPHEP_CUDA_CHECK(cudaMemcpy(p.direct.shared, shared.data(), shared.size() * 4, cudaMemcpyHostToDevice));
    } else {
      GRAPHEP_CUDA_CHECK(cudaMemcpy(user + ph.llCombArrive, arrivals.data(), Rs * 4, cudaMemcpyHostToDevice));
      // The partial arrivals expected so far match the counter's start.
      const std::vector<std::uint32_t> expected(Rs, SG);
      GRAPHEP_CUDA_CHECK(cudaMemcpy(p.latency.expected, expected.data(), expected.size() * 4, cudaMemcpyHostToDevice));
    }
  }
}

void bindExchanges(const BindPlan& plan, const MoeParams& p, char* block, char* user, Engine::Impl& impl) {
  if (!plan.throughput) return;
  const MoeConfig& cfg = plan.cfg;
  const MoeSizes& sizes = plan.sizes;
  const PathHeap& ph = plan.ph;
  const LocalCarve& o = plan.carve;
  const std::size_t Rs = sizes.R, T = sizes.T;
  const std::size_t recBytes = sizes.recBytes, cntMsgBytes = sizes.cntMsgBytes, rowBytes = sizes.rowBytes;
  char* b = block;
  const EngineExchanges x = exchangeTablesAt(b + o.arrays, sizes);
  auto exchange = [&](const ExchangeTables& t, const void* src, std::size_t srcBytes, void* dst,
                      std::size_t dstBytes, std::size_t perPeer, bool zeroCopy) {
    AllToAllvArgs a;
    a.src = src;
    a.srcBytes = srcBytes;
    a.dst = dst;
    a.dstBytes = dstBytes;
    a.sendCounts = t.sendCounts;
    a.sendOffsets = t.sendOffsets;
    a.recvCounts = t.recvCounts;
    a.recvOffsets = t.recvOffsets;
    a.maxBytesPerPeer = perPeer;
    a.channelsPerPeer = cfg.smBudget;
    a.zeroCopy = zeroCopy;
    a.fixedSlots = true;  // every peer's message at [peer][perPeer] (setupExchangeTables): NCCL peers in place
    return a;
  };
  // Records and partials: this rank's own stay where pack and reduce wrote them (kernels/moe/movers.cu
  // reads them there), so their exchanges skip the own block; the count messages are copied.
  impl.cntArgs = exchange(x.counts, p.movers.countSend, Rs * cntMsgBytes, b + o.cntRecv, Rs * cntMsgBytes, cntMsgBytes, false);
  AllToAllvArgs records = exchange(x.records, p.staging.recordStage, Rs * T * recBytes, user + ph.recRecv,
                                   Rs * T * recBytes, T * recBytes, true);
  records.skipOwnBlock = true;
  if (p.node.aware) {  // records to this node's ranks and to the landing ranks on the others; hop records from the ranks landing here
    const NodeMap::Peers peers = plan.nodes.landingPeers(p.shape.rank);
    records.sendPeers = peers.send;
    records.recvPeers = peers.recv;
  }
  AllToAllvArgs partials = exchange(x.partials, p.staging.partialStage, Rs * T * rowBytes, user + ph.combRecv,
                                    Rs * T * rowBytes, T * rowBytes, true);
  partials.skipOwnBlock = true;
  partials.sendPeers = records.recvPeers;  // node-aware: a partial back per record carried (one per hop record)
  partials.recvPeers = records.sendPeers;
  // Chunk j of the records and of the partials (moeChunk): a window of each slot
  // (AllToAllvArgs::slotStride) with the counts of row j.
  impl.dispChunks.clear();
  impl.combChunks.clear();
  for (int j = 0; j < p.movers.chunks; ++j) {
    const MoeRange c = moeChunk(p.movers, j, p.shape.maxTokens);
    const std::size_t first = static_cast<std::size_t>(c.first), n = static_cast<std::size_t>(c.end - c.first);
    auto window = [&](AllToAllvArgs a, std::size_t unit, std::size_t countRow) {
      const std::size_t skip = first * unit;
      a.src = static_cast<const char*>(a.src) + skip;
      a.srcBytes -= skip;
      a.dst = static_cast<char*>(a.dst) + skip;
      a.dstBytes -= skip;
      a.sendCounts += countRow;
      a.recvCounts += countRow;
      a.maxBytesPerPeer = n * unit;
      a.slotStride = T * unit;
      return a;
    };
    impl.dispChunks.push_back(window(records, recBytes, static_cast<std::size_t>(j) * Rs));
    impl.combChunks.push_back(window(partials, rowBytes, static_cast<std::size_t>(j) * Rs));
  }
}

DispatchLayout layoutViews(const BindPlan& plan, const MoeParams& p, char* block) {
  const MoeConfig& cfg = plan.cfg;
  const bool fp8 = cfg.dispatchType == DType::kFp8E4m3;
  const int L = cfg.numExperts / static_cast<int>(plan.sizes.R);
  const long long capacity = plan.capacity;
  char* b = block;
  const LocalCarve& o = plan.carve;
  DispatchLayout v{};
  v.recvX = p.layout.recvX;
  v.recvScales = fp8 ? p.layout.recvScales : nullptr;
  v.scalesBuffer = p.layout.recvScales;
  v.expertOffsets = p.layout.expertOffsets;
  v.expertCounts = p.layout.expertCounts;
  v.expertDropped = p.layout.expertDropped;
  v.rowSrcRank = p.layout.rowSrcRank;
  v.rowSrcToken = p.layout.rowSrcToken;
  v.rowTopkSlot = p.layout.rowTopkSlot;
  v.rowWeight = p.layout.rowWeight;
  v.numRecvRows = p.layout.numRecvRows;
  v.expertTotals = p.layout.expertTotals;
  v.expertOutput = b + o.y;
  v.capacity = capacity;
  v.receiveLayout = cfg.receiveLayout;
  v.rowsPerExpert = p.layout.rowsPerExpert;
  v.rankOffsets = p.layout.rankOffsets;
  v.expertSourceRanges = reinterpret_cast<const long long*>(p.layout.expertSourceRanges);
  v.rowExperts = static_cast<const int*>(p.layout.rowExperts);
  v.rowExpertWeights = p.layout.rowExpertWeights;
  v.hidden = cfg.hidden;
  v.numLocalExperts = L;
  v.firstLocalExpert = p.shape.rank * L;
  return v;
}

}  // namespace moe_setup
}  // namespace graphep
