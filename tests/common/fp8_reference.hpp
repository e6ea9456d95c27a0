// The fp8 e4m3 reference of the MoE tests: e4m3 from the format's definition (not from the
// engine's conversion, so that the tests check the engine's quantiser) and the per-128-value
// quantisation of a bf16 row that the dispatch's fp8 mode documents.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/bf16.hpp"

namespace graphep::test {

// e4m3 (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities, 0x7f NaN) of x,
// rounded to nearest even and saturated to +-448: written here from the format's definition, not
// from the engine's conversion, so that the test checks the engine's quantiser.
inline unsigned char e4m3Reference(float x) {
  if (std::isnan(x)) return 0x7f;
  const unsigned char sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 448.0) return sign | 0x7e;  // saturation (448 = 1.75 x 2^8, the largest finite)
  if (a < std::ldexp(1.0, -6)) {       // subnormal: a multiple of 2^-9
    const double m = std::nearbyint(a * 512.0);  // ties to even (the default rounding mode)
    return sign | static_cast<unsigned char>(m);  // m == 8 is the smallest normal, 0x08
  }
  int e = 0;
  const double f = std::frexp(a, &e);  // a = f x 2^e, f in [0.5, 1)
  double m = std::nearbyint((f * 2.0 - 1.0) * 8.0);  // mantissa of 1.m x 2^(e-1)
  int exp = e - 1;
  if (m == 8.0) {
    m = 0;
    ++exp;
  }
  if (exp > 8 || (exp == 8 && m > 6)) return sign | 0x7e;  // rounded past 448: saturate
  return sign | static_cast<unsigned char>(((exp + 7) << 3) | static_cast<int>(m));
}

// A positive normal fp32 scale rounded up to the next power of two (itself when it is one), from
// its bits: when any mantissa bit is set, the exponent goes up by one and the mantissa is cleared
// (Fp8Scales::kPow2, DeepEP's round_scale).
inline float pow2ScaleReference(float scale) {
  std::uint32_t b = 0;
  std::memcpy(&b, &scale, sizeof b);
  if ((b & 0x7fffffu) != 0u) b = (b & 0xff800000u) + 0x800000u;
  float r = 0.f;
  std::memcpy(&r, &b, sizeof r);
  return r;
}

// The fp8 record of one bf16 row: per 128 values, scale = max(amax, 448 x 2^-126) / 448 (1 for an
// all-zero tile), with `pow2` rounded up to a power of two (pow2ScaleReference), and
// e4m3(v x (1 / scale)), in fp32, as documented for the dispatch's fp8 mode.
inline void quantizeRow(const std::uint16_t* row, int H, std::vector<unsigned char>* q, std::vector<float>* scales,
                        bool pow2 = false) {
  q->resize(static_cast<std::size_t>(H));
  scales->resize(static_cast<std::size_t>(H / 128));
  for (int tile = 0; tile < H / 128; ++tile) {
    float amax = 0;
    for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(bf16Value(row[tile * 128 + i])));
    const float floor = std::ldexp(448.f, -126);
    const float linear = amax > 0.f ? std::max(amax, floor) / 448.f : 1.f;
    const float scale = pow2 ? pow2ScaleReference(linear) : linear;
    const float inv = 1.0f / scale;
    (*scales)[static_cast<std::size_t>(tile)] = scale;
    for (int i = 0; i < 128; ++i) {
      (*q)[static_cast<std::size_t>(tile * 128 + i)] = e4m3Reference(bf16Value(row[tile * 128 + i]) * inv);
    }
  }
}

}  // namespace graphep::test
