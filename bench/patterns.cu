// Byte patterns for benchmark correctness checks (#wrong column).
#include <cuda_runtime.h>

#include <algorithm>

#include "bench/harness.hpp"
#include "engine/error.hpp"

namespace graphep::bench {
namespace {

__device__ __forceinline__ unsigned char patternByte(std::size_t i, unsigned salt) {
  return static_cast<unsigned char>((i * 2654435761u + salt) >> 7);
}

__global__ void fillKernel(unsigned char* p, std::size_t n, unsigned salt) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    p[i] = patternByte(i, salt);
}

__global__ void checkKernel(const unsigned char* p, std::size_t n, unsigned salt,
                            unsigned long long* wrong) {
  unsigned long long bad = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    bad += p[i] != patternByte(i, salt);
  if (bad) atomicAdd(wrong, bad);
}

}  // namespace

void fillBytes(void* p, std::size_t bytes, unsigned salt, cudaStream_t stream) {
  if (bytes == 0) return;
  fillKernel<<<1024, 256, 0, stream>>>(static_cast<unsigned char*>(p), bytes, salt);
  GRAPHEP_CUDA_CHECK(cudaGetLastError());
}

long long checkBytes(Ranks& r, int i, const void* p, std::size_t bytes, unsigned salt) {
  GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[static_cast<size_t>(i)]));
  unsigned long long* wrong = nullptr;
  GRAPHEP_CUDA_CHECK(cudaMalloc(&wrong, sizeof(unsigned long long)));
  // On the check's stream: a legacy-stream memset is not ordered before the non-blocking stream.
  GRAPHEP_CUDA_CHECK(cudaMemsetAsync(wrong, 0, sizeof(unsigned long long), r.streams[static_cast<size_t>(i)]));
  if (bytes > 0) {
    checkKernel<<<1024, 256, 0, r.streams[static_cast<size_t>(i)]>>>(
        static_cast<const unsigned char*>(p), bytes, salt, wrong);
    GRAPHEP_CUDA_CHECK(cudaGetLastError());
  }
  GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(r.streams[static_cast<size_t>(i)]));
  unsigned long long w = 0;
  GRAPHEP_CUDA_CHECK(cudaMemcpy(&w, wrong, sizeof(w), cudaMemcpyDeviceToHost));
  GRAPHEP_CUDA_CHECK(cudaFree(wrong));
  return static_cast<long long>(w);
}

}  // namespace graphep::bench
