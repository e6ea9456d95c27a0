#include "engine/watchdog.hpp"

#include <thread>

#include "engine/error.hpp"
#include "engine/log.hpp"

namespace graphep::detail {

bool streamFinishesWithin(cudaStream_t stream, cudaEvent_t event, std::chrono::milliseconds timeout) {
  GRAPHEP_CUDA_CHECK(cudaEventRecord(event, stream));
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  cudaError_t q = cudaEventQuery(event);
  while (q == cudaErrorNotReady && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    q = cudaEventQuery(event);
  }
  if (q != cudaSuccess && q != cudaErrorNotReady) GRAPHEP_CUDA_CHECK(q);
  return q == cudaSuccess;
}

HealthReport judgeStream(const SymmetricHeap& heap, int local, cudaStream_t stream, cudaEvent_t event,
                         std::chrono::milliseconds timeout, const std::function<std::string()>& diagnose) {
  HealthReport r;
  const bool finished = streamFinishesWithin(stream, event, timeout);
  const std::string deviceError = heap.errorMessage(local);  // mapped memory: no sync
  if (finished && deviceError.empty()) return r;
  r.ok = false;
  const int rank = heap.rank(local);
  if (finished) {
    r.message = "rank " + std::to_string(rank) + ": " + deviceError;
  } else {
    r.message = format("rank %d: the work on stream %p did not finish within %lld ms", rank,
                       static_cast<void*>(stream), static_cast<long long>(timeout.count()));
    r.message += diagnose();
    if (!deviceError.empty()) r.message += "; device error: " + deviceError;
  }
  GRAPHEP_LOG_WARN(log::kSync, "%s", r.message.c_str());
  return r;
}

}  // namespace graphep::detail
