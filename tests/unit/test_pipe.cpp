// CPU unit tests of the host+device pipe helpers: both ends of a transfer derive the same
// channel split, so it must cover every byte exactly once with 16-byte aligned boundaries.
#include <gtest/gtest.h>

#include <cstdint>

#include "engine/movers.hpp"
#include "kernels/common/pipe.h"

namespace graphep {
namespace {

// The channels per link keep every waiting mover CTA of the ranks sharing a GPU resident at once.
TEST(Unit_Pipe, MoverLinkChannelsFitEveryWaitingCtaOfAGpu) {
  // One rank per GPU, one NVLink peer: the heap's 32 channels fit (2 x 132 resident CTAs).
  EXPECT_EQ(moverLinkChannels(264, 1, 1, 0, 32), 32);
  // 4 ranks on each of 2 GPUs: per rank 4 NVLink peers at c and 3 same-GPU peers at min(c, 4):
  // 4 x (4c + 12) <= 264 gives c = 13 (14 would need 272).
  EXPECT_EQ(moverLinkChannels(264, 4, 4, 3, 32), 13);
  EXPECT_EQ(moverLinkChannels(272, 4, 4, 3, 32), 14);
  // 8 ranks on one GPU: only same-GPU peers, each at min(c, 4): 8 x 28 = 224 fits from c = 4 up,
  // and a sendRecv's 8 x c must fit too.
  EXPECT_EQ(moverLinkChannels(264, 8, 0, 7, 32), 32);
  EXPECT_EQ(moverLinkChannels(240, 8, 0, 7, 64), 30);
  // Nothing fits: not even one channel per link.
  EXPECT_EQ(moverLinkChannels(20, 4, 4, 3, 32), 0);
  // Never above the heap's channels.
  EXPECT_EQ(moverLinkChannels(1 << 20, 1, 7, 0, 32), 32);
}

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

TEST(Unit_Pipe, LLChannelChoice) {
  constexpr std::uint64_t kLL = 16384;
  constexpr std::uint32_t kBlocks = 16;
  EXPECT_EQ(llChannelsFor(1024, 0, 0, kBlocks), 0u);        // LL disabled
  EXPECT_EQ(llChannelsFor(0, 0, kLL, kBlocks), 1u);         // empty transfers still take a step
  EXPECT_EQ(llChannelsFor(1024, 0, kLL, kBlocks), 1u);
  EXPECT_EQ(llChannelsFor(4096, 0, kLL, kBlocks), 2u);      // ~2 KiB per channel
  EXPECT_EQ(llChannelsFor(8192, 0, kLL, kBlocks), 4u);
  EXPECT_EQ(llChannelsFor(65536, 0, kLL, kBlocks), 16u);    // capped by the channels
  EXPECT_EQ(llChannelsFor(16 * kLL, 0, kLL, kBlocks), 16u); // full capacity
  EXPECT_EQ(llChannelsFor(16 * kLL + 1, 0, kLL, kBlocks), 0u);
  EXPECT_EQ(llChannelsFor(16384, 4, kLL, kBlocks), 4u);     // the caller's count fits
  EXPECT_EQ(llChannelsFor(20000, 1, kLL, kBlocks), 0u);     // one channel cannot hold it
  // Whatever is chosen, every channel's range fits its halves.
  for (std::uint64_t bytes = 0; bytes <= 16 * kLL + 64; bytes += 997) {
    for (std::uint32_t asked : {0u, 1u, 3u, 16u}) {
      const std::uint32_t n = llChannelsFor(bytes, asked, kLL, kBlocks);
      if (n == 0) continue;
      EXPECT_LE(n, kBlocks);
      for (std::uint32_t c = 0; c < n; ++c) {
        std::uint64_t b, e;
        channelRange(bytes, n, c, &b, &e);
        EXPECT_LE(e - b, kLL) << "bytes=" << bytes << " channels=" << n;
      }
    }
  }
}

TEST(Unit_Pipe, AutoChannels) {
  EXPECT_EQ(autoChannels(0, 32), 1u);
  EXPECT_EQ(autoChannels(16384, 32), 1u);
  EXPECT_EQ(autoChannels(16385, 32), 2u);
  EXPECT_EQ(autoChannels(std::uint64_t{4} << 20, 32), 32u);
  EXPECT_EQ(autoChannels(std::uint64_t{4} << 20, kZeroCopyMaxChannels), 16u);
}

TEST(Unit_Pipe, LLChannels) {
  EXPECT_EQ(llChannels(0, 4096), 1u);
  EXPECT_EQ(llChannels(4096, 4096), 1u);
  EXPECT_EQ(llChannels(4097, 4096), 2u);
  EXPECT_EQ(llChannels(65536, 4096), 16u);
}

}  // namespace
}  // namespace graphep
