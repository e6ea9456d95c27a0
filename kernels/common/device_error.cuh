// Device-side error reporting and the device assert.
#pragma once

#include <cstdint>
#include <cstdio>

#include "kernels/common/device_error.h"
#include "kernels/common/ptx.cuh"

namespace graphep {

// True once a wait of this rank timed out (or the host aborted it): its other waits use it to stop
// promptly instead of each running into its own timeout.
__device__ __forceinline__ bool deviceErrorRaised(const DeviceErrorSink& sink) {
  return ptx::ldRelaxedSys(sink.words + 2) != 0;
}

// Records the first error in full and prints one line; later errors only count.
__device__ __noinline__ inline void reportDeviceError(const DeviceErrorSink& sink, DeviceErrorKind kind,
                                         std::int32_t rank, std::int32_t peer, WaitSite site,
                                         std::uint32_t expected, std::uint32_t observed,
                                         std::uint64_t elapsedNs, const void* address) {
  DeviceErrorRecord* rec = sink.record;
  // Racing reports may store their running totals out of order: the host's count is then a
  // lower bound, exact once reports stop.
  const std::uint32_t seen = ptx::atomAcqRelSysAdd(sink.words + 1, 1u) + 1u;
  ptx::stRelaxedSys(&rec->count, seen);
  if (kind == DeviceErrorKind::kTimeout) ptx::stRelaxedSys(sink.words + 2, 1u);
  if (ptx::atomAcqRelSysCas(sink.words, 0u, 1u) != 0u) return;
  rec->kind = static_cast<std::uint32_t>(kind);
  rec->rank = rank;
  rec->peer = peer;
  rec->site = static_cast<std::uint32_t>(site);
  rec->expected = expected;
  rec->observed = observed;
  rec->elapsedNs = elapsedNs;
  rec->address = reinterpret_cast<std::uint64_t>(address);
  // Fields become visible to the host before state reads 2.
  ptx::stReleaseSys(&rec->state, 2u);
  if (kind == DeviceErrorKind::kTimeout) {
    printf("graphep: rank %d timed out after %llu ms waiting for peer %d in %s: expected >= %u, "
           "observed %u\n",
           rank, static_cast<unsigned long long>(elapsedNs / 1000000ull), peer,
           waitSiteName(static_cast<std::uint32_t>(site)), expected, observed);
  } else {
    printf("graphep: rank %d device error %u (peer %d, %s): expected %u, observed %u\n", rank,
           static_cast<unsigned>(kind), peer, waitSiteName(static_cast<std::uint32_t>(site)),
           expected, observed);
  }
}

}  // namespace graphep

// Device assert: prints the condition and file:line, then traps. Kept in release builds.
#define GRAPHEP_DEVICE_ASSERT(cond)                                                           \
  do {                                                                                        \
    if (!(cond)) {                                                                            \
      printf("graphep: device assertion '%s' failed at %s:%d (block %d, thread %d)\n", #cond, \
             __FILE__, __LINE__, static_cast<int>(blockIdx.x), static_cast<int>(threadIdx.x)); \
      __trap();                                                                               \
    }                                                                                         \
  } while (0)
