// The latency path's tagged count words on the host (common.cuh's __host__ __device__ helpers are
// the ones the kernels run): a step's tag is never that of a word no one has written (0), nor that
// of the same parity's step before it, across the 32-bit wrap; the count stays in the low half.
#include <gtest/gtest.h>

#include <cstdint>

#include "kernels/moe/common.cuh"

namespace graphep {
namespace {

TEST(Unit_MoeCountWords, TagIsNeitherAnUnwrittenWordsNorTheSameParitysStepBefore) {
  for (std::uint32_t s : {0u, 1u, 2u, 0x7ffffffeu, 0x7fffffffu, 0x80000000u, 0xfffffffdu, 0xfffffffeu, 0xffffffffu}) {
    EXPECT_NE(moeCountTag(s), 0u) << "step " << s;  // the heap starts zeroed
    EXPECT_NE(moeCountTag(s), moeCountTag(s - 2u)) << "step " << s;  // the words step s - 2 left in its buffers
  }
}

TEST(Unit_MoeCountWords, ATaggedWordKeepsItsCountInTheLowHalf) {
  for (std::uint32_t s : {0u, 41u, 0xffffffffu}) {
    for (std::int64_t count : {0ll, 1234ll, 0xffffffffll}) {
      const std::uint64_t w = moeTaggedCount(s, count);
      EXPECT_EQ(static_cast<std::uint32_t>(w >> 32), moeCountTag(s)) << "step " << s;
      EXPECT_EQ(static_cast<std::uint32_t>(w), static_cast<std::uint32_t>(count)) << "step " << s;
    }
  }
}

}  // namespace
}  // namespace graphep
