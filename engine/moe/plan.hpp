// The MoE engine's plan and its sizing (setup only): which path a config takes, the byte sizes of
// its records and messages, where the peer-written buffers sit in the symmetric heap, how one
// rank's private buffers are carved from one allocation, and the config checks that run before
// anything is allocated. Engine::createAll and Engine::memoryRequirements both size from here:
// the one place the buffers are laid out.
#pragma once

#include <graphep/comm.hpp>
#include <graphep/moe.hpp>

#include <cstddef>

#include "engine/heap.hpp"
#include "engine/movers.hpp"
#include "kernels/moe/moe.h"

namespace graphep::moe_setup {

inline std::size_t alignUp(std::size_t v, std::size_t a) { return (v + a - 1) / a * a; }

// Engine-wide default of the movers' staging slot: large enough for 4 KiB-row records to pipeline,
// small enough that 32 channels x 4 slots x R peers stay a few hundred MiB at most.
inline constexpr std::size_t kEngineSlotBytes = std::size_t{256} << 10;

// Words of the throughput path's exchange tables (bind.cpp, EngineExchanges): the count messages'
// four [R] tables; for records and for partials, [kMoeMaxChunks][R] send and receive counts and [R]
// send and receive offsets.
inline std::size_t moeExchangeTableWords(std::size_t R) { return 4 * R + 2 * (2 * kMoeMaxChunks * R + 2 * R); }

// Whether a config fits the latency path's kernels (routing held in shared memory).
bool latencyFits(const MoeConfig& c, int R);

// Byte sizes of one config's records and messages. The node-aware dispatch (docs/DESIGN.md §5.10)
// needs room in every record for the hop record's [R] forward indices, and a word in the count
// message for the hop records.
struct MoeSizes {
  std::size_t R, T, rowBytes, payloadBytes, recBytes, cntMsgBytes, directMsgBytes;
  std::size_t llRecBytes, llMetaOff;  // the latency path's record slot and its plain metadata (moeLatencyRecordBytes)
  bool nodeAware;
};
MoeSizes moeSizes(const MoeConfig& cfg, int R, bool nodeAware = false);

// The path whose heap createAll sizes first: latency when the config fits it (peer classes may
// still send it to the throughput path).
MoePath preferredPath(const MoeConfig& cfg, int R);

// Where a path's peer-written buffers sit in the heap's user region (the same on every rank), and
// the heap that holds them: only the chosen path's buffers, and staging only for the throughput
// path's movers.
struct PathHeap {
  // Throughput: [R][T] records and partials. Latency: [2][R][T] records, [2][R] count messages,
  // [2][R][T] partials and the [R] count flags and partial arrivals (kernels/moe/moe.h, MoeParams).
  std::size_t recRecv = 0, combRecv = 0;
  std::size_t llRec = 0, llCnt = 0, llComb = 0, llFlag = 0, llCombArrive = 0, llBlock = 0;
  std::size_t llCombBlock = 0, llDispAck = 0, llCombAck = 0, llCombVal = 0, llCombW = 0;
  std::size_t llPlaced = 0;  // latency: [2][R][kMoeMaxPlacedCtas] u64, the send CTAs' starts
  std::size_t llBarrier = 0;  // the device barrier's [R] pair counts (Engine::barrier), both paths
  // The node-aware dispatch and combine (sizes.nodeAware): [R][T] forwarded records, [R][T] partials
  // of other nodes' sources' records, the [R] counters of its node peers' four signals (MoeNodeParams).
  std::size_t fwdRecv = 0, nodePartial = 0, nodeReady = 0, nodeForwarded = 0, nodeReduced = 0, nodeSummed = 0;
  HeapConfig heap;
};
PathHeap pathHeap(MoePath path, const MoeSizes& z, const MoeConfig& cfg);

// The movers' options of an engine: the largest message is the records, or partial rows (larger
// than fp8 records).
MoverOptions engineMoverOptions(const MoeSizes& z);

// One rank's local buffers: one allocation, carved in this order (byte offsets). createAll carves
// the allocation with it and memoryRequirements sizes it: the one place the buffers are laid out.
struct LocalCarve {
  std::size_t status, live, pending, tokRank;
  std::size_t entry, expertCount, rankCount, routeBits, routePrefix, recSend, cntSend, cntRecv, rankTok, arrays;
  std::size_t recvRows, srcBase, offsets, counts, dropped, numRows, totals;
  std::size_t recvX, scales, rowRank, rowToken, rowSlot, rowWeight, y, combSend, combValSend;
  std::size_t rankOffsets, rowExperts, rowExpertWeights;  // rank-major layout only
  std::size_t sourceRanges;                             // expert-major and batched only
  std::size_t llSteps, llDone, combArrive, combReady, timeline;
  std::size_t llMask, llExpected, llShrink, llDeferred, llZeroMsg;  // the active-rank mask; latency: expected arrivals, direct: steps shared; zero message
  std::size_t llBarrier;   // the device barrier's pair counts [R] (Engine::barrier)
  // The node-aware dispatch and combine: hop lists [R][T], their counts [R], each token's hop
  // index [T][R], the node peers' signals seen [4][R].
  std::size_t nodeTokens, nodeRecords, tokenNodeIndex, nodeSeen;
  std::size_t routeWords;  // moeRouteWords(maxTokensPerRank)
  std::size_t routeZero;   // bytes of the routing words zeroed per dispatch (throughput path)
  std::size_t bytes;       // the whole allocation
};
LocalCarve carveLocal(const MoeConfig& cfg, const MoeSizes& z, std::size_t cap, bool throughput);

// The batched layout's rows per local expert: MoeConfig.rowsPerExpert, or worldSize x T_max.
long long batchedRowsPerExpert(const MoeConfig& cfg, int worldSize);

// Collective: every rank must pass the same config. The fields travel in an allgather (setup only);
// a mismatch names the field, this rank's value and the first rank that differs, on every rank.
void requireSameConfig(Communicator& comm, const MoeConfig& cfg);

// Collective: every rank's local buffers (one allocation of `bytes`) fit its device's free memory,
// or every rank raises the same kOutOfMemory naming the first rank that has no room and the
// config fields that size the buffers (before anything is allocated, so no rank is left waiting).
void requireLocalBuffersFit(Communicator& comm, const SymmetricHeap& heap, const MoeConfig& cfg, std::size_t bytes,
                            long long capacity);

}  // namespace graphep::moe_setup
