// Engine: the host half of MoE dispatch / combine (kernels/moe.h is the device half). Setup sizes
// and allocates everything once; dispatch() and combine() only enqueue kernels and the movers'
// alltoallv, all of whose sizes are the configured maxima, so they capture into graphs that
// replay with any live token count.
#include <graphep/moe.hpp>

#include <algorithm>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>

#include "engine/device_pointer.hpp"
#include "engine/env.hpp"
#include "engine/error.hpp"
#include "engine/heap.hpp"
#include "engine/log.hpp"
#include "engine/moe_health.hpp"
#include "engine/watchdog.hpp"
#include "engine/movers.hpp"
#include "engine/platform.hpp"
#include "engine/sm_model.hpp"
#include "engine/topology.hpp"
#include "kernels/common/counter.h"
#include "kernels/moe.h"
#include "kernels/probe.h"

namespace graphep {
namespace {

// Engine-wide default of the movers' staging slot: large enough for 4 KiB-row records to pipeline,
// small enough that 32 channels x 4 slots x R peers stay a few hundred MiB at most.
constexpr std::size_t kEngineSlotBytes = std::size_t{256} << 10;

std::size_t alignUp(std::size_t v, std::size_t a) { return (v + a - 1) / a * a; }

using detail::DeviceGuard;
using detail::requireDevicePointer;


// Whether a config fits the latency path's kernels (routing held in shared memory).
bool latencyFits(const MoeConfig& c, int R) {
  return c.maxTokensPerRank <= kMoeLatencyMaxTokens &&
         static_cast<long long>(c.maxTokensPerRank) * c.topK <= kMoeLatencyMaxEntries &&
         moeLatencySmem(c.maxTokensPerRank, c.topK, c.numExperts, R).bytes <= kMoeLatencyMaxSmem;
}

// CTAs of each latency kernel when no budget is given.
constexpr int kLatencyDefaultCtas = 24;

// Byte sizes of one config's records and messages.
struct MoeSizes {
  std::size_t R, T, rowBytes, payloadBytes, recBytes, cntMsgBytes, directMsgBytes;
};

MoeSizes moeSizes(const MoeConfig& cfg, int R) {
  const bool fp8 = cfg.dispatchType == DType::kFp8E4m3;
  const std::size_t payloadBytes = moePayloadBytes(cfg.hidden, fp8);
  return MoeSizes{static_cast<std::size_t>(R), static_cast<std::size_t>(cfg.maxTokensPerRank),
                  static_cast<std::size_t>(cfg.hidden) * 2, payloadBytes,
                  alignUp(payloadBytes + moeMetaBytes(cfg.topK), 16), moeCountMsgBytes(cfg.numExperts / R),
                  moeDirectMsgBytes(cfg.numExperts / R, cfg.maxTokensPerRank, R)};
}

// The path whose heap createAll sizes first: latency when the config fits it (peer classes may
// still send it to the throughput path).
MoePath preferredPath(const MoeConfig& cfg, int R) {
  return cfg.path != MoePath::kThroughput && latencyFits(cfg, R) ? MoePath::kLatency : MoePath::kThroughput;
}

// Where a path's peer-written buffers sit in the heap's user region (the same on every rank), and
// the heap that holds them: only the chosen path's buffers, and staging only for the throughput
// path's movers.
struct PathHeap {
  // Throughput: [R][T] records and partials. Latency: [2][R][T] records, [2][R] count messages,
  // [2][R][T] partials and the three [R] counter arrays (kernels/moe.h, MoeParams).
  std::size_t recRecv = 0, combRecv = 0;
  std::size_t llRec = 0, llCnt = 0, llComb = 0, llFlag = 0, llArrive = 0, llCombArrive = 0, llBlock = 0;
  std::size_t llCombBlock = 0, llDispAck = 0, llCombAck = 0, llCombVal = 0, llCombW = 0, llCombWFlag = 0;
  HeapConfig heap;
};

PathHeap pathHeap(MoePath path, const MoeSizes& z, const MoeConfig& cfg) {
  PathHeap h;
  std::size_t end = 0;
  if (path == MoePath::kLatency) {
    h.llRec = 0;
    h.llCnt = alignUp(h.llRec + 2 * z.R * z.T * z.recBytes, 256);
    h.llComb = alignUp(h.llCnt + 2 * z.R * z.cntMsgBytes, 256);
    h.llFlag = alignUp(h.llComb + 2 * z.R * z.T * z.rowBytes, 256);
    h.llArrive = alignUp(h.llFlag + z.R * 4, 256);
    h.llCombArrive = alignUp(h.llArrive + z.R * 4, 256);
    // The combine's top-k weights from each source ([2][R][T][K] fp32) and their flags [R].
    h.llCombW = alignUp(h.llCombArrive + z.R * 4, 256);
    h.llCombWFlag = alignUp(h.llCombW + 2 * z.R * z.T * static_cast<std::size_t>(cfg.topK) * 4, 256);
    end = h.llCombWFlag + z.R * 4;
  } else {
    // The records and partials, then the direct dispatch's [2][R] count messages, [R] flags and
    // [R][W] block flags for the records and for the partials, its [R] acknowledgements of the
    // records and of the partials, and the partials' [R][T][kMoeMaxValues] fp32 values
    // (kernels/moe_direct.cu; a few KB and 64 B per slot, also when the movers carry the dispatch).
    h.recRecv = 0;
    h.combRecv = alignUp(h.recRecv + z.R * z.T * z.recBytes, 4096);
    h.llCnt = alignUp(h.combRecv + z.R * z.T * z.rowBytes, 256);
    h.llFlag = alignUp(h.llCnt + 2 * z.R * z.directMsgBytes, 256);
    h.llBlock = alignUp(h.llFlag + z.R * 4, 256);
    h.llCombBlock = alignUp(h.llBlock + z.R * moeRouteWords(static_cast<int>(z.T)) * 4, 256);
    h.llDispAck = alignUp(h.llCombBlock + z.R * moeRouteWords(static_cast<int>(z.T)) * 4, 256);
    h.llCombAck = alignUp(h.llDispAck + z.R * 4, 256);
    h.llCombVal = alignUp(h.llCombAck + z.R * 4, 256);
    end = h.llCombVal + z.R * z.T * kMoeMaxValues * 4;
  }
  h.heap.numRanks = static_cast<int>(z.R);
  h.heap.userBytes = alignUp(end, 4096);
  h.heap.moverSlotBytes = path == MoePath::kThroughput ? kEngineSlotBytes : 0;
  if (cfg.smBudget > 0) h.heap.moverBlocks = cfg.smBudget;
  h.heap.counterStart = cfg.counterStart;
  return h;
}

// The movers' options of an engine: the largest message is the records, or partial rows (larger
// than fp8 records).
MoverOptions engineMoverOptions(const MoeSizes& z) {
  MoverOptions mo;
  mo.maxRemoteBytesPerPeer = z.T * std::max(z.recBytes, z.rowBytes);
  return mo;
}

// One rank's local buffers: one allocation, carved in this order (byte offsets). createAll carves
// the allocation with it and memoryRequirements sizes it: the one place the buffers are laid out.
struct LocalCarve {
  std::size_t status, live, pending, tokRank;
  std::size_t entry, expertCount, rankCount, routeBits, routePrefix, recSend, cntSend, cntRecv, arrays;
  std::size_t recvRows, srcBase, offsets, counts, dropped, numRows, totals;
  std::size_t recvX, scales, rowRank, rowToken, rowSlot, rowWeight, y, combSend, combValSend;
  std::size_t rankOffsets, rowExperts, rowExpertWeights;  // rank-major layout only
  std::size_t sourceRanges;                             // expert-major and batched only
  std::size_t llSteps, llDone, combArrive, combReady, timeline;
  std::size_t routeWords;  // moeRouteWords(maxTokensPerRank)
  std::size_t routeZero;   // bytes of the routing words zeroed per dispatch (throughput path)
  std::size_t bytes;       // the whole allocation
};

LocalCarve carveLocal(const MoeConfig& cfg, const MoeSizes& z, std::size_t cap, bool throughput) {
  // recv_x holds the config's type; a bf16 engine's rows have room for fp8 ones (H bytes of 2H),
  // and the scales are there whenever H allows fp8 (1/64 of a bf16 recv_x): one engine serves
  // both types.
  const bool fp8 = cfg.dispatchType == DType::kFp8E4m3;
  const bool scales = cfg.hidden % 128 == 0;
  const std::size_t T = z.T, Rs = z.R, H = static_cast<std::size_t>(cfg.hidden);
  const std::size_t L = static_cast<std::size_t>(cfg.numExperts) / Rs;
  std::size_t used = 0;
  auto carve = [&](std::size_t bytes) {
    const std::size_t off = alignUp(used, 256);
    used = off + std::max<std::size_t>(bytes, 1);
    return off;
  };
  LocalCarve o{};
  o.status = carve(sizeof(MoeDeviceStatus));
  o.live = carve(sizeof(std::int32_t));
  o.pending = carve(sizeof(std::uint32_t));
  o.tokRank = carve(T * Rs * 4);
  // Throughput path only (the latency path routes in shared memory and writes peers directly).
  o.entry = carve(throughput ? T * static_cast<std::size_t>(cfg.topK) * 4 : 0);
  o.expertCount = carve(throughput ? static_cast<std::size_t>(cfg.numExperts) * 4 : 0);
  o.rankCount = carve(throughput ? Rs * 4 : 0);
  const std::size_t W = moeRouteWords(cfg.maxTokensPerRank), Es = static_cast<std::size_t>(cfg.numExperts);
  o.routeWords = W;
  o.routeZero = ((Es + Rs) * W + Es * W + 1) * 4;  // bits, counts, the duplicate flag
  o.routeBits = carve(throughput ? o.routeZero : 0);
  o.routePrefix = carve(throughput ? (Es + Rs) * W * 4 : 0);
  o.recSend = carve(throughput ? Rs * T * z.recBytes : 0);
  o.cntSend = carve(throughput ? Rs * z.cntMsgBytes : 0);
  o.cntRecv = carve(throughput ? Rs * z.cntMsgBytes : 0);
  o.arrays = carve(throughput ? 12 * Rs * 8 : 0);  // EngineExchanges: 3 exchanges x 4 tables x [R]
  o.recvRows = carve(Rs * 4);
  o.srcBase = carve(Rs * L * 4);
  o.offsets = carve((L + 1) * 4);
  o.counts = carve(L * 4);
  o.dropped = carve(L * 4);
  o.numRows = carve(4);
  o.totals = carve(L * 8);
  o.recvX = carve(cap * (fp8 ? H : z.rowBytes));
  o.scales = carve(scales ? cap * (H / 128) * 4 : 0);
  o.rowRank = carve(cap * 4);
  o.rowToken = carve(cap * 4);
  o.rowSlot = carve(cap * 4);
  o.rowWeight = carve(cap * 4);
  o.y = carve(cap * z.rowBytes);
  o.combSend = carve(throughput ? Rs * T * z.rowBytes : 0);
  o.combValSend = carve(throughput ? Rs * T * kMoeMaxValues * 4 : 0);  // the direct combine's staged values
  const bool rankMajor = cfg.receiveLayout == ReceiveLayout::kRankMajor;
  const std::size_t K = static_cast<std::size_t>(cfg.topK);
  o.rankOffsets = carve(rankMajor ? (Rs + 1) * 4 : 0);
  o.rowExperts = carve(rankMajor ? cap * K * 4 : 0);
  o.rowExpertWeights = carve(rankMajor ? cap * K * 4 : 0);
  o.sourceRanges = carve(rankMajor ? 0 : L * Rs * 8);
  o.llSteps = carve(2 * 4);  // dispatch and combine steps and last-CTA counters (latency and direct kernels)
  o.llDone = carve(2 * 4);
  o.combArrive = carve(throughput ? Rs * W * 4 : 0);  // the direct combine's block arrivals and flags
  o.combReady = carve(throughput ? Rs * W * 4 : 0);
  constexpr std::size_t kStamps = kMoeStampWords * static_cast<std::size_t>(MoeKernel::kCount);
  o.timeline = carve(cfg.profile ? (kStamps + kMoeTraceWords) * 8 : 0);
  o.bytes = used;
  return o;
}

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

// Lays the three exchanges' tables out in the carved region (LocalCarve.arrays: 12 x R words) and
// writes their constant halves: a count message of cntMsgBytes to and from every peer, and every
// peer's records and partials at a fixed place ([peer][maxTokens][record]).
EngineExchanges setupExchangeTables(char* region, const MoeSizes& z) {
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

// Collective: whether every local rank of every process reaches every peer by load/store (the
// latency path writes peers' memory directly). Every rank gets the same answer.
// Collective: whether every rank finds `ok` true of its class of every peer.
template <class Ok>
bool everyPeerIs(Communicator& comm, const SymmetricHeap& heap, Ok ok) {
  std::vector<unsigned char> mine(static_cast<std::size_t>(heap.numLocalRanks()), 1);
  for (int l = 0; l < heap.numLocalRanks(); ++l) {
    for (int q = 0; q < heap.worldSize(); ++q) {
      if (q != heap.rank(l) && !ok(heap.peerClass(l, q))) mine[static_cast<std::size_t>(l)] = 0;
    }
  }
  std::vector<unsigned char> all(static_cast<std::size_t>(heap.worldSize()), 0);
  comm.allgather(mine.data(), all.data(), 1);
  return std::all_of(all.begin(), all.end(), [](unsigned char v) { return v != 0; });
}

bool everyPeerLoadStore(Communicator& comm, const SymmetricHeap& heap) {
  return everyPeerIs(comm, heap, [](PeerClass c) { return isLoadStore(c); });
}

// The throughput path's direct dispatch (kernels/moe_direct.cu) needs every peer by load/store and
// no two ranks on one GPU: its receive kernel's CTAs wait for the peers' send kernels, which must
// find room on their GPUs (ranks sharing a GPU keep the movers, whose waiting CTAs are capped).
bool directDispatch(Communicator& comm, const SymmetricHeap& heap) {
  return everyPeerIs(comm, heap, [](PeerClass c) { return isLoadStore(c) && c != PeerClass::kSameDevice; });
}

// Collective: every rank's local buffers (one allocation of `bytes`) fit its device's free memory,
// or every rank raises the same kOutOfMemory naming the first rank that has no room and the
// config fields that size the buffers (before anything is allocated, so no rank is left waiting).
void requireLocalBuffersFit(Communicator& comm, const SymmetricHeap& heap, const MoeConfig& cfg, std::size_t bytes,
                            long long capacity) {
  struct Room {
    unsigned long long free;  // the device's free bytes shared out over this process's ranks on it
    int device;
  };
  std::vector<Room> mine;
  for (int l = 0; l < heap.numLocalRanks(); ++l) {
    DeviceGuard guard(heap.device(l));
    std::size_t free = 0, total = 0;
    GRAPHEP_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    int sharing = 0;  // emulated ranks of this process on the same GPU allocate one after another
    for (int k = 0; k < heap.numLocalRanks(); ++k) sharing += heap.device(k) == heap.device(l) ? 1 : 0;
    mine.push_back(Room{free / static_cast<unsigned long long>(sharing), heap.device(l)});
  }
  std::vector<Room> all(static_cast<std::size_t>(comm.worldSize()));
  comm.allgather(mine.data(), all.data(), sizeof(Room));
  for (std::size_t q = 0; q < all.size(); ++q) {
    GRAPHEP_REQUIRE(bytes <= all[q].free, Status::kOutOfMemory,
                    "MoeConfig: rank %zu needs %zu B of engine buffers (recv_x and expert outputs: %lld rows "
                    "of H=%d%s), more than its share (%llu B) of the memory free on its device %d; lower %s",
                    q, bytes, capacity, cfg.hidden,
                    cfg.receiveLayout == ReceiveLayout::kBatched ? ", the batched layout's E_local x rowsPerExpert" : "",
                    all[q].free, all[q].device,
                    cfg.receiveLayout == ReceiveLayout::kBatched ? "rowsPerExpert" : "recvCapacity or maxTokensPerRank");
  }
}

// Collective: the lowest of the ranks' values (the CTA counts that arrival counters count).
int minOverRanks(Communicator& comm, const std::vector<std::int32_t>& mine) {
  std::vector<std::int32_t> all(static_cast<std::size_t>(comm.worldSize()), 0);
  comm.allgather(mine.data(), all.data(), sizeof(std::int32_t));
  return *std::min_element(all.begin(), all.end());
}

// Collective. The latency path's CTAs: `send`, the senders of each kernel (the SM budget, or 24), the same on
// every rank (the arrival counters count them), and each local rank's receivers. The senders wait
// for nothing but other ranks' senders (the combine's weights, posted first) and the receivers
// only for senders (of every rank), so the ranks sharing a GPU must
// hold all their senders and receivers at once: send + receive <= the GPU's resident CTAs / the
// ranks on it. A rank on a GPU of its own gives its receivers one CTA per SM within what the senders leave (or
// epilogueSms); ranks sharing a GPU take as many receivers as senders, so that two engines in
// flight still fit (§3.7).
struct LatencyCtas {
  int send = 0;
  std::vector<int> receive;  // per local rank
};
LatencyCtas latencyCtas(Communicator& comm, const SymmetricHeap& heap, const MoeConfig& cfg) {
  const int R = heap.worldSize(), locals = heap.numLocalRanks();
  const std::uint32_t smem = moeLatencySmem(cfg.maxTokensPerRank, cfg.topK, cfg.numExperts, R).bytes;
  std::vector<std::int32_t> mine(static_cast<std::size_t>(locals));
  std::vector<int> resident(static_cast<std::size_t>(locals)), sharing(static_cast<std::size_t>(locals));
  std::vector<int> smCount(static_cast<std::size_t>(locals));
  for (int l = 0; l < locals; ++l) {
    const std::size_t ls = static_cast<std::size_t>(l);
    DeviceGuard guard(heap.device(l));
    int perSm = 0, sms = 0;
    GRAPHEP_CUDA_CHECK(moeLatencyCtasPerSm(smem, &perSm));
    GRAPHEP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, heap.device(l)));
    sharing[ls] = 1;
    for (int q = 0; q < R; ++q) sharing[ls] += heap.peerClass(l, q) == PeerClass::kSameDevice ? 1 : 0;
    resident[ls] = perSm * sms / sharing[ls];
    smCount[ls] = sms;
    GRAPHEP_REQUIRE(resident[ls] >= 2, Status::kNotSupported,
                    "MoE latency path: %d ranks share GPU %d, which holds %d of its CTAs at once (%d per "
                    "SM, %u B of shared memory each); each rank needs 2 (a sender and a receiver)",
                    sharing[ls], heap.device(l), perSm * sms, perSm, smem);
    const int budget = cfg.smBudget > 0 ? cfg.smBudget : kLatencyDefaultCtas;
    mine[ls] = std::min(budget, sharing[ls] > 1 ? resident[ls] / 2 : resident[ls] - 1);
  }
  LatencyCtas c;
  c.send = minOverRanks(comm, mine);
  for (int l = 0; l < locals; ++l) {
    const std::size_t ls = static_cast<std::size_t>(l);
    // At least 1 (send <= resident / 2 or resident - 1); ranks sharing a GPU keep to half of their
    // share, so that two engines in flight still fit.
    const int room = sharing[ls] > 1 ? resident[ls] / 2 : resident[ls] - c.send;
    const int want = cfg.epilogueSms > 0 ? cfg.epilogueSms : (sharing[ls] > 1 ? c.send : smCount[ls]);
    c.receive.push_back(std::max(1, std::min(want, room)));
  }
  return c;
}

// Collective, setup only (every peer by load/store): every rank pushes into its next rank's record
// slots (unused until the first dispatch) with one CTA, then with 64 (the slots pushed over again
// until 64 MiB have gone, so the timing is not launch-bound), all ranks at once. This rank's local
// ranks' rates; unknown (zeros) when the slots are under 4 MiB or a CUDA call fails here (logged:
// setup goes on with the SM count; every rank still makes the same collective calls).
std::vector<LinkRates> measureLinkRates(Communicator& comm, const SymmetricHeap& heap, std::size_t slotBytes) {
  constexpr std::size_t kOneCtaBytes = std::size_t{4} << 20, kLinkBytes = std::size_t{64} << 20;
  constexpr int kLinkCtas = 64;
  const int R = heap.worldSize(), locals = heap.numLocalRanks();
  std::vector<LinkRates> rates(static_cast<std::size_t>(locals));
  const std::size_t regionBytes = std::min(kLinkBytes, slotBytes / 16 * 16);
  if (R < 2 || regionBytes < kOneCtaBytes) return rates;  // the same on every rank (config sizes)
  struct Probe {
    char* src = nullptr;
    cudaStream_t stream = nullptr;
    cudaEvent_t ev[3] = {nullptr, nullptr, nullptr};
  };
  std::vector<Probe> probes(static_cast<std::size_t>(locals));
  bool ok = true;
  auto attempt = [&](auto&& step) {  // a failure here leaves this rank's rates unknown
    if (!ok) return;
    try {
      step();
    } catch (const Error& e) {
      ok = false;
      GRAPHEP_LOG_WARN(log::kTune, "rank %d: link probe failed (%s); the SM count is used", heap.rank(0), e.what());
    }
  };
  attempt([&] {
    for (int l = 0; l < locals; ++l) {
      Probe& pr = probes[static_cast<std::size_t>(l)];
      DeviceGuard guard(heap.device(l));
      GRAPHEP_CUDA_CHECK(cudaMalloc(&pr.src, regionBytes));
      GRAPHEP_CUDA_CHECK(cudaMemset(pr.src, 0x3c, regionBytes));
      GRAPHEP_CUDA_CHECK(cudaStreamCreateWithFlags(&pr.stream, cudaStreamNonBlocking));
      for (cudaEvent_t& e : pr.ev) GRAPHEP_CUDA_CHECK(cudaEventCreate(&e));
      GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
    }
  });
  comm.barrier();  // every rank pushes at once, as in a dispatch
  attempt([&] {
    for (int l = 0; l < locals; ++l) {
      Probe& pr = probes[static_cast<std::size_t>(l)];
      DeviceGuard guard(heap.device(l));
      char* dst = heap.peerUser(l, (heap.rank(l) + 1) % R);
      GRAPHEP_CUDA_CHECK(launchPushProbe(dst, pr.src, std::size_t{1} << 20, kLinkCtas, pr.stream));  // warm-up
      GRAPHEP_CUDA_CHECK(cudaEventRecord(pr.ev[0], pr.stream));
      GRAPHEP_CUDA_CHECK(launchPushProbe(dst, pr.src, kOneCtaBytes, 1, pr.stream));
      GRAPHEP_CUDA_CHECK(cudaEventRecord(pr.ev[1], pr.stream));
      for (std::size_t done = 0; done < kLinkBytes; done += regionBytes) {
        GRAPHEP_CUDA_CHECK(launchPushProbe(dst, pr.src, regionBytes, kLinkCtas, pr.stream));
      }
      GRAPHEP_CUDA_CHECK(cudaEventRecord(pr.ev[2], pr.stream));
    }
    for (int l = 0; l < locals; ++l) {
      Probe& pr = probes[static_cast<std::size_t>(l)];
      DeviceGuard guard(heap.device(l));
      GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(pr.stream));
      float one = 0, link = 0;
      GRAPHEP_CUDA_CHECK(cudaEventElapsedTime(&one, pr.ev[0], pr.ev[1]));
      GRAPHEP_CUDA_CHECK(cudaEventElapsedTime(&link, pr.ev[1], pr.ev[2]));
      const std::size_t linkTotal = (kLinkBytes + regionBytes - 1) / regionBytes * regionBytes;
      rates[static_cast<std::size_t>(l)] =
          LinkRates{one > 0 ? static_cast<double>(kOneCtaBytes) / (one * 1e6) : 0.0,
                    link > 0 ? static_cast<double>(linkTotal) / (link * 1e6) : 0.0};
    }
  });
  for (int l = 0; l < locals; ++l) {
    Probe& pr = probes[static_cast<std::size_t>(l)];
    DeviceGuard guard(heap.device(l));
    if (pr.stream != nullptr) cudaStreamSynchronize(pr.stream);  // nothing in flight before the frees
    for (cudaEvent_t e : pr.ev) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (pr.stream != nullptr) cudaStreamDestroy(pr.stream);
    if (pr.src != nullptr) cudaFree(pr.src);
  }
  if (!ok) std::fill(rates.begin(), rates.end(), LinkRates{});
  comm.barrier();  // no rank's probe still writes into a peer when setup goes on
  return rates;
}

