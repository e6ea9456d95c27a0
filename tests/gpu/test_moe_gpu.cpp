// MoE dispatch / combine on one GPU with 1, 4 and 8 emulated ranks, against a CPU reference.
#include <gtest/gtest.h>

#include <graphep/graphep.hpp>

#include "common/gpu_env.hpp"
#include "common/moe_suite.hpp"

namespace graphep::test {
namespace {

TEST(Gpu1_Moe, OneRank) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0});
  for (const MoeCase& c : standardMoeCases(1, false)) runMoeCase(*comm, c);
}

TEST(Gpu1_Moe, FourEmulatedRanks) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0, 0, 0});
  for (const MoeCase& c : standardMoeCases(4, false)) runMoeCase(*comm, c);
}

TEST(Gpu1_Moe, EightEmulatedRanks) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0, 0, 0, 0, 0, 0, 0});
  for (const MoeCase& c : standardMoeCases(8, false)) runMoeCase(*comm, c);
}

TEST(Gpu1_Moe, MisuseFourEmulatedRanks) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0, 0, 0});
  runMoeMisuse(*comm, MoePath::kAuto);
  runMoeMisuse(*comm, MoePath::kThroughput);
}

TEST(Gpu1_MoeFaults, MissingRankWatchdogAndGraphLifetime) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0, 0, 0});
  runMoeMissingRank(*comm, MoePath::kAuto);
  runMoeMissingRank(*comm, MoePath::kThroughput);
  runMoeWatchdog(*comm);
  runMoeGraphOutlivesEngine(*comm);
}

}  // namespace
}  // namespace graphep::test
