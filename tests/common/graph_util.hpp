// Capturing test work into CUDA graphs.
#pragma once

#include <cuda_runtime.h>

#include "engine/error.hpp"

namespace graphep::test {

// Captures what `enqueue(stream)` issues on `stream` (thread-local capture mode) and returns the
// instantiated graph. The caller destroys it.
template <class F>
cudaGraphExec_t captureOnStream(cudaStream_t stream, F&& enqueue) {
  GRAPHEP_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  enqueue(stream);
  cudaGraph_t g;
  GRAPHEP_CUDA_CHECK(cudaStreamEndCapture(stream, &g));
  cudaGraphExec_t e;
  GRAPHEP_CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
  GRAPHEP_CUDA_CHECK(cudaGraphDestroy(g));
  return e;
}

}  // namespace graphep::test
