// sendrecv on one GPU with 4 and 8 emulated ranks.
#include <gtest/gtest.h>

#include <string>
#include <vector>

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
  runSendRecvReplays(*comm, 4093, 1000, /*zeroCopy=*/false);  // LL mode across the wrap
}

TEST(Gpu1_Ring, AllGatherEmulatedRanks) {
  GRAPHEP_REQUIRE_GPUS(1);
  for (int ranks : {4, 8}) {
    auto comm = createLocalGroup(std::vector<int>(static_cast<size_t>(ranks), 0));
    for (std::size_t chunk : {std::size_t{0}, std::size_t{3}, std::size_t{4095},
                              std::size_t{1} << 20}) {
      SCOPED_TRACE("ranks=" + std::to_string(ranks) + " chunk=" + std::to_string(chunk));
      runAllGatherRing(*comm, chunk, false, 1);
      runAllGatherRing(*comm, chunk, true, 1);
    }
    runAllGatherRing(*comm, (std::size_t{256} << 10) + 16, true, 100);
  }
}

TEST(Gpu1_Ring, ReduceScatterEmulatedRanks) {
  GRAPHEP_REQUIRE_GPUS(1);
  for (int ranks : {4, 8}) {
    auto comm = createLocalGroup(std::vector<int>(static_cast<size_t>(ranks), 0));
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{1001},
                              std::size_t{1} << 18}) {
      SCOPED_TRACE("ranks=" + std::to_string(ranks) + " count=" + std::to_string(count));
      runReduceScatterRing(*comm, count, false, 1);
      runReduceScatterRing(*comm, count, true, 1);
    }
    runReduceScatterRing(*comm, 65536 + 7, true, 100);
  }
}

TEST(Gpu1_AllToAllv, EmulatedRanksPatternsAndReplays) {
  GRAPHEP_REQUIRE_GPUS(1);
  for (int ranks : {4, 8}) {
    auto comm = createLocalGroup(std::vector<int>(static_cast<size_t>(ranks), 0));
    for (CountPattern pat : {CountPattern::kEqual, CountPattern::kRandom, CountPattern::kSomePairsZero,
                             CountPattern::kEmpty}) {
      SCOPED_TRACE("ranks=" + std::to_string(ranks) + " pattern=" + std::to_string(static_cast<int>(pat)));
      runAllToAllv(*comm, pat, (std::size_t{64} << 10) + 5, 1);
    }
    runAllToAllv(*comm, CountPattern::kRandom, std::size_t{1} << 20, 1);
    runAllToAllv(*comm, CountPattern::kSomePairsZero, (std::size_t{16} << 10) + 3, 200);
  }
}

TEST(Gpu1_AllToAllv, OverflowingCountIsDroppedAndReported) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0, 0, 0});
  runAllToAllvOutOfBounds(*comm);
}

}  // namespace
}  // namespace graphep::test
