// Replay stress of MoeGraph: one graph per (rank, bucket), each replay with no host work at all.
// Inside every graph: poison the output, an optional random per-rank delay (ranks drift apart),
// inputs generated on the GPU from a device replay counter (each rank's own live count, routing with masked and
// duplicate slots, weights), then the MoeGraph (dispatch -> a stand-in expert -> combine), then a
// device-side check of every output value against a reference recomputed from the same counter
// (and of the layout views: expert counts and offsets, the received row count, rank-major's source
// offsets; and of the untouched rows past the live count), then counter + 1. The stand-in expert
// of the expert-major and batched layouts writes y = x * scale(e) per row; rank-major's writes
// each row's weighted sum of its slots (what combine takes there), so the output is the same in
// every layout. The host only launches graphs, in a random bucket order that is the same on every
// process, and reads the mismatch and check counters at the end.
#pragma once

#include <graphep/comm.hpp>
#include <graphep/moe.hpp>

#include <cstdint>
#include <vector>

namespace graphep::test {

struct StressCase {
  MoePath path = MoePath::kAuto;
  long long replays = 1000;               // graph launches per rank
  // Live tokens of each graph (the largest is T_max; 1 to 8 buckets). In a replay rank q runs
  // bucket (b + q) mod n: ranks differ, and the 0 bucket leaves one rank silent while its peers send.
  std::vector<int> buckets = {0, 1, 8, 64, 128};
  int maxDelayUs = 0;                     // > 0: a random delay of up to this before each dispatch
  std::uint32_t counterStart = 0;         // the engine's counters start here (near 2^32: they wrap)
  ReceiveLayout layout = ReceiveLayout::kExpertMajor;
  // Batched: MoeConfig.rowsPerExpert (0: the engine's default). The checker expects every entry
  // kept: leave room for all of them.
  long long rowsPerExpert = 0;
};

// Runs the stress and EXPECTs zero mismatches, replays x local ranks checks, a clean status.
void runMoeStress(Communicator& comm, const StressCase& sc);

// The standard stress of every configuration, in each receive layout one after the other
// (expert-major, batched with room for every entry, rank-major): N replays on the latency path
// (kAuto) and a tenth (at least 200; GRAPHEP_STRESS_THROUGHPUT_REPLAYS when set) on the
// throughput path, ranks drifting by up to 100 us, counters from 1,000 below the 32-bit wrap; then
// 300 replays with ranks drifting by up to 5 ms. N: GRAPHEP_STRESS_REPLAYS in every layout when
// set; else 2000 expert-major and 666 in each other layout.
void runMoeStressStandard(Communicator& comm);

// Replays for the stress tests: GRAPHEP_STRESS_REPLAYS when set, else `fallback`.
long long stressReplays(long long fallback);

}  // namespace graphep::test
