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

// dst = a + b elementwise for fp32 (T = float) or bf16 (T = __nv_bfloat16, summed in fp32 and
// rounded once). `a` is loaded with ld.global.cg (staging written by a peer). Byte counts are
// whole elements; 16-byte vectors when all three pointers allow it.
template <class T>
__device__ __forceinline__ void addElems(void* dstPtr, const void* aPtr, const void* bPtr,
                                         std::uint64_t bytes, int tid, int nthreads) {
  const std::uint64_t n = bytes / sizeof(T);
  auto* dst = static_cast<T*>(dstPtr);
  const auto* a = static_cast<const T*>(aPtr);
  const auto* b = static_cast<const T*>(bPtr);
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
#pragma unroll
      for (int k = 0; k < kPer; ++k) eo[k] = T(static_cast<float>(ea[k]) + static_cast<float>(eb[k]));
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
    dst[i] = T(static_cast<float>(va) + static_cast<float>(b[i]));
  }
}

}  // namespace graphep
