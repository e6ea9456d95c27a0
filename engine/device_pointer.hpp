// The one check of a pointer a kernel will dereference (engine/moe/engine.cpp, engine/moe/token_layout.cpp):
// device or managed memory of the given GPU, or a graphep::Error naming it.
#pragma once

#include <cuda_runtime.h>

#include "engine/error.hpp"

namespace graphep::detail {

// A pointer the kernels dereference must be device memory of this rank's GPU (or managed).
inline void requireDevicePointer(const void* p, int device, const char* what) {
  GRAPHEP_REQUIRE(p != nullptr, Status::kInvalidArgument, "%s is null", what);
  cudaPointerAttributes a{};
  const cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    cudaGetLastError();
    GRAPHEP_FAIL(Status::kInvalidArgument, "%s (%p) is not a CUDA allocation: %s", what, p,
                 cudaGetErrorString(e));
  }
  GRAPHEP_REQUIRE(a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged,
                  Status::kInvalidArgument, "%s (%p) is host memory, not device memory", what, p);
  GRAPHEP_REQUIRE(a.type == cudaMemoryTypeManaged || a.device == device, Status::kInvalidArgument,
                  "%s (%p) lives on device %d, but this rank runs on device %d", what, p, a.device,
                  device);
}

}  // namespace graphep::detail
