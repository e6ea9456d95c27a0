// CPU unit tests of the host+device pipe helpers: both ends of a transfer derive the same
// channel split, so it must cover every byte exactly once with 16-byte aligned boundaries.
#include <gtest/gtest.h>

#include <cstdint>

#include "kernels/common/pipe.h"

namespace graphep {
namespace {

TEST(Unit_Pipe, ChannelRangesPartitionEveryByteOnce) {
  for (std::uint64_t bytes : {0ull, 1ull, 3ull, 15ull, 16ull, 17ull, 4095ull, 65536ull,
                              (1ull << 20) + 5, (3ull << 20) + 13, 1ull << 30}) {
    for (std::uint32_t channels : {1u, 2u, 3u, 7u, 16u, 64u}) {
      std::uint64_t expectedBegin = 0;
      for (std::uint32_t c = 0; c < channels; ++c) {
        std::uint64_t b = 0, e = 0;
        channelRange(bytes, channels, c, &b, &e);
        ASSERT_LE(b, e);
        ASSERT_EQ(b, expectedBegin) << "bytes=" << bytes << " channels=" << channels << " c=" << c;
        if (e < bytes) {
          ASSERT_EQ(e % 16, 0u) << "inner boundaries must stay 16-byte aligned";
        }
        expectedBegin = e;
      }
      EXPECT_EQ(expectedBegin, bytes) << "bytes=" << bytes << " channels=" << channels;
    }
  }
}

TEST(Unit_Pipe, ConsumeElementSizes) {
  EXPECT_EQ(consumeElemBytes(Consume::kCopy), 1u);
  EXPECT_EQ(consumeElemBytes(Consume::kAddF32), 4u);
  EXPECT_EQ(consumeElemBytes(Consume::kAddBf16), 2u);
  EXPECT_EQ(consumeElemBytes(Consume::kWeightedAddF32), 4u);
  EXPECT_EQ(consumeElemBytes(Consume::kWeightedAddBf16), 2u);
  EXPECT_EQ(consumeElemBytes(Consume::kFp8ToBf16), 1u);  // tiled: whole 256-byte tiles
}

TEST(Unit_Pipe, LLChannels) {
  EXPECT_EQ(llChannels(0, 4096), 1u);
  EXPECT_EQ(llChannels(4096, 4096), 1u);
  EXPECT_EQ(llChannels(4097, 4096), 2u);
  EXPECT_EQ(llChannels(65536, 4096), 16u);
}

}  // namespace
}  // namespace graphep
