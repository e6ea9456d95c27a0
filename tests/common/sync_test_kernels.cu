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
