#include "engine/error.hpp"

#include <cstdarg>
#include <cstdio>

#include "engine/platform.hpp"
#include "engine/log.hpp"
#include "kernels/common/launch.h"

namespace graphep {

const char* statusName(Status status) noexcept {
  switch (status) {
    case Status::kSuccess: return "SUCCESS";
    case Status::kInvalidArgument: return "INVALID_ARGUMENT";
    case Status::kInvalidUsage: return "INVALID_USAGE";
    case Status::kNotSupported: return "NOT_SUPPORTED";
    case Status::kNoDevice: return "NO_DEVICE";
    case Status::kCudaError: return "CUDA_ERROR";
    case Status::kNcclError: return "NCCL_ERROR";
    case Status::kMpiError: return "MPI_ERROR";
    case Status::kSystemError: return "SYSTEM_ERROR";
    case Status::kOutOfMemory: return "OUT_OF_MEMORY";
    case Status::kTimeout: return "TIMEOUT";
    case Status::kGraphInvalidated: return "GRAPH_INVALIDATED";
    case Status::kRemoteError: return "REMOTE_ERROR";
    case Status::kInternalError: return "INTERNAL_ERROR";
  }
  return "UNKNOWN_STATUS";
}

namespace detail {

std::string format(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  va_list ap2;
  va_copy(ap2, ap);
  int n = std::vsnprintf(nullptr, 0, fmt, ap);
  va_end(ap);
  std::string out(n > 0 ? static_cast<size_t>(n) : 0, '\0');
  if (n > 0) std::vsnprintf(out.data(), out.size() + 1, fmt, ap2);
  va_end(ap2);
  return out;
}

void throwError(Status status, const std::string& message) {
  // INFO, not WARN: callers often catch and handle these (argument checks, probes).
  GRAPHEP_LOG_INFO(log::kAll, "%s: %s", statusName(status), message.c_str());
  throw Error(status, message);
}

void throwCuda(cudaError_t err, const char* call, const char* file, int line, const char* func) {
  Status status = Status::kCudaError;
  if (err == cudaErrorMemoryAllocation) status = Status::kOutOfMemory;
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) status = Status::kNoDevice;
  // A launcher's refusal names the limit the launch breaks (kernels/common/launch.h).
  const std::string refusal = takeLaunchRefusal();
  const std::string why = err == cudaErrorInvalidValue && !refusal.empty() ? " (" + refusal + ")" : "";
  throwError(status, format("%s failed: %s (%s)%s at %s:%d in %s()", call, cudaGetErrorName(err),
                            cudaGetErrorString(err), why.c_str(), file, line, func));
}

void throwCu(CUresult err, const char* call, const char* file, int line, const char* func) {
  const char* name = driverErrorName(err);
  Status status = err == CUDA_ERROR_OUT_OF_MEMORY ? Status::kOutOfMemory : Status::kCudaError;
  throwError(status, format("%s failed: %s (%d) at %s:%d in %s()", call, name,
                            static_cast<int>(err), file, line, func));
}

void throwNccl(ncclResult_t err, const char* call, const char* file, int line, const char* func) {
  throwError(Status::kNcclError, format("%s failed: %s (%d) at %s:%d in %s()", call,
                                        ncclGetErrorString(err), static_cast<int>(err), file, line,
                                        func));
}

}  // namespace detail
}  // namespace graphep
