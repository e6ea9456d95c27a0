// Memory-ordered accesses, spelled out. Every flag, counter and semaphore access that another GPU
// or the host reads or writes goes through one of these, so the scope (.sys: visible to peer GPUs
// and the host) and the order (acquire/release/relaxed) are explicit at each use. Words only this
// GPU touches (a launch's last-CTA counter, its own arrival slot, the shrink words) may use CUDA's
// atomics after a fence, as their comments say.
#pragma once

#include <cstdint>

#include "kernels/common/counter.h"

namespace graphep::ptx {

__device__ __forceinline__ std::uint32_t ldAcquireSys(const std::uint32_t* p) {
  std::uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ std::uint32_t ldRelaxedSys(const std::uint32_t* p) {
  std::uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void stReleaseSys(std::uint32_t* p, std::uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void stRelaxedSys(std::uint32_t* p, std::uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// 8-byte relaxed accesses: single-copy atomic, so a word that carries its own tag beside its value
// is read whole (the latency path's tagged count messages).
__device__ __forceinline__ std::uint64_t ldRelaxedSys64(const std::uint64_t* p) {
  std::uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void stRelaxedSys64(std::uint64_t* p, std::uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void redReleaseSysAdd(std::uint32_t* p, std::uint32_t v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void redRelaxedSysAdd(std::uint32_t* p, std::uint32_t v) {
  asm volatile("red.relaxed.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ std::uint32_t atomAcqRelSysAdd(std::uint32_t* p, std::uint32_t v) {
  std::uint32_t old;
  asm volatile("atom.acq_rel.sys.global.add.u32 %0, [%1], %2;"
               : "=r"(old)
               : "l"(p), "r"(v)
               : "memory");
  return old;
}

__device__ __forceinline__ std::uint32_t atomAcqRelSysCas(std::uint32_t* p, std::uint32_t cmp,
                                                          std::uint32_t val) {
  std::uint32_t old;
  asm volatile("atom.acq_rel.sys.global.cas.b32 %0, [%1], %2, %3;"
               : "=r"(old)
               : "l"(p), "r"(cmp), "r"(val)
               : "memory");
  return old;
}

// 16-byte LL line accesses: volatile (= relaxed.sys on sm_70+), one transaction each, so a line's
// data and flags arrive together.
__device__ __forceinline__ uint4 ldVolatileV4(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ void stVolatileV4(uint4* p, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

// Asks for [p, p + bytes) in L2 (sm_90 bulk prefetch: no register written, no wait): a later load
// finds it there. p and bytes multiples of 16.
__device__ __forceinline__ void prefetchL2(const void* p, std::uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// Orders all prior memory accesses of this thread before all later ones, at system scope.
__device__ __forceinline__ void fenceAcqRelSys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// Global nanosecond timer (coarse ticks, but monotonic across SMs): wait bounds and the optional
// phase profile of the movers.
__device__ __forceinline__ std::uint64_t globalTimerNs() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

using graphep::counterReached;

// Programmatic dependent launch (sm_90): the grid lets the next kernel of its stream, launched
// with cudaLaunchAttributeProgrammaticStreamSerialization, start before it completes; that kernel
// waits for this one's completion and memory with gridDependencyWait().
__device__ __forceinline__ void launchDependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void gridDependencyWait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

}  // namespace graphep::ptx
