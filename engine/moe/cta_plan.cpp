// The MoE engine's CTA plan (engine/moe/cta_plan.hpp): peer reachability, the latency path's
// send and receive parts, the throughput path's grids (from the measured link when no budget).
#include "engine/moe/cta_plan.hpp"

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "engine/device_pointer.hpp"
#include "engine/env.hpp"
#include "engine/error.hpp"
#include "engine/log.hpp"
#include "engine/platform.hpp"
#include "engine/sm_model.hpp"
#include "engine/topology.hpp"
#include "kernels/moe/moe.h"
#include "kernels/probe.h"

namespace graphep {
namespace moe_setup {

using detail::DeviceGuard;

namespace {

// Collective: whether `ok(l)` holds for every local rank l of every process.
template <class Ok>
bool everyRank(Communicator& comm, const SymmetricHeap& heap, Ok ok) {
  std::vector<unsigned char> mine(static_cast<std::size_t>(heap.numLocalRanks()), 1);
  for (int l = 0; l < heap.numLocalRanks(); ++l) mine[static_cast<std::size_t>(l)] = ok(l) ? 1 : 0;
  std::vector<unsigned char> all(static_cast<std::size_t>(heap.worldSize()), 0);
  comm.allgather(mine.data(), all.data(), 1);
  return std::all_of(all.begin(), all.end(), [](unsigned char v) { return v != 0; });
}

// Collective: whether every rank finds `ok` true of its class of every peer.
template <class Ok>
bool everyPeerIs(Communicator& comm, const SymmetricHeap& heap, Ok ok) {
  return everyRank(comm, heap, [&](int l) {
    for (int q = 0; q < heap.worldSize(); ++q) {
      if (q != heap.rank(l) && !ok(heap.peerClass(l, q))) return false;
    }
    return true;
  });
}

// The ranks on local rank l's GPU (itself included).
int ranksOnGpu(const SymmetricHeap& heap, int l) {
  int sharing = 1;
  for (int q = 0; q < heap.worldSize(); ++q) sharing += heap.peerClass(l, q) == PeerClass::kSameDevice ? 1 : 0;
  return sharing;
}

// Local rank l's share of the direct kernels' resident CTAs on its GPU.
int directShare(const SymmetricHeap& heap, int l) {
  DeviceGuard guard(heap.device(l));
  int perSm = 0, sms = 0;
  GRAPHEP_CUDA_CHECK(moeDirectCtasPerSm(&perSm));
  GRAPHEP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, heap.device(l)));
  return perSm * sms / ranksOnGpu(heap, l);
}

// Collective: the lowest of the ranks' values (the CTA counts that arrival counters count).
int minOverRanks(Communicator& comm, const std::vector<std::int32_t>& mine) {
  std::vector<std::int32_t> all(static_cast<std::size_t>(comm.worldSize()), 0);
  comm.allgather(mine.data(), all.data(), sizeof(std::int32_t));
  return *std::min_element(all.begin(), all.end());
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

}  // namespace

int latencySendCtasBound(int smBudget) { return smBudget > 0 ? smBudget : kLatencyDefaultCtas; }

int latencySendCtas(int smBudget, int resident, int sharing) {
  return std::min(latencySendCtasBound(smBudget), sharing > 1 ? resident / 2 : resident - 1);
}

int latencyReceiveCtas(int send, int epilogueSms, int resident, int sharing, int sms) {
  // At least 1 (send <= resident / 2 or resident - 1); ranks sharing a GPU keep to half of their
  // share, so that two engines in flight still fit.
  const int room = sharing > 1 ? resident / 2 : resident - send;
  const int want = epilogueSms > 0 ? epilogueSms : (sharing > 1 ? send : sms);
  return std::max(1, std::min(want, room));
}

int throughputEpilogueCtas(int comm, int epilogueSms, int sms) {
  return epilogueSms > 0 ? std::min(epilogueSms, sms) : (sms - comm >= sms / 2 ? sms - comm : sms);
}

bool everyPeerLoadStore(Communicator& comm, const SymmetricHeap& heap) {
  return everyPeerIs(comm, heap, [](PeerClass c) { return isLoadStore(c); });
}

bool everyPeerTakesWholeLines(Communicator& comm, const SymmetricHeap& heap) {
  return everyPeerIs(comm, heap, [](PeerClass c) { return takesWholeLines(c); });
}

int directSharedCtas(int want, int share) {
  const int most = share / kDirectSharedParts;
  return want > 0 ? std::min(want, most) : most;
}

bool directDispatch(Communicator& comm, const SymmetricHeap& heap) {
  // The emulated network is metered in the movers' all-to-all-v: its engines run over them.
  const bool movers = env::kMoeKernels.get() == "movers" || env::kEmulatedNodes.get() > 0;
  const bool loadStore = everyPeerLoadStore(comm, heap);  // collective: every rank calls both
  return everyRank(comm, heap, [&](int l) {
    if (!loadStore || movers) return false;
    if (ranksOnGpu(heap, l) == 1) return true;
    const int share = directShare(heap, l);
    if (share >= kDirectSharedParts) return true;
    GRAPHEP_LOG_INFO(log::kTune, "rank %d: %d ranks share GPU %d, %d resident direct CTAs each (%d needed): the "
                     "throughput path runs over the movers", heap.rank(l), ranksOnGpu(heap, l), heap.device(l),
                     share, kDirectSharedParts);
    return false;
  });
}

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
    sharing[ls] = ranksOnGpu(heap, l);
    resident[ls] = perSm * sms / sharing[ls];
    smCount[ls] = sms;
    GRAPHEP_REQUIRE(resident[ls] >= 2, Status::kNotSupported,
                    "MoE latency path: %d ranks share GPU %d, which holds %d of its CTAs at once (%d per "
                    "SM, %u B of shared memory each); each rank needs 2 (a sender and a receiver)",
                    sharing[ls], heap.device(l), perSm * sms, perSm, smem);
    mine[ls] = latencySendCtas(cfg.smBudget, resident[ls], sharing[ls]);
  }
  LatencyCtas c;
  c.send = minOverRanks(comm, mine);
  for (int l = 0; l < locals; ++l) {
    const std::size_t ls = static_cast<std::size_t>(l);
    c.receive.push_back(latencyReceiveCtas(c.send, cfg.epilogueSms, resident[ls], sharing[ls], smCount[ls]));
  }
  return c;
}