// Collective: the throughput kernels' CTAs, the same on every rank (the peers' flags count them):
// the SM budget; without one, for the direct dispatch the most CTAs any rank needs to carry its
// measured link (commCtasFor), within the smallest SM count; else one per SM of the smallest GPU.
// And the direct epilogues' CTAs and cluster size per local rank.
struct ThroughputCtas {
  int comm = 0;
  std::vector<int> epilogue;  // per local rank
  std::vector<int> cluster;   // per local rank; epilogue is a multiple of it
};

// The direct epilogues' cluster size on local rank l's GPU for `ctas` CTAs (GRAPHEP_EPILOGUE_CLUSTER
// preferred, halved until the GPU can place it).
int epilogueClusterFor(const SymmetricHeap& heap, int l, int ctas) {
  DeviceGuard guard(heap.device(l));
  const int size = clusterSizeFor(static_cast<int>(env::kEpilogueCluster.get()), ctas, [&](int s) {
    bool fits = false;
    GRAPHEP_CUDA_CHECK(moeDirectEpilogueFits(s, ctas / s * s, &fits));
    return fits;
  });
  GRAPHEP_LOG_INFO(log::kTune, "rank %d: direct epilogues in clusters of %d CTAs (%d preferred)", heap.rank(l), size,
                   static_cast<int>(env::kEpilogueCluster.get()));
  return size;
}
ThroughputCtas throughputCtas(Communicator& comm, const SymmetricHeap& heap, const MoeConfig& cfg, bool direct,
                              std::size_t slotBytes) {
  ThroughputCtas c;
  const int locals = heap.numLocalRanks();
  const std::vector<LinkRates> rates =
      direct && cfg.smBudget == 0 ? measureLinkRates(comm, heap, slotBytes) : std::vector<LinkRates>(locals);
  std::vector<std::int32_t> sms(static_cast<std::size_t>(locals)), needNeg(static_cast<std::size_t>(locals));
  const double share = remoteStoreShare(heap.worldSize());
  for (int l = 0; l < locals; ++l) {
    const std::size_t ls = static_cast<std::size_t>(l);
    GRAPHEP_CUDA_CHECK(cudaDeviceGetAttribute(&sms[ls], cudaDevAttrMultiProcessorCount, heap.device(l)));
    needNeg[ls] = -(cfg.smBudget > 0 ? cfg.smBudget : commCtasFor(rates[ls], sms[ls], share));
    if (rates[ls].linkGBps > 0) {
      GRAPHEP_LOG_INFO(log::kTune,
                       "rank %d: link %.0f GB/s, one CTA %.1f GB/s, %.2f of its stores remote: %d communication "
                       "CTAs needed",
                       heap.rank(l), rates[ls].linkGBps, rates[ls].perCtaGBps, share, -needNeg[ls]);
    }
  }
  const int most = -minOverRanks(comm, needNeg);  // the largest need
  c.comm = cfg.smBudget > 0 ? most : std::min(most, minOverRanks(comm, sms));
  // MoeConfig.epilogueSms, at most one per SM; by default the SMs the send leaves free (one CTA
  // per SM: each kernel's CTA fills an SM's registers), so that every receive CTA starts at once
  // beside the send; when it leaves fewer than half, one per SM (those past the free SMs start as
  // the send ends).
  for (int l = 0; l < locals; ++l) {
    const int n = sms[static_cast<std::size_t>(l)];
    const int ctas = cfg.epilogueSms > 0 ? std::min(cfg.epilogueSms, n) : (n - c.comm >= n / 2 ? n - c.comm : n);
    const int cluster = direct ? epilogueClusterFor(heap, l, ctas) : 1;
    c.epilogue.push_back(ctas / cluster * cluster);
    c.cluster.push_back(cluster);
  }
  return c;
}

}  // namespace

