// The node-aware exchange's kernel family (see kernels/moe/moe.h, MoeNodeParams; docs/DESIGN.md
// §5.10), launchers below: the landing rank's forwards of the hop records into its node's fwdRecv
// slots (dispatch), its sums of the node's partials of each hop record (combine), and the one-CTA
// posts and bounded waits of the four node peer signals (ready, forwarded, reduced, summed) that
// order them. The packing of the hop records, the exchange and the reads of forwarded records
// and node partials are the movers path's (kernels/moe/movers.cu).
#include "kernels/common/launch.h"
#include "kernels/moe/node.cuh"
#include "kernels/moe/peer.cuh"

namespace graphep {
namespace {

constexpr int kThreads = kMoeThreads;  // kGroups hop records per CTA at a time
constexpr int kGroups = kThreads / kMoeGroupThreads;

// One hop record `hop` of source s (on another node) to each destination of this node it names:
// its payload copied to every one, and each one's metadata (the slots whose experts live there,
// as moeWriteRecordMeta writes them for a record sent directly). The group's shared arrays hold
// the destinations.
__device__ void moeForwardRecord(const MoeParams& p, int s, const char* hop, char** dsts, int* dstRanks, int* ndst,
                                 const MoeGroup& g) {
  const int R = p.shape.numRanks, T = p.shape.maxTokens;
  if (g.tid == 0) {
    const std::int32_t* fwd = moeHopForwards(p, hop);
    int n = 0;
    for (int q = 0; q < R; ++q) {
      const int i = fwd[q];
      if (((p.node.nodeMask >> q) & 1u) == 0 || i < 0 || i >= T) continue;  // not this node's, or not going there
      dsts[n] = p.peers.userRegions[q] + p.node.fwdRecvOff +
                (static_cast<std::uint64_t>(s) * T + static_cast<std::uint64_t>(i)) * p.shape.recordBytes;
      dstRanks[n++] = q;
    }
    *ndst = n;
  }
  g.sync();
  const int n = *ndst;
  const auto* src = reinterpret_cast<const uint4*>(hop);
  const int vecs = static_cast<int>(p.shape.payloadBytes / 16);
  for (int c0 = g.tid; c0 < vecs; c0 += g.nthreads * kMoeUnroll) {
    uint4 v[kMoeUnroll];
#pragma unroll
    for (int u = 0; u < kMoeUnroll; ++u) {
      if (c0 + u * g.nthreads < vecs) v[u] = src[c0 + u * g.nthreads];
    }
    for (int d = 0; d < n; ++d) {
      auto* out = reinterpret_cast<uint4*>(dsts[d]);
#pragma unroll
      for (int u = 0; u < kMoeUnroll; ++u) {
        if (c0 + u * g.nthreads < vecs) out[c0 + u * g.nthreads] = v[u];
      }
    }
  }
  if (g.tid < 32) {  // lane k: the hop record's slot k
    const int k = g.tid;
    const MoeRecordHeader head = *moeRecordHeader(p, hop);
    const bool has = k < head.nslots && k < p.shape.topK;
    const MoeRecordSlot slot = has ? moeRecordSlots(p, hop)[k] : MoeRecordSlot{-1, 0, 0.f, 0};
    for (int d = 0; d < n; ++d) {
      const bool here = has && slot.localExpert / p.shape.localExperts == dstRanks[d];
      const unsigned m = __ballot_sync(0xffffffffu, here);
      if (here) {
        auto* slots = reinterpret_cast<MoeRecordSlot*>(dsts[d] + p.shape.payloadBytes + sizeof(MoeRecordHeader));
        slots[__popc(m & ((1u << k) - 1u))] =
            MoeRecordSlot{slot.localExpert % p.shape.localExperts, slot.index, slot.weight, slot.k};
      }
      if (k == 0) *reinterpret_cast<MoeRecordHeader*>(dsts[d] + p.shape.payloadBytes) = MoeRecordHeader{head.token, __popc(m), {0, 0}};
    }
  }
  g.sync();  // the shared destinations are rewritten for the group's next record
}

// Grid: p.grid.epilogueCtas CTAs; each group forwards one hop record at a time, those of every
// source on another node whose landing rank this is (their count in its count message), in
// source order.
__global__ void __launch_bounds__(kThreads) moeForwardKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kForward);
  __shared__ char* dsts[kGroups][kMaxRanks];
  __shared__ int dstRanks[kGroups][kMaxRanks];
  __shared__ int ndst[kGroups];
  const MoeGroupSlice gs = moeGroupSlice();
  const int total = moeHopRecordsHere(p);
  for (int m = gs.first; m < total; m += gs.stride) {
    const MoeHopItem hop = moeHopItem(p, m);
    moeForwardRecord(p, hop.source, hop.record, dsts[gs.group], dstRanks[gs.group], &ndst[gs.group], gs.g);
  }
}

