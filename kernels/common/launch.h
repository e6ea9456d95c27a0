// The launchers' shared host pieces, used by every kernel family file:
//  - GRAPHEP_LAUNCH_REQUIRE(cond, fmt, ...): a launcher's check of its parameters. A failed one
//    records which limit the launch breaks, with the values, and returns cudaErrorInvalidValue;
//    the engine's error for that call (GRAPHEP_CUDA_CHECK, engine/error.cpp) carries the text.
//  - launchGrid(...): a launch on a grid of CTAs that must not be empty, the check included;
//  - preloadKernels(kernels...): setup loads each kernel's code (cudaFuncGetAttributes forces
//    the module load), so that no kernel is first loaded inside a stream capture.
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace graphep {

// Records "launcher: what" (this thread's last refusal) and returns cudaErrorInvalidValue.
cudaError_t refuseLaunch(const char* launcher, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
// This thread's last refusal, cleared ("" when none).
std::string takeLaunchRefusal();

template <typename... Kernel>
cudaError_t preloadKernels(Kernel... kernels) {
  cudaFuncAttributes a{};
  cudaError_t e = cudaSuccess;
  ((e = e == cudaSuccess ? cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(kernels)) : e), ...);
  return e;
}

#ifdef __CUDACC__
// The launchers' common case: kernel<<<ctas, threads, 0, stream>>>(args...), refused unless
// ctas >= 1 (`what` names the count in `launcher`'s refusal).
template <typename... Params, typename... Args>
cudaError_t launchGrid(const char* launcher, const char* what, int ctas, int threads, cudaStream_t stream,
                       void (*kernel)(Params...), const Args&... args) {
  if (ctas < 1) return refuseLaunch(launcher, "%s %d (at least 1)", what, ctas);
  kernel<<<static_cast<unsigned>(ctas), static_cast<unsigned>(threads), 0, stream>>>(args...);
  return cudaGetLastError();
}
#endif

}  // namespace graphep

#define GRAPHEP_LAUNCH_REQUIRE(cond, ...)                                             \
  do {                                                                                \
    if (!(cond)) [[unlikely]] return ::graphep::refuseLaunch(__func__, __VA_ARGS__);  \
  } while (0)