// The engines of one createAll share the heap and the movers.
struct EngineGroup {
  std::unique_ptr<SymmetricHeap> heap;
  std::vector<Movers> movers;  // destroyed before the heap they point into
};

namespace {
// Every live engine of this process, to recognise another engine's buffers handed to this one.
std::mutex registryMutex;
std::vector<const Engine::Impl*> registry;
}  // namespace

struct Engine::Impl {
  std::shared_ptr<EngineGroup> group;
  int local = 0;
  int device = 0;
  MoeConfig cfg;
  MoeParams base{};  // every buffer of the engine, as createAll set them: each dispatch starts here
  MoeParams p{};     // the last dispatch's (combine serves it)
  // A latency-path operation enqueued as its send half (MoeHalf::kSend), whose receive half
  // Engine::receive enqueues with these parameters; none between operations.
  enum class Half { kNone, kDispatch, kCombine } half = Half::kNone;
  MoeParams halfParams{};
  DispatchLayout layout{};
  AllToAllvArgs cntArgs, dispArgs, combArgs;
  MoePath path = MoePath::kThroughput;
  bool direct = false;    // the throughput path's dispatch by direct stores (kernels/moe_direct.cu)
  char* block = nullptr;  // every local buffer, carved from one allocation
  std::size_t blockBytes = 0;
  // The failed state (why; "" when healthy) and the watchdog's tools: a private stream for
  // snapshots, an event, pinned host memory for the counters.
  mutable std::string failure;
  cudaStream_t watchStream = nullptr;
  cudaEvent_t watchEvent = nullptr;
  std::uint32_t* snapshot = nullptr;  // pinned: llSteps[2], pending, then flags, arrivals, combine arrivals [R] each
  Impl() {
    std::lock_guard<std::mutex> lock(registryMutex);
    registry.push_back(this);
  }
  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(registryMutex);
      registry.erase(std::remove(registry.begin(), registry.end(), this), registry.end());
    }
    cudaSetDevice(device);
    if (watchEvent != nullptr) cudaEventDestroy(watchEvent);
    if (watchStream != nullptr) cudaStreamDestroy(watchStream);
    if (snapshot != nullptr) cudaFreeHost(snapshot);
    if (block != nullptr) cudaFree(block);
  }
  const Movers& movers() const { return group->movers[static_cast<std::size_t>(local)]; }
};

