// The CUDA platform as graphep sees it: driver entry points resolved at run time (graphep links
// only the runtime, so every binary starts on a machine with no driver), device counting that
// never throws, and version queries.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include "engine/error.hpp"

namespace graphep::detail {

struct DriverApi {
  PFN_cuStreamWaitValue32_v11070 streamWaitValue32 = nullptr;
  PFN_cuStreamWriteValue32_v11070 streamWriteValue32 = nullptr;
  PFN_cuGetErrorName_v6000 getErrorName = nullptr;
  PFN_cuDeviceGetAttribute_v2000 deviceGetAttribute = nullptr;
  PFN_cuCtxGetCurrent_v4000 ctxGetCurrent = nullptr;
  PFN_cuCtxGetId_v12000 ctxGetId = nullptr;
};

// Resolved once on first use; throws graphep::Error(kNoDevice) when the driver is missing.
const DriverApi& driver();

// Name of a driver error ("CUDA_ERROR_INVALID_VALUE"), or "CUresult <n>" when unresolvable.
const char* driverErrorName(CUresult err) noexcept;

// Makes `device` current and restores the caller's current device when it goes out of scope.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    GRAPHEP_CUDA_CHECK(cudaGetDevice(&saved_));
    if (saved_ != device) GRAPHEP_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    if (saved_ != device_) cudaSetDevice(saved_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_;
  int saved_ = 0;
};

}  // namespace graphep::detail
