#include "engine/platform.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <mutex>

#include <graphep/graphep.hpp>

#include "engine/error.hpp"

namespace graphep {

const char* versionString() noexcept { return GRAPHEP_VERSION_STRING; }

const char* cudaTargets() noexcept { return GRAPHEP_CUDA_ARCHS_LIST; }

int ncclRuntimeVersion() {
  int v = 0;
  GRAPHEP_NCCL_CHECK(ncclGetVersion(&v));
  return v;
}

int cudaDeviceCountOrZero(const char** reason) noexcept {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    // On a machine without a driver this is cudaErrorInsufficientDriver or cudaErrorNoDevice;
    // any error means "no usable GPU".
    cudaGetLastError();
    if (reason != nullptr) *reason = cudaGetErrorName(err);
    return 0;
  }
  if (n == 0 && reason != nullptr) *reason = "cudaGetDeviceCount returned 0";
  return n;
}

namespace detail {
namespace {

template <class Fn>
void resolve(const char* symbol, Fn& fn, unsigned version) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q{};
  cudaError_t err = cudaGetDriverEntryPointByVersion(symbol, &p, version, cudaEnableDefault, &q);
  if (err != cudaSuccess || q != cudaDriverEntryPointSuccess || p == nullptr) {
    cudaGetLastError();
    GRAPHEP_FAIL(Status::kNoDevice,
                 "cannot resolve CUDA driver entry point %s (version %u): %s, query result %d",
                 symbol, version, cudaGetErrorName(err), static_cast<int>(q));
  }
  fn = reinterpret_cast<Fn>(p);
}

}  // namespace

const DriverApi& driver() {
  static DriverApi api;
  static std::once_flag once;
  static bool ok = false;
  std::call_once(once, [] {
    try {
      resolve("cuStreamWaitValue32", api.streamWaitValue32, 12000);
      resolve("cuStreamWriteValue32", api.streamWriteValue32, 12000);
      resolve("cuGetErrorName", api.getErrorName, 6000);
      resolve("cuDeviceGetAttribute", api.deviceGetAttribute, 2000);
      resolve("cuCtxGetCurrent", api.ctxGetCurrent, 4000);
      resolve("cuCtxGetId", api.ctxGetId, 12000);
      ok = true;
    } catch (const Error&) {
      ok = false;
    }
  });
  GRAPHEP_REQUIRE(ok, Status::kNoDevice,
                  "the CUDA driver API is unavailable (no driver on this machine?)");
  return api;
}

const char* driverErrorName(CUresult err) noexcept {
  static thread_local char buf[32];
  try {
    const char* name = nullptr;
    if (driver().getErrorName(err, &name) == CUDA_SUCCESS && name != nullptr) return name;
  } catch (...) {
  }
  std::snprintf(buf, sizeof(buf), "CUresult %d", static_cast<int>(err));
  return buf;
}

}  // namespace detail
}  // namespace graphep