namespace {
// The batched layout's rows per local expert: MoeConfig.rowsPerExpert, or worldSize x T_max.
long long batchedRowsPerExpert(const MoeConfig& cfg, int worldSize) {
  return cfg.rowsPerExpert > 0 ? cfg.rowsPerExpert : static_cast<long long>(worldSize) * cfg.maxTokensPerRank;
}
}  // namespace

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
  const MoeSizes z = moeSizes(cfg, worldSize);
  const long long capacity = receiveCapacity(cfg, worldSize);
  MoeMemory m;
  m.path = preferredPath(cfg, worldSize);
  const bool throughput = m.path == MoePath::kThroughput;
  m.symmetricHeapBytes = heapBytes(pathHeap(m.path, z, cfg).heap);
  m.privateBytes = carveLocal(cfg, z, static_cast<std::size_t>(capacity), throughput).bytes;
  m.ncclStagingBytes = throughput ? Movers::remoteStageBytes(engineMoverOptions(z), worldSize) : 0;
  return m;
}

namespace {
// The batched and rank-major layouts size themselves (`capacity`): recvCapacity stays 0 and
// expertAlignment 1.
void requireLayoutSizesItself(const MoeConfig& c, const char* layout, const char* capacity) {
  GRAPHEP_REQUIRE(c.recvCapacity == 0, Status::kInvalidArgument,
                  "MoeConfig.recvCapacity=%lld: the %s layout's capacity is %s (leave recvCapacity 0)",
                  c.recvCapacity, layout, capacity);
  GRAPHEP_REQUIRE(c.expertAlignment == 1, Status::kInvalidArgument,
                  "MoeConfig.expertAlignment=%d does not apply to the %s layout (leave it 1)", c.expertAlignment,
                  layout);
}
}  // namespace

void Engine::validate(const MoeConfig& c, int R) {
  GRAPHEP_REQUIRE(R >= 1 && R <= kMaxRanks, Status::kInvalidArgument,
                  "MoeConfig: world size %d is out of range [1, %d]", R, kMaxRanks);
  GRAPHEP_REQUIRE(c.maxTokensPerRank >= 1 && c.maxTokensPerRank <= (1 << 20),
                  Status::kInvalidArgument,
                  "MoeConfig.maxTokensPerRank=%d is out of range [1, 1048576]", c.maxTokensPerRank);
  GRAPHEP_REQUIRE(c.hidden > 0 && c.hidden % 8 == 0, Status::kInvalidArgument,
                  "MoeConfig.hidden=%d is not a positive multiple of 8", c.hidden);
  GRAPHEP_REQUIRE(c.dispatchType == DType::kBf16 || c.dispatchType == DType::kFp8E4m3,
                  Status::kInvalidArgument, "MoeConfig.dispatchType=%d is not a DType",
                  static_cast<int>(c.dispatchType));
  GRAPHEP_REQUIRE(c.dispatchType != DType::kFp8E4m3 || c.hidden % 128 == 0,
                  Status::kInvalidArgument,
                  "MoeConfig.hidden=%d is not a multiple of 128 (fp8 dispatch has one scale per 128 "
                  "values)",
                  c.hidden);
  GRAPHEP_REQUIRE(c.numExperts >= 1, Status::kInvalidArgument,
                  "MoeConfig.numExperts=%d is not positive", c.numExperts);
  GRAPHEP_REQUIRE(c.numExperts % R == 0, Status::kInvalidArgument,
                  "MoeConfig.numExperts=%d is not divisible by the %d ranks", c.numExperts, R);
  GRAPHEP_REQUIRE(c.topK >= 1, Status::kInvalidArgument, "MoeConfig.topK=%d is not positive", c.topK);
  GRAPHEP_REQUIRE(c.topK <= c.numExperts, Status::kInvalidArgument,
                  "MoeConfig.topK=%d exceeds numExperts=%d", c.topK, c.numExperts);
  GRAPHEP_REQUIRE(c.topK <= kMoeMaxTopK, Status::kInvalidArgument,
                  "MoeConfig.topK=%d exceeds the supported %d", c.topK, kMoeMaxTopK);
  GRAPHEP_REQUIRE(c.expertAlignment >= 1 && c.expertAlignment <= 4096, Status::kInvalidArgument,
                  "MoeConfig.expertAlignment=%d is out of range [1, 4096]", c.expertAlignment);
  GRAPHEP_REQUIRE(c.smBudget >= 0 && c.smBudget <= 64, Status::kInvalidArgument,
                  "MoeConfig.smBudget=%d is out of range [0, 64]", c.smBudget);
  GRAPHEP_REQUIRE(c.epilogueSms >= 0 && c.epilogueSms <= 1024, Status::kInvalidArgument,
                  "MoeConfig.epilogueSms=%d is out of range [0, 1024]", c.epilogueSms);
  GRAPHEP_REQUIRE(c.numExperts / R <= kMoeMaxLocalExperts, Status::kInvalidArgument,
                  "MoeConfig: %d experts per rank (numExperts=%d over %d ranks) exceed the supported %d",
                  c.numExperts / R, c.numExperts, R, kMoeMaxLocalExperts);
  GRAPHEP_REQUIRE(c.path == MoePath::kAuto || c.path == MoePath::kLatency || c.path == MoePath::kThroughput,
                  Status::kInvalidArgument, "MoeConfig.path=%d is not a MoePath", static_cast<int>(c.path));
  GRAPHEP_REQUIRE(c.path != MoePath::kLatency || latencyFits(c, R), Status::kInvalidArgument,
                  "MoeConfig.path=kLatency needs maxTokensPerRank <= %d, maxTokensPerRank * topK <= %d and "
                  "its routing in %u B of shared memory (maxTokensPerRank=%d, topK=%d, numExperts=%d)",
                  kMoeLatencyMaxTokens, kMoeLatencyMaxEntries, kMoeLatencyMaxSmem, c.maxTokensPerRank, c.topK,
                  c.numExperts);
  GRAPHEP_REQUIRE(c.recvCapacity >= 0, Status::kInvalidArgument,
                  "MoeConfig.recvCapacity=%lld is negative", c.recvCapacity);
  GRAPHEP_REQUIRE(c.receiveLayout == ReceiveLayout::kExpertMajor || c.receiveLayout == ReceiveLayout::kBatched ||
                      c.receiveLayout == ReceiveLayout::kRankMajor,
                  Status::kInvalidArgument, "MoeConfig.receiveLayout=%d is not a ReceiveLayout",
                  static_cast<int>(c.receiveLayout));
  if (c.receiveLayout == ReceiveLayout::kRankMajor) {
    requireLayoutSizesItself(c, "rank-major", "worldSize x maxTokensPerRank (one row per source token)");
  }
  GRAPHEP_REQUIRE(c.rowsPerExpert >= 0, Status::kInvalidArgument, "MoeConfig.rowsPerExpert=%lld is negative",
                  c.rowsPerExpert);
  if (c.receiveLayout == ReceiveLayout::kBatched) {
    requireLayoutSizesItself(c, "batched", "E_local x rowsPerExpert");
  } else {
    GRAPHEP_REQUIRE(c.rowsPerExpert == 0, Status::kInvalidArgument,
                    "MoeConfig.rowsPerExpert=%lld applies to the batched layout only", c.rowsPerExpert);
  }
  const long long cap = receiveCapacity(c, R);
  if (c.receiveLayout == ReceiveLayout::kBatched) {  // the capacity's own field named
    GRAPHEP_REQUIRE(cap < (1ll << 31), Status::kInvalidArgument,
                    "MoeConfig.rowsPerExpert=%lld: %d local experts x %lld rows exceed 2^31 - 1 rows (lower "
                    "rowsPerExpert)",
                    c.rowsPerExpert, c.numExperts / R, batchedRowsPerExpert(c, R));
  } else {
    GRAPHEP_REQUIRE(cap < (1ll << 31), Status::kInvalidArgument,
                    "MoeConfig: a receive capacity of %lld rows exceeds 2^31 - 1 (lower recvCapacity)", cap);
  }
  GRAPHEP_REQUIRE(static_cast<long long>(R) * c.maxTokensPerRank < (1ll << 31),
                  Status::kInvalidArgument,
                  "MoeConfig: %d ranks x maxTokensPerRank=%d records exceed 2^31 - 1", R,
                  c.maxTokensPerRank);
}

