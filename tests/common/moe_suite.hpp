// MoE dispatch / combine test bodies shared by every configuration (emulated ranks on one GPU, 2
// GPUs in one process, one process per GPU). Inputs are a pure function of (seed, rank), so every
// process builds the CPU reference of every rank; each rank checks its own results:
//   dispatch  recv_x rows (bf16 bit for bit; fp8 e4m3 bytes and scales against the host
//             quantisation), per-row source rank / token / top-k slot / weight, expert counts and
//             offsets (with alignment), the received row count, cumulative expert totals, and that
//             padding and unused rows keep their poison
//   combine   out[t] within 2^-7 of sum_k |w_k y_k| of an fp64 reference (bf16 partials summed in
//             fp32: two bf16 roundings), rows past the live count untouched
//   status    invalid ids, dropped rows and clamped live counts with exact counts
// Every buffer is poisoned before every run; data is fresh for every call and every replay.
#pragma once

#include <gtest/gtest.h>

#include <graphep/comm.hpp>
#include <graphep/graph.hpp>
#include <graphep/moe.hpp>

#include <ostream>
#include <string>
#include <vector>

namespace graphep::test {

enum class Routing {
  kUniform,        // K distinct experts per token, uniformly
  kSkewed,         // every token's first choice is expert 0
  kRankEmpty,      // no token picks an expert of the last rank
  kAllMasked,      // every entry is -1
  kInvalidMixed,   // uniform, with some entries -1 and some outside [-1, E)
  kDuplicates,     // uniform, but about half the tokens name one expert in two or three slots
};

struct MoeCase {
  std::string name;  // words: the test instance's name, with the path (moeCaseName)
  MoeConfig cfg;
  Routing routing = Routing::kUniform;
  IndexType indexType = IndexType::kInt32;
  // Live token counts, one dispatch + combine per entry (values above maxTokensPerRank or below 0
  // test the clamp); rank q takes entry (run + q) mod size, so ranks differ in a run. Captured
  // once and replayed when `replays` > 0 (then the counts cycle).
  std::vector<int> tokens;
  int replays = 0;
  // Active-rank masks (Engine::setActiveRanks), one per run, cycling (bits past the ranks dropped;
  // a mask left empty by that means every rank); set only when the engine is on the latency path.
  // Empty: every rank, never set.
  std::vector<std::uint32_t> masks;
};

void runMoeCase(Communicator& comm, const MoeCase& c);
// The case's name for a test instance (letters, digits and '_'): its name and its path.
std::string moeCaseName(const MoeCase& c);
// The path Engine::createAll must choose for `cfg` (kAuto: latency when the config fits its
// kernels, GRAPHEP_FORCE_TRANSPORT is not "remote" and linePeers).
MoePath expectedPath(const MoeConfig& cfg, Communicator& comm);
// Whether comm's ranks reach each other as the latency path needs (gpusTakeWholeLines).
bool linePeers(Communicator& comm);
// Whether the throughput path is expected to run its direct kernels: every peer is reached by
// load/store on the machines the tests run on (ranks sharing a GPU included) unless
// GRAPHEP_FORCE_TRANSPORT=remote, and GRAPHEP_MOE_KERNELS=movers or GRAPHEP_EMULATED_NODES keeps
// the movers.
bool expectedDirect();

// MoeGraph on one engine per rank: an expert callback graph, an expert child graph swapped in
// place and across topologies, four bucket graphs (1 / 8 / 33 / 64 live tokens), a dispatch-only +
// combine-only pair, and the engine's operations captured inside the caller's own capture in
// global, thread-local and relaxed modes; every kind once, then replays in a random interleaving
// (the same on every process), fresh inputs and a full check each time. In every receive layout,
// one after the other: `iterations` is shared among them (each at least every kind once and 6
// random replays).
void runMoeGraphSuite(Communicator& comm, MoePath path, int iterations);

// Misuse: bad pointers (null, misaligned, host memory, another engine's buffer) get named errors
// before anything is enqueued; dispatch / combine out of order is counted (never a hang) and a
// paired operation is correct after it; NaN and infinite weights propagate to their tokens only.
// In every receive layout, one after the other.
void runMoeMisuse(Communicator& comm, MoePath path);

// Faults: the last rank never launches. Every other rank's wait expires within the (short) timeout
// naming it, the engine enters its failed state and refuses work, and destruction does not hang.
// Where the engines take an active-rank mask (the latency path, the direct throughput path) the
// survivors then recover (Engine::recover, the missing rank masked) and replay the graphs they
// captured before the failure, every output exact for the experts left (GRAPHEP_RECOVERY_REPLAYS
// replays, default 12); elsewhere recover is refused by name. In every receive layout, one after
// the other. `recovers`: whether the engines must take the mask (asserted: a fallback to the
// movers would otherwise skip the recovery unseen).
void runMoeMissingRank(Communicator& comm, MoePath path, bool recovers);
// Shrink on timeout (MoeConfig::shrinkOnTimeout, the latency path): the last rank sits out one
// step after a good one; the survivors' step completes exact for the experts left, with no failure,
// the rank masked (active-rank mask, MoeStatus::shrunkRanks); then their graphs replay exactly
// (GRAPHEP_RECOVERY_REPLAYS, default 12) with no recover. In every receive layout.
void runMoeShrinkOnTimeout(Communicator& comm);
// The device barrier (Engine::barrier) on `path`: no rank's barrier returns before a late rank
// reached it; barriers around the operations of captured graphs replay with exact results; a rank
// that skips a barrier is masked by the others' with shrinkOnTimeout (latency path: no failure,
// MoeStatus::shrunkRanks, the mask word, and the next barrier passes among them), else named.
// Over the movers (no load/store peers) every rank's barrier is refused by name.
void runMoeBarrier(Communicator& comm, MoePath path);
// The host watchdog (latency path): with long device waits, checkHealth finds within 200 ms that
// the last rank's count message has not arrived, names it, and fails the engine; the late rank then
// arrives, the work completes, and the failed engines keep refusing work.
void runMoeWatchdog(Communicator& comm);
// A MoeGraph replayed (with a full check) after its Engine objects were destroyed: the graph keeps
// the engine's buffers alive.
void runMoeGraphOutlivesEngine(Communicator& comm);
// The movers path (GRAPHEP_MOE_KERNELS=movers or NCCL peers) while a capture of an engine's
// dispatch is still open: an eager combine of that engine on another stream is refused by name
// (its comm stream belongs to the open capture), nothing is queued, and the engine is not
// failed; once the capture ended, the graph replays and the combine runs, checked.
void runMoeOpenCaptureRefused(Communicator& comm);

// Two engines (two buffer sets) per rank with their operations in flight at once on two streams:
// every round both micro-batches' outputs are checked. Ranks sharing a GPU need a budget small
// enough for both engines' waiting CTAs to be resident at once (smBudget; 0: the default). In
// every receive layout, one after the other, each `rounds` rounds.
void runMoeMicroBatches(Communicator& comm, MoePath path, int rounds, int smBudget);

// The case matrix of a configuration: emulated ranks get small shapes, real GPUs the large ones;
// every small case runs on the latency path (kAuto) and on the throughput path.
std::vector<MoeCase> standardMoeCases(int worldSize, bool large);
// Cases for ranks placed several to a GPU over several GPUs (a rank with both same-GPU and NVLink
// peers): the prefill shape that once timed out there, and a decode one.
std::vector<MoeCase> mixedPlacementMoeCases();

// One test instance per case (GoogleTest TEST_P), named in words: the parameter names a case of a
// list whose names and order do not depend on the world size; the test builds the list for its
// communicator and runs that case.
enum class MoeCaseList { kSmall, kLarge, kMixedPlacement };
struct MoeCaseIndex {
  MoeCaseList list;
  int index;
  std::string name;  // moeCaseName
};
std::vector<MoeCase> moeCases(MoeCaseList list, int worldSize);
std::vector<MoeCaseIndex> moeCaseIndices(MoeCaseList list);
void runMoeCaseAt(Communicator& comm, const MoeCaseIndex& at);
// The small list's throughput-path cases (those over the movers, where the latency path has none).
std::vector<MoeCaseIndex> throughputCaseIndices();
// GoogleTest prints a parameter by its name.
inline void PrintTo(const MoeCaseIndex& at, std::ostream* os) { *os << at.name; }
// GoogleTest's name for an instance.
struct MoeCaseIndexName {
  std::string operator()(const ::testing::TestParamInfo<MoeCaseIndex>& info) const { return info.param.name; }
};

// Overflow on both paths: skewed routing into a capacity far below it (with and without
// alignment); an expert that reads and writes exactly the documented rows writes into a buffer of
// exactly `capacity` rows of the caller's (compute-sanitizer memcheck sees any row past it), and
// the layout, the per-expert dropped counts, the status and the combine are checked. In every
// receive layout: batched overflows past 9 rows per expert; rank-major cannot overflow (one row
// per source token) and must drop nothing; the aligned case runs in expert-major only.
void runMoeOverflow(Communicator& comm, MoePath path);

}  // namespace graphep::test
