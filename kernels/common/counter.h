// Wrap-safe comparison of monotonic 32-bit counters (host + device).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace graphep {

// True while (int32)(observed - target) >= 0, the same cyclic rule as CU_STREAM_WAIT_VALUE_GEQ, so
// monotonic counters may wrap past 2^32 freely as long as no two compared values are 2^31 or
// more apart.
__host__ __device__ __forceinline__ bool counterReached(std::uint32_t observed, std::uint32_t target) {
  return static_cast<std::int32_t>(observed - target) >= 0;
}

}  // namespace graphep
