// sendrecv on one GPU with 4 and 8 emulated ranks.
#include <gtest/gtest.h>

#include <graphep/graphep.hpp>

#include "common/gpu_env.hpp"
#include "common/mover_cases.hpp"
#include "common/mover_suite.hpp"

namespace graphep::test {
namespace {

TEST(Gpu1_SendRecv, FourEmulatedRanks) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0, 0, 0});
  runSendRecvCases(*comm, standardSendRecvCases(std::size_t{64} << 20));
}

TEST(Gpu1_SendRecv, EightEmulatedRanks) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0, 0, 0, 0, 0, 0, 0});
  runSendRecvCases(*comm, standardSendRecvCases(std::size_t{64} << 20));
}

TEST(Gpu1_SendRecv, GraphReplaysStagedAndZeroCopy) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0, 0, 0});
  runSendRecvReplays(*comm, std::size_t{1} << 20, 1000, /*zeroCopy=*/false);
  runSendRecvReplays(*comm, (std::size_t{1} << 20) + 3, 1000, /*zeroCopy=*/true);
}

}  // namespace
}  // namespace graphep::test
