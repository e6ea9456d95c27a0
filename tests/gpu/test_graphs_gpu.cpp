// MoeGraph on one GPU with 4 emulated ranks: every graph kind, interleaved, both paths.
#include <gtest/gtest.h>


#include <graphep/graphep.hpp>

#include "common/gpu_env.hpp"
#include "common/moe_suite.hpp"
#include "common/stress_suite.hpp"

namespace graphep::test {
namespace {

TEST(Gpu1_MoeGraph, FourEmulatedRanksLatency) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0, 0, 0});
  runMoeGraphSuite(*comm, MoePath::kAuto, 60);
}

TEST(Gpu1_MoeGraph, FourEmulatedRanksThroughput) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0, 0, 0});
  runMoeGraphSuite(*comm, MoePath::kThroughput, 40);
}

TEST(Gpu1_MoeMicroBatches, FourEmulatedRanksBothPaths) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0, 0, 0});
  runMoeMicroBatches(*comm, MoePath::kAuto, 6, 8);  // 2 engines x 4 ranks x (8 senders + 8 receivers) at once
  runMoeMicroBatches(*comm, MoePath::kThroughput, 4, 8);
}

// Replays of 4 bucket graphs (1 / 8 / 64 / 128 tokens) in random order with no host work between
// them, ranks drifting apart by up to 100 us, counters starting 1,000 below the 32-bit wrap, every
// output checked on the GPU each replay. GRAPHEP_STRESS_REPLAYS scales it (gpu-check: 100,000).
TEST(Gpu1_MoeStress, FourEmulatedRanks) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0, 0, 0});
  runMoeStressStandard(*comm);
}

// The latency path from the wrap step: counters start at 2^32 - 1, so the first dispatch's count
// words would carry a tag of 0 if it were step + 1 alone, the high half of the words no one has
// written yet (the heap starts zeroed), and a receive ahead of its peers would take them for this
// step's. Ranks drift by up to 100 us before each dispatch, so a receive is ahead of some peer on
// the first dispatch more often than not; every output is checked.
TEST(Gpu1_MoeStress, LatencyFromTheWrapStep) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0, 0, 0});
  StressCase sc;
  sc.path = MoePath::kLatency;
  sc.replays = 50;
  sc.maxDelayUs = 100;
  sc.counterStart = 0xffffffffu;
  runMoeStress(*comm, sc);
}

// The same at 8 ranks (issue 7 asks for the stress at 8 ranks; until 8 GPUs can be borrowed, 8
// emulated ranks share one).
TEST(Gpu1_MoeStress, EightEmulatedRanks) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0, 0, 0, 0, 0, 0, 0});
  runMoeStressStandard(*comm);
}

}  // namespace
}  // namespace graphep::test