// Grid: p.grid.epilogueCtas CTAs; each group sums one hop record's partials at a time (those
// forward wrote), in the forward's order: the partials of the record at each destination q of this
// node (its nodePartial slot [source][index], read in q's heap), fp32 in rank order, bf16 out into
// partialStage[source][hop index], for the partials exchange to carry home.
__global__ void __launch_bounds__(kThreads) moeNodeSumKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kNodeSum);
  __shared__ const uint4* parts[kGroups][kMaxRanks];
  const MoeGroupSlice gs = moeGroupSlice();
  const int R = p.shape.numRanks, T = p.shape.maxTokens;
  const std::uint64_t rowBytes = static_cast<std::uint64_t>(p.shape.hidden) * 2;
  const int total = moeHopRecordsHere(p);
  for (int m = gs.first; m < total; m += gs.stride) {
    const MoeHopItem hop = moeHopItem(p, m);
    const int s = hop.source, j = hop.index;
    const std::int32_t* fwd = moeHopForwards(p, hop.record);
    gs.g.sync();  // the group's previous readers of `parts` are done
    if (gs.g.tid == 0) {
      int n = 0;
      for (int q = 0; q < R; ++q) {
        const int i = fwd[q];
        if (((p.node.nodeMask >> q) & 1u) == 0 || i < 0 || i >= T) continue;
        parts[gs.group][n++] = reinterpret_cast<const uint4*>(p.peers.userRegions[q] + p.node.nodePartialOff +
                                                              (static_cast<std::uint64_t>(s) * T + i) * rowBytes);
      }
      for (int q = n; q < R; ++q) parts[gs.group][q] = nullptr;
    }
    gs.g.sync();
    int n = 0;
    while (n < R && parts[gs.group][n] != nullptr) ++n;
    moeWeightedSum(
        p, n, [&](int i) { return parts[gs.group][i]; }, [](int) { return 1.0f; },
        reinterpret_cast<uint4*>(p.staging.partialStage + (static_cast<std::uint64_t>(s) * T + j) * rowBytes), gs.g);
  }
}

// Node peer signal `which`'s counters (MoeNodeParams) and the wait's site.
__device__ inline std::uint64_t moeNodeSignalOff(const MoeParams& p, int which) {
  return which == kMoeNodeReady       ? p.node.readyOff
         : which == kMoeNodeForwarded ? p.node.forwardedOff
         : which == kMoeNodeReduced   ? p.node.reducedOff
                                      : p.node.summedOff;
}

// One CTA of 32 threads: thread q posts (+1, system-scope release) signal `which` into node peer
// q's counter for this rank (arriveAtEveryPeer), after everything the stream ran before.
__global__ void __launch_bounds__(32) moeNodePostKernel(const __grid_constant__ MoeParams p, int which) {
  arriveAtEveryPeer(p, moeNodeSignalOff(p, which), p.node.nodeMask);
}

// One CTA of 32 threads: thread q waits, bounded, until node peer q's post of `which` reaches one
// more than this rank has seen (seen[which][q]), then counts it.
__global__ void __launch_bounds__(32) moeNodeWaitKernel(const __grid_constant__ MoeParams p, int which) {
  std::uint32_t* seen = p.node.seen + which * p.shape.numRanks;
  const WaitSite site = which == kMoeNodeReady       ? WaitSite::kMoeNodeReady
                        : which == kMoeNodeForwarded ? WaitSite::kMoeNodeForwarded
                        : which == kMoeNodeReduced   ? WaitSite::kMoeNodeReduced
                                                     : WaitSite::kMoeNodeSummed;
  const bool ok = waitEveryRank(p, moeNodeSignalOff(p, which), 1u, site, true, p.node.nodeMask, seen);
  const int q = static_cast<int>(threadIdx.x);
  if (ok && q < p.shape.numRanks && q != p.shape.rank && ((p.node.nodeMask >> q) & 1u) != 0) seen[q] += 1u;
}

}  // namespace

cudaError_t launchMoeNodePost(const MoeParams& p, int which, cudaStream_t stream) {
  GRAPHEP_LAUNCH_REQUIRE(p.node.aware != 0, "node.aware %d (the node-aware dispatch only)", p.node.aware);
  GRAPHEP_LAUNCH_REQUIRE(which >= 0 && which < kMoeNodeSignals, "signal %d (0 to %d)", which, kMoeNodeSignals - 1);
  moeNodePostKernel<<<1, 32, 0, stream>>>(p, which);
  return cudaGetLastError();
}

cudaError_t launchMoeNodeWait(const MoeParams& p, int which, cudaStream_t stream) {
  GRAPHEP_LAUNCH_REQUIRE(p.node.aware != 0, "node.aware %d (the node-aware dispatch only)", p.node.aware);
  GRAPHEP_LAUNCH_REQUIRE(which >= 0 && which < kMoeNodeSignals, "signal %d (0 to %d)", which, kMoeNodeSignals - 1);
  moeNodeWaitKernel<<<1, 32, 0, stream>>>(p, which);
  return cudaGetLastError();
}

cudaError_t launchMoeForward(const MoeParams& p, cudaStream_t stream) {
  return launchGrid(__func__, "grid.epilogueCtas", p.grid.epilogueCtas, kThreads, stream, moeForwardKernel, p);
}

cudaError_t launchMoeNodeSum(const MoeParams& p, cudaStream_t stream) {
  return launchGrid(__func__, "grid.epilogueCtas", p.grid.epilogueCtas, kThreads, stream, moeNodeSumKernel, p);
}

cudaError_t preloadMoeNodeKernels() {
  return preloadKernels(moeForwardKernel, moeNodeSumKernel, moeNodePostKernel, moeNodeWaitKernel);
}

}  // namespace graphep
