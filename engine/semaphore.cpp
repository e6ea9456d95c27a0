#include "engine/semaphore.hpp"

#include <algorithm>
#include <mutex>

#include "engine/error.hpp"
#include "engine/log.hpp"
#include "engine/platform.hpp"
#include "engine/topology.hpp"
#include "engine/watchdog.hpp"
#include "kernels/semaphore.h"

namespace graphep {

struct SemaphoreOps::Watch {
  int device = -1;
  mutable std::mutex mu;
  std::vector<SemaphoreWait> waits;  // one per (channel, src) waited on, the largest k
  std::string failure;               // "" while healthy
  cudaStream_t stream = nullptr;     // private, non-blocking: copies that never queue behind a stall
  cudaEvent_t event = nullptr;
  std::uint32_t* snapshot = nullptr;  // pinned: count, arrived, consumed per wait

  ~Watch() {
    if (device >= 0) cudaSetDevice(device);
    if (event != nullptr) cudaEventDestroy(event);
    if (stream != nullptr) cudaStreamDestroy(stream);
    if (snapshot != nullptr) cudaFreeHost(snapshot);
  }
};

SemaphoreOps::SemaphoreOps(const SymmetricHeap& heap, int local)
    : heap_(&heap), local_(local), h_(heap.syncHandle(local)), watch_(std::make_shared<Watch>()) {
  // Setup: resolve the driver entry points and load the kernels now, never on the run path.
  detail::driver();
  GRAPHEP_CUDA_CHECK(cudaSetDevice(heap.device(local)));
  GRAPHEP_CUDA_CHECK(preloadSemaphoreKernels());
  for (int l = 0; l < heap.numLocalRanks(); ++l) {
    if (l != local && heap.device(l) == heap.device(local)) sharesDevice_ = true;
  }
  Watch& w = *watch_;
  w.device = heap.device(local);
  GRAPHEP_CUDA_CHECK(cudaStreamCreateWithFlags(&w.stream, cudaStreamNonBlocking));
  GRAPHEP_CUDA_CHECK(cudaEventCreateWithFlags(&w.event, cudaEventDisableTiming));
  const std::size_t words = static_cast<std::size_t>(h_.numSemChannels) * static_cast<std::size_t>(h_.numRanks);
  GRAPHEP_CUDA_CHECK(cudaHostAlloc(&w.snapshot, 3 * words * sizeof(std::uint32_t), cudaHostAllocDefault));
}

void SemaphoreOps::requireHealthy(const char* op) const {
  std::lock_guard<std::mutex> lock(watch_->mu);
  GRAPHEP_REQUIRE(watch_->failure.empty(), Status::kRemoteError,
                  "semaphore %s refused: this rank's semaphores have failed: %s", op,
                  watch_->failure.c_str());
}

bool SemaphoreOps::failed() const {
  std::lock_guard<std::mutex> lock(watch_->mu);
  return !watch_->failure.empty();
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
  requireHealthy("signal");
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
  requireHealthy("wait");
  checkWord("wait", channel, src, k);
  {
    std::lock_guard<std::mutex> lock(watch_->mu);
    auto& waits = watch_->waits;
    auto it = std::find_if(waits.begin(), waits.end(), [&](const SemaphoreWait& x) {
      return x.channel == channel && x.src == src;
    });
    if (it == waits.end()) {
      waits.push_back({channel, src, k});
    } else {
      it->k = std::max(it->k, k);
    }
  }
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
  requireHealthy("consume");
  checkWord("consume", channel, src, k);
  GRAPHEP_CUDA_CHECK(
      launchSemaphoreConsume(h_, static_cast<std::uint32_t>(channel), src, k, stream));
}

SemaphoreCounts SemaphoreOps::read(int channel, int src) const {
  checkWord("read", channel, src, 1);
  return readAll({SemaphoreWait{channel, src, 1}})[0];
}

std::vector<SemaphoreCounts> SemaphoreOps::readAll(const std::vector<SemaphoreWait>& waits) const {
  Watch& w = *watch_;
  std::lock_guard<std::mutex> lock(w.mu);  // the snapshot buffer is shared
  GRAPHEP_CUDA_CHECK(cudaSetDevice(w.device));
  std::uint32_t* snap = w.snapshot;
  for (std::size_t i = 0; i < waits.size(); ++i) {
    const std::uint32_t idx = h_.semIndex(static_cast<std::uint32_t>(waits[i].channel), waits[i].src);
    GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(snap + 3 * i, h_.semCount + idx, 4, cudaMemcpyDeviceToHost, w.stream));
    GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(snap + 3 * i + 1, h_.semArrived + idx, 4, cudaMemcpyDeviceToHost, w.stream));
    GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(snap + 3 * i + 2, h_.semConsumed + idx, 4, cudaMemcpyDeviceToHost, w.stream));
  }
  GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(w.stream));
  std::vector<SemaphoreCounts> counts(waits.size());
  for (std::size_t i = 0; i < waits.size(); ++i) counts[i] = {snap[3 * i], snap[3 * i + 1], snap[3 * i + 2]};
  return counts;
}

