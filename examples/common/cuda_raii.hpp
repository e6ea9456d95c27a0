// Owners for the CUDA resources of the examples: every allocation, stream, event, graph and cuBLAS
// handle is released by its owner's destructor, on the device it was created on, on every exit path
// (an exception included). One check macro per library: a failing call throws CudaError naming the
// call, the error's name, file:line and the function.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>

namespace graphep::example {

class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void throwCudaError(const char* call, const char* name, const char* text, const char* file,
                                        int line, const char* function) {
  throw CudaError(std::string(call) + " failed: " + name + " (" + text + ") at " + file + ":" + std::to_string(line) +
                  " in " + function);
}

// The check behind the macros, one overload per library's status type (a call's own status picks it).
inline void checkStatus(cudaError_t s, const char* call, const char* file, int line, const char* function) {
  if (s != cudaSuccess) throwCudaError(call, cudaGetErrorName(s), cudaGetErrorString(s), file, line, function);
}
inline void checkStatus(cublasStatus_t s, const char* call, const char* file, int line, const char* function) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    throwCudaError(call, cublasGetStatusName(s), cublasGetStatusString(s), file, line, function);
  }
}

#define GRAPHEP_EXAMPLE_CUDA_CHECK(call) ::graphep::example::checkStatus((call), #call, __FILE__, __LINE__, __func__)
#define GRAPHEP_EXAMPLE_CUBLAS_CHECK(call) ::graphep::example::checkStatus((call), #call, __FILE__, __LINE__, __func__)

// Makes `device` current for its scope.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    GRAPHEP_EXAMPLE_CUDA_CHECK(cudaGetDevice(&saved_));
    GRAPHEP_EXAMPLE_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(saved_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int saved_ = 0;
};

// Runs `release` with `device` current. For destructors: it never throws (a failure while releasing
// has nowhere to go, and the next checked call reports a sticky error).
template <class F>
void releaseOnDevice(int device, F&& release) noexcept {
  int saved = -1;
  if (cudaGetDevice(&saved) != cudaSuccess) saved = -1;
  cudaSetDevice(device);
  release();
  if (saved >= 0) cudaSetDevice(saved);
}

// `count` elements of T in device memory of `device` (uninitialised).
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(int device, std::size_t count) : device_(device), count_(count) {
    DeviceGuard guard(device);
    GRAPHEP_EXAMPLE_CUDA_CHECK(cudaMalloc(&ptr_, bytes()));
  }
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      device_ = std::exchange(o.device_, 0);
      count_ = std::exchange(o.count_, 0);
      ptr_ = std::exchange(o.ptr_, nullptr);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return ptr_; }
  std::size_t size() const { return count_; }
  std::size_t bytes() const { return count_ * sizeof(T); }
  int device() const { return device_; }

 private:
  void reset() noexcept {
    if (ptr_ != nullptr) releaseOnDevice(device_, [p = ptr_] { cudaFree(p); });
    ptr_ = nullptr;
  }
  int device_ = 0;
  std::size_t count_ = 0;
  T* ptr_ = nullptr;
};

// A CUDA handle (stream, event, graph, executable graph, cuBLAS handle) with its release function,
// destroyed on the device it was created on.
template <class H, void (*kRelease)(H)>
class UniqueHandle {
 public:
  UniqueHandle() = default;
  UniqueHandle(int device, H handle) : device_(device), handle_(handle) {}
  ~UniqueHandle() { reset(); }
  UniqueHandle(UniqueHandle&& o) noexcept { *this = std::move(o); }
  UniqueHandle& operator=(UniqueHandle&& o) noexcept {
    if (this != &o) {
      reset();
      device_ = std::exchange(o.device_, 0);
      handle_ = std::exchange(o.handle_, H{});
    }
    return *this;
  }
  UniqueHandle(const UniqueHandle&) = delete;
  UniqueHandle& operator=(const UniqueHandle&) = delete;

  H get() const { return handle_; }
  int device() const { return device_; }

 private:
  void reset() noexcept {
    if (handle_ != H{}) releaseOnDevice(device_, [h = handle_] { kRelease(h); });
    handle_ = H{};
  }
  int device_ = 0;
  H handle_{};
};

inline void destroyStream(cudaStream_t s) { cudaStreamDestroy(s); }
inline void destroyEvent(cudaEvent_t e) { cudaEventDestroy(e); }
inline void destroyGraph(cudaGraph_t g) { cudaGraphDestroy(g); }
inline void destroyGraphExec(cudaGraphExec_t g) { cudaGraphExecDestroy(g); }
inline void destroyCublas(cublasHandle_t h) { cublasDestroy(h); }

using Stream = UniqueHandle<cudaStream_t, destroyStream>;
using Event = UniqueHandle<cudaEvent_t, destroyEvent>;
using Graph = UniqueHandle<cudaGraph_t, destroyGraph>;
using GraphExec = UniqueHandle<cudaGraphExec_t, destroyGraphExec>;
using CublasHandle = UniqueHandle<cublasHandle_t, destroyCublas>;

inline Stream makeStream(int device) {
  DeviceGuard guard(device);
  cudaStream_t s = nullptr;
  GRAPHEP_EXAMPLE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return Stream(device, s);
}

// Timing events (graph event-record nodes may record them too: cudaEventRecordExternal).
inline Event makeEvent(int device) {
  DeviceGuard guard(device);
  cudaEvent_t e = nullptr;
  GRAPHEP_EXAMPLE_CUDA_CHECK(cudaEventCreate(&e));
  return Event(device, e);
}

inline Graph makeGraph(int device) {
  cudaGraph_t g = nullptr;
  GRAPHEP_EXAMPLE_CUDA_CHECK(cudaGraphCreate(&g, 0));
  return Graph(device, g);
}

inline GraphExec instantiate(const Graph& graph) {
  DeviceGuard guard(graph.device());
  cudaGraphExec_t exec = nullptr;
  GRAPHEP_EXAMPLE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph.get(), 0));
  return GraphExec(graph.device(), exec);
}

// Captures what `enqueue(stream)` issues on `stream` (of `device`) into a new graph. Thread-local
// capture mode: other threads' CUDA calls are unaffected.
template <class F>
Graph capture(int device, cudaStream_t stream, F&& enqueue) {
  DeviceGuard guard(device);
  GRAPHEP_EXAMPLE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  cudaGraph_t g = nullptr;
  try {
    enqueue(stream);
  } catch (...) {
    cudaStreamEndCapture(stream, &g);  // leaves the stream usable; the partial graph is dropped
    if (g != nullptr) cudaGraphDestroy(g);
    throw;
  }
  GRAPHEP_EXAMPLE_CUDA_CHECK(cudaStreamEndCapture(stream, &g));
  return Graph(device, g);
}

// One value copied from device memory of `device` (synchronous: setup and diagnostics only).
template <class T>
T readDeviceValue(const T* p, int device) {
  DeviceGuard guard(device);
  T v{};
  GRAPHEP_EXAMPLE_CUDA_CHECK(cudaMemcpy(&v, p, sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

// The time between two completed events, in microseconds.
inline double elapsedUs(const Event& from, const Event& to) {
  float ms = 0;
  GRAPHEP_EXAMPLE_CUDA_CHECK(cudaEventElapsedTime(&ms, from.get(), to.get()));
  return static_cast<double>(ms) * 1e3;
}

}  // namespace graphep::example