namespace {
// Collective: every rank must pass the same config. The fields travel in an allgather (setup only);
// a mismatch names the field, this rank's value and the first rank that differs, on every rank.
void requireSameConfig(Communicator& comm, const MoeConfig& cfg) {
  struct Fields {
    long long v[16];
  };
  const Fields mine{{cfg.maxTokensPerRank, cfg.hidden, cfg.numExperts, cfg.topK, static_cast<long long>(cfg.dispatchType),
                     cfg.recvCapacity, cfg.expertAlignment, static_cast<long long>(cfg.receiveLayout),
                     cfg.rowsPerExpert, cfg.smBudget, cfg.epilogueSms, cfg.strict ? 1 : 0,
                     static_cast<long long>(cfg.path), cfg.profile ? 1 : 0, static_cast<long long>(cfg.counterStart),
                     comm.worldSize()}};
  static const char* const names[16] = {"maxTokensPerRank", "hidden", "numExperts", "topK", "dispatchType",
                                        "recvCapacity", "expertAlignment", "receiveLayout", "rowsPerExpert",
                                        "smBudget", "epilogueSms", "strict", "path", "profile", "counterStart",
                                        "world size"};
  std::vector<Fields> local(static_cast<std::size_t>(comm.numLocalRanks()), mine);
  std::vector<Fields> all(static_cast<std::size_t>(comm.worldSize()));
  comm.allgather(local.data(), all.data(), sizeof(Fields));
  for (std::size_t q = 0; q < all.size(); ++q) {
    for (int k = 0; k < 16; ++k) {
      GRAPHEP_REQUIRE(all[q].v[k] == mine.v[k], Status::kInvalidArgument,
                      "MoeConfig differs across ranks: %s is %lld on rank %d but %lld on rank %zu (every rank "
                      "must pass the same config)",
                      names[k], mine.v[k], comm.globalRank(0), all[q].v[k], q);
    }
  }
}
}  // namespace

