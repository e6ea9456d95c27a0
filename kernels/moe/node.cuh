// The node-aware exchange's device helpers (MoeNodeParams in kernels/moe/moe.h; docs/DESIGN.md
// §5.10), shared by the movers path's kernels (kernels/moe/movers.cu: pack, offsets, expand,
// reduce, final) and the node kernels (kernels/moe/node.cu: forward, node sum, the node peers'
// signals): which ranks are on another node, what the records exchange carries to each rank, and
// the hop records that landed on this rank.
#pragma once

#include "kernels/moe/common.cuh"

namespace graphep {

// Whether rank r is on another node than this rank's, under the node-aware dispatch.
__device__ inline bool moeOtherNode(const MoeParams& p, int r) {
  return p.node.aware != 0 && p.node.nodeOf[r] != p.node.nodeOf[p.shape.rank];
}

// A hop record's [R] forward indices (each rank's index of the token in its list from the source,
// -1 where it does not go), after its payload and its topK slots.
__device__ inline std::int32_t* moeHopForwards(const MoeParams& p, char* rec) {
  return reinterpret_cast<std::int32_t*>(rec + p.shape.payloadBytes + moeMetaBytes(p.shape.topK));
}
__device__ inline const std::int32_t* moeHopForwards(const MoeParams& p, const char* rec) {
  return reinterpret_cast<const std::int32_t*>(rec + p.shape.payloadBytes + moeMetaBytes(p.shape.topK));
}

// The records this rank's records exchange carries to rank r: its list for r, or, for a rank on
// another node (node-aware), the hop list of r's node where r is this rank's landing rank there
// (none to the node's other ranks).
__device__ inline std::uint32_t moeRecordsTo(const MoeParams& p, int r) {
  if (!moeOtherNode(p, r)) return p.routing.rankRecords[r];
  const int m = p.node.nodeOf[r];
  return p.node.landing[m] == r ? p.node.nodeRecords[m] : 0u;
}

// A count message's word of hop records (node-aware: after the per-expert counts), clamped.
__device__ inline int moeHopRecordsIn(const MoeParams& p, const std::uint64_t* msg) {
  const std::uint64_t n = msg[1 + p.shape.localExperts];
  return static_cast<int>(n < static_cast<std::uint64_t>(p.shape.maxTokens) ? n : p.shape.maxTokens);
}

// The hop records source s sent this rank to forward (none from this node's ranks).
__device__ inline int moeHopRecordsFrom(const MoeParams& p, int s) {
  const auto* msg = reinterpret_cast<const std::uint64_t*>(p.movers.countRecv + static_cast<std::uint64_t>(s) * p.shape.countMsgBytes);
  return moeOtherNode(p, s) ? moeHopRecordsIn(p, msg) : 0;
}

// The hop records that landed here, in source order (forward and node-sum take them alike): how
// many, and item m's source s, its index j in s's hop list and the record (recordRecv[s][j]).
__device__ inline int moeHopRecordsHere(const MoeParams& p) {
  int total = 0;
  for (int s = 0; s < p.shape.numRanks; ++s) total += moeHopRecordsFrom(p, s);
  return total;
}
struct MoeHopItem {
  int source, index;
  const char* record;
};
__device__ inline MoeHopItem moeHopItem(const MoeParams& p, int m) {
  int s = 0, j = m;
  for (; s < p.shape.numRanks; ++s) {
    const int n = moeHopRecordsFrom(p, s);
    if (j < n) break;
    j -= n;
  }
  return MoeHopItem{s, j, p.staging.recordRecv + (static_cast<std::uint64_t>(s) * p.shape.maxTokens + j) * p.shape.recordBytes};
}

}  // namespace graphep
