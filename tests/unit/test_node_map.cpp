// Nodes from the ranks' load/store reach, and the emulated nodes of GRAPHEP_EMULATED_NODES
// (engine/node_map.hpp): against machines built by hand, and the refusals by name.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/expect_error.hpp"
#include "engine/node_map.hpp"

namespace graphep {
namespace {

// The reach of machines holding `sizes` ranks each, in that order (rank-consecutive), or with
// `owner` the machine of each rank.
std::vector<std::vector<bool>> machinesOf(const std::vector<int>& owner) {
  const std::size_t R = owner.size();
  std::vector<std::vector<bool>> reach(R, std::vector<bool>(R));
  for (std::size_t a = 0; a < R; ++a) {
    for (std::size_t b = 0; b < R; ++b) reach[a][b] = owner[a] == owner[b];
  }
  return reach;
}

TEST(Unit_NodeMap, MachinesAreTheReachClasses) {
  // Machines interleaved over the ranks (0 2 4 | 1 3 | 5), numbered by their lowest rank.
  const NodeMap m = nodeMap(machinesOf({7, 3, 7, 3, 7, 9}), 0);
  EXPECT_EQ(m.numNodes, 3);
  EXPECT_EQ(m.nodeOf, (std::vector<int>{0, 1, 0, 1, 0, 2}));
  EXPECT_FALSE(m.apart(0, 4));
  EXPECT_TRUE(m.apart(0, 1));
  EXPECT_EQ(m.networkMask(1), 0b110101u);  // ranks 0, 2, 4, 5
  EXPECT_EQ(m.networkMask(5), 0b011111u);
  // One machine: no network.
  const NodeMap one = nodeMap(machinesOf({0, 0, 0, 0}), 0);
  EXPECT_EQ(one.numNodes, 1);
  EXPECT_EQ(one.networkMask(2), 0u);
}

TEST(Unit_NodeMap, EmulatedNodesSplitAMachineIntoConsecutiveRanks) {
  // 8 ranks of one machine as 2 and as 4 nodes; 4 ranks on 2 machines as 4 nodes.
  const NodeMap two = nodeMap(machinesOf({0, 0, 0, 0, 0, 0, 0, 0}), 2);
  EXPECT_EQ(two.numNodes, 2);
  EXPECT_EQ(two.nodeOf, (std::vector<int>{0, 0, 0, 0, 1, 1, 1, 1}));
  EXPECT_EQ(two.networkMask(0), 0xF0u);
  EXPECT_EQ(two.networkMask(6), 0x0Fu);
  const NodeMap four = nodeMap(machinesOf({0, 0, 0, 0, 0, 0, 0, 0}), 4);
  EXPECT_EQ(four.nodeOf, (std::vector<int>{0, 0, 1, 1, 2, 2, 3, 3}));
  EXPECT_EQ(four.networkMask(3), 0xF3u);
  const NodeMap split = nodeMap(machinesOf({0, 0, 1, 1}), 4);
  EXPECT_EQ(split.numNodes, 4);
  EXPECT_EQ(split.networkMask(0), 0b1110u);
  // Every rank its own machine, as many nodes: the same map.
  EXPECT_EQ(nodeMap(machinesOf({0, 1, 2}), 3).nodeOf, (std::vector<int>{0, 1, 2}));
}

TEST(Unit_NodeMap, LandingRanksKeepTheIndexInTheNode) {
  // 2 nodes of 2 (0 1 | 2 3): rank 1's records for node 1 land on rank 3, rank 2's for node 0 on 0.
  const NodeMap two = nodeMap(machinesOf({0, 0, 0, 0}), 2);
  EXPECT_EQ(two.landing(0, 1), 2);
  EXPECT_EQ(two.landing(1, 1), 3);
  EXPECT_EQ(two.landing(2, 0), 0);
  EXPECT_EQ(two.landing(3, 0), 1);
  EXPECT_EQ(two.landing(3, 1), 3);  // its own node: itself
  EXPECT_EQ(two.nodeMask(2), 0b1100u);
  EXPECT_TRUE(two.worthGrouping());
  // Nodes of unequal size, interleaved (0 2 4 | 1 3 | 5): index modulo the node's size.
  const NodeMap m = nodeMap(machinesOf({7, 3, 7, 3, 7, 9}), 0);
  EXPECT_EQ(m.landing(4, 1), 1);  // rank 4 is index 2 of node 0; node 1 has 2 ranks: index 0
  EXPECT_EQ(m.landing(2, 1), 3);
  EXPECT_EQ(m.landing(3, 0), 2);
  EXPECT_EQ(m.landing(0, 2), 5);
  EXPECT_EQ(m.landing(5, 0), 0);
  EXPECT_EQ(m.nodeMask(2), 0b010101u);
  // The records exchange's peers: rank 4 sends to node 1's rank 1 (4's index 2 mod 2 = 0) and to
  // rank 5; rank 1 receives from ranks 0 and 4 of node 0 (indices 0 and 2, both 0 mod 2) and from
  // rank 5 (node 2's index 0); every pair agrees.
  EXPECT_EQ(m.landingPeers(4).send, 0b110111u);
  EXPECT_EQ(m.landingPeers(1).recv, 0b111011u);
  for (int a = 0; a < 6; ++a) {
    for (int b = 0; b < 6; ++b) {
      EXPECT_EQ((m.landingPeers(a).send >> b) & 1u, (m.landingPeers(b).recv >> a) & 1u) << a << " -> " << b;
    }
  }
  EXPECT_EQ(two.landingPeers(1).send, 0b1011u);  // its node (0, 1) and rank 3
  EXPECT_EQ(two.landingPeers(1).recv, 0b1011u);
  // One rank per node, or one node: nothing to group.
  EXPECT_FALSE(nodeMap(machinesOf({0, 1, 2}), 0).worthGrouping());
  EXPECT_FALSE(nodeMap(machinesOf({0, 0, 0}), 0).worthGrouping());
  test::expectError([&] { (void)two.landing(0, 3); }, Status::kInvalidArgument, "no landing rank for rank 0 on node 3");
  test::expectError([&] { (void)two.landing(7, 0); }, Status::kInvalidArgument, "no landing rank for rank 7 on node 0");
}

TEST(Unit_NodeMap, NodeAwareOnEmulatedNodesOrWhenAsked) {
  NodeMap real = nodeMap(machinesOf({0, 0, 1, 1}), 0);  // 2 machines of 2
  EXPECT_FALSE(real.nodeAware()) << "real machines: off until asked (GRAPHEP_NODE_AWARE=on)";
  real.groupAsked = true;
  EXPECT_TRUE(real.nodeAware());
  real.flatAsked = true;  // off on some rank wins
  EXPECT_FALSE(real.nodeAware());
  NodeMap emulated = nodeMap(machinesOf({0, 0, 0, 0}), 2);
  emulated.emulated = true;
  EXPECT_TRUE(emulated.nodeAware());
  NodeMap singles = nodeMap(machinesOf({0, 1, 2, 3}), 0);  // a rank per node: nothing to group
  singles.groupAsked = true;
  EXPECT_FALSE(singles.nodeAware());
}

// What Engine::memoryRequirements assumes before any communicator: emulated nodes group where
// each holds several ranks, unless off; without them only "on" groups (real machines unknown).
TEST(Unit_NodeMap, NodeAwareExpectedFromTheSettings) {
  EXPECT_TRUE(nodeAwareExpected(4, 2, "auto"));
  EXPECT_TRUE(nodeAwareExpected(8, 4, "on"));
  EXPECT_FALSE(nodeAwareExpected(4, 2, "off"));
  EXPECT_FALSE(nodeAwareExpected(4, 4, "auto")) << "a rank per node: nothing to group";
  EXPECT_FALSE(nodeAwareExpected(4, 1, "auto")) << "one node";
  EXPECT_FALSE(nodeAwareExpected(6, 4, "auto")) << "4 does not divide 6 (createAll refuses it)";
  EXPECT_FALSE(nodeAwareExpected(4, 0, "auto")) << "real machines: off until asked";
  EXPECT_TRUE(nodeAwareExpected(4, 0, "on"));
  EXPECT_FALSE(nodeAwareExpected(1, 0, "on"));
  // Agrees with the map createAll builds wherever the nodes are known (emulated).
  for (int R : {2, 4, 6, 8, 12}) {
    for (int n = 1; n <= R; ++n) {
      if (R % n != 0) continue;
      std::vector<int> oneMachine(static_cast<std::size_t>(R), 0);
      for (const char* asked : {"auto", "on", "off"}) {
        NodeMap m = nodeMap(machinesOf(oneMachine), n);
        m.emulated = true;
        m.groupAsked = std::string(asked) == "on";
        m.flatAsked = std::string(asked) == "off";
        EXPECT_EQ(nodeAwareExpected(R, n, asked), m.nodeAware()) << R << " ranks as " << n << " nodes, " << asked;
      }
    }
  }
}

TEST(Unit_NodeMap, RefusalsNameTheRanks) {
  using test::expectError;
  // An emulated node across two machines; a count that does not divide the ranks.
  EXPECT_EQ(nodeMap(machinesOf({0, 0, 0, 1, 1, 1}), 2).nodeOf, (std::vector<int>{0, 0, 0, 1, 1, 1}));
  expectError([] { nodeMap(machinesOf({0, 0, 0, 1, 1, 1}), 3); }, Status::kInvalidArgument,
              "puts ranks 2 and 3 in one node, but rank 2 does not reach rank 3");
  expectError([] { nodeMap(machinesOf({0, 0, 0, 0, 0, 0}), 4); }, Status::kInvalidArgument,
              "GRAPHEP_EMULATED_NODES=4 does not divide the 6 ranks");
  // Asymmetric and non-transitive reach: not machines.
  std::vector<std::vector<bool>> reach = machinesOf({0, 0, 1});
  reach[2][1] = true;
  expectError([&] { nodeMap(reach, 0); }, Status::kNotSupported,
              "rank 2 reaches rank 1 by load/store but not the other way");
  reach[1][2] = true;  // 0-1 and 1-2, not 0-2
  expectError([&] { nodeMap(reach, 0); }, Status::kNotSupported, "not transitive");
  reach = machinesOf({0, 0});
  reach[1][1] = false;
  expectError([&] { nodeMap(reach, 0); }, Status::kInvalidArgument, "rank 1's reach leaves out rank 1 itself");
  expectError([] { nodeMap(machinesOf({0, 0}), -1); }, Status::kInvalidArgument, "emulatedNodes=-1 is negative");
  expectError([] { nodeMap({}, 0); }, Status::kInvalidArgument, "0 ranks");
}

}  // namespace
}  // namespace graphep
