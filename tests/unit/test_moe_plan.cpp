// The MoE engine's plan (engine/moe/plan.hpp) against the sizes its documentation gives, on the CPU:
// every region of a rank's local allocation and of the heap's user region in order, 256-aligned,
// each at least as large as what the kernels write there, the whole inside the allocation; and
// Engine::memoryRequirements equal to what createAll allocates.
#include <gtest/gtest.h>

#include <graphep/moe.hpp>

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "engine/moe/plan.hpp"
#include "kernels/moe/moe.h"

namespace graphep {
namespace {

using moe_setup::LocalCarve;
using moe_setup::PathHeap;

struct PlanCase {
  std::string name;
  MoeConfig cfg;
  int R;
};

std::vector<PlanCase> planCases() {
  std::vector<PlanCase> out;
  for (ReceiveLayout layout : {ReceiveLayout::kExpertMajor, ReceiveLayout::kBatched, ReceiveLayout::kRankMajor}) {
    for (DType type : {DType::kBf16, DType::kFp8E4m3}) {
      for (int tokens : {128, 4096}) {  // the latency path's size and the throughput path's
        MoeConfig c;
        c.maxTokensPerRank = tokens;
        c.hidden = 7168;
        c.numExperts = 256;
        c.topK = 8;
        c.dispatchType = type;
        c.receiveLayout = layout;
        if (layout == ReceiveLayout::kBatched && tokens > 256) c.rowsPerExpert = 512;
        c.profile = tokens == 128;
        c.shrinkOnTimeout = tokens == 128 && type == DType::kBf16;  // latency only: its words
        out.push_back({"layout" + std::to_string(static_cast<int>(layout)) + "_type" +
                           std::to_string(static_cast<int>(type)) + "_T" + std::to_string(tokens),
                       c, 8});
      }
    }
  }
  return out;
}

// Regions given as (offset, bytes the kernels need there), in carve order: each starts 256-aligned
// at or after the previous one's end, and the last ends inside `total`.
void expectLaidOut(const std::vector<std::pair<std::size_t, std::size_t>>& regions, std::size_t total,
                   const std::string& where) {
  std::size_t end = 0;
  for (std::size_t i = 0; i < regions.size(); ++i) {
    const auto [off, bytes] = regions[i];
    EXPECT_EQ(off % 256, 0u) << where << ", region " << i;
    EXPECT_GE(off, end) << where << ", region " << i << " overlaps the one before";
    end = off + bytes;
  }
  EXPECT_LE(end, total) << where << ": the regions pass the end";
}

TEST(Unit_MoePlan, LocalRegionsHoldWhatTheKernelsWrite) {
  for (const PlanCase& pc : planCases()) {
    for (const bool aware : {false, true}) {  // flat, and node-aware (docs/DESIGN.md §5.10)
      const MoeConfig& c = pc.cfg;
      const int R = pc.R;
      const moe_setup::MoeSizes z = moe_setup::moeSizes(c, R, aware);
      const bool throughput = moe_setup::preferredPath(c, R) == MoePath::kThroughput;
      const bool node = throughput && aware;
      const std::size_t cap = static_cast<std::size_t>(Engine::receiveCapacity(c, R));
      const LocalCarve o = moe_setup::carveLocal(c, z, cap, throughput);
      const std::size_t T = static_cast<std::size_t>(c.maxTokensPerRank), Rs = static_cast<std::size_t>(R);
      const std::size_t H = static_cast<std::size_t>(c.hidden), L = static_cast<std::size_t>(c.numExperts / R);
      const std::size_t K = static_cast<std::size_t>(c.topK);
      const bool fp8 = c.dispatchType == DType::kFp8E4m3, rankMajor = c.receiveLayout == ReceiveLayout::kRankMajor;
      const std::size_t stamps = (kMoeStampWords * static_cast<std::size_t>(MoeKernel::kCount) + kMoeTraceWords) * 8;
      // In carve order, with the bytes each region must hold (docs/DESIGN.md §5.1, kernels/moe/moe.h).
      const std::vector<std::pair<std::size_t, std::size_t>> regions = {
          {o.status, sizeof(MoeDeviceStatus)},
          {o.live, 4},
          {o.pending, 4},
          {o.tokRank, T * Rs * 4},
          {o.entry, throughput ? T * K * 4 : 0},
          {o.expertCount, throughput ? static_cast<std::size_t>(c.numExperts) * 4 : 0},
          {o.rankCount, throughput ? Rs * 4 : 0},
          {o.routeBits, throughput ? o.routeZero : 0},
          {o.routePrefix, throughput ? (static_cast<std::size_t>(c.numExperts) + 2 * Rs) * o.routeWords * 4 : 0},  // experts, ranks, nodes
          {o.recSend, throughput ? Rs * T * z.recBytes : 0},
          {o.cntSend, throughput ? Rs * z.cntMsgBytes : 0},
          {o.cntRecv, throughput ? Rs * z.cntMsgBytes : 0},
          {o.arrays, throughput ? 12 * Rs * 8 : 0},
          {o.recvRows, Rs * 4},
          {o.srcBase, Rs * L * 4},
          {o.offsets, (L + 1) * 4},
          {o.counts, L * 4},
          {o.dropped, L * 4},
          {o.numRows, 4},
          {o.totals, L * 8},
          {o.recvX, cap * (fp8 ? H : 2 * H)},
          {o.scales, cap * (H / 128) * 4},  // a bf16 engine keeps fp8 scales too
          {o.rowRank, cap * 4},
          {o.rowToken, cap * 4},
          {o.rowSlot, cap * 4},
          {o.rowWeight, cap * 4},
          {o.y, cap * 2 * H},
          {o.combSend, throughput ? Rs * T * 2 * H : 0},
          {o.combValSend, throughput ? Rs * T * kMoeMaxValues * 4 : 0},
          {o.rankOffsets, rankMajor ? (Rs + 1) * 4 : 0},
          {o.rowExperts, rankMajor ? cap * K * 4 : 0},
          {o.rowExpertWeights, rankMajor ? cap * K * 4 : 0},
          {o.sourceRanges, rankMajor ? 0 : L * Rs * 8},
          {o.llSteps, 8},
          {o.llDone, 4 * 4},  // the last-CTA counters, then the latency dispatch receive's item claims (one per parity)
          {o.llMask, 3 * 4},         // the active-rank mask, the last dispatch's, a latency send half's
          {o.llExpected, 2 * Rs * 4},  // latency: the partial arrivals expected; direct: the steps each pair shared
          {o.llShrink, !throughput && c.shrinkOnTimeout ? 2 * 4 * 4 : 0},  // shrink on timeout: [2 operations][4 words]
          {o.llZeroMsg, std::max(z.cntMsgBytes, z.directMsgBytes)},  // the direct path's zero count message, sized as either path's
          {o.llBarrier, Rs * 4},  // the device barrier's pair counts
          {o.nodeTokens, node ? Rs * T * 4 : 0},  // hop lists, at most one per rank
          {o.nodeRecords, node ? Rs * 4 : 0},
          {o.tokenNodeIndex, node ? T * Rs * 4 : 0},
          {o.nodeSeen, node ? kMoeNodeSignals * Rs * 4 : 0},
          {o.combArrive, throughput ? Rs * o.routeWords * 4 : 0},
          {o.combReady, throughput ? Rs * o.routeWords * 4 : 0},
          {o.timeline, c.profile ? stamps : 0},
      };
      expectLaidOut(regions, o.bytes, pc.name + (aware ? " node-aware" : ""));
      EXPECT_EQ(o.routeZero, ((static_cast<std::size_t>(c.numExperts) + 2 * Rs) * o.routeWords +
                              static_cast<std::size_t>(c.numExperts) * o.routeWords + 1) * 4) << pc.name;
      if (!aware) {  // memoryRequirements sizes the flat engine
        EXPECT_EQ(Engine::memoryRequirements(c, R).privateBytes, o.bytes) << pc.name;
      }
      if (aware) {  // room for the hop record's [R] indices and the count message's hop word
        EXPECT_GE(z.recBytes, z.payloadBytes + moeMetaBytes(c.topK) + Rs * 4) << pc.name;
        EXPECT_GE(z.cntMsgBytes, (2 + L) * 8) << pc.name;
      }
    }
  }
}

TEST(Unit_MoePlan, HeapRegionsHoldWhatThePeersWrite) {
  for (const PlanCase& pc : planCases()) {
    const MoeConfig& c = pc.cfg;
    const int R = pc.R;
    const moe_setup::MoeSizes z = moe_setup::moeSizes(c, R);
    const std::size_t T = z.T, Rs = z.R, K = static_cast<std::size_t>(c.topK);
    for (MoePath path : {MoePath::kLatency, MoePath::kThroughput}) {
      if (path == MoePath::kLatency && !moe_setup::latencyFits(c, R)) continue;
      const PathHeap h = moe_setup::pathHeap(path, z, c);
      const std::string where = pc.name + " " + name(path);
      if (path == MoePath::kLatency) {
        expectLaidOut({{h.llRec, 2 * Rs * T * z.llRecBytes},
                       {h.llCnt, 2 * Rs * z.cntMsgBytes},
                       // partials as 128-byte lines: 5 lines (640 bytes) a 256 values
                       {h.llComb, 2 * Rs * T * ((static_cast<std::size_t>(c.hidden) + 255) / 256 * 640)},
                       {h.llFlag, Rs * 4},
                       {h.llCombArrive, Rs * 4},
                       {h.llCombW, 2 * Rs * T * K * 8},
                       {h.llPlaced, 2 * Rs * kMoeMaxPlacedCtas * 8},
                       {h.llBarrier, Rs * 4}},
                      h.heap.userBytes, where);
        EXPECT_EQ(h.heap.moverSlotBytes, 0u) << where << ": the latency path has no movers' staging";
      } else {
        const std::size_t W = static_cast<std::size_t>(moeRouteWords(static_cast<int>(T)));
        // Flat, then node-aware: the forwarded records, the node's partials and the four signals'
        // counters too, before the barrier's counts.
        const moe_setup::MoeSizes za = moe_setup::moeSizes(c, R, true);
        for (const bool aware : {false, true}) {
          const moe_setup::MoeSizes& s = aware ? za : z;
          const PathHeap a = moe_setup::pathHeap(path, s, c);
          std::vector<std::pair<std::size_t, std::size_t>> regions = {{a.recRecv, Rs * T * s.recBytes},
                                                                      {a.combRecv, Rs * T * s.rowBytes},
                                                                      {a.llCnt, 2 * Rs * s.directMsgBytes},
                                                                      {a.llFlag, Rs * 4},
                                                                      {a.llBlock, Rs * W * 4},
                                                                      {a.llCombBlock, Rs * W * 4},
                                                                      {a.llDispAck, Rs * 4},
                                                                      {a.llCombAck, Rs * 4},
                                                                      {a.llCombVal, Rs * T * kMoeMaxValues * 4}};
          if (aware) {
            regions.insert(regions.end(), {{a.fwdRecv, Rs * T * s.recBytes},
                                           {a.nodePartial, Rs * T * s.rowBytes},
                                           {a.nodeReady, Rs * 4},
                                           {a.nodeForwarded, Rs * 4},
                                           {a.nodeReduced, Rs * 4},
                                           {a.nodeSummed, Rs * 4}});
          } else {
            EXPECT_EQ(a.fwdRecv + a.nodePartial + a.nodeSummed, 0u) << where << ": no node-aware regions when flat";
          }
          regions.push_back({a.llBarrier, Rs * 4});
          expectLaidOut(regions, a.heap.userBytes, where + (aware ? " node-aware" : ""));
        }
        EXPECT_GT(h.heap.moverSlotBytes, 0u) << where;
      }
      EXPECT_EQ(h.heap.numRanks, R) << where;
      EXPECT_EQ(h.heap.userBytes % 4096, 0u) << where;
    }
  }
}

}  // namespace
}  // namespace graphep
