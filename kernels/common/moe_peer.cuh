// Device helpers of the MoE kernels that store straight into peers' memory (the latency path,
// kernels/moe_latency.cu, and the throughput path's direct dispatch, kernels/moe_direct.cu):
// monotonic counters in every rank's symmetric user region (MoeParams::peerUser, the same offsets
// on every rank), posted after a system-scope fence and waited for with bounded waits.
#pragma once

#include "kernels/common/flags.cuh"
#include "kernels/common/moe.cuh"

namespace graphep {

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
  return reinterpret_cast<std::uint32_t*>(p.peerUser[rank] + off);
}

// Block-wide "am I the last of the grid's CTAs to get here": every thread's prior writes (local or
// to peers) are fenced at system scope before the count; returns the same answer in every thread,
// and the last one resets the counter for the next launch. Verdicts reach the CTA through
// __syncthreads_or, not a shared word: nothing for a later exchange to race with, one barrier
// fewer, and racecheck-clean after the groups' uneven loops (see the latency records loop).
__device__ inline bool lastBlock(std::uint32_t* counter) {
  __threadfence_system();  // every thread's own stores, before the barrier hands over to thread 0
  __syncthreads();
  bool last = false;
  if (threadIdx.x == 0) {
    last = atomicAdd(counter, 1u) == gridDim.x - 1u;
    if (last) {
      *counter = 0;  // every CTA counted: ready for the next launch
      __threadfence_system();
    }
  }
  return __syncthreads_or(last) != 0;  // thread 0's answer, to every thread
}

// Every thread's stores (records or partials, local or peers') are made visible at system scope,
// then thread r < R adds 1 to rank r's counter for this rank (release).
__device__ inline void arriveAtEveryRank(const MoeParams& p, std::uint64_t counterOff) {
  __threadfence_system();
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < p.numRanks) {
    ptx::redReleaseSysAdd(peerCounter(p, static_cast<int>(threadIdx.x), counterOff) + p.rank, 1u);
  }
}

// Threads q < R wait until this rank's counter for q reaches `target`; true when all did (every
// thread gets the answer).
__device__ inline bool waitEveryRank(const MoeParams& p, std::uint64_t counterOff, std::uint32_t target, WaitSite site) {
  const int q = static_cast<int>(threadIdx.x);
  const bool failed = q < p.numRanks && !flagWait(p.sync, peerCounter(p, p.rank, counterOff) + q, target, q, site);
  return __syncthreads_or(failed) == 0;
}

}  // namespace graphep
