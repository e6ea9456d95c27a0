// Flag ping-pong probe (see kernels/probe.h).
#include "kernels/probe.h"

#include "kernels/common/flags.cuh"

namespace graphep {

__global__ void flagPingPongKernel(SyncHandle h, std::uint32_t channel, std::uint32_t rounds,
                                   unsigned long long* errors) {
  const int p = static_cast<int>(threadIdx.x);
  if (p >= h.numRanks || p == h.rank || h.peerFlagInbox[p] == nullptr) return;
  const std::uint32_t idx = h.flagIndex(channel, p);
  std::uint32_t* peerSlot = h.peerFlagInbox[p] + h.flagIndex(channel, h.rank);
  const std::uint32_t* mySlot = h.flagInbox + idx;
  // The step counter is local and owned by this thread; each launch or replay continues it.
  std::uint32_t step = h.flagStep[idx];
  unsigned long long bad = 0;
  for (std::uint32_t r = 0; r < rounds; ++r) {
    ++step;
    std::uint32_t seen = 0;
    bool ok;
    if (h.rank < p) {
      flagPost(peerSlot, step);
      ok = flagWait(h, mySlot, step, p, WaitSite::kPingPongPong, &seen);
    } else {
      ok = flagWait(h, mySlot, step, p, WaitSite::kPingPongPing, &seen);
      if (ok) flagPost(peerSlot, step);
    }
    if (!ok) {
      bad += rounds - r;  // every remaining round is lost
      break;
    }
    bad += seen != step;
  }
  h.flagStep[idx] = step;
  if (bad != 0) atomicAdd(errors, bad);
}

cudaError_t launchFlagPingPong(const SyncHandle& h, std::uint32_t channel, std::uint32_t rounds,
                               unsigned long long* errors, cudaStream_t stream) {
  if (h.numRanks > 32) return cudaErrorInvalidValue;  // one thread per peer in one warp
  flagPingPongKernel<<<1, 32, 0, stream>>>(h, channel, rounds, errors);
  return cudaGetLastError();
}

cudaError_t preloadProbeKernels() {
  cudaFuncAttributes a{};
  return cudaFuncGetAttributes(&a, flagPingPongKernel);
}

}  // namespace graphep
