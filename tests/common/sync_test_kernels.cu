#include "common/sync_test_kernels.h"

#include "kernels/common/flags.cuh"

namespace graphep::test {

__global__ void copyWordsKernel(const std::uint32_t* src, std::uint32_t* dst, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    dst[i] = src[i];
  }
}

cudaError_t launchCopyWords(const std::uint32_t* src, std::uint32_t* dst, std::size_t n,
                            cudaStream_t stream) {
  copyWordsKernel<<<16, 256, 0, stream>>>(src, dst, n);
  return cudaGetLastError();
}

__global__ void waitForPeerKernel(SyncHandle h, std::uint32_t channel, int peer, int* result) {
  const std::uint32_t* slot = h.flagInbox + h.flagIndex(channel, peer);
  const std::uint32_t target = ptx::ldAcquireSys(slot) + 1u;
  *result = flagWait(h, slot, target, peer, WaitSite::kFlag) ? 1 : 0;
}

cudaError_t launchWaitForPeer(const SyncHandle& h, std::uint32_t channel, int peer, int* result,
                              cudaStream_t stream) {
  waitForPeerKernel<<<1, 1, 0, stream>>>(h, channel, peer, result);
  return cudaGetLastError();
}

}  // namespace graphep::test

namespace graphep::test {

__device__ __forceinline__ unsigned char patternByte(std::uint64_t seed, int rank, std::uint64_t i) {
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(rank) * 0xD1B54A32D192ED03ull +
                    (i >> 3) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<unsigned char>(x >> (8 * (i & 7)));
}

__global__ void fillPatternKernel(unsigned char* dst, std::size_t bytes, std::uint64_t seed, int rank) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < bytes;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    dst[i] = patternByte(seed, rank, i);
  }
}

__global__ void countMismatchKernel(const unsigned char* p, std::size_t bytes, std::uint64_t seed,
                                    int rank, unsigned long long* wrong) {
  unsigned long long bad = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < bytes;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    bad += p[i] != patternByte(seed, rank, i);
  }
  if (bad) atomicAdd(wrong, bad);
}

static unsigned gridFor(std::size_t bytes) {
  const std::size_t blocks = (bytes + 255) / 256;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 1024 ? 1024 : blocks));
}

cudaError_t launchFillPattern(void* dst, std::size_t bytes, std::uint64_t seed, int rank,
                              cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  fillPatternKernel<<<gridFor(bytes), 256, 0, stream>>>(static_cast<unsigned char*>(dst), bytes,
                                                          seed, rank);
  return cudaGetLastError();
}

cudaError_t preloadTestKernels() {
  cudaFuncAttributes a{};
  for (const void* fn : {reinterpret_cast<const void*>(fillPatternKernel),
                         reinterpret_cast<const void*>(countMismatchKernel),
                         reinterpret_cast<const void*>(copyWordsKernel),
                         reinterpret_cast<const void*>(waitForPeerKernel)}) {
    cudaError_t e = cudaFuncGetAttributes(&a, fn);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

cudaError_t launchCountMismatches(const void* p, std::size_t bytes, std::uint64_t seed, int rank,
                                  unsigned long long* wrong, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  countMismatchKernel<<<gridFor(bytes), 256, 0, stream>>>(static_cast<const unsigned char*>(p),
                                                            bytes, seed, rank, wrong);
  return cudaGetLastError();
}

}  // namespace graphep::test
