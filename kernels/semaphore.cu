// Standalone counting-semaphore kernels: signal and consume (docs/DESIGN.md §3).
#include "kernels/semaphore.h"

#include "kernels/common/launch.h"
#include "kernels/common/flags.cuh"
#include "kernels/common/semaphore.cuh"

namespace graphep {

// One thread: everything the stream ran before this kernel is complete (stream order), so the
// fence inside semaphoreSignal publishes it before the signal.
__global__ void semaphoreSignalKernel(SyncHandle h, std::uint32_t channel,
                                      std::uint32_t peerMask) {
  for (int p = 0; p < h.numRanks; ++p) {
    if (peerMask & (1u << p)) semaphoreSignal(h, channel, p);
  }
}

__global__ void semaphoreConsumeKernel(SyncHandle h, std::uint32_t channel, std::int32_t src,
                                       std::uint32_t k) {
  semaphoreConsume(h, channel, src, k);
}

__global__ void semaphoreWaitKernel(SyncHandle h, std::uint32_t channel, std::int32_t src,
                                    std::uint32_t k) {
  // Counts stay far below 2^31, so a plain unsigned comparison is the semaphore's GEQ.
  boundedWait(
      h, h.semCount + h.semIndex(channel, src), k, [k](std::uint32_t v) { return v >= k; }, src,
      WaitSite::kSemaphoreWait, nullptr);
}

cudaError_t launchSemaphoreWait(const SyncHandle& h, std::uint32_t channel, std::int32_t src,
                                std::uint32_t k, cudaStream_t stream) {
  semaphoreWaitKernel<<<1, 1, 0, stream>>>(h, channel, src, k);
  return cudaGetLastError();
}

cudaError_t launchSemaphoreSignal(const SyncHandle& h, std::uint32_t channel,
                                  std::uint32_t peerMask, cudaStream_t stream) {
  semaphoreSignalKernel<<<1, 1, 0, stream>>>(h, channel, peerMask);
  return cudaGetLastError();
}

cudaError_t launchSemaphoreConsume(const SyncHandle& h, std::uint32_t channel, std::int32_t src,
                                   std::uint32_t k, cudaStream_t stream) {
  semaphoreConsumeKernel<<<1, 1, 0, stream>>>(h, channel, src, k);
  return cudaGetLastError();
}

cudaError_t preloadSemaphoreKernels() {
  return preloadKernels(semaphoreSignalKernel, semaphoreConsumeKernel, semaphoreWaitKernel);
}

}  // namespace graphep
