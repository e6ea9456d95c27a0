// Device helpers of the MoE kernels that store straight into peers' memory (the latency path,
// kernels/moe/latency.cu, and the throughput path's direct dispatch, kernels/moe/direct.cu):
// monotonic counters in every rank's symmetric user region (MoeParams::peers.userRegions, the same offsets
// on every rank), posted after a system-scope fence and waited for with bounded waits.
#pragma once

#include "kernels/common/flags.cuh"
#include "kernels/common/launch.h"
#include "kernels/moe/common.cuh"

namespace graphep {

// The limits every launch of these paths holds to (the kernels' shared arrays are sized by them),
// refused by name for `launcher` (kernels/common/launch.h).
inline cudaError_t moeCheckLimits(const char* launcher, const MoeParams& p) {
  if (p.shape.numRanks > kMaxRanks) return refuseLaunch(launcher, "numRanks %d (at most %d)", p.shape.numRanks, kMaxRanks);
  if (p.shape.topK > kMoeMaxTopK) return refuseLaunch(launcher, "topK %d (at most %d)", p.shape.topK, kMoeMaxTopK);
  if (p.shape.localExperts > kMoeMaxLocalExperts) {
    return refuseLaunch(launcher, "localExperts %d (at most %d)", p.shape.localExperts, kMoeMaxLocalExperts);
  }
  return cudaSuccess;
}

// The launch of `ctas` CTAs of `threads`, in clusters of `cluster` (1: none), as the programmatic
// dependent of the stream's last kernel when `dependent` (it may start while that one runs, and
// ends with griddepcontrol.wait where the stream must see the earlier kernel finished). `attrs`
// holds the attributes the config points to.
inline cudaLaunchConfig_t moeLaunchConfig(int ctas, int threads, int cluster, bool dependent, cudaStream_t stream,
                                          cudaLaunchAttribute (&attrs)[2]) {
  int n = 0;
  if (dependent) {
    attrs[n] = cudaLaunchAttribute{};
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 1) {
    attrs[n] = cudaLaunchAttribute{};
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n++].val.clusterDim = {static_cast<unsigned>(cluster), 1, 1};
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(ctas));
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.stream = stream;
  cfg.attrs = attrs;
  cfg.numAttrs = static_cast<unsigned>(n);
  return cfg;
}

__device__ __forceinline__ std::uint32_t* peerCounter(const MoeParams& p, int rank, std::uint64_t off) {
  return reinterpret_cast<std::uint32_t*>(p.peers.userRegions[rank] + off);
}

// Block-wide "am I the last of the grid's CTAs to get here": after the barrier, thread 0 counts
// the CTA; returns the same answer in every thread, and the last one resets the counter for the
// next launch. `ordered` (the default): thread 0 fences at GPU scope before it counts
// (cumulative over the CTA's writes the barrier ordered before it) and the last CTA after it
// reset the counter, a release / acquire pair: every counted CTA's writes are visible to whatever
// the last one publishes. GPU scope: every caller's counted writes (expanded rows, layouts,
// outputs) are read on this GPU only, by later kernels of the stream. One fence in thread 0, not
// one in every thread at system scope: that form cost the direct combine's reduce 17% at 4096
// tokens (run 84). Verdicts reach the CTA through __syncthreads_or, not a shared word: nothing for
// a later exchange to race with, and racecheck-clean after the groups' uneven loops (see the
// latency records loop).
// `ordered` false: no fence (the latency kernels without shrink on timeout), for a last CTA that
// reads nothing the other CTAs wrote and writes only words (the step, the item claims, the
// expected arrivals) that each other CTA read, and used, before it counted. That order holds as
// the hardware executes it (a used value has been read before the count is issued; the last CTA
// stores after its own count returns), not by the PTX memory model, which orders relaxed counts
// by nothing: the ordered form is the one the model proves. The fence waited for the CTA's last
// stores (rows, partials) to land before it counted; the kernel's end waits for them anyway, and
// the count goes out beside them (run 293: 0.55 us off each latency dispatch in graph replay).
__device__ inline bool lastBlock(std::uint32_t* counter, bool ordered = true) {
  __syncthreads();  // every thread's writes, ordered before thread 0's fence
  bool last = false;
  if (threadIdx.x == 0) {
    if (ordered) __threadfence();
    last = atomicAdd(counter, 1u) == gridDim.x - 1u;
    if (last) {
      *counter = 0;  // every CTA counted: ready for the next launch
      if (ordered) __threadfence();
    }
  }
  return __syncthreads_or(last) != 0;  // thread 0's answer, to every thread
}

