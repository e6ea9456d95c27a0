#include "engine/node_map.hpp"

#include <algorithm>
#include <string>
#include <vector>

#include "engine/env.hpp"
#include "engine/error.hpp"
#include "engine/topology.hpp"

namespace graphep {

std::uint32_t NodeMap::networkMask(int rank) const {
  std::uint32_t mask = 0;
  for (std::size_t q = 0; q < nodeOf.size(); ++q) {
    if (apart(rank, static_cast<int>(q))) mask |= 1u << q;
  }
  return mask;
}

int NodeMap::landing(int rank, int node) const {
  const int R = static_cast<int>(nodeOf.size());
  GRAPHEP_REQUIRE(rank >= 0 && rank < R && node >= 0 && node < numNodes, Status::kInvalidArgument,
                  "nodes: no landing rank for rank %d on node %d (%d ranks, %d nodes)", rank, node, R, numNodes);
  int index = 0, size = 0;  // rank's index in its own node; the size of `node`
  for (int q = 0; q < R; ++q) {
    if (q < rank && !apart(q, rank)) ++index;
    if (nodeOf[static_cast<std::size_t>(q)] == node) ++size;
  }
  if (nodeOf[static_cast<std::size_t>(rank)] == node) return rank;
  for (int q = 0, i = 0; q < R; ++q) {
    if (nodeOf[static_cast<std::size_t>(q)] != node) continue;
    if (i++ == index % size) return q;
  }
  return -1;  // not reached: `node` has `size` ranks
}

NodeMap::Peers NodeMap::landingPeers(int rank) const {
  Peers p{nodeMask(rank), nodeMask(rank)};
  for (int q = 0; q < static_cast<int>(nodeOf.size()); ++q) {
    if (!apart(rank, q)) continue;
    if (landing(rank, nodeOf[static_cast<std::size_t>(q)]) == q) p.send |= 1u << q;
    if (landing(q, nodeOf[static_cast<std::size_t>(rank)]) == rank) p.recv |= 1u << q;
  }
  return p;
}

namespace {

// Reach's classes, refusing an asymmetric or non-transitive reach by name.
NodeMap reachClasses(const std::vector<std::vector<bool>>& reach) {
  const int R = static_cast<int>(reach.size());
  auto reaches = [&](int a, int b) { return reach[static_cast<std::size_t>(a)][static_cast<std::size_t>(b)]; };
  for (int a = 0; a < R; ++a) {
    GRAPHEP_REQUIRE(reaches(a, a), Status::kInvalidArgument, "nodes: rank %d's reach leaves out rank %d itself", a, a);
    for (int b = a + 1; b < R; ++b) {
      GRAPHEP_REQUIRE(reaches(a, b) == reaches(b, a), Status::kNotSupported,
                      "nodes: rank %d reaches rank %d by load/store but not the other way: the ranks' reach is not "
                      "symmetric, so they do not group into machines",
                      reaches(a, b) ? a : b, reaches(a, b) ? b : a);
    }
  }
  // Each node is what its lowest rank reaches; every rank must reach exactly its node.
  NodeMap m;
  m.nodeOf.assign(static_cast<std::size_t>(R), -1);
  m.numNodes = 0;
  std::vector<int> lowest;
  for (int a = 0; a < R; ++a) {
    if (m.nodeOf[static_cast<std::size_t>(a)] >= 0) continue;
    lowest.push_back(a);
    for (int b = a; b < R; ++b) {
      if (reaches(a, b) && m.nodeOf[static_cast<std::size_t>(b)] < 0) m.nodeOf[static_cast<std::size_t>(b)] = m.numNodes;
    }
    ++m.numNodes;
  }
  for (int a = 0; a < R; ++a) {
    const int first = lowest[static_cast<std::size_t>(m.nodeOf[static_cast<std::size_t>(a)])];
    for (int b = 0; b < R; ++b) {
      GRAPHEP_REQUIRE(reaches(a, b) == reaches(first, b), Status::kNotSupported,
                      "nodes: rank %d %s rank %d by load/store, but rank %d, which it reaches, %s: the ranks' "
                      "reach is not transitive, so they do not group into machines",
                      a, reaches(a, b) ? "reaches" : "does not reach", b, first, reaches(first, b) ? "does" : "does not");
    }
  }
  return m;
}

// Whether reach is an equivalence (reflexive, symmetric, transitive): the ranks group into
// machines. reachClasses refuses the others by name; setup asks first, so as to stay flat quietly.
bool groupsIntoMachines(const std::vector<std::vector<bool>>& reach) {
  const std::size_t R = reach.size();
  for (std::size_t a = 0; a < R; ++a) {
    if (!reach[a][a]) return false;
    for (std::size_t b = 0; b < R; ++b) {
      if (reach[a][b] != reach[b][a]) return false;
      for (std::size_t c = 0; c < R; ++c) {
        if (reach[a][b] && reach[b][c] && !reach[a][c]) return false;
      }
    }
  }
  return true;
}

}  // namespace

NodeMap nodeMap(const std::vector<std::vector<bool>>& reach, int emulatedNodes) {
  const int R = static_cast<int>(reach.size());
  GRAPHEP_REQUIRE(R >= 1 && R <= 32, Status::kInvalidArgument, "nodes: %d ranks (1 to 32)", R);
  for (const std::vector<bool>& row : reach) {
    GRAPHEP_REQUIRE(static_cast<int>(row.size()) == R, Status::kInvalidArgument,
                    "nodes: a reach row has %zu entries for %d ranks", row.size(), R);
  }
  GRAPHEP_REQUIRE(emulatedNodes >= 0, Status::kInvalidArgument, "nodes: emulatedNodes=%d is negative", emulatedNodes);
  const NodeMap machines = reachClasses(reach);
  if (emulatedNodes == 0) return machines;
  GRAPHEP_REQUIRE(R % emulatedNodes == 0, Status::kInvalidArgument,
                  "GRAPHEP_EMULATED_NODES=%d does not divide the %d ranks into equal nodes", emulatedNodes, R);
  const int size = R / emulatedNodes;
  NodeMap m;
  m.numNodes = emulatedNodes;
  m.nodeOf.resize(static_cast<std::size_t>(R));
  for (int r = 0; r < R; ++r) {
    m.nodeOf[static_cast<std::size_t>(r)] = r / size;
    GRAPHEP_REQUIRE(!machines.apart(r, r / size * size), Status::kInvalidArgument,
                    "GRAPHEP_EMULATED_NODES=%d puts ranks %d and %d in one node, but rank %d does not reach rank %d "
                    "by load/store (an emulated node lies inside one machine)",
                    emulatedNodes, r / size * size, r, r / size * size, r);
  }
  return m;
}

bool nodeAwareExpected(int worldSize, int emulatedNodes, const std::string& asked) {
  if (asked == "off" || worldSize < 2) return false;
  if (emulatedNodes > 0) return emulatedNodes > 1 && worldSize % emulatedNodes == 0 && worldSize / emulatedNodes > 1;
  return asked == "on";
}

NodeMap nodeMapOf(const SymmetricHeap& heap) {
  // Each local rank's row: GRAPHEP_EMULATED_NODES and GRAPHEP_NODE_AWARE as it reads them, then its
  // reach of every rank.
  const int R = heap.worldSize(), L = heap.numLocalRanks();
  const std::size_t row = static_cast<std::size_t>(R) + 2;
  const auto asked = static_cast<std::uint8_t>(env::kEmulatedNodes.get());
  const std::string grouping = env::kNodeAware.get();
  const auto flat = static_cast<std::uint8_t>(grouping == "off" ? 1 : grouping == "on" ? 2 : 0);
  std::vector<std::uint8_t> mine(static_cast<std::size_t>(L) * row, 0);
  for (int l = 0; l < L; ++l) {
    mine[static_cast<std::size_t>(l) * row] = asked;
    mine[static_cast<std::size_t>(l) * row + 1] = flat;
    for (int q = 0; q < R; ++q) {
      const PeerClass c = heap.peerClass(l, q);
      mine[static_cast<std::size_t>(l) * row + 2 + static_cast<std::size_t>(q)] = isLoadStore(c) ? 1 : 0;
    }
  }
  std::vector<std::uint8_t> all(static_cast<std::size_t>(R) * row, 0);
  heap.comm().allgather(mine.data(), all.data(), row);
  int emulated = 0;  // the largest any rank asked for, so that every rank builds the same map
  bool flatAsked = false, groupAsked = false;
  for (int a = 0; a < R; ++a) {
    emulated = std::max(emulated, static_cast<int>(all[static_cast<std::size_t>(a) * row]));
    flatAsked = flatAsked || all[static_cast<std::size_t>(a) * row + 1] == 1;
    groupAsked = groupAsked || all[static_cast<std::size_t>(a) * row + 1] == 2;
  }
  std::vector<std::vector<bool>> reach(static_cast<std::size_t>(R), std::vector<bool>(static_cast<std::size_t>(R)));
  for (int a = 0; a < R; ++a) {
    for (int b = 0; b < R; ++b) {
      reach[static_cast<std::size_t>(a)][static_cast<std::size_t>(b)] =
          all[static_cast<std::size_t>(a) * row + 2 + static_cast<std::size_t>(b)] != 0;
    }
  }
  NodeMap m;
  if (emulated > 0) {
    m = nodeMap(reach, emulated);
    m.emulated = true;
  } else if (groupsIntoMachines(reach)) {
    m = nodeMap(reach, 0);  // the machines
  } else {  // one node: the engine stays flat (the same on every rank: the reach is gathered)
    m.nodeOf.assign(static_cast<std::size_t>(R), 0);
    m.numNodes = 1;
  }
  m.flatAsked = flatAsked;
  m.groupAsked = groupAsked;
  return m;
}

}  // namespace graphep
