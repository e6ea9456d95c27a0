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

// The device tables of one alltoallv exchange of the throughput path: [R] byte counts and offsets
// per direction. The offsets and the count messages' counts are constant (setupExchangeTables);
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

// The three exchanges' tables in the carved region (LocalCarve.arrays: 12 x R words).
// (exchangeTablesAt), and setupExchangeTables writes their constant halves: a count message of cntMsgBytes to and from every peer, and every
// peer's records and partials at a fixed place ([peer][maxTokens][record]).
EngineExchanges exchangeTablesAt(char* region, const MoeSizes& z) {
  auto* w = reinterpret_cast<std::uint64_t*>(region);
  auto next = [&]() {
    ExchangeTables t{w, w + z.R, w + 2 * z.R, w + 3 * z.R};
    w += 4 * z.R;
    return t;
  };
  EngineExchanges x;
  x.counts = next();
  x.records = next();
  x.partials = next();
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
  GRAPHEP_CUDA_CHECK(cudaMemset(region, 0, 12 * bytes));
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
  p.rank = heap.rank(l);
  p.numRanks = R;
  p.hidden = cfg.hidden;
  p.topK = cfg.topK;
  p.numExperts = cfg.numExperts;
  p.localExperts = L;
  p.maxTokens = cfg.maxTokensPerRank;
  p.fp8 = fp8 ? 1 : 0;
  p.alignment = cfg.expertAlignment;
  p.strict = cfg.strict ? 1 : 0;
  p.capacity = capacity;
  p.batchedRows = cfg.receiveLayout == ReceiveLayout::kBatched ? batchedRowsPerExpert(cfg, R) : 0;
  p.rankMajor = cfg.receiveLayout == ReceiveLayout::kRankMajor ? 1 : 0;
  p.rankOffsets = p.rankMajor ? reinterpret_cast<std::int32_t*>(b + o.rankOffsets) : nullptr;
  p.rowExperts = p.rankMajor ? reinterpret_cast<std::int32_t*>(b + o.rowExperts) : nullptr;
  p.rowExpertWeights = p.rankMajor ? reinterpret_cast<float*>(b + o.rowExpertWeights) : nullptr;
  p.outRows = capacity;  // a dispatch's own outputs may lower it (DispatchOutputs.rows)
  p.yRows = capacity;    // a combine's own input may lower it (CombineArgs.expertOutputRows)
  p.recBytes = recBytes;
  p.payloadBytes = sizes.payloadBytes;
  p.cntMsgBytes = cntMsgBytes;
  p.directMsgBytes = sizes.directMsgBytes;
  p.status = reinterpret_cast<MoeDeviceStatus*>(b + o.status);
  p.liveTokens = reinterpret_cast<std::int32_t*>(b + o.live);
  p.pending = reinterpret_cast<std::uint32_t*>(b + o.pending);
  p.tokRankIdx = reinterpret_cast<std::int32_t*>(b + o.tokRank);
  p.entryIdx = reinterpret_cast<std::int32_t*>(b + o.entry);
  p.expertCount = reinterpret_cast<std::uint32_t*>(b + o.expertCount);
  p.rankCount = reinterpret_cast<std::uint32_t*>(b + o.rankCount);
  p.routeBits = reinterpret_cast<std::uint32_t*>(b + o.routeBits);
  p.routeCount = p.routeBits + (static_cast<std::size_t>(cfg.numExperts) + Rs) * o.routeWords;
  p.routeDup = p.routeCount + static_cast<std::size_t>(cfg.numExperts) * o.routeWords;
  p.routePrefix = reinterpret_cast<std::uint32_t*>(b + o.routePrefix);
  p.routeZeroBytes = throughput ? o.routeZero : 0;
  if (throughput) {  // the throughput kernels' CTAs: the SM budget, or one per SM
    p.ctas = tctas.comm;
    p.epilogueCtas = tctas.epilogue[static_cast<std::size_t>(l)];
    p.epilogueCluster = tctas.cluster[static_cast<std::size_t>(l)];
  }
  p.recSend = b + o.recSend;
  p.recRecv = throughput ? user + ph.recRecv : nullptr;
  p.cntSend = b + o.cntSend;
  p.cntRecv = b + o.cntRecv;
  const EngineExchanges x = throughput ? setupExchangeTables(b + o.arrays, sizes) : EngineExchanges{};
  p.dispSendCounts = x.records.sendCounts;
  p.dispRecvCounts = x.records.recvCounts;
  p.combSendCounts = x.partials.sendCounts;
  p.combRecvCounts = x.partials.recvCounts;
  p.recvRows = reinterpret_cast<std::int32_t*>(b + o.recvRows);
  p.srcBase = reinterpret_cast<std::int32_t*>(b + o.srcBase);
  p.expertOffsets = reinterpret_cast<std::int32_t*>(b + o.offsets);
  p.expertCounts = reinterpret_cast<std::int32_t*>(b + o.counts);
  p.expertDropped = reinterpret_cast<std::int32_t*>(b + o.dropped);
  p.numRecvRows = reinterpret_cast<std::int32_t*>(b + o.numRows);
  p.expertTotals = reinterpret_cast<unsigned long long*>(b + o.totals);
  p.recvX = b + o.recvX;
  p.recvScales = cfg.hidden % 128 == 0 ? reinterpret_cast<float*>(b + o.scales) : nullptr;
  p.sourceRanges = p.rankMajor ? nullptr : reinterpret_cast<std::int64_t*>(b + o.sourceRanges);
  p.rowSrcRank = reinterpret_cast<std::int32_t*>(b + o.rowRank);
  p.rowSrcToken = reinterpret_cast<std::int32_t*>(b + o.rowToken);
  p.rowTopkSlot = reinterpret_cast<std::int32_t*>(b + o.rowSlot);
  p.rowWeight = reinterpret_cast<float*>(b + o.rowWeight);
  p.y = b + o.y;
  p.combSend = b + o.combSend;
  p.combValSend = reinterpret_cast<float*>(b + o.combValSend);
  p.combRecv = throughput ? user + ph.combRecv : nullptr;
  for (int q = 0; q < R; ++q) {
    p.peerUser[q] = q == p.rank ? user : heap.peerUser(l, q);  // nullptr when remote
  }
  p.llRecOff = throughput ? ph.recRecv : ph.llRec;
  p.llCntOff = ph.llCnt;
  p.llCombOff = throughput ? ph.combRecv : ph.llComb;
  p.llFlagOff = ph.llFlag;
  p.llArriveOff = ph.llArrive;
  p.llCombArriveOff = ph.llCombArrive;
  p.llBlockOff = ph.llBlock;
  p.llCombBlockOff = ph.llCombBlock;
  p.llDispAckOff = ph.llDispAck;
  p.llCombAckOff = ph.llCombAck;
  p.llCombValOff = ph.llCombVal;
  p.llCombWOff = ph.llCombW;
  p.llCombWFlagOff = ph.llCombWFlag;
  p.llSteps = reinterpret_cast<std::uint32_t*>(b + o.llSteps);
  p.llDone = reinterpret_cast<std::uint32_t*>(b + o.llDone);
  p.combArrive = reinterpret_cast<std::uint32_t*>(b + o.combArrive);
  p.combReady = reinterpret_cast<std::uint32_t*>(b + o.combReady);
  p.llCtas = llCtas;
  if (!throughput) {  // the latency receivers
    p.epilogueCtas = lctas.receive[static_cast<std::size_t>(l)];
    p.epilogueCluster = 1;
  }
  p.sync = heap.syncHandle(l);
  p.timeline = cfg.profile ? reinterpret_cast<unsigned long long*>(b + o.timeline) : nullptr;
  return p;
}

