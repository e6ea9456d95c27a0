// Copy loops shared by the data movers: `nthreads` threads of one role move a byte range with
// 16-byte accesses when both ends are 16-byte aligned, kUnroll independent loads in flight per
// thread. Loads of memory that another GPU rewrites between uses (staging slots) must bypass L1:
// kLoadCg selects ld.global.cg for them.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace graphep {

enum class LoadKind { kDefault, kCacheGlobal };

template <LoadKind kLoad>
__device__ __forceinline__ uint4 loadVec(const uint4* p) {
  if constexpr (kLoad == LoadKind::kCacheGlobal) {
    return __ldcg(p);
  } else {
    return *p;
  }
}

template <LoadKind kLoad>
__device__ __forceinline__ unsigned char loadByte(const unsigned char* p) {
  if constexpr (kLoad == LoadKind::kCacheGlobal) {
    return static_cast<unsigned char>(__ldcg(reinterpret_cast<const char*>(p)));
  } else {
    return *p;
  }
}

template <LoadKind kLoad, int kUnroll = 8>
__device__ __forceinline__ void copyBytes(void* dstPtr, const void* srcPtr, std::uint64_t bytes,
                                          int tid, int nthreads) {
  auto* dst = static_cast<unsigned char*>(dstPtr);
  const auto* src = static_cast<const unsigned char*>(srcPtr);
  std::uint64_t vecBytes = 0;
  if (((reinterpret_cast<std::uintptr_t>(dst) | reinterpret_cast<std::uintptr_t>(src)) & 15u) == 0) {
    const std::uint64_t nvec = bytes / 16;
    const auto* s = reinterpret_cast<const uint4*>(src);
    auto* d = reinterpret_cast<uint4*>(dst);
    std::uint64_t i = static_cast<std::uint64_t>(tid);
    const std::uint64_t stride = static_cast<std::uint64_t>(nthreads);
    for (; i + (kUnroll - 1) * stride < nvec; i += kUnroll * stride) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = loadVec<kLoad>(s + i + u * stride);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) d[i + u * stride] = v[u];
    }
    for (; i < nvec; i += stride) d[i] = loadVec<kLoad>(s + i);
    vecBytes = nvec * 16;
  }
  // Unaligned ends (or an unaligned buffer): bytes. Correct for any pointer and size.
  for (std::uint64_t j = vecBytes + static_cast<std::uint64_t>(tid); j < bytes;
       j += static_cast<std::uint64_t>(nthreads)) {
    dst[j] = loadByte<kLoad>(src + j);
  }
}

// Row of byte `off` for rows of rowBytes bytes (32-bit division when both fit).
__device__ __forceinline__ std::uint64_t rowOf(std::uint64_t off, std::uint64_t rowBytes) {
  if ((off | rowBytes) <= 0xffffffffull) {
    return static_cast<std::uint32_t>(off) / static_cast<std::uint32_t>(rowBytes);
  }
  return off / rowBytes;
}

// Element-wise reduction of a received buffer `a` (staging written by a peer: ld.global.cg) with
// this rank's `b`, for fp32 (T = float) or bf16 (T = __nv_bfloat16), in fp32, rounded once:
//   kWeighted = false:  dst = a + b
//   kWeighted = true:   dst = b + weights[row] * a (one fma), row = (base + byte offset) / rowBytes
// Byte counts are whole elements; 16-byte vectors when all three pointers allow it (weighted
// reductions need rowBytes % 16 == 0, which the host checks, so a vector never spans two rows).
template <class T, bool kWeighted>
__device__ __forceinline__ void reduceElems(void* dstPtr, const void* aPtr, const void* bPtr,
                                            std::uint64_t bytes, int tid, int nthreads,
                                            const float* weights = nullptr,
                                            std::uint64_t rowBytes = 1, std::uint64_t base = 0) {
  const std::uint64_t n = bytes / sizeof(T);
  auto* dst = static_cast<T*>(dstPtr);
  const auto* a = static_cast<const T*>(aPtr);
  const auto* b = static_cast<const T*>(bPtr);
  auto combine = [&](T x, T y, std::uint64_t byteOff) -> T {
    if constexpr (kWeighted) {
      const float w = weights[rowOf(base + byteOff, rowBytes)];
      return T(__fmaf_rn(w, static_cast<float>(x), static_cast<float>(y)));
    } else {
      return T(static_cast<float>(x) + static_cast<float>(y));
    }
  };
  std::uint64_t done = 0;
  if (((reinterpret_cast<std::uintptr_t>(dst) | reinterpret_cast<std::uintptr_t>(a) |
        reinterpret_cast<std::uintptr_t>(b)) & 15u) == 0) {
    constexpr int kPer = 16 / sizeof(T);
    const std::uint64_t nvec = n / kPer;
    for (std::uint64_t i = static_cast<std::uint64_t>(tid); i < nvec;
         i += static_cast<std::uint64_t>(nthreads)) {
      const uint4 va = __ldcg(reinterpret_cast<const uint4*>(a) + i);
      const uint4 vb = reinterpret_cast<const uint4*>(b)[i];
      uint4 out;
      const T* ea = reinterpret_cast<const T*>(&va);
      const T* eb = reinterpret_cast<const T*>(&vb);
      T* eo = reinterpret_cast<T*>(&out);
      if constexpr (kWeighted) {
        const float w = weights[rowOf(base + i * 16, rowBytes)];
#pragma unroll
        for (int k = 0; k < kPer; ++k) {
          eo[k] = T(__fmaf_rn(w, static_cast<float>(ea[k]), static_cast<float>(eb[k])));
        }
      } else {
#pragma unroll
        for (int k = 0; k < kPer; ++k) eo[k] = combine(ea[k], eb[k], 0);
      }
      reinterpret_cast<uint4*>(dst)[i] = out;
    }
    done = nvec * kPer;
  }
  for (std::uint64_t i = done + static_cast<std::uint64_t>(tid); i < n;
       i += static_cast<std::uint64_t>(nthreads)) {
    T va;
    if constexpr (sizeof(T) == 4) {
      va = __ldcg(reinterpret_cast<const float*>(a) + i);
    } else {
      const unsigned short raw = __ldcg(reinterpret_cast<const unsigned short*>(a) + i);
      va = *reinterpret_cast<const T*>(&raw);
    }
    dst[i] = combine(va, b[i], i * sizeof(T));
  }
}

}  // namespace graphep