std::vector<std::unique_ptr<Engine>> Engine::createAll(Communicator& comm, const MoeConfig& cfg) {
  const int R = comm.worldSize();
  requireSameConfig(comm, cfg);  // first: a rank whose config alone is invalid must not strand the others
  validate(cfg, R);
  const bool fp8 = cfg.dispatchType == DType::kFp8E4m3;
  const int L = cfg.numExperts / R;
  const std::size_t T = static_cast<std::size_t>(cfg.maxTokensPerRank);
  const MoeSizes sizes = moeSizes(cfg, R);
  const std::size_t rowBytes = sizes.rowBytes, recBytes = sizes.recBytes, cntMsgBytes = sizes.cntMsgBytes;
  const long long capacity = receiveCapacity(cfg, R);
  const std::size_t cap = static_cast<std::size_t>(capacity);
  const std::size_t Rs = static_cast<std::size_t>(R);

  // The heap is sized for the latency path when the config fits it; peer classes (known once the
  // heap exists) decide, on every rank alike, whether it stays there or falls back to the
  // throughput path, whose heap replaces it.
  const bool latencyCandidate = preferredPath(cfg, R) == MoePath::kLatency;
  PathHeap ph = pathHeap(latencyCandidate ? MoePath::kLatency : MoePath::kThroughput, sizes, cfg);
  auto group = std::make_shared<EngineGroup>();
  group->heap = SymmetricHeap::create(comm, ph.heap);
  const bool allLoadStore = everyPeerLoadStore(comm, *group->heap);
  GRAPHEP_REQUIRE(cfg.path != MoePath::kLatency || allLoadStore, Status::kNotSupported,
                  "MoeConfig.path=kLatency needs load/store access to every peer; some are reached "
                  "only through NCCL (use kAuto or kThroughput)");
  const MoePath path = latencyCandidate && allLoadStore ? MoePath::kLatency : MoePath::kThroughput;
  if (latencyCandidate && path == MoePath::kThroughput) {
    ph = pathHeap(path, sizes, cfg);
    group->heap->reallocate(ph.heap);
  }
  const bool throughput = path == MoePath::kThroughput;
  const LatencyCtas lctas = throughput ? LatencyCtas{} : latencyCtas(comm, *group->heap, cfg);
  const int llCtas = lctas.send;
  const bool direct = throughput && directDispatch(comm, *group->heap);
  const ThroughputCtas tctas =
      throughput ? throughputCtas(comm, *group->heap, cfg, direct, Rs * T * recBytes) : ThroughputCtas{};
  group->movers = Movers::createAll(*group->heap, engineMoverOptions(sizes));

  requireLocalBuffersFit(comm, *group->heap, cfg, carveLocal(cfg, sizes, cap, throughput).bytes, capacity);
  std::vector<std::unique_ptr<Engine>> engines;
  for (int l = 0; l < group->heap->numLocalRanks(); ++l) {
    auto impl = std::make_unique<Impl>();
    impl->group = group;
    impl->local = l;
    impl->device = group->heap->device(l);
    impl->cfg = cfg;
    impl->path = path;
    impl->direct = direct;
    DeviceGuard guard(impl->device);
    GRAPHEP_CUDA_CHECK(preloadMoeLatencyKernels());
    GRAPHEP_CUDA_CHECK(preloadMoeRouteKernels());
    GRAPHEP_CUDA_CHECK(preloadMoeDispatchKernels());
    GRAPHEP_CUDA_CHECK(preloadMoeDirectKernels());
    GRAPHEP_CUDA_CHECK(preloadMoeCombineKernels());
    GRAPHEP_CUDA_CHECK(preloadMoeTokenLayoutKernels());  // graphep::tokenLayout, beside the engine's

    const LocalCarve o = carveLocal(cfg, sizes, cap, throughput);
    GRAPHEP_CUDA_CHECK(cudaMalloc(&impl->block, o.bytes));
    impl->blockBytes = o.bytes;
    GRAPHEP_CUDA_CHECK(cudaStreamCreateWithFlags(&impl->watchStream, cudaStreamNonBlocking));
    GRAPHEP_CUDA_CHECK(cudaEventCreateWithFlags(&impl->watchEvent, cudaEventDisableTiming));
    GRAPHEP_CUDA_CHECK(cudaHostAlloc(&impl->snapshot, (3 + 3 * Rs) * sizeof(std::uint32_t), cudaHostAllocDefault));
    GRAPHEP_CUDA_CHECK(cudaMemset(impl->block, 0, o.bytes));
    char* b = impl->block;
    char* user = group->heap->user(l);

    MoeParams& p = impl->p;
    p.rank = group->heap->rank(l);
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
      p.peerUser[q] = q == p.rank ? user : group->heap->peerUser(l, q);  // nullptr when remote
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
    if (!throughput || direct) {
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
    p.sync = group->heap->syncHandle(l);
    p.timeline = cfg.profile ? reinterpret_cast<unsigned long long*>(b + o.timeline) : nullptr;

    if (throughput) {
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
      impl->cntArgs = exchange(x.counts, p.cntSend, Rs * cntMsgBytes, b + o.cntRecv, Rs * cntMsgBytes, cntMsgBytes, false);
      impl->dispArgs = exchange(x.records, p.recSend, Rs * T * recBytes, user + ph.recRecv, Rs * T * recBytes,
                                T * recBytes, true);
      impl->combArgs = exchange(x.partials, p.combSend, Rs * T * rowBytes, user + ph.combRecv, Rs * T * rowBytes,
                                T * rowBytes, true);
    }

    impl->base = p;
    DispatchLayout& v = impl->layout;
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
    GRAPHEP_LOG_INFO(log::kInit,
                "rank %d: MoE engine T_max=%d H=%d E=%d K=%d %s, %s path, capacity %lld rows, %zu B "
                "local, %zu B symmetric heap",
                p.rank, cfg.maxTokensPerRank, cfg.hidden, cfg.numExperts, cfg.topK,
                fp8 ? "fp8" : "bf16", path == MoePath::kLatency ? "latency" : "throughput", capacity,
                o.bytes, heapBytes(group->heap->config()));
    engines.push_back(std::unique_ptr<Engine>(new Engine(std::move(impl))));
    engines.back()->resetTimeline();
  }
  comm.barrier();
  return engines;
}

std::unique_ptr<Engine> Engine::create(Communicator& comm, const MoeConfig& cfg) {
  GRAPHEP_REQUIRE(comm.numLocalRanks() == 1, Status::kInvalidArgument,
                  "Engine::create: this process drives %d ranks; use Engine::createAll",
                  comm.numLocalRanks());
  auto all = createAll(comm, cfg);
  return std::move(all[0]);
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

int Engine::rank() const { return impl_->p.rank; }
int Engine::device() const { return impl_->device; }
int Engine::worldSize() const { return impl_->p.numRanks; }
MoePath Engine::path() const { return impl_->path; }
const MoeConfig& Engine::config() const { return impl_->cfg; }
std::size_t Engine::symmetricHeapBytes() const { return heapBytes(impl_->group->heap->config()); }
std::size_t Engine::privateBytes() const { return impl_->blockBytes; }
const DispatchLayout& Engine::layout() const { return impl_->layout; }

namespace {
void requireHealthy(const Engine::Impl& m, int rank, const char* op);
}  // namespace

namespace {
const char* layoutName(ReceiveLayout l) {
  switch (l) {
    case ReceiveLayout::kExpertMajor: return "expert-major";
    case ReceiveLayout::kBatched: return "batched";
    case ReceiveLayout::kRankMajor: return "rank-major";
  }
  return "?";
}

// A dispatch argument that needs the rank-major layout on the throughput path (and, with `direct`,
// its direct dispatch: every peer by load/store, each rank on a GPU of its own).
void requireRankMajorThroughput(const Engine::Impl& m, const char* what, bool direct);
// No send half waits for its receive (Engine::receive) when `op` starts.
void requireNoHalf(const Engine::Impl& m, const char* op);
// A capability of the latency path.
void requireLatency(const Engine::Impl& m, const char* what);
// `op`'s MoeHalf: a value of the enum, kSend on the latency path only.
void requireHalf(const Engine::Impl& m, MoeHalf half, const char* op);
// The latency path's launch of operation `op` (dispatch or combine) with `p`: both parts for
// kWhole; the send part for kSend, remembered for Engine::receive; the receive part for nullopt
// (Engine::receive).
void launchLatency(Engine::Impl& m, MoeParams p, Engine::Impl::Half op, std::optional<MoeHalf> half,
                   cudaStream_t stream);

// The caller's DispatchOutputs over the engine's buffers in `p`: every given pointer checked and
// taken, rows (the caller's) bounding what is written.
void applyOutputs(const Engine::Impl& m, const DispatchArgs& a, MoeParams& p);
}  // namespace

const DispatchLayout& Engine::dispatch(const DispatchArgs& a, cudaStream_t stream) {
  Impl& m = *impl_;
  requireHealthy(m, m.p.rank, "dispatch");
  DeviceGuard guard(m.device);
  const MoeConfig& c = m.cfg;
  requireDevicePointer(a.x, m.device, "dispatch: x");
  GRAPHEP_REQUIRE(a.tokenInRank != nullptr || a.topkIdx != nullptr, Status::kInvalidArgument,
                  "dispatch: topkIdx is null (pass the top-k ids, or route by tokenInRank)");
  requireNoHalf(m, "dispatch");
  if (a.topkIdx != nullptr) {
    requireDevicePointer(a.topkIdx, m.device, "dispatch: topkIdx");
    // The latency path takes none (weights 1: its combine may bring them, CombineArgs.topkWeights).
    if (m.path != MoePath::kLatency || a.topkWeights != nullptr) {
      requireDevicePointer(a.topkWeights, m.device, "dispatch: topkWeights");
    }
  }
  requireDevicePointer(a.numTokens, m.device, "dispatch: numTokens");
  GRAPHEP_REQUIRE((reinterpret_cast<std::uintptr_t>(a.x) & 15u) == 0, Status::kInvalidArgument,
                  "dispatch: x (%p) is not 16-byte aligned", a.x);
  GRAPHEP_REQUIRE(a.indexType == IndexType::kInt32 || a.indexType == IndexType::kInt64,
                  Status::kInvalidArgument, "dispatch: indexType=%d is not an IndexType",
                  static_cast<int>(a.indexType));
  const int topK = a.topkIdx == nullptr ? 0 : (a.topK == 0 ? c.topK : a.topK);
  GRAPHEP_REQUIRE(a.topkIdx == nullptr || (topK >= 1 && topK <= c.topK), Status::kInvalidArgument,
                  "dispatch: topK=%d is outside [1, MoeConfig.topK=%d]", a.topK, c.topK);
  GRAPHEP_REQUIRE(a.topkIdx != nullptr || a.topK == 0, Status::kInvalidArgument,
                  "dispatch: topK=%d with no topkIdx (routing by tokenInRank alone has no slots)", a.topK);
  if (a.tokenInRank != nullptr) {
    requireDevicePointer(a.tokenInRank, m.device, "dispatch: tokenInRank");
    requireRankMajorThroughput(m, "tokenInRank", false);
  }
  const DispatchInput in = a.input;
  GRAPHEP_REQUIRE(in == DispatchInput::kConfig || in == DispatchInput::kBf16 || in == DispatchInput::kFp8Quantize ||
                      in == DispatchInput::kFp8,
                  Status::kInvalidArgument, "dispatch: input=%d is not a DispatchInput", static_cast<int>(in));
  const bool configFp8 = c.dispatchType == DType::kFp8E4m3;
  const bool fp8 = in == DispatchInput::kConfig ? configFp8 : in != DispatchInput::kBf16;
  GRAPHEP_REQUIRE(fp8 || !configFp8, Status::kInvalidArgument,
                  "dispatch: input=kBf16 on an engine whose MoeConfig.dispatchType is fp8 (its record slots "
                  "hold fp8 rows; create the engine with kBf16 to send both)");
  GRAPHEP_REQUIRE(!fp8 || c.hidden % 128 == 0, Status::kInvalidArgument,
                  "dispatch: an fp8 dispatch needs hidden=%d to be a multiple of 128", c.hidden);
  GRAPHEP_REQUIRE(a.scaleFormat == Fp8Scales::kFloat || a.scaleFormat == Fp8Scales::kPow2 ||
                      a.scaleFormat == Fp8Scales::kUe8m0,
                  Status::kInvalidArgument, "dispatch: scaleFormat=%d is not an Fp8Scales",
                  static_cast<int>(a.scaleFormat));
  if (a.scaleFormat != Fp8Scales::kFloat) {
    GRAPHEP_REQUIRE(fp8 && in != DispatchInput::kFp8, Status::kInvalidArgument,
                    "dispatch: scaleFormat=%d applies to an fp8 dispatch the engine quantises (input=%d)",
                    static_cast<int>(a.scaleFormat), static_cast<int>(in));
    requireLatency(m, "scaleFormat other than kFloat");
  }
  requireHalf(m, a.half, "dispatch");
  if (a.recvStats != nullptr) requireDevicePointer(a.recvStats, m.device, "dispatch: recvStats");
  if (in == DispatchInput::kFp8) {
    requireDevicePointer(a.xScales, m.device, "dispatch: xScales");
    requireRankMajorThroughput(m, "input=kFp8 (caller-quantised x)", true);
    GRAPHEP_REQUIRE((a.scaleTokenStride == 0 && a.scaleHiddenStride == 0) ||
                        (a.scaleTokenStride > 0 && a.scaleHiddenStride > 0),
                    Status::kInvalidArgument,
                    "dispatch: scaleTokenStride=%lld, scaleHiddenStride=%lld (both 0 for row-major, or both "
                    "positive element strides)",
                    a.scaleTokenStride, a.scaleHiddenStride);
  } else {
    GRAPHEP_REQUIRE(a.xScales == nullptr, Status::kInvalidArgument,
                    "dispatch: xScales is set but input=%d is not kFp8 (x would be read as bf16)",
                    static_cast<int>(in));
  }
  MoeParams p = m.base;
  p.x = a.x;
  p.topkIdx = a.topkIdx;
  p.int64Ids = a.indexType == IndexType::kInt64 ? 1 : 0;
  p.topkWeights = a.topkWeights;
  p.numTokens = a.numTokens;
  p.topK = topK;
  p.tokenInRank = reinterpret_cast<const std::uint8_t*>(a.tokenInRank);
  p.fp8 = fp8 ? 1 : 0;
  p.payloadBytes = moePayloadBytes(c.hidden, fp8);
  p.fp8Input = in == DispatchInput::kFp8 ? 1 : 0;
  p.xScales = a.xScales;
  const bool rowMajorScales = a.scaleTokenStride == 0 && a.scaleHiddenStride == 0;
  p.scaleTokenStride = rowMajorScales ? c.hidden / 128 : a.scaleTokenStride;
  p.scaleHiddenStride = rowMajorScales ? 1 : a.scaleHiddenStride;
  p.scaleFormat = static_cast<std::int32_t>(a.scaleFormat);
  p.recvStats = a.recvStats;
  applyOutputs(m, a, p);
  m.layout.recvScales = fp8 ? m.base.recvScales : nullptr;  // the engine's rows hold this type now
  m.p = p;  // combine reads the routing of the last dispatch
  if (m.path == MoePath::kLatency) {
    launchLatency(m, p, Impl::Half::kDispatch, a.half, stream);
    return m.layout;
  }
  GRAPHEP_CUDA_CHECK(launchMoeRoute(p, stream));
  if (m.direct) {
    if (p.fp8) GRAPHEP_CUDA_CHECK(launchMoeDirectQuantize(p, stream));
    GRAPHEP_CUDA_CHECK(launchMoeDirectSend(p, stream));
    GRAPHEP_CUDA_CHECK(launchMoeDirectReceive(p, stream));
    return m.layout;
  }
  const Movers& movers = m.movers();
  GRAPHEP_CUDA_CHECK(launchMoePack(p, stream));
  movers.allToAllv(stream, m.cntArgs);
  GRAPHEP_CUDA_CHECK(launchMoeOffsets(p, stream));
  movers.allToAllv(stream, m.dispArgs);
  GRAPHEP_CUDA_CHECK(launchMoeExpand(p, stream));
  return m.layout;
}

void Engine::combine(const CombineArgs& a, cudaStream_t stream) {
  Impl& m = *impl_;
  requireHealthy(m, m.p.rank, "combine");
  requireNoHalf(m, "combine");
  DeviceGuard guard(m.device);
  MoeParams p = m.p;
  requireHalf(m, a.half, "combine");
  if (a.topkWeights != nullptr) {
    requireLatency(m, "combine topkWeights");
    GRAPHEP_REQUIRE(m.cfg.receiveLayout != ReceiveLayout::kRankMajor, Status::kNotSupported,
                    "combine: topkWeights with the rank-major layout (its experts apply the weights)");
    requireDevicePointer(a.topkWeights, m.device, "combine: topkWeights");
    p.combineWeights = a.topkWeights;
  }
  GRAPHEP_REQUIRE(a.expertOutputRows >= 0, Status::kInvalidArgument, "combine: expertOutputRows=%lld is negative",
                  a.expertOutputRows);
  GRAPHEP_REQUIRE(a.expertOutput != nullptr || a.expertOutputRows <= m.layout.capacity, Status::kInvalidArgument,
                  "combine: expertOutputRows=%lld exceeds the engine's expertOutput of %lld rows",
                  a.expertOutputRows, m.layout.capacity);
  p.y = m.base.y;
  p.yRows = a.expertOutputRows > 0 ? a.expertOutputRows : m.layout.capacity;
  GRAPHEP_REQUIRE((a.rowValues == nullptr) == (a.outValues == nullptr), Status::kInvalidArgument,
                  "combine: rowValues (%p) and outValues (%p) come together", static_cast<const void*>(a.rowValues),
                  static_cast<void*>(a.outValues));
  p.rowValues = nullptr;
  p.outValues = nullptr;
  p.numValues = 0;
  if (a.rowValues != nullptr) {
    requireRankMajorThroughput(m, "rowValues", true);
    requireDevicePointer(a.rowValues, m.device, "combine: rowValues");
    requireDevicePointer(a.outValues, m.device, "combine: outValues");
    GRAPHEP_REQUIRE(a.numValues >= 1 && a.numValues <= kMoeMaxValues, Status::kInvalidArgument,
                    "combine: numValues=%d is outside [1, %d]", a.numValues, kMoeMaxValues);
    p.rowValues = a.rowValues;
    p.outValues = a.outValues;
    p.numValues = a.numValues;
  } else {
    GRAPHEP_REQUIRE(a.numValues == 0, Status::kInvalidArgument, "combine: numValues=%d with no rowValues",
                    a.numValues);
  }
  if (a.expertOutput != nullptr) {
    requireDevicePointer(a.expertOutput, m.device, "combine: expertOutput");
    GRAPHEP_REQUIRE((reinterpret_cast<std::uintptr_t>(a.expertOutput) & 15u) == 0,
                    Status::kInvalidArgument, "combine: expertOutput (%p) is not 16-byte aligned",
                    a.expertOutput);
    p.y = static_cast<const char*>(a.expertOutput);
    std::lock_guard<std::mutex> lock(registryMutex);
    for (const Impl* other : registry) {
      const char* y = static_cast<const char*>(a.expertOutput);
      GRAPHEP_REQUIRE(other == &m || other->block == nullptr || y < other->block || y >= other->block + other->blockBytes,
                      Status::kInvalidArgument,
                      "combine: expertOutput (%p) lies in the buffers of another engine (rank %d); pass this "
                      "engine's layout().expertOutput, or a buffer of your own",
                      a.expertOutput, other->p.rank);
    }
  }
  requireDevicePointer(a.out, m.device, "combine: out");
  GRAPHEP_REQUIRE((reinterpret_cast<std::uintptr_t>(a.out) & 15u) == 0, Status::kInvalidArgument,
                  "combine: out (%p) is not 16-byte aligned", a.out);
  p.out = static_cast<char*>(a.out);
  if (m.path == MoePath::kLatency) {
    launchLatency(m, p, Impl::Half::kCombine, a.half, stream);
    return;
  }
  if (m.direct) {
    GRAPHEP_CUDA_CHECK(launchMoeDirectCombineReduce(p, stream));
    GRAPHEP_CUDA_CHECK(launchMoeDirectCombineSend(p, stream));
    GRAPHEP_CUDA_CHECK(launchMoeDirectCombineFinal(p, stream));
    return;
  }
  GRAPHEP_CUDA_CHECK(launchMoeCombineReduce(p, stream));
  m.movers().allToAllv(stream, m.combArgs);
  GRAPHEP_CUDA_CHECK(launchMoeCombineFinal(p, stream));
}

void Engine::receive(cudaStream_t stream) {
  Impl& m = *impl_;
  requireHealthy(m, m.p.rank, "receive");
  GRAPHEP_REQUIRE(m.half != Impl::Half::kNone, Status::kInvalidArgument,
                  "receive: rank %d has no send half waiting for its receive (dispatch or combine with "
                  "half=kSend comes first)",
                  m.p.rank);
  DeviceGuard guard(m.device);
  const Impl::Half op = m.half;
  m.half = Impl::Half::kNone;
  launchLatency(m, m.halfParams, op, std::nullopt, stream);
}

MoeStatus Engine::status() const {
  const Impl& m = *impl_;
  DeviceGuard guard(m.device);
  GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  MoeDeviceStatus d{};
  GRAPHEP_CUDA_CHECK(cudaMemcpy(&d, m.p.status, sizeof(d), cudaMemcpyDeviceToHost));
  MoeStatus s;
  s.invalidExpertIds = d.invalidIds;
  s.droppedRows = d.droppedRows;
  s.clampedTokenCounts = d.clampedCounts;
  s.unpairedDispatches = d.unpairedDispatches;
  s.unpairedCombines = d.unpairedCombines;
  s.missingCombineRows = d.missingCombineRows;
  if (d.firstInvalidSet != 0) {
    s.firstInvalidId = d.firstInvalidId;
    s.firstInvalidToken = d.firstInvalidToken;
    s.firstInvalidSlot = d.firstInvalidSlot;
  }
  if (d.firstClampedSet != 0) s.firstClampedCount = d.firstClampedCount;
  s.deviceError = m.group->heap->errorMessage(m.local);
  if (!s.deviceError.empty() && m.failure.empty()) m.failure = s.deviceError;
  return s;
}

namespace {
void requireHealthy(const Engine::Impl& m, int rank, const char* op) {
  GRAPHEP_REQUIRE(m.failure.empty(), Status::kRemoteError,
                  "%s: the engine of rank %d is in its failed state (%s); destroy it and create a new one",
                  op, rank, m.failure.c_str());
}

void requireNoHalf(const Engine::Impl& m, const char* op) {
  GRAPHEP_REQUIRE(m.half == Engine::Impl::Half::kNone, Status::kInvalidArgument,
                  "%s: rank %d's last %s was enqueued as its send half; enqueue its receive half first "
                  "(Engine::receive)",
                  op, m.p.rank, m.half == Engine::Impl::Half::kDispatch ? "dispatch" : "combine");
}

void requireLatency(const Engine::Impl& m, const char* what) {
  GRAPHEP_REQUIRE(m.path == MoePath::kLatency, Status::kNotSupported,
                  "%s applies to the latency path; this engine is on the throughput path (MoeConfig.path, "
                  "maxTokensPerRank <= %d and load/store peers choose the latency path)",
                  what, kMoeLatencyMaxTokens);
}

void requireHalf(const Engine::Impl& m, MoeHalf half, const char* op) {
  GRAPHEP_REQUIRE(half == MoeHalf::kWhole || half == MoeHalf::kSend, Status::kInvalidArgument,
                  "%s: half=%d is not a MoeHalf", op, static_cast<int>(half));
  if (half == MoeHalf::kSend) requireLatency(m, (std::string(op) + " half=kSend").c_str());
}

void launchLatency(Engine::Impl& m, MoeParams p, Engine::Impl::Half op, std::optional<MoeHalf> half,
                   cudaStream_t stream) {
  p.llPhase = !half ? kMoeLatencyReceive
              : *half == MoeHalf::kSend ? kMoeLatencySend
                                        : kMoeLatencySend | kMoeLatencyReceive;
  GRAPHEP_CUDA_CHECK(op == Engine::Impl::Half::kDispatch ? launchMoeLatencyDispatch(p, stream)
                                                           : launchMoeLatencyCombine(p, stream));
  if (half == MoeHalf::kSend) {
    m.half = op;
    m.halfParams = p;
  }
}

void requireRankMajorThroughput(const Engine::Impl& m, const char* what, bool direct) {
  GRAPHEP_REQUIRE(m.cfg.receiveLayout == ReceiveLayout::kRankMajor && m.path == MoePath::kThroughput,
                  Status::kNotSupported,
                  "%s applies to the rank-major receive layout on the throughput path; this engine has the %s "
                  "layout on the %s path (MoeConfig.receiveLayout, MoeConfig.path)",
                  what, layoutName(m.cfg.receiveLayout), m.path == MoePath::kLatency ? "latency" : "throughput");
  GRAPHEP_REQUIRE(!direct || m.direct, Status::kNotSupported,
                  "%s needs the direct dispatch (every peer by load/store, each rank on a GPU of its own); this "
                  "engine's peers go through the movers",
                  what);
}

void applyOutputs(const Engine::Impl& m, const DispatchArgs& a, MoeParams& p) {
  const DispatchOutputs& o = a.outputs;
  const bool rowBuffers = o.recvX != nullptr || o.recvScales != nullptr || o.rowExperts != nullptr ||
                          o.rowExpertWeights != nullptr || o.rowSrcRank != nullptr || o.rowSrcToken != nullptr;
  GRAPHEP_REQUIRE(o.rows >= 0, Status::kInvalidArgument, "dispatch: outputs.rows=%lld is negative", o.rows);
  if (!rowBuffers && o.rankPrefixMatrix == nullptr) {
    GRAPHEP_REQUIRE(o.rows == 0, Status::kInvalidArgument, "dispatch: outputs.rows=%lld with no output buffer",
                    o.rows);
    return;
  }
  requireRankMajorThroughput(m, "DispatchOutputs", o.rankPrefixMatrix != nullptr);
  GRAPHEP_REQUIRE(!rowBuffers || o.rows > 0, Status::kInvalidArgument,
                  "dispatch: outputs.rows=0: give the rows your output buffers hold");
  if (o.rows > 0) p.outRows = o.rows;
  // Each buffer given is checked and replaces the engine's for this dispatch.
  auto take = [&](auto* given, const char* what, auto*& into) {
    if (given == nullptr) return;
    requireDevicePointer(given, m.device, what);
    into = static_cast<std::remove_reference_t<decltype(into)>>(given);
  };
  if (o.recvX != nullptr) {
    GRAPHEP_REQUIRE((reinterpret_cast<std::uintptr_t>(o.recvX) & 15u) == 0, Status::kInvalidArgument,
                    "dispatch: outputs.recvX (%p) is not 16-byte aligned", o.recvX);
  }
  GRAPHEP_REQUIRE(o.recvScales == nullptr || p.fp8 != 0, Status::kInvalidArgument,
                  "dispatch: outputs.recvScales is set for a bf16 dispatch");
  take(o.recvX, "dispatch: outputs.recvX", p.recvX);
  take(o.recvScales, "dispatch: outputs.recvScales", p.recvScales);
  take(o.rowExperts, "dispatch: outputs.rowExperts", p.rowExperts);
  if (o.rowExperts != nullptr) p.rowExperts64 = a.indexType == IndexType::kInt64 ? 1 : 0;
  take(o.rowExpertWeights, "dispatch: outputs.rowExpertWeights", p.rowExpertWeights);
  take(o.rowSrcRank, "dispatch: outputs.rowSrcRank", p.rowSrcRank);
  take(o.rowSrcToken, "dispatch: outputs.rowSrcToken", p.rowSrcToken);
  take(o.rankPrefixMatrix, "dispatch: outputs.rankPrefixMatrix", p.rankPrefix);
  // A row buffer the caller did not give is the engine's: its rows hold outRows (the capacity holds
  // every rank-major row).
}
}  // namespace

bool Engine::failed() const { return !impl_->failure.empty(); }

HealthReport Engine::checkHealth(cudaStream_t stream, std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  DeviceGuard guard(m.device);
  HealthReport r = detail::judgeStream(*m.group->heap, m.local, stream, m.watchEvent, timeout, [&]() -> std::string {
    if (m.path != MoePath::kLatency) return "";
    // The counters, copied on the private stream by a copy engine while the kernels spin.
    const int R = m.p.numRanks;
    std::uint32_t* h = m.snapshot;
    const char* user = m.p.peerUser[m.p.rank];
    GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(h, m.p.llSteps, 2 * 4, cudaMemcpyDeviceToHost, m.watchStream));
    GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(h + 2, m.p.pending, 4, cudaMemcpyDeviceToHost, m.watchStream));
    GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(h + 3, user + m.p.llFlagOff, R * 4, cudaMemcpyDeviceToHost, m.watchStream));
    GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(h + 3 + R, user + m.p.llArriveOff, R * 4, cudaMemcpyDeviceToHost, m.watchStream));
    GRAPHEP_CUDA_CHECK(
        cudaMemcpyAsync(h + 3 + 2 * R, user + m.p.llCombArriveOff, R * 4, cudaMemcpyDeviceToHost, m.watchStream));
    GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(m.watchStream));
    detail::LatencyCounters c;
    c.dispatchStep = h[0];
    c.combineStep = h[1];
    c.pending = h[2];
    c.ctas = static_cast<std::uint32_t>(m.p.llCtas);
    c.rank = m.p.rank;
    c.flags.assign(h + 3, h + 3 + R);
    c.arrivals.assign(h + 3 + R, h + 3 + 2 * R);
    c.combineArrivals.assign(h + 3 + 2 * R, h + 3 + 3 * R);
    return detail::describeLatencyStall(c);
  });
  if (!r.ok && m.failure.empty()) m.failure = r.message;
  return r;
}

