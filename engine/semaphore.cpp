#include "engine/semaphore.hpp"

#include "engine/error.hpp"
#include "engine/platform.hpp"
#include "engine/topology.hpp"
#include "kernels/semaphore.h"

namespace graphep {

SemaphoreOps::SemaphoreOps(const SymmetricHeap& heap, int local)
    : heap_(&heap), local_(local), h_(heap.syncHandle(local)) {
  // Setup: resolve the driver entry points and load the kernels now, never on the run path.
  detail::driver();
  GRAPHEP_CUDA_CHECK(cudaSetDevice(heap.device(local)));
  GRAPHEP_CUDA_CHECK(preloadSemaphoreKernels());
  for (int l = 0; l < heap.numLocalRanks(); ++l) {
    if (l != local && heap.device(l) == heap.device(local)) sharesDevice_ = true;
  }
}

void SemaphoreOps::checkChannel(int channel) const {
  GRAPHEP_REQUIRE(channel >= 0 && static_cast<std::uint32_t>(channel) < h_.numSemChannels,
                  Status::kInvalidArgument, "semaphore channel %d is out of range [0, %u)",
                  channel, h_.numSemChannels);
}

void SemaphoreOps::checkWord(const char* op, int channel, int src, std::uint32_t k) const {
  checkChannel(channel);
  GRAPHEP_REQUIRE(src >= 0 && src < h_.numRanks, Status::kInvalidArgument,
                  "semaphore %s: source rank %d is out of range [0, %d)", op, src, h_.numRanks);
  GRAPHEP_REQUIRE(k >= 1 && k < (1u << 30), Status::kInvalidArgument,
                  "semaphore %s count %u is out of range [1, 2^30)", op, k);
}

void SemaphoreOps::signal(cudaStream_t stream, int channel, std::uint32_t peerMask) const {
  checkChannel(channel);
  GRAPHEP_REQUIRE(h_.numRanks == 32 || (peerMask >> h_.numRanks) == 0, Status::kInvalidArgument,
                  "semaphore peer mask 0x%x names ranks beyond the %d in the group", peerMask,
                  h_.numRanks);
  for (int p = 0; p < h_.numRanks; ++p) {
    if ((peerMask & (1u << p)) == 0) continue;
    GRAPHEP_REQUIRE(isLoadStore(heap_->peerClass(local_, p)), Status::kNotSupported,
                    "rank %d cannot signal rank %d's semaphore: the peer is %s (no load/store)",
                    h_.rank, p, peerClassName(heap_->peerClass(local_, p)));
  }
  GRAPHEP_CUDA_CHECK(launchSemaphoreSignal(h_, static_cast<std::uint32_t>(channel), peerMask,
                                           stream));
}

void SemaphoreOps::wait(cudaStream_t stream, int channel, int src, std::uint32_t k) const {
  checkWord("wait", channel, src, k);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  GRAPHEP_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture == cudaStreamCaptureStatusNone && sharesDevice_) {
    GRAPHEP_CUDA_CHECK(
        launchSemaphoreWait(h_, static_cast<std::uint32_t>(channel), src, k, stream));
    return;
  }
  const CUdeviceptr addr =
      reinterpret_cast<CUdeviceptr>(h_.semCount + h_.semIndex(static_cast<std::uint32_t>(channel), src));
  GRAPHEP_CU_CHECK(detail::driver().streamWaitValue32(reinterpret_cast<CUstream>(stream), addr, k,
                                                      CU_STREAM_WAIT_VALUE_GEQ));
}

void SemaphoreOps::consume(cudaStream_t stream, int channel, int src, std::uint32_t k) const {
  checkWord("consume", channel, src, k);
  GRAPHEP_CUDA_CHECK(
      launchSemaphoreConsume(h_, static_cast<std::uint32_t>(channel), src, k, stream));
}

SemaphoreCounts SemaphoreOps::read(int channel, int src) const {
  checkWord("read", channel, src, 1);
  const std::uint32_t idx = h_.semIndex(static_cast<std::uint32_t>(channel), src);
  SemaphoreCounts c{};
  GRAPHEP_CUDA_CHECK(cudaSetDevice(heap_->device(local_)));
  GRAPHEP_CUDA_CHECK(cudaMemcpy(&c.count, h_.semCount + idx, 4, cudaMemcpyDeviceToHost));
  GRAPHEP_CUDA_CHECK(cudaMemcpy(&c.arrived, h_.semArrived + idx, 4, cudaMemcpyDeviceToHost));
  GRAPHEP_CUDA_CHECK(cudaMemcpy(&c.consumed, h_.semConsumed + idx, 4, cudaMemcpyDeviceToHost));
  return c;
}

}  // namespace graphep
