// Nodes: which ranks share a machine (reach each other by load/store) and which reach each other
// only through the network. The node-aware exchange (docs/DESIGN.md §5.10) and the emulated
// network (GRAPHEP_EMULATED_NODES: ranks of one machine split into N pretend nodes, whose traffic
// between nodes the movers count) both start from it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/heap.hpp"

namespace graphep {

struct NodeMap {
  std::vector<int> nodeOf;  // [R]: each rank's node, numbered by their lowest rank, from 0
  int numNodes = 1;
  bool emulated = false;  // GRAPHEP_EMULATED_NODES made these nodes (the movers then meter the network)
  bool flatAsked = false;   // some rank set GRAPHEP_NODE_AWARE=off: the MoE engine stays flat
  bool groupAsked = false;  // some rank set GRAPHEP_NODE_AWARE=on (real machines included)
  // Whether the MoE engine's throughput path over the movers groups its exchanges by node
  // (GRAPHEP_NODE_AWARE auto: on emulated nodes only).
  bool nodeAware() const { return worthGrouping() && !flatAsked && (emulated || groupAsked); }
  // Whether ranks a and b are on different nodes (their traffic crosses the network).
  bool apart(int a, int b) const { return nodeOf[static_cast<std::size_t>(a)] != nodeOf[static_cast<std::size_t>(b)]; }
  // The ranks on other nodes than `rank`, as a bit mask (R <= 32).
  std::uint32_t networkMask(int rank) const;
  // The ranks on `rank`'s node, as a bit mask (rank included).
  std::uint32_t nodeMask(int rank) const { return ~networkMask(rank) & (nodeOf.size() >= 32 ? ~0u : (1u << nodeOf.size()) - 1u); }
  // The rank of node `node` that `rank`'s records for that node land on (the node-aware dispatch,
  // docs/DESIGN.md §5.10): the one whose index in its node is rank's index in its own, modulo the
  // node's size (nodes may differ in size); `rank` itself on its own node.
  int landing(int rank, int node) const;
  // The node-aware records exchange of `rank` (bit q): it sends to its node's ranks and to its
  // landing rank on every other node, and receives from its node's ranks and from every rank
  // whose landing rank on this node it is. The combine's partials go the other way.
  struct Peers {
    std::uint32_t send, recv;
  };
  Peers landingPeers(int rank) const;
  // Whether the node-aware dispatch can gain anything: several nodes, and some with several ranks
  // (with one rank per node every record already crosses once per (token, node)).
  bool worthGrouping() const { return numNodes > 1 && numNodes < static_cast<int>(nodeOf.size()); }
};

// Pure. reach[a][b]: rank a reaches rank b by load/store (reach[a][a] true). With emulatedNodes 0
// the nodes are reach's classes, refused by name unless reach is an equivalence (symmetric and
// transitive: a machine's ranks reach each other, and none beyond it). With emulatedNodes N >= 1
// the ranks split into N nodes of R / N consecutive ranks, refused unless N divides R and each
// such node lies inside one of reach's classes.
NodeMap nodeMap(const std::vector<std::vector<bool>>& reach, int emulatedNodes);

// Pure: whether an engine of `worldSize` ranks sends tokens once per node, as far as the settings
// tell before any communicator (Engine::memoryRequirements): with `emulatedNodes` N > 0
// (GRAPHEP_EMULATED_NODES) the nodes are known, and it does where N > 1 divides the ranks into
// nodes of several, unless `asked` (GRAPHEP_NODE_AWARE) is "off"; without emulated nodes only "on" makes
// it, across machines, which are not known here: then assumed (its heap is the larger, an upper
// bound where the ranks turn out to be one machine or one rank a machine).
bool nodeAwareExpected(int worldSize, int emulatedNodes, const std::string& asked);

// Setup, collective over the heap's communicator: every rank's load/store reach gathered, then
// with GRAPHEP_EMULATED_NODES N > 0 on some rank (the largest asked) nodeMap(reach, N), marked
// emulated; without it, the machines (reach's classes), or one node of every rank where the reach
// does not group into machines (the engine then stays flat); flatAsked / groupAsked where some
// rank set GRAPHEP_NODE_AWARE off / on. The same map on every rank.
NodeMap nodeMapOf(const SymmetricHeap& heap);

}  // namespace graphep