HealthReport SemaphoreOps::watch(cudaStream_t stream, std::chrono::milliseconds timeout) {
  Watch& w = *watch_;
  detail::DeviceGuard guard(w.device);
  const HealthReport r = detail::judgeStream(*heap_, local_, stream, w.event, timeout, [&] {
    std::vector<SemaphoreWait> waits;
    {
      std::lock_guard<std::mutex> lock(w.mu);
      waits = w.waits;
    }
    return detail::describeSemaphoreStall(waits, readAll(waits));
  });
  if (!r.ok) {
    std::lock_guard<std::mutex> lock(w.mu);
    if (w.failure.empty()) w.failure = r.message;
  }
  return r;
}

void SemaphoreOps::release() {
  Watch& w = *watch_;
  detail::DeviceGuard guard(w.device);
  std::vector<SemaphoreWait> waits;
  {
    std::lock_guard<std::mutex> lock(w.mu);
    GRAPHEP_REQUIRE(!w.failure.empty(), Status::kInvalidUsage,
                    "semaphore release: rank %d has not failed (watch() found no stall); lifting "
                    "its waits would run consumers on data that may still arrive", h_.rank);
    waits = w.waits;
  }
  const std::vector<SemaphoreCounts> counts = readAll(waits);
  std::lock_guard<std::mutex> lock(w.mu);  // the snapshot buffer is shared
  int lifted = 0;
  for (std::size_t i = 0; i < waits.size(); ++i) {
    if (counts[i].count >= waits[i].k) continue;
    if (lifted++ == 0) {
      heap_->recordHostError(local_, w.stream, DeviceErrorKind::kAborted, waits[i].src,
                             WaitSite::kSemaphoreWait, waits[i].k, counts[i].count);
    }
    // Raised far above any wait: every later wait on the word passes too (the rank is failed).
    w.snapshot[i] = counts[i].count + (1u << 30);
    const std::uint32_t idx = h_.semIndex(static_cast<std::uint32_t>(waits[i].channel), waits[i].src);
    GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(h_.semCount + idx, w.snapshot + i, 4, cudaMemcpyHostToDevice, w.stream));
  }
  GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(w.stream));
  GRAPHEP_LOG_WARN(log::kSync, "rank %d: lifted %d semaphore wait(s) after a stall%s", h_.rank, lifted,
                   lifted == 0 ? " (none was short: the stall is elsewhere on the stream)" : "");
}

std::string detail::describeSemaphoreStall(const std::vector<SemaphoreWait>& waits,
                                           const std::vector<SemaphoreCounts>& counts) {
  std::string missing;
  for (std::size_t i = 0; i < waits.size() && i < counts.size(); ++i) {
    const SemaphoreCounts& c = counts[i];
    if (c.count >= waits[i].k) continue;
    missing += format("; semaphore channel %d: rank %d has not signalled (count %u of the %u waited for; "
                      "arrived %u, consumed %u)",
                      waits[i].channel, waits[i].src, c.count, waits[i].k, c.arrived, c.consumed);
  }
  return missing.empty() ? " (no semaphore word is short of its wait: the stall is elsewhere on the stream)"
                         : missing;
}

}  // namespace graphep