// After the barrier, thread r < R, r != this rank, makes the CTA's stores (records or partials)
// visible at system scope and adds 1 to peer r's counter for this rank: flagPost's producer rule
// (kernels/common/flags.cuh), a release cumulative over the writes the barrier ordered before it,
// instead of a system fence in every thread. (A rank's own records and partials are its own
// receiver's: nothing to announce to itself.)
// `live`: the ranks taking part (bit r); the others are sent nothing. `ordered` false: a relaxed
// add, no fence, for stores that carry their own order (the latency combine's tagged lines): the
// count says only that the CTA sent.
__device__ inline void arriveAtEveryPeer(const MoeParams& p, std::uint64_t counterOff, std::uint32_t live = ~0u, bool ordered = true) {
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < p.shape.numRanks && static_cast<int>(threadIdx.x) != p.shape.rank &&
      ((live >> threadIdx.x) & 1u) != 0) {
    std::uint32_t* counter = peerCounter(p, static_cast<int>(threadIdx.x), counterOff) + p.shape.rank;
    if (ordered) {
      ptx::fenceAcqRelSys();
      ptx::redReleaseSysAdd(counter, 1u);
    } else {
      ptx::redRelaxedSysAdd(counter, 1u);
    }
  }
}

// MoeConfig::shrinkOnTimeout: rank q, which a wait of this operation timed out on, is masked: in
// the operation's word `masked` (the ranks this operation leaves out from here on), in the
// engine's active-rank mask (the next operations'; Engine::activeRanksDevice) and in the status
// (MoeStatus::shrunkRanks). Not an error: the operation goes on among the others.
__device__ __noinline__ inline void maskAfterTimeout(const MoeParams& p, std::uint32_t* masked, int q) {
  const std::uint32_t bit = 1u << q;
  atomicOr(masked, bit);
  atomicAnd(const_cast<std::uint32_t*>(p.peers.live), ~bit);  // the engine's mask word (stream writes between operations)
  atomicOr(&p.state.status->shrunkRanks, bit);
}

// Threads q < R wait until this rank's counter for q reaches `target` (plus base[q] when `base` is
// given: a per-rank count); true when all did (every thread gets the answer). `peersOnly`: every q
// but this rank; `live`: only the ranks taking part (bit q). `masked` (shrink on timeout): a rank
// whose wait times out is masked (maskAfterTimeout) instead of failing the wait.
__device__ inline bool waitEveryRank(const MoeParams& p, std::uint64_t counterOff, std::uint32_t target, WaitSite site,
                                     bool peersOnly = false, std::uint32_t live = ~0u,
                                     const std::uint32_t* base = nullptr, std::uint32_t* masked = nullptr) {
  const int q = static_cast<int>(threadIdx.x);
  const bool mine = q < p.shape.numRanks && !(peersOnly && q == p.shape.rank) && ((live >> (q & 31)) & 1u) != 0;
  const std::uint32_t want = mine && base != nullptr ? base[q] + target : target;
  const bool shrink = masked != nullptr;
  bool failed = mine && !flagWait(p.peers.sync, peerCounter(p, p.shape.rank, counterOff) + q, want, q, site, nullptr,
                                  false, shrink);  // quiet: its own timeout only
  if (failed && shrink) {
    maskAfterTimeout(p, masked, q);
    failed = false;
  }
  return __syncthreads_or(failed) == 0;
}

// The direct dispatch receive's shared memory: the layout's per-expert
// counts and offsets, one source's bases, the layout scratch and each group's slot stage.
template <int kThreads, int kGroups>
struct MoeReceiveSmem {
  std::int32_t counts[kMoeMaxLocalExperts];
  std::int32_t offsets[kMoeMaxLocalExperts + 1];
  std::int32_t base[kMoeMaxLocalExperts];
  MoeLayoutScratch<kThreads> scratch;
  MoeSlotStage stages[kGroups];
};

// The layout once every source's count message is in (the direct path's moeReceiveLayout below;
// the latency receive computes its own from its shared copy of the words): every CTA derives the
// expert offsets (its expansion needs them), the `publisher` CTA writes the per-source bases and
// publishes the layout.
template <int kThreads, int kGroups, typename Msg>
__device__ __forceinline__ void moeComputeReceiveLayout(const MoeParams& p, Msg msgOf, bool publisher,
                                                        MoeReceiveSmem<kThreads, kGroups>& sm) {
  moeComputeOffsets<kThreads>(p, msgOf, sm.counts, sm.offsets, sm.scratch);
  if (publisher) {
    moeComputeSourceBases<kThreads>(p, msgOf, sm.offsets, p.layout.sourceBase);
    moePublishLayout<kThreads>(p, msgOf, sm.counts, sm.offsets, p.layout.sourceBase, sm.scratch);
  }
}

// The direct path's dispatch receive's first step: wait for every source's count message
// (peers.countFlagsOff reaching pairBase[q] + 1, the direct path's steps shared with each source;
// the sources in `live` only, msgOf giving zeros for the others), then moeComputeReceiveLayout.
// False: a wait failed (reported), nothing was computed.
template <int kThreads, int kGroups, typename Msg>
__device__ __forceinline__ bool moeReceiveLayout(const MoeParams& p, Msg msgOf, bool publisher,
                                                 MoeReceiveSmem<kThreads, kGroups>& sm, std::uint32_t live,
                                                 const std::uint32_t* pairBase) {
  const bool ok = waitEveryRank(p, p.peers.countFlagsOff, 1u, WaitSite::kMoeDispatch, false, live, pairBase);
  if (ok) moeComputeReceiveLayout<kThreads, kGroups>(p, msgOf, publisher, sm);
  return ok;
}

}  // namespace graphep
