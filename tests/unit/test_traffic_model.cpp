// The byte model of expert-parallel traffic across nodes (engine/traffic_model.hpp) against an exact
// enumeration of the routing on small shapes, and its rules on DeepSeek-V3's.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/expect_error.hpp"
#include "engine/error.hpp"
#include "engine/traffic_model.hpp"

namespace graphep {
namespace {

// Every way a token can route (each group choice, each top-k set of experts in the chosen
// groups), equally likely: the exact chance that it hits rank 0's and node 0's experts.
struct Exact {
  double rankHit = 0, nodeHit = 0;
};
Exact enumerate(const TrafficModelInput& in) {
  const int S = in.numExperts / in.numGroups, perRank = in.numExperts / in.numRanks;
  const int perNode = perRank * in.ranksPerNode;
  long long ways = 0, rankHits = 0, nodeHits = 0;
  for (unsigned groups = 0; groups < (1u << in.numGroups); ++groups) {
    if (__builtin_popcount(groups) != in.groupsPerToken) continue;
    std::vector<int> pool;
    for (int g = 0; g < in.numGroups; ++g) {
      if ((groups >> g) & 1u) {
        for (int e = g * S; e < (g + 1) * S; ++e) pool.push_back(e);
      }
    }
    const int n = static_cast<int>(pool.size());
    for (unsigned pick = 0; pick < (1u << n); ++pick) {
      if (__builtin_popcount(pick) != in.topK) continue;
      bool rank = false, node = false;
      for (int i = 0; i < n; ++i) {
        if ((pick >> i) & 1u) {
          rank |= pool[static_cast<std::size_t>(i)] < perRank;
          node |= pool[static_cast<std::size_t>(i)] < perNode;
        }
      }
      ++ways;
      rankHits += rank;
      nodeHits += node;
    }
  }
  return Exact{static_cast<double>(rankHits) / ways, static_cast<double>(nodeHits) / ways};
}

TrafficModelInput small() {
  return {.numRanks = 8, .ranksPerNode = 2, .tokensPerRank = 1000, .hidden = 128, .numExperts = 16, .topK = 3,
          .numGroups = 4, .groupsPerToken = 2, .dispatchRowBytes = 100, .combineRowBytes = 200, .nicGBps = 50,
          .nvlinkGBps = 150};
}

TEST(Unit_TrafficModel, HitChancesMatchAnExactEnumeration) {
  // A rank's and a node's block inside one group (2 and 4 experts of 4), whole groups (8 of 4),
  // and plain top-k (one group).
  for (const auto& [ranks, perNode, groups, chosen, k] :
       std::vector<std::tuple<int, int, int, int, int>>{{8, 2, 4, 2, 3}, {8, 4, 4, 2, 3}, {4, 2, 4, 2, 4},
                                                        {8, 2, 1, 1, 3}, {16, 4, 4, 3, 5}, {2, 1, 4, 2, 2}}) {
    TrafficModelInput in = small();
    in.numRanks = ranks;
    in.ranksPerNode = perNode;
    in.numGroups = groups;
    in.groupsPerToken = chosen;
    in.topK = k;
    const TrafficModelResult m = trafficModel(in);
    const Exact e = enumerate(in);
    EXPECT_NEAR(m.rankHit, e.rankHit, 1e-12) << ranks << " ranks, " << groups << " groups";
    if (ranks / perNode > 1) {
      EXPECT_NEAR(m.nodeHit, e.nodeHit, 1e-12) << ranks << " ranks, " << perNode << " per node";
    }
  }
}

TEST(Unit_TrafficModel, RowsAndTimesFollowTheSchemes) {
  TrafficModelInput in = small();  // 4 nodes of 2 ranks
  const TrafficModelResult m = trafficModel(in);
  const double T = 1000, R = 8, G = 2, N = 4;
  EXPECT_DOUBLE_EQ(m.flatDispatch.nicBytes, T * (R - G) * m.rankHit * 100);
  EXPECT_DOUBLE_EQ(m.flatDispatch.nvlinkBytes, T * (G - 1) * m.rankHit * 100);
  EXPECT_DOUBLE_EQ(m.nodeAwareDispatch.nicBytes, T * (N - 1) * m.nodeHit * 100);
  // Its own node's hit ranks, and the forwards of the tokens it lands from the N - 1 other nodes.
  EXPECT_DOUBLE_EQ(m.nodeAwareDispatch.nvlinkBytes, T * (G - 1) * m.rankHit * N * 100);
  EXPECT_DOUBLE_EQ(m.nodeAwareCombine.nicBytes, 2 * m.nodeAwareDispatch.nicBytes);
  EXPECT_DOUBLE_EQ(m.flatCombine.nvlinkBytes, 2 * m.flatDispatch.nvlinkBytes);
  // A token crosses to a node once, however many of its ranks it hits.
  EXPECT_LT(m.nodeAwareDispatch.nicBytes, m.flatDispatch.nicBytes);
  // Bandwidth-bound: the busier link sets the time (bytes / (GB/s x 1e3) us).
  EXPECT_DOUBLE_EQ(m.flatDispatch.us, std::max(m.flatDispatch.nicBytes / 50e3, m.flatDispatch.nvlinkBytes / 150e3));
  EXPECT_DOUBLE_EQ(m.nodeAwareCombine.us,
                   std::max(m.nodeAwareCombine.nicBytes / 50e3, m.nodeAwareCombine.nvlinkBytes / 150e3));
}

TEST(Unit_TrafficModel, OneNodeSendsNothingOverTheNetwork) {
  TrafficModelInput in = small();
  in.ranksPerNode = 8;
  const TrafficModelResult m = trafficModel(in);
  EXPECT_EQ(m.flatDispatch.nicBytes, 0.0);
  EXPECT_EQ(m.nodeAwareCombine.nicBytes, 0.0);
  EXPECT_EQ(m.nodeHit, 0.0);
  EXPECT_DOUBLE_EQ(m.nodeAwareDispatch.nvlinkBytes, m.flatDispatch.nvlinkBytes);
}

TEST(Unit_TrafficModel, DeepSeekV3GroupLimitedRouting) {
  // 256 experts in 8 groups, 4 groups and top-8 per token, 8 GPUs per node. A token reaches at most
  // 4 groups' nodes (its own node is not among them more often than any other): at EP 16 and 32 a
  // node holds several groups, at EP 64 one (at most 4 nodes), at EP 128 half of one (at most 8).
  TrafficModelInput in = small();
  in.numExperts = 256;
  in.topK = 8;
  in.numGroups = 8;
  in.groupsPerToken = 4;
  in.ranksPerNode = 8;
  for (const auto& [R, most] : std::vector<std::pair<int, double>>{{16, 1}, {32, 3}, {64, 4}, {128, 8}}) {
    in.numRanks = R;
    const TrafficModelResult m = trafficModel(in);
    const double otherNodes = (R / 8 - 1) * m.nodeHit;
    EXPECT_GT(otherNodes, 0.0) << R;
    EXPECT_LE(otherNodes, most) << R;
    EXPECT_LT(m.nodeAwareDispatch.nicBytes, m.flatDispatch.nicBytes) << R;
  }
}

TEST(Unit_TrafficModel, BadInputIsNamed) {
  auto expectNamed = [](TrafficModelInput in, const char* needle) {
    test::expectError([&] { trafficModel(in); }, Status::kInvalidArgument, needle);
  };
  TrafficModelInput in = small();
  in.ranksPerNode = 3;
  expectNamed(in, "ranksPerNode=3 does not divide numRanks=8");
  in = small();
  in.groupsPerToken = 5;
  expectNamed(in, "groupsPerToken=5 is outside [1, numGroups=4]");
  in = small();
  in.topK = 9;
  expectNamed(in, "topK=9 is outside");
  in = small();
  in.numExperts = 24;
  in.numGroups = 8;  // 3 experts a group, 3 a rank, 6 a node: a node spans two groups
  in.ranksPerNode = 2;
  in.groupsPerToken = 2;
  in.topK = 2;
  trafficModel(in);  // 6 = 2 whole groups: fine
  in.numGroups = 4;  // 6 a group, 3 a rank, 6 a node: fine too
  trafficModel(in);
  in.numGroups = 2;  // 12 a group: a rank (3) and a node (6) inside one
  trafficModel(in);
  in.numExperts = 40;
  in.numGroups = 4;  // 10 a group, 5 a rank, 10 a node: fine; 4 nodes of 2 ranks
  trafficModel(in);
  in.ranksPerNode = 4;  // a node of 20: two whole groups
  in.numRanks = 8;
  trafficModel(in);
  in.numExperts = 48;
  in.numGroups = 16;  // 3 a group, 6 a rank: two whole groups; 24 a node
  trafficModel(in);
  in.numGroups = 12;  // 4 a group, 6 a rank: neither
  expectNamed(in, "neither lies in one group of 4 nor is made of whole groups");
}

}  // namespace
}  // namespace graphep
