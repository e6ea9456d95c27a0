// bf16 bit conversions for host-side test references.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace graphep::test {

inline std::uint16_t bf16Bits(float x) {
  const __nv_bfloat16_raw r = __float2bfloat16_rn(x);
  return r.x;
}

inline float bf16Value(std::uint16_t u) {
  __nv_bfloat16_raw r;
  r.x = u;
  return __bfloat162float(__nv_bfloat16(r));
}

}  // namespace graphep::test
