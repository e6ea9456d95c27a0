#include "common/sync_test_kernels.h"

#include "kernels/common/flags.cuh"

namespace graphep::test {

__global__ void copyWordsKernel(const std::uint32_t* src, std::uint32_t* dst, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    dst[i] = src[i];
  }
}

cudaError_t launchCopyWords(const std::uint32_t* src, std::uint32_t* dst, std::size_t n,
                            cudaStream_t stream) {
  copyWordsKernel<<<16, 256, 0, stream>>>(src, dst, n);
  return cudaGetLastError();
}

__global__ void flagPingPongKernel(SyncHandle h, std::uint32_t channel,
                                   unsigned long long* errors) {
  const int p = static_cast<int>(threadIdx.x);
  if (p >= h.numRanks || p == h.rank) return;
  const std::uint32_t idx = h.flagIndex(channel, p);
  // The step counter is local and owned by this thread; the graph advances it on every replay.
  const std::uint32_t step = h.flagStep[idx] + 1u;
  h.flagStep[idx] = step;
  std::uint32_t* peerSlot = h.peerFlagInbox[p] + h.flagIndex(channel, h.rank);
  const std::uint32_t* mySlot = h.flagInbox + idx;
  std::uint32_t seen = 0;
  bool ok;
  if (h.rank < p) {
    flagPost(peerSlot, step);
    ok = flagWait(h, mySlot, step, p, WaitSite::kPingPongPong, &seen);
  } else {
    ok = flagWait(h, mySlot, step, p, WaitSite::kPingPongPing, &seen);
    if (ok) flagPost(peerSlot, step);
  }
  if (!ok || seen != step) atomicAdd(errors, 1ull);
}

cudaError_t launchFlagPingPong(const SyncHandle& h, std::uint32_t channel,
                               unsigned long long* errors, cudaStream_t stream) {
  flagPingPongKernel<<<1, 32, 0, stream>>>(h, channel, errors);
  return cudaGetLastError();
}

__global__ void waitForPeerKernel(SyncHandle h, std::uint32_t channel, int peer, int* result) {
  const std::uint32_t* slot = h.flagInbox + h.flagIndex(channel, peer);
  const std::uint32_t target = ptx::ldAcquireSys(slot) + 1u;
  *result = flagWait(h, slot, target, peer, WaitSite::kFlag) ? 1 : 0;
}

cudaError_t launchWaitForPeer(const SyncHandle& h, std::uint32_t channel, int peer, int* result,
                              cudaStream_t stream) {
  waitForPeerKernel<<<1, 1, 0, stream>>>(h, channel, peer, result);
  return cudaGetLastError();
}

}  // namespace graphep::test