void startCounters(const BindPlan& plan, const MoeParams& p, char* user) {
  const MoeConfig& cfg = plan.cfg;
  const PathHeap& ph = plan.ph;
  const bool throughput = plan.throughput;
  const std::size_t Rs = plan.sizes.R;
  const int llCtas = plan.latency.send;
  if (!throughput || plan.direct) {
    // The latency and direct counters start at counterStart (steps, flags, block flags) and
    // G x it (the latency arrivals, G the CTAs that post them).
    const std::uint32_t S = cfg.counterStart, SG = cfg.counterStart * static_cast<std::uint32_t>(llCtas);
    const std::uint32_t steps[2] = {S, S};
    GRAPHEP_CUDA_CHECK(cudaMemcpy(p.llSteps, steps, sizeof(steps), cudaMemcpyHostToDevice));
    const std::vector<std::uint32_t> flags(Rs, S), arrivals(Rs, SG);
    GRAPHEP_CUDA_CHECK(cudaMemcpy(user + ph.llFlag, flags.data(), Rs * 4, cudaMemcpyHostToDevice));
    if (throughput) {
      const std::vector<std::uint32_t> blocks(Rs * moeRouteWords(cfg.maxTokensPerRank), S);
      GRAPHEP_CUDA_CHECK(cudaMemcpy(user + ph.llBlock, blocks.data(), blocks.size() * 4, cudaMemcpyHostToDevice));
      GRAPHEP_CUDA_CHECK(cudaMemcpy(user + ph.llCombBlock, blocks.data(), blocks.size() * 4, cudaMemcpyHostToDevice));
      GRAPHEP_CUDA_CHECK(cudaMemcpy(p.combReady, blocks.data(), blocks.size() * 4, cudaMemcpyHostToDevice));
      GRAPHEP_CUDA_CHECK(cudaMemset(p.combArrive, 0, blocks.size() * 4));
      // The acknowledgements start as if step counterStart - 1 had been read everywhere.
      GRAPHEP_CUDA_CHECK(cudaMemcpy(user + ph.llDispAck, flags.data(), Rs * 4, cudaMemcpyHostToDevice));
      GRAPHEP_CUDA_CHECK(cudaMemcpy(user + ph.llCombAck, flags.data(), Rs * 4, cudaMemcpyHostToDevice));
    } else {
      GRAPHEP_CUDA_CHECK(cudaMemcpy(user + ph.llArrive, arrivals.data(), Rs * 4, cudaMemcpyHostToDevice));
      GRAPHEP_CUDA_CHECK(cudaMemcpy(user + ph.llCombArrive, arrivals.data(), Rs * 4, cudaMemcpyHostToDevice));
      GRAPHEP_CUDA_CHECK(cudaMemcpy(user + ph.llCombWFlag, flags.data(), Rs * 4, cudaMemcpyHostToDevice));
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
    return a;
  };
  impl.cntArgs = exchange(x.counts, p.cntSend, Rs * cntMsgBytes, b + o.cntRecv, Rs * cntMsgBytes, cntMsgBytes, false);
  impl.dispArgs = exchange(x.records, p.recSend, Rs * T * recBytes, user + ph.recRecv, Rs * T * recBytes,
                            T * recBytes, true);
  impl.combArgs = exchange(x.partials, p.combSend, Rs * T * rowBytes, user + ph.combRecv, Rs * T * rowBytes,
                            T * rowBytes, true);
}

DispatchLayout layoutViews(const BindPlan& plan, const MoeParams& p, char* block) {
  const MoeConfig& cfg = plan.cfg;
  const bool fp8 = cfg.dispatchType == DType::kFp8E4m3;
  const int L = cfg.numExperts / static_cast<int>(plan.sizes.R);
  const long long capacity = plan.capacity;
  char* b = block;
  const LocalCarve& o = plan.carve;
  DispatchLayout v{};
  v.recvX = p.recvX;
  v.recvScales = fp8 ? p.recvScales : nullptr;
  v.scalesBuffer = p.recvScales;
  v.expertOffsets = p.expertOffsets;
  v.expertCounts = p.expertCounts;
  v.expertDropped = p.expertDropped;
  v.rowSrcRank = p.rowSrcRank;
  v.rowSrcToken = p.rowSrcToken;
  v.rowTopkSlot = p.rowTopkSlot;
  v.rowWeight = p.rowWeight;
  v.numRecvRows = p.numRecvRows;
  v.expertTotals = p.expertTotals;
  v.expertOutput = b + o.y;
  v.capacity = capacity;
  v.receiveLayout = cfg.receiveLayout;
  v.rowsPerExpert = p.batchedRows;
  v.rankOffsets = p.rankOffsets;
  v.expertSourceRanges = reinterpret_cast<const long long*>(p.sourceRanges);
  v.rowExperts = static_cast<const int*>(p.rowExperts);
  v.rowExpertWeights = p.rowExpertWeights;
  v.hidden = cfg.hidden;
  v.numLocalExperts = L;
  v.firstLocalExpert = p.rank * L;
  return v;
}

}  // namespace moe_setup
}  // namespace graphep
