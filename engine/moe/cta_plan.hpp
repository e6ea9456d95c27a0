// The MoE engine's CTA plan (setup only, collective): which path the peers allow (load/store
// everywhere for the latency path and the direct dispatch), and how many CTAs each kernel gets:
// MoeConfig.smBudget and epilogueSms turned into the latency path's send and receive parts and
// the throughput path's communication and epilogue grids, the same on every rank where peers'
// counters count them.
#pragma once

#include <graphep/comm.hpp>
#include <graphep/moe.hpp>

#include <cstddef>
#include <vector>

#include "engine/heap.hpp"

namespace graphep::moe_setup {

// Collective: whether every local rank of every process reaches every peer by load/store (the
// direct throughput path writes peers' memory directly; the latency path also needs
// everyPeerTakesWholeLines). Every rank gets the same answer.
bool everyPeerLoadStore(Communicator& comm, const SymmetricHeap& heap);
// Collective: whether every peer takes the latency path's 128-byte payload lines whole
// (takesWholeLines: this GPU or NVLink, no PCIe peer). Every rank gets the same answer.
bool everyPeerTakesWholeLines(Communicator& comm, const SymmetricHeap& heap);

// Collective: whether the throughput path runs its direct kernels (kernels/moe/direct.cu): every
// peer by load/store, GRAPHEP_MOE_KERNELS not "movers" on any rank, and on a GPU that ranks share,
// room for each rank's kernels (its share of the GPU's resident CTAs at least
// kDirectSharedParts: the receive's CTAs wait for the peers' send kernels, which must find room on
// the same GPU; directSharedCtas). Every rank gets the same answer.
bool directDispatch(Communicator& comm, const SymmetricHeap& heap);

// Ranks sharing a GPU on the direct kernels. At most three of one rank's grids wait at once (the
// combine's reduce, send and final; the dispatch's send and receive are two), and two engines in
// flight on one rank make five: each grid keeps to a sixth of the rank's `share` (the direct
// kernels' resident CTAs on its GPU / the ranks on it), so that every rank's waiting grids and the
// grids they wait for are resident together. A grid's CTAs: `want` (the SM budget, or
// epilogueSms) within that sixth, or the sixth when `want` is 0; at least 1 when share >=
// kDirectSharedParts (directDispatch keeps the movers below it).
inline constexpr int kDirectSharedParts = 6;
int directSharedCtas(int want, int share);

// Collective. The latency path's CTAs: `send`, the senders of each kernel (the SM budget, or 24),
// the same on every rank (the arrival counters count them), and each local rank's receivers. The
// senders wait for nothing but other ranks' senders (the combine's weights, posted first) and the
// receivers only for senders (of every rank), so the ranks sharing a GPU must hold all their
// senders and receivers at once: send + receive <= the GPU's resident CTAs / the ranks on it. A
// rank on a GPU of its own gives its receivers one CTA per SM within what the senders leave (or
// epilogueSms); ranks sharing a GPU take as many receivers as senders, so that two engines in
// flight still fit (§3.7).
// The rules of the plan, pure (unit-tested). A rank's latency send CTAs (before the lowest over
// the ranks is taken): smBudget (or kLatencyDefaultCtas) within what leaves a receiver room on its
// GPU, `resident` the CTAs of the latency kernel its share of the GPU holds at once and `sharing`
// the ranks on that GPU. Its receive CTAs: epilogueSms, or one per SM (ranks sharing a GPU: as
// many as the senders), within the room the senders leave (half of the share when shared, so that
// two engines in flight fit), at least 1. The throughput epilogues' CTAs on a GPU of `sms` SMs:
// epilogueSms (at most one per SM), or the SMs the `comm` CTAs leave free when that is at least
// half of them, else one per SM.
// 64: the dispatch runs on every CTA of its launch whatever the split; the combine reduces one
// received record per group of 128 threads, so that 64 send CTAs (256 groups) reduce 128 records
// in one round where 24 took two (graph replay, 2 GPUs: combine 25.8 -> 21.2 us at H 7168, 15.3 ->
// 13.5 at H 2048; docs/PERFORMANCE.md).
inline constexpr int kLatencyDefaultCtas = 64;
int latencySendCtas(int smBudget, int resident, int sharing);
// The most latency send CTAs any rank takes under MoeConfig::smBudget `smBudget` (it, or the default).
int latencySendCtasBound(int smBudget);
int latencyReceiveCtas(int send, int epilogueSms, int resident, int sharing, int sms);
int throughputEpilogueCtas(int comm, int epilogueSms, int sms);

struct LatencyCtas {
  int send = 0;
  std::vector<int> receive;  // per local rank
};
LatencyCtas latencyCtas(Communicator& comm, const SymmetricHeap& heap, const MoeConfig& cfg);

// Collective: the throughput kernels' CTAs, the same on every rank (the peers' flags count them):
// the SM budget; without one, for the direct dispatch the most CTAs any rank needs to carry its
// measured link (commCtasFor), within the smallest SM count; else one per SM of the smallest GPU.
// Direct kernels on a GPU that ranks share: directSharedCtas for both grids (the lowest over the
// ranks for the communication CTAs), no clusters, no link probe.
// And the direct epilogues' CTAs and cluster size per local rank. slotBytes: the record slots the
// link probe may push into (unused until the first dispatch).
// The movers path also moves records and partials in `chunks` exchanges (exchangeChunks).
struct ThroughputCtas {
  int comm = 0;
  std::vector<int> epilogue;  // per local rank
  std::vector<int> cluster;   // per local rank; epilogue is a multiple of it
  int chunks = 1;
  std::vector<int> streams;  // per local rank: the movers path's streams (moversStreams); empty when direct
};

// The movers path's chunks (MoeMoverParams; docs/DESIGN.md §5.5), pure: `requested`
// (GRAPHEP_EXCHANGE_CHUNKS; 0: automatic) within [1, maxTokens], lowered so that none of the
// chunks of ceil(maxTokens / chunks) list indices is empty; automatically, where some peer is
// reached through NCCL, one chunk per kExchangeChunkTokens slots of maxTokens, from 1 to
// kExchangeAutoChunks; 1 where every peer is reached by load/store (the movers' channels already
// overlap their own copies). Measured on 2x H200 over NCCL (docs/PERFORMANCE.md, run 158): 2
// chunks beat 1 at 4,096 and 16,384 tokens (combine by 8-10%, dispatch by 2-4%), 4 lost to 1 at
// 4,096 (the exchange, not the pack or the expansion, is the bottleneck, and each chunk's NCCL
// group costs its own start).
inline constexpr int kExchangeChunkTokens = 2048;
inline constexpr int kExchangeAutoChunks = 2;
int exchangeChunks(int maxTokens, bool anyRemote, int requested);
// The movers path's streams per rank (docs/DESIGN.md §5.5), pure: 2 (the caller's, and a comm
// stream that carries the exchanges beside the pack and the expansion) while the `sharing` ranks on
// a GPU have no more busy streams than it has hardware queues (2 x sharing <= `queues`,
// CUDA_DEVICE_MAX_CONNECTIONS); else 1, the caller's alone (the exchanges then run in order with
// the rest). Ranks whose busy streams meet in one queue hang: a rank's kernel waiting for a peer
// holds the queue that the peer's kernel waits behind (run 166: 8 ranks, 16 streams, 8 queues). A
// heuristic, necessary and not sufficient (other streams take places in the queues too). More ranks
// on a GPU than queues: an error naming both and the setting to raise.
int moversStreams(int sharing, int queues);
// Whether `sharing` ranks of the movers path on one GPU fit its `queues` hardware queues (at most
// one rank a queue); moversStreams refuses the ranks that do not.
bool queuesHold(int sharing, int queues);
// The hardware queues the CUDA driver gives each device (CUDA_DEVICE_MAX_CONNECTIONS, read by the
// driver when the process creates its first context: 8 unset, 1 to 32).
int hardwareQueues();
ThroughputCtas throughputCtas(Communicator& comm, const SymmetricHeap& heap, const MoeConfig& cfg, bool direct,
                              std::size_t slotBytes);

}  // namespace graphep::moe_setup
