// Flag ping-pong probe (see kernels/probe.h).
#include "kernels/probe.h"

#include "kernels/common/launch.h"
#include "kernels/common/copy.cuh"
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
  GRAPHEP_LAUNCH_REQUIRE(h.numRanks <= 32, "numRanks %d (at most 32: one thread per peer in one warp)", h.numRanks);
  flagPingPongKernel<<<1, 32, 0, stream>>>(h, channel, rounds, errors);
  return cudaGetLastError();
}

constexpr int kPushThreads = 512;

// CTA c copies bytes [c * share, (c + 1) * share) (the last CTA the rest) with the movers' copy loop.
__global__ void __launch_bounds__(kPushThreads) pushProbeKernel(char* dst, const char* src, std::uint64_t bytes) {
  const std::uint64_t share = bytes / gridDim.x / 16 * 16;
  const std::uint64_t first = share * blockIdx.x;
  const std::uint64_t n = blockIdx.x + 1 == gridDim.x ? bytes - first : share;
  copyBytes<LoadKind::kDefault>(dst + first, src + first, n, static_cast<int>(threadIdx.x), kPushThreads);
}

cudaError_t launchPushProbe(char* dst, const char* src, std::size_t bytes, int ctas, cudaStream_t stream) {
  GRAPHEP_LAUNCH_REQUIRE(ctas >= 1 && bytes % 16 == 0, "%d CTAs, %zu bytes (at least 1 CTA, a multiple of 16 bytes)", ctas, bytes);
  pushProbeKernel<<<static_cast<unsigned>(ctas), kPushThreads, 0, stream>>>(dst, src, bytes);
  return cudaGetLastError();
}

cudaError_t preloadProbeKernels() { return preloadKernels(flagPingPongKernel, pushProbeKernel); }

}  // namespace graphep
