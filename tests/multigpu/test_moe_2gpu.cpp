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

}  // namespace
}  // namespace graphep::test