std::string detail::describeLatencyStall(const LatencyCounters& c) {
  const std::uint32_t step = c.dispatchStep, cstep = c.combineStep, G = c.ctas;
  const bool inCombine = (c.pending & kMoePendingCombine) != 0;
  std::string missing;
  for (std::size_t peer = 0; peer < c.flags.size(); ++peer) {
    const std::uint32_t flag = c.flags[peer], arrive = c.arrivals[peer], comb = c.combineArrivals[peer];
    if (!inCombine && !counterReached(flag, step + 1u)) {
      missing += format("; rank %zu's count message for dispatch step %u has not arrived (flag %u)", peer, step, flag);
    } else if (!inCombine && !counterReached(arrive, (step + 1u) * G)) {
      missing += format("; %u of rank %zu's %u CTAs have delivered their records for dispatch step %u",
                        arrive - step * G, peer, G, step);
    } else if (inCombine && static_cast<int>(peer) != c.rank && !counterReached(comb, (cstep + 1u) * G)) {
      missing += format("; %u of rank %zu's %u CTAs have delivered their partials for combine step %u",
                        comb - cstep * G, peer, G, cstep);
    }
  }
  return missing.empty() ? " (every peer's counters are complete: this rank's own kernels are behind)" : missing;
}

void Engine::clearStatus() {
  Impl& m = *impl_;
  DeviceGuard guard(m.device);
  GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  GRAPHEP_CUDA_CHECK(cudaMemset(m.p.status, 0, sizeof(MoeDeviceStatus)));
  m.group->heap->clearError(m.local);
}