int exchangeChunks(int maxTokens, bool anyRemote, int requested) {
  const int most = std::max(1, std::min(maxTokens, kMoeMaxChunks));
  int c = 1;
  if (requested > 0) {
    c = std::min(requested, most);
  } else if (anyRemote) {
    c = std::clamp(maxTokens / kExchangeChunkTokens, 1, std::min(kExchangeAutoChunks, most));
  }
  // Chunks of ceil(T / c) list indices; as many as that fills, so none is empty (T 4 in 3: 2 + 2).
  const int per = (std::max(maxTokens, 1) + c - 1) / c;
  return (std::max(maxTokens, 1) + per - 1) / per;
}

bool queuesHold(int sharing, int queues) { return sharing >= 1 && sharing <= queues; }

int moversStreams(int sharing, int queues) {
  GRAPHEP_REQUIRE(queuesHold(sharing, queues), Status::kNotSupported,
                  "%d ranks share one GPU over the movers path, and the GPU runs %d hardware queues "
                  "(CUDA_DEVICE_MAX_CONNECTIONS): ranks sharing a queue deadlock, one waiting kernel holding the "
                  "queue another's kernel waits behind. Set CUDA_DEVICE_MAX_CONNECTIONS (up to 32) at least to "
                  "the ranks per GPU before the process's first CUDA call, or put fewer ranks on a GPU",
                  sharing, queues);
  return 2 * sharing <= queues ? 2 : 1;
}

