// sendrecv on one GPU with 4 and 8 emulated ranks.
#include <gtest/gtest.h>

#include <algorithm>
#include <initializer_list>
#include <string>
#include <vector>

#include <graphep/graphep.hpp>

#include "common/expect_error.hpp"
#include "common/gpu_env.hpp"
#include "common/mover_cases.hpp"
#include "common/mover_suite.hpp"
#include "engine/error.hpp"
#include "engine/heap.hpp"
#include "engine/movers.hpp"

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
  // At least 200: counters start 100 below the 32-bit wrap and must cross it.
  const int n = static_cast<int>(std::max<long long>(200, replaysFromEnv("GRAPHEP_TEST_REPLAYS", 1000)));
  runSendRecvReplays(*comm, std::size_t{1} << 20, n, /*zeroCopy=*/false);
  runSendRecvReplays(*comm, (std::size_t{1} << 20) + 3, n, /*zeroCopy=*/true, ZeroCopyEngine::kSm);
  runSendRecvReplays(*comm, 4093, n, /*zeroCopy=*/false);  // LL mode across the wrap
  runSendRecvReplays(*comm, 4093, n, /*zeroCopy=*/true, ZeroCopyEngine::kCopyEngine);
}

// Produce / consume hooks (fp8 quantisation, weighted accumulation) against a host reference.
TEST(Gpu1_Hooks, Fp8AndWeightedFourEmulatedRanks) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0, 0, 0});
  runHookSuite(*comm);
}

// Bad sendRecv arguments fail on the host with the offending value in the message; nothing is
// launched.
TEST(Gpu1_Movers, BadArgumentsNameTheValue) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0});
  auto heap = SymmetricHeap::create(*comm, {.numRanks = 2, .userBytes = 4096, .moverSlotBytes = 4096});
  auto movers = Movers::createAll(*heap);
  char* buf = heap->user(0);
  SendRecvArgs a;
  auto expectRefused = [&](const char* needle) {
    expectError([&] { movers[0].sendRecv(nullptr, a); }, Status::kInvalidArgument, needle);
  };
  a.sendPeer = 1;
  a.src = buf;
  a.sendBytes = 100;
  a.wire = Wire::kFp8E4m3;
  expectRefused("sendBytes=100");
  a.sendBytes = 256;
  a.sendToUserOffset = 0;
  expectRefused("not zero-copy");
  a = SendRecvArgs{};
  a.recvPeer = 1;
  a.dst = buf;
  a.recvBytes = 64;
  a.consume = Consume::kFp8ToBf16;  // a consume hook of the fp8 wire on the byte wire
  expectRefused("consume=5");
  a.consume = Consume::kWeightedAddBf16;
  a.addend = buf;
  a.rowBytes = 10;
  expectRefused("it is 10");
  a.rowBytes = 32;
  expectRefused("needs weights");
  a.recvPeer = 2;
  expectRefused("receive peer 2");
}

// The ring tests' sweep, at 4 and 8 emulated ranks on GPU 0: run(comm, size, flag, 1) for every
// size with its flag off and on (allgather: zero-copy; reduce-scatter: bf16), each traced by the
// rank count and `sizeName`, then replays(comm), the replayed runs at that rank count.
template <typename Run, typename Replays>
void ringSweep(const char* sizeName, std::initializer_list<std::size_t> sizes, Run run, Replays replays) {
  for (int ranks : {4, 8}) {
    auto comm = createLocalGroup(std::vector<int>(static_cast<size_t>(ranks), 0));
    for (std::size_t size : sizes) {
      SCOPED_TRACE("ranks=" + std::to_string(ranks) + " " + sizeName + "=" + std::to_string(size));
      run(*comm, size, false, 1);
      run(*comm, size, true, 1);
    }
    replays(*comm);
  }
}

TEST(Gpu1_Ring, AllGatherEmulatedRanks) {
  GRAPHEP_REQUIRE_GPUS(1);
  ringSweep("chunk", {0, 3, 4095, std::size_t{1} << 20}, runAllGatherRing, [](Communicator& comm) {
    runAllGatherRing(comm, (std::size_t{256} << 10) + 16, true, 100);
    runAllGatherRing(comm, (std::size_t{3} << 20) + 16, true, 10);  // steps by the copy engine
  });
}

TEST(Gpu1_Ring, ReduceScatterEmulatedRanks) {
  GRAPHEP_REQUIRE_GPUS(1);
  ringSweep("count", {0, 1, 1001, std::size_t{1} << 18}, runReduceScatterRing,
            [](Communicator& comm) { runReduceScatterRing(comm, 65536 + 7, true, 100); });
}

// Every count pattern, eager and replayed, staged and zero-copy, on `ranks` emulated ranks.
void runAllToAllvEmulated(int ranks) {
  auto comm = createLocalGroup(std::vector<int>(static_cast<size_t>(ranks), 0));
  for (CountPattern pat : {CountPattern::kEqual, CountPattern::kRandom, CountPattern::kSomePairsZero,
                           CountPattern::kEmpty}) {
    SCOPED_TRACE("ranks=" + std::to_string(ranks) + " pattern=" + std::to_string(static_cast<int>(pat)));
    runAllToAllv(*comm, pat, (std::size_t{64} << 10) + 5, 1);
  }
  runAllToAllv(*comm, CountPattern::kRandom, std::size_t{1} << 20, 1);
  runAllToAllv(*comm, CountPattern::kSomePairsZero, (std::size_t{16} << 10) + 3, 200);
  for (CountPattern pat : {CountPattern::kEqual, CountPattern::kRandom, CountPattern::kEmpty}) {
    runAllToAllv(*comm, pat, (std::size_t{64} << 10) + 5, 1, /*zeroCopy=*/true);
  }
  runAllToAllv(*comm, CountPattern::kSomePairsZero, (std::size_t{16} << 10) + 3, 200, true);
}

TEST(Gpu1_AllToAllv, FourEmulatedRanks) {
  GRAPHEP_REQUIRE_GPUS(1);
  runAllToAllvEmulated(4);
}

// The emulated network's byte counts: 4 ranks as 2 and 4 nodes, 8 ranks as 2 and 4 nodes.
TEST(Gpu1_AllToAllv, EmulatedNodesCountNetworkBytes) {
  GRAPHEP_REQUIRE_GPUS(1);
  for (const auto& [ranks, nodes] : std::vector<std::pair<int, int>>{{4, 2}, {4, 4}, {8, 2}, {8, 4}}) {
    auto comm = createLocalGroup(std::vector<int>(static_cast<size_t>(ranks), 0));
    runAllToAllvNetworkBytes(*comm, nodes);
  }
}

// The emulated network's rate cap: 4 ranks as 2 nodes at 1 GB/s (2 MiB between nodes a rank:
// about 2 ms, against some 0.1 ms uncapped).
TEST(Gpu1_AllToAllv, EmulatedNetworkRateCap) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0, 0, 0});
  runAllToAllvNetworkPace(*comm, 2, 1000);
}

TEST(Gpu1_AllToAllv, EightEmulatedRanks) {
  GRAPHEP_REQUIRE_GPUS(1);
  runAllToAllvEmulated(8);
}

TEST(Gpu1_AllToAllv, OverflowingCountIsDroppedAndReported) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0, 0, 0});
  runAllToAllvOutOfBounds(*comm);
  runAllToAllvOutOfBounds(*comm, /*zeroCopy=*/true);
  runAllToAllvZeroCopyMismatch(*comm);
}

}  // namespace
}  // namespace graphep::test
