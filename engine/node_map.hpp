// Nodes: which ranks share a machine (reach each other by load/store) and which reach each other
// only through the network. The node-aware exchange (docs/DESIGN.md §5.10) and the emulated
// network (GRAPHEP_EMULATED_NODES: ranks of one machine split into N pretend nodes, whose traffic
// between nodes the movers count) both start from it.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/heap.hpp"

namespace graphep {

struct NodeMap {
  std::vector<int> nodeOf;  // [R]: each rank's node, numbered by their lowest rank, from 0
  int numNodes = 1;
  // Whether ranks a and b are on different nodes (their traffic crosses the network).
  bool apart(int a, int b) const { return nodeOf[static_cast<std::size_t>(a)] != nodeOf[static_cast<std::size_t>(b)]; }
  // The ranks on other nodes than `rank`, as a bit mask (R <= 32).
  std::uint32_t networkMask(int rank) const;
};

// Pure. reach[a][b]: rank a reaches rank b by load/store (reach[a][a] true). With emulatedNodes 0
// the nodes are reach's classes, refused by name unless reach is an equivalence (symmetric and
// transitive: a machine's ranks reach each other, and none beyond it). With emulatedNodes N >= 1
// the ranks split into N nodes of R / N consecutive ranks, refused unless N divides R and each
// such node lies inside one of reach's classes.
NodeMap nodeMap(const std::vector<std::vector<bool>>& reach, int emulatedNodes);

// Setup, collective over the heap's communicator: with GRAPHEP_EMULATED_NODES N > 0 on some rank
// (the largest asked), every rank's load/store reach gathered and nodeMap(reach, N); without it,
// one node of every rank (nothing checked: only the emulated network reads the map so far). The
// same map on every rank.
NodeMap nodeMapOf(const SymmetricHeap& heap);

}  // namespace graphep
