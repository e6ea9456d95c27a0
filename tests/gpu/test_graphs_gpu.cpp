// MoeGraph on one GPU with 4 emulated ranks: every graph kind, interleaved, both paths.
#include <gtest/gtest.h>

#include <graphep/graphep.hpp>

#include "common/gpu_env.hpp"
#include "common/moe_suite.hpp"

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

}  // namespace
}  // namespace graphep::test
