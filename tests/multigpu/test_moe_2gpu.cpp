// MoE dispatch / combine on 2 GPUs driven from one process, against a CPU reference.
#include <gtest/gtest.h>

#include <graphep/graphep.hpp>

#include "common/gpu_env.hpp"
#include "common/moe_suite.hpp"

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

}  // namespace
}  // namespace graphep::test
