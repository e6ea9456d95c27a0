// MoE dispatch / combine on 2 GPUs driven from one process, against a CPU reference.
#include <gtest/gtest.h>

#include <algorithm>

#include <graphep/graphep.hpp>

#include "common/gpu_env.hpp"
#include "common/moe_suite.hpp"
#include "common/stress_suite.hpp"

namespace graphep::test {
namespace {

TEST(Gpu2_Moe, LocalGroupCases) {
  GRAPHEP_REQUIRE_GPUS(2);
  auto comm = createLocalGroup({0, 1});
  for (const MoeCase& c : standardMoeCases(2, true)) runMoeCase(*comm, c);
}

TEST(Gpu2_MoeGraph, LocalGroupBothPaths) {
  GRAPHEP_REQUIRE_GPUS(2);
  auto comm = createLocalGroup({0, 1});
  runMoeGraphSuite(*comm, MoePath::kAuto, 60);
  runMoeGraphSuite(*comm, MoePath::kThroughput, 40);
}

TEST(Gpu2_MoeMicroBatches, LocalGroupBothPaths) {
  GRAPHEP_REQUIRE_GPUS(2);
  auto comm = createLocalGroup({0, 1});
  runMoeMicroBatches(*comm, MoePath::kAuto, 6, 0);
  runMoeMicroBatches(*comm, MoePath::kThroughput, 4, 0);
}

TEST(Gpu2_MoeStress, LocalGroupBothPaths) {
  GRAPHEP_REQUIRE_GPUS(2);
  auto comm = createLocalGroup({0, 1});
  StressCase sc;
  sc.replays = stressReplays(2000);
  sc.maxDelayUs = 100;
  sc.counterStart = 0xffffffffu - 1000u;
  runMoeStress(*comm, sc);
  sc.path = MoePath::kThroughput;
  sc.replays = std::max<long long>(200, sc.replays / 10);
  runMoeStress(*comm, sc);
}

}  // namespace
}  // namespace graphep::test
