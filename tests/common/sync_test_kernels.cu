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

__global__ void countDiffKernel(const unsigned char* a, const unsigned char* b, std::size_t bytes,
                                unsigned long long* wrong) {
  unsigned long long bad = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < bytes;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    bad += a[i] != b[i];
  }
  if (bad) atomicAdd(wrong, bad);
}

cudaError_t launchCountDiffs(const void* a, const void* b, std::size_t bytes,
                             unsigned long long* wrong, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  countDiffKernel<<<gridFor(bytes), 256, 0, stream>>>(static_cast<const unsigned char*>(a),
                                                        static_cast<const unsigned char*>(b), bytes,
                                                        wrong);
  return cudaGetLastError();
}

cudaError_t launchCountMismatches(const void* p, std::size_t bytes, std::uint64_t seed, int rank,
                                  unsigned long long* wrong, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  countMismatchKernel<<<gridFor(bytes), 256, 0, stream>>>(static_cast<const unsigned char*>(p),
                                                            bytes, seed, rank, wrong);
  return cudaGetLastError();
}

}  // namespace graphep::test

#include <cuda_bf16.h>

namespace graphep::test {

__device__ __forceinline__ float elemValue(bool bf16, std::uint64_t seed, int rank, std::size_t i) {
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull ^ (static_cast<std::uint64_t>(rank) << 40) ^ i;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return bf16 ? static_cast<float>(static_cast<int>(x % 17) - 8)
              : static_cast<float>(static_cast<int>(x % 2001) - 1000) / 64.0f;
}

__global__ void fillElemsKernel(void* dst, std::size_t count, bool bf16, std::uint64_t seed, int rank) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const float v = elemValue(bf16, seed, rank, i);
    if (bf16) {
      static_cast<__nv_bfloat16*>(dst)[i] = __float2bfloat16(v);
    } else {
      static_cast<float*>(dst)[i] = v;
    }
  }
}

__global__ void countSumMismatchKernel(const void* out, std::size_t count, bool bf16,
                                       std::uint64_t seed, int numRanks, std::size_t first,
                                       unsigned long long* wrong) {
  unsigned long long bad = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    float want = 0;
    for (int s = 0; s < numRanks; ++s) want += elemValue(bf16, seed, s, first + i);
    const float got = bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(out)[i])
                           : static_cast<const float*>(out)[i];
    bad += got != want;
  }
  if (bad) atomicAdd(wrong, bad);
}

cudaError_t launchFillElems(void* dst, std::size_t count, bool bf16, std::uint64_t seed, int rank,
                            cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  fillElemsKernel<<<gridFor(count), 256, 0, stream>>>(dst, count, bf16, seed, rank);
  return cudaGetLastError();
}

cudaError_t launchCountSumMismatches(const void* out, std::size_t count, bool bf16,
                                     std::uint64_t seed, int numRanks, std::size_t firstIndex,
                                     unsigned long long* wrong, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  countSumMismatchKernel<<<gridFor(count), 256, 0, stream>>>(out, count, bf16, seed, numRanks,
                                                             firstIndex, wrong);
  return cudaGetLastError();
}

cudaError_t preloadTestKernels() {
  cudaFuncAttributes a{};
  for (const void* fn : {reinterpret_cast<const void*>(fillPatternKernel),
                         reinterpret_cast<const void*>(countMismatchKernel),
                         reinterpret_cast<const void*>(countDiffKernel),
                         reinterpret_cast<const void*>(copyWordsKernel),
                         reinterpret_cast<const void*>(waitForPeerKernel),
                         reinterpret_cast<const void*>(fillElemsKernel),
                         reinterpret_cast<const void*>(countSumMismatchKernel)}) {
    cudaError_t e = cudaFuncGetAttributes(&a, fn);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace graphep::test
