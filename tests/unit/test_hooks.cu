// The hook arithmetic on the host (hooks.cuh's __host__ __device__ functions are the ones the
// kernels run): the fp8 scale rule, saturation, rounding and the dequantisation round trip.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>

#include "kernels/common/hooks.cuh"

namespace graphep {
namespace {

TEST(Unit_Hooks, Fp8ScaleMapsAmaxToTheLargestFinite) {
  EXPECT_EQ(ProduceFp8E4m3::fp8Scale(0.f), 1.f);  // an all-zero tile keeps scale 1
  EXPECT_EQ(ProduceFp8E4m3::fp8Scale(448.f), 1.f);
  EXPECT_EQ(ProduceFp8E4m3::fp8Scale(896.f), 2.f);
  // amax / scale is e4m3's largest finite value, 448 = 0x7e.
  for (float amax : {1e-6f, 0.37f, 1.f, 3.5f, 1000.f, 65504.f}) {
    const float scale = ProduceFp8E4m3::fp8Scale(amax);
    EXPECT_EQ(ProduceFp8E4m3::fp8E4m3(amax * (1.f / scale)), 0x7e) << "amax=" << amax;
  }
}

TEST(Unit_Hooks, Fp8SaturatesAndRoundsToNearest) {
  EXPECT_EQ(ProduceFp8E4m3::fp8E4m3(1e9f), 0x7e);   // saturating, never NaN (0x7f)
  EXPECT_EQ(ProduceFp8E4m3::fp8E4m3(-1e9f), 0xfe);
  EXPECT_EQ(ProduceFp8E4m3::fp8E4m3(0.f), 0x00);
  EXPECT_EQ(ProduceFp8E4m3::fp8E4m3(1.f), 0x38);    // exponent bias 7, mantissa 0
  EXPECT_EQ(ProduceFp8E4m3::fp8E4m3(1.0625f), 0x38);  // halfway between 1 and 1.125: to even
  EXPECT_EQ(ProduceFp8E4m3::fp8E4m3(1.0626f), 0x39);
}

// Quantise-dequantise of one tile: every value within half an e4m3 step of the original (relative
// 2^-4 for normal values; absolute for the subnormal range, scaled), the amax exact.
TEST(Unit_Hooks, Fp8RoundTripErrorIsBounded) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (int tile = 0; tile < 200; ++tile) {
    const float mag = std::ldexp(1.f, tile % 17 - 8);
    float v[128], amax = 0.f;
    for (float& x : v) {
      x = __bfloat162float(__float2bfloat16_rn(u(rng) * mag));
      amax = std::fmax(amax, std::fabs(x));
    }
    const float scale = ProduceFp8E4m3::fp8Scale(amax);
    for (float x : v) {
      const unsigned char q = ProduceFp8E4m3::fp8E4m3(x * (1.f / scale));
      const float back = __bfloat162float(ConsumeFp8ToBf16::dequant(q, scale));
      const float bound = std::fmax(std::fabs(x) * 0.0625f, scale * std::ldexp(1.f, -10)) +
                          std::fabs(x) * 0.0079f;  // e4m3 half-step + the bf16 rounding of back
      EXPECT_LE(std::fabs(back - x), bound) << "tile " << tile << " x=" << x << " back=" << back;
      if (std::fabs(x) == amax && amax > 0.f) {
        EXPECT_NEAR(std::fabs(back), amax, amax * 0.0079f) << "tile " << tile;
      }
    }
  }
}

}  // namespace
}  // namespace graphep
