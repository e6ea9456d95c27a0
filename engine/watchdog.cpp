#include "engine/watchdog.hpp"

#include <thread>

#include "engine/error.hpp"

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

}  // namespace graphep::detail
