// The communication CTA count for smBudget 0 (engine/sm_model.hpp): CPU tests with the rates
// measured on the GPUs this project runs on and with degenerate ones.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>
#include <limits>

#include "engine/sm_model.hpp"

namespace graphep::test {
namespace {

TEST(Unit_SmModel, CoversTheLinkWithTheMargin) {
  // 2x H200 over NV18: one CTA pushes ~19 GB/s, the link carries ~350 GB/s both ways at once:
  // 350 / 19 = 18.4 CTAs, x 1.25 = 23.03 -> 24.
  EXPECT_EQ(commCtasFor(LinkRates{19.0, 350.0}, 132), 24);
  // Exactly 20 x 1.25 = 25: no rounding up past an exact fit.
  EXPECT_EQ(commCtasFor(LinkRates{10.0, 200.0}, 132), 25);
  // A faster CTA needs fewer; a faster link more.
  EXPECT_LT(commCtasFor(LinkRates{38.0, 350.0}, 132), commCtasFor(LinkRates{19.0, 350.0}, 132));
  EXPECT_GT(commCtasFor(LinkRates{19.0, 700.0}, 132), commCtasFor(LinkRates{19.0, 350.0}, 132));
  // The margin is the caller's to change.
  EXPECT_EQ(commCtasFor(LinkRates{10.0, 200.0}, 132, 1.0, 1.0), 20);
}

TEST(Unit_SmModel, OnlyTheRemoteShareOfACtasStoresCarriesTheLink) {
  // Measured at setup on 2x H200 NV18 (run 80): one CTA pushes 42 GB/s alone, the link carries 353
  // GB/s; with 2 ranks half of a send CTA's rows stay local, so it carries 21 GB/s of the link:
  // 353 / 21 = 16.8, x 1.25 = 21.01 -> 22 (the bare one-CTA rate gave 11, and 11 CTAs ran the
  // 4096-token bf16 dispatch in 323 us against 254 us at 24).
  EXPECT_EQ(commCtasFor(LinkRates{42.0, 353.0}, 132, remoteStoreShare(2)), 22);
  EXPECT_EQ(commCtasFor(LinkRates{42.0, 353.0}, 132), 11);
  EXPECT_EQ(commCtasFor(LinkRates{10.0, 200.0}, 132, 0.5, 1.0), 40);
  // A share above 1 is 1.
  EXPECT_EQ(commCtasFor(LinkRates{10.0, 200.0}, 132, 3.0, 1.0), 20);
  // Uniform routing: of a token's destinations, all but this rank cross the link.
  EXPECT_DOUBLE_EQ(remoteStoreShare(2), 0.5);
  EXPECT_DOUBLE_EQ(remoteStoreShare(8), 0.875);
  EXPECT_DOUBLE_EQ(remoteStoreShare(1), 1.0);
  EXPECT_DOUBLE_EQ(remoteStoreShare(0), 1.0);
}

TEST(Unit_SmModel, StaysWithinOneAndTheCap) {
  EXPECT_EQ(commCtasFor(LinkRates{19.0, 350.0}, 16), 16);    // capped by the SMs there are
  EXPECT_EQ(commCtasFor(LinkRates{500.0, 10.0}, 132), 1);    // a link one CTA fills
  EXPECT_EQ(commCtasFor(LinkRates{19.0, 350.0}, 0), 1);      // a cap below 1 still leaves one CTA
}

TEST(Unit_SmModel, UnknownRatesKeepTheCap) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (const LinkRates r : {LinkRates{0.0, 350.0}, LinkRates{19.0, 0.0}, LinkRates{-1.0, 350.0},
                            LinkRates{nan, 350.0}, LinkRates{19.0, nan},
                            LinkRates{19.0, std::numeric_limits<double>::infinity()}}) {
    EXPECT_EQ(commCtasFor(r, 132), 132) << r.perCtaGBps << " " << r.linkGBps;
  }
  EXPECT_EQ(commCtasFor(LinkRates{19.0, 350.0}, 132, 1.0, 0.0), 132);  // a margin of 0 is no rule
  EXPECT_EQ(commCtasFor(LinkRates{19.0, 350.0}, 132, 0.0), 132);       // nor a share of 0
  EXPECT_EQ(commCtasFor(LinkRates{19.0, 350.0}, 132, nan), 132);
}

// The direct epilogues' cluster size: the preferred size when it fits, else halved until it does.
TEST(Unit_ClusterSize, PreferredWhenItFits) {
  EXPECT_EQ(clusterSizeFor(4, 108, [](int) { return true; }), 4);
  EXPECT_EQ(clusterSizeFor(1, 108, [](int) { return true; }), 1);
}

TEST(Unit_ClusterSize, FallsBackByHalvesDownToOne) {
  std::vector<int> asked;
  const auto upTo2 = [&](int s) { asked.push_back(s); return s <= 2; };
  EXPECT_EQ(clusterSizeFor(16, 108, upTo2), 2);
  EXPECT_EQ(asked, (std::vector<int>{16, 8, 4, 2}));  // each size tried once, largest first
  asked.clear();
  EXPECT_EQ(clusterSizeFor(8, 108, [&](int s) { asked.push_back(s); return false; }), 1);
  EXPECT_EQ(asked, (std::vector<int>{8, 4, 2}));  // 1 is a plain launch: never asked
}

TEST(Unit_ClusterSize, PowerOfTwoWithinTheGrid) {
  const auto all = [](int) { return true; };
  EXPECT_EQ(clusterSizeFor(6, 108, all), 4);   // not a power of two: the one below
  EXPECT_EQ(clusterSizeFor(8, 3, all), 2);     // no larger than the grid
  EXPECT_EQ(clusterSizeFor(0, 108, all), 1);   // nothing preferred: a plain launch
  EXPECT_EQ(clusterSizeFor(-4, 108, all), 1);
}

}  // namespace
}  // namespace graphep::test