int hardwareQueues() {
  static const int queues = [] {  // read once: the driver read it when the process's first context began
    const char* v = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
    char* end = nullptr;
    const long n = v != nullptr ? std::strtol(v, &end, 10) : 0;
    if (v == nullptr || end == v || *end != '\0' || n < 1) return 8;  // the driver's default
    return static_cast<int>(std::min(n, 32L));
  }();
  return queues;
}

ThroughputCtas throughputCtas(Communicator& comm, const SymmetricHeap& heap, const MoeConfig& cfg, bool direct,
                              std::size_t slotBytes) {
  ThroughputCtas c;
  const int locals = heap.numLocalRanks();
  if (!direct) {  // the same on every rank: the exchanges are collective
    // The streams of each local rank (moversStreams), refused on every rank together where some
    // process puts more ranks on a GPU than it has hardware queues (no rank left in a collective).
    std::vector<std::int32_t> fits;
    for (int l = 0; l < locals; ++l) fits.push_back(queuesHold(ranksOnGpu(heap, l), hardwareQueues()) ? 1 : 0);
    const bool allFit = minOverRanks(comm, fits) == 1;
    for (int l = 0; l < locals; ++l) {  // a misfit here is refused by moversStreams, naming it
      c.streams.push_back(moversStreams(ranksOnGpu(heap, l), hardwareQueues()));
    }
    GRAPHEP_REQUIRE(allFit, Status::kNotSupported,
                    "rank %d: another process puts more ranks of the movers path on one GPU than it has hardware "
                    "queues (CUDA_DEVICE_MAX_CONNECTIONS; its own error names them)",
                    heap.rank(0));
    for (int l = 0; l < locals; ++l) {
      if (c.streams[static_cast<std::size_t>(l)] == 1) {
        GRAPHEP_LOG_INFO(log::kTune, "rank %d: %d ranks share GPU %d over %d hardware queues: the movers path runs "
                         "its exchanges on the caller's stream (no comm stream)",
                         heap.rank(l), ranksOnGpu(heap, l), heap.device(l), hardwareQueues());
      }
    }
    const bool anyRemote = !everyPeerIs(comm, heap, [](PeerClass k) { return k != PeerClass::kRemote; });
    const std::vector<std::int32_t> want(static_cast<std::size_t>(locals),
                                         -static_cast<std::int32_t>(env::kExchangeChunks.get()));
    c.chunks = exchangeChunks(cfg.maxTokensPerRank, anyRemote, -minOverRanks(comm, want));
    GRAPHEP_LOG_INFO(log::kTune, "rank %d: the movers path exchanges records and partials in %d chunk(s)%s",
                     heap.rank(0), c.chunks, anyRemote ? " (some peer through NCCL)" : "");
  }
  if (direct && !everyPeerIs(comm, heap, [](PeerClass k) { return k != PeerClass::kSameDevice; })) {
    std::vector<int> share;
    std::vector<std::int32_t> mine;
    for (int l = 0; l < locals; ++l) {
      share.push_back(directShare(heap, l));
      mine.push_back(directSharedCtas(cfg.smBudget, share.back()));
    }
    c.comm = minOverRanks(comm, mine);
    for (int l = 0; l < locals; ++l) {
      const int s = share[static_cast<std::size_t>(l)];
      c.epilogue.push_back(directSharedCtas(cfg.epilogueSms, s));
      c.cluster.push_back(1);
      GRAPHEP_LOG_INFO(log::kTune, "rank %d: %d ranks share GPU %d: direct kernels of %d communication and %d "
                       "epilogue CTAs (%d resident each)", heap.rank(l), ranksOnGpu(heap, l), heap.device(l), c.comm,
                       c.epilogue.back(), s);
    }
    return c;
  }
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
    const int ctas = throughputEpilogueCtas(c.comm, cfg.epilogueSms, n);
    const int cluster = direct ? epilogueClusterFor(heap, l, ctas) : 1;
    c.epilogue.push_back(ctas / cluster * cluster);
    c.cluster.push_back(cluster);
  }
  return c;
}

}  // namespace moe_setup
}  // namespace graphep