namespace {
const char* kernelName(MoeKernel k) {
  switch (k) {
    case MoeKernel::kRoute: return "route";
    case MoeKernel::kPack: return "pack";
    case MoeKernel::kOffsets: return "offsets";
    case MoeKernel::kExpand: return "expand";
    case MoeKernel::kCombineReduce: return "combine reduce";
    case MoeKernel::kCombineFinal: return "combine final";
    case MoeKernel::kLatencyDispatch: return "latency route";
    case MoeKernel::kLatencyRecords: return "latency records";
    case MoeKernel::kLatencyReceive: return "latency layout";
    case MoeKernel::kLatencyExpand: return "latency expand";
    case MoeKernel::kLatencyCombine: return "latency combine";
    case MoeKernel::kLatencyCombineOwn: return "latency combine own rows";
    case MoeKernel::kLatencyCombineReceive: return "latency combine receive";
    case MoeKernel::kDirectQuantize: return "direct quantise";
    case MoeKernel::kDirectSend: return "direct send";
    case MoeKernel::kDirectReceive: return "direct receive";
    case MoeKernel::kDirectOwn: return "direct own rows";
    case MoeKernel::kDirectPeers: return "direct peers' rows";
    case MoeKernel::kDirectCombineReduce: return "direct combine reduce";
    case MoeKernel::kDirectCombineSend: return "direct combine send";
    case MoeKernel::kDirectCombineFinal: return "direct combine final";
    case MoeKernel::kCount: break;
  }
  return "?";
}
}  // namespace

std::vector<MoeKernelSpan> Engine::timeline() const {
  const Impl& m = *impl_;
  std::vector<MoeKernelSpan> spans;
  if (m.p.timeline == nullptr) return spans;
  DeviceGuard guard(m.device);
  GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  constexpr int kN = static_cast<int>(MoeKernel::kCount);
  constexpr int kW = kMoeStampWords;
  unsigned long long t[kW * kN];
  GRAPHEP_CUDA_CHECK(cudaMemcpy(t, m.p.timeline, sizeof(t), cudaMemcpyDeviceToHost));
  unsigned long long first = ~0ull;
  for (int k = 0; k < kN; ++k) {
    if (t[kW * k + 3] != 0) first = std::min(first, t[kW * k]);
  }
  for (int k = 0; k < kN; ++k) {
    const unsigned long long* w = t + kW * k;
    if (w[3] == 0) continue;  // did not run
    spans.push_back(MoeKernelSpan{kernelName(static_cast<MoeKernel>(k)), static_cast<double>(w[0] - first) / 1e3,
                                  static_cast<double>(w[1] - first) / 1e3,
                                  static_cast<double>(w[2]) / static_cast<double>(w[3]) / 1e3, w[3], w[0], w[1]});
  }
  return spans;
}

void Engine::resetTimeline() {
  const Impl& m = *impl_;
  if (m.p.timeline == nullptr) return;
  DeviceGuard guard(m.device);
  GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  constexpr int kN = static_cast<int>(MoeKernel::kCount);
  constexpr int kW = kMoeStampWords;
  unsigned long long t[kW * kN];
  for (int k = 0; k < kN; ++k) {
    t[kW * k] = ~0ull;  // min of entry times
    t[kW * k + 1] = 0;  // max of exit times
    t[kW * k + 2] = 0;  // sum of CTA durations
    t[kW * k + 3] = 0;  // CTAs
  }
  GRAPHEP_CUDA_CHECK(cudaMemcpy(m.p.timeline, t, sizeof(t), cudaMemcpyHostToDevice));
  GRAPHEP_CUDA_CHECK(cudaMemset(m.p.timeline + kW * kN, 0, kMoeTraceWords * sizeof(unsigned long long)));
}

std::vector<MoeStepTrace> Engine::stepTrace() const {
  const Impl& m = *impl_;
  std::vector<MoeStepTrace> steps;
  if (m.p.timeline == nullptr) return steps;
  DeviceGuard guard(m.device);
  GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  constexpr int kE = static_cast<int>(MoeTraceEvent::kCount);
  std::vector<unsigned long long> t(kMoeTraceWords);
  GRAPHEP_CUDA_CHECK(cudaMemcpy(t.data(), m.p.timeline + kMoeStampWords * static_cast<int>(MoeKernel::kCount),
                                t.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
  for (int op = 0; op < 2; ++op) {
    for (int s = 0; s < kMoeTraceSteps; ++s) {
      const unsigned long long* w = t.data() + (op * kMoeTraceSteps + s) * kE;
      if (w[static_cast<int>(MoeTraceEvent::kDone)] == 0) continue;  // no operation of this slot completed
      MoeStepTrace st;
      st.combine = op == 1;
      for (int e = 0; e < kE && e < 11; ++e) st.ns[e] = w[e];
      steps.push_back(st);
    }
  }
  std::sort(steps.begin(), steps.end(), [](const MoeStepTrace& a, const MoeStepTrace& b) {
    return a.ns[static_cast<int>(MoeTraceEvent::kDone)] < b.ns[static_cast<int>(MoeTraceEvent::kDone)];
  });
  return steps;
}

std::string MoeStatus::describe() const {
  if (ok()) return "ok";
  std::string s;
  auto line = [&](const std::string& l) { s += (s.empty() ? "" : "\n") + l; };
  if (invalidExpertIds > 0) {
    line(detail::format("%llu expert id(s) outside [-1, E) skipped; the first: topk_idx[%d][%d] = %lld",
                        invalidExpertIds, firstInvalidToken, firstInvalidSlot, firstInvalidId));
  }
  if (droppedRows > 0) {
    line(detail::format("%llu received row(s) past the receive capacity (batched: past their expert's block) dropped",
                        droppedRows));
  }
  if (clampedTokenCounts > 0) {
    line(detail::format("%llu dispatch(es) had a live token count outside [0, maxTokensPerRank]; "
                        "the first was %d (clamped)",
                        clampedTokenCounts, firstClampedCount));
  }
  if (unpairedDispatches > 0) {
    line(detail::format("%llu dispatch(es) counted as unpaired", unpairedDispatches));
  }
  if (unpairedCombines > 0) {
    line(detail::format("%llu combine(s) ran before any dispatch (nothing to combine)", unpairedCombines));
  }
  if (missingCombineRows > 0) {
    line(detail::format("%llu expert output row(s) a combine needed lay past CombineArgs.expertOutputRows (they "
                        "added nothing)",
                        missingCombineRows));
  }
  if (!deviceError.empty()) line(deviceError);
  return s;
}

}  // namespace graphep
