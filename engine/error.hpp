// Internal error model: one check macro per API family, each naming the call, the error name and
// file:line, and throwing graphep::Error. Argument checks use GRAPHEP_REQUIRE, a real branch in
// every build type (never assert).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

#include <graphep/status.hpp>

namespace graphep::detail {

// printf-style formatting into a std::string.
std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

[[noreturn]] void throwError(Status status, const std::string& message);
[[noreturn]] void throwCuda(cudaError_t err, const char* call, const char* file, int line,
                            const char* func);
[[noreturn]] void throwCu(CUresult err, const char* call, const char* file, int line,
                          const char* func);
[[noreturn]] void throwNccl(ncclResult_t err, const char* call, const char* file, int line,
                            const char* func);

inline void checkCuda(cudaError_t err, const char* call, const char* file, int line,
                      const char* func) {
  if (err != cudaSuccess) [[unlikely]] throwCuda(err, call, file, line, func);
}
inline void checkCu(CUresult err, const char* call, const char* file, int line, const char* func) {
  if (err != CUDA_SUCCESS) [[unlikely]] throwCu(err, call, file, line, func);
}
inline void checkNccl(ncclResult_t err, const char* call, const char* file, int line,
                      const char* func) {
  if (err != ncclSuccess && err != ncclInProgress) [[unlikely]]
    throwNccl(err, call, file, line, func);
}

}  // namespace graphep::detail

#define GRAPHEP_CUDA_CHECK(call) \
  ::graphep::detail::checkCuda((call), #call, __FILE__, __LINE__, __func__)
#define GRAPHEP_CU_CHECK(call) \
  ::graphep::detail::checkCu((call), #call, __FILE__, __LINE__, __func__)
#define GRAPHEP_NCCL_CHECK(call) \
  ::graphep::detail::checkNccl((call), #call, __FILE__, __LINE__, __func__)

// GRAPHEP_REQUIRE(cond, Status::kInvalidArgument, "hidden=%d is not a multiple of 8", hidden)
#define GRAPHEP_REQUIRE(cond, status, ...)                                        \
  do {                                                                            \
    if (!(cond)) [[unlikely]]                                                     \
      ::graphep::detail::throwError((status), ::graphep::detail::format(__VA_ARGS__)); \
  } while (0)

#define GRAPHEP_FAIL(status, ...) \
  ::graphep::detail::throwError((status), ::graphep::detail::format(__VA_ARGS__))
