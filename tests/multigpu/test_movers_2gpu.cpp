// The movers on 2 or more GPUs in one process (one rank per visible GPU; NVLink peers), sizes up
// to 1 GiB.
#include <gtest/gtest.h>

#include <vector>

#include <string>

#include <graphep/graphep.hpp>

#include "common/gpu_env.hpp"
#include "common/mover_cases.hpp"
#include "common/mover_suite.hpp"
#include "common/nccl_comms.hpp"

namespace graphep::test {
namespace {

TEST(Gpu2_SendRecv, LocalGroupUpTo1GiB) {
  GRAPHEP_REQUIRE_GPUS(2);
  auto comm = createLocalGroup(visibleGpus());
  runSendRecvCases(*comm, standardSendRecvCases(std::size_t{1} << 30));
}

TEST(Gpu2_SendRecv, GraphReplaysStagedAndZeroCopy) {
  GRAPHEP_REQUIRE_GPUS(2);
  auto comm = createLocalGroup(visibleGpus());
  runSendRecvReplays(*comm, std::size_t{1} << 20, 1000, false);
  runSendRecvReplays(*comm, (std::size_t{1} << 20) + 3, 1000, true, ZeroCopyEngine::kSm);
  runSendRecvReplays(*comm, std::size_t{256} << 10, 1000, false);  // LL mode, full capacity (16 x 16 KiB)
  runSendRecvReplays(*comm, (std::size_t{4} << 20) + 3, 1000, true);  // zero-copy by the copy engine
}

// GRAPHEP_FORCE_TRANSPORT=remote: every byte goes through NCCL send/recv (eager and captured).
TEST(Gpu2_SendRecv, ForcedRemoteThroughAdoptedNccl) {
  GRAPHEP_REQUIRE_GPUS(2);
  AdoptedNcclGroup g(visibleGpus());
  ASSERT_NE(g.comm, nullptr) << "ncclCommInitAll failed";
  ScopedEnv force("GRAPHEP_FORCE_TRANSPORT", "remote");
  runSendRecvCases(*g.comm, standardSendRecvCases(std::size_t{64} << 20));
  runSendRecvReplays(*g.comm, std::size_t{1} << 20, 200, false);
}

// Every mover against NCCL on the same data (every visible GPU in one process, NCCL comms adopted).
TEST(Gpu2_Movers, BitExactAgainstNccl) {
  GRAPHEP_REQUIRE_GPUS(2);
  AdoptedNcclGroup g(visibleGpus());
  ASSERT_NE(g.comm, nullptr) << "ncclCommInitAll failed";
  runAgainstNccl(*g.comm, std::size_t{64} << 20);
}

TEST(Gpu2_Hooks, Fp8AndWeighted) {
  GRAPHEP_REQUIRE_GPUS(2);
  auto comm = createLocalGroup(visibleGpus());
  runHookSuite(*comm);
}

TEST(Gpu2_AllToAllv, PatternsSizesAndReplays) {
  GRAPHEP_REQUIRE_GPUS(2);
  auto comm = createLocalGroup(visibleGpus());
  for (std::size_t perPeer : {std::size_t{1}, std::size_t{4095}, std::size_t{1} << 20,
                              std::size_t{64} << 20}) {
    for (bool zeroCopy : {false, true}) {
      runAllToAllv(*comm, CountPattern::kEqual, perPeer, 1, zeroCopy);
      runAllToAllv(*comm, CountPattern::kRandom, perPeer, 1, zeroCopy);
    }
  }
  runAllToAllv(*comm, CountPattern::kEmpty, 4096, 1);
  runAllToAllv(*comm, CountPattern::kEmpty, 4096, 1, true);
  runAllToAllv(*comm, CountPattern::kSomePairsZero, (std::size_t{256} << 10) + 9, 1000);
  runAllToAllv(*comm, CountPattern::kSomePairsZero, (std::size_t{256} << 10) + 9, 1000, true);
  runAllToAllvOutOfBounds(*comm);
  runAllToAllvOutOfBounds(*comm, true);
  runAllToAllvZeroCopyMismatch(*comm);
}

// alltoallv with every peer remote: fixed-capacity stages through NCCL. Graph replays only: one
// thread issuing eager NCCL groups for two ranks one after the other may block in the first.
TEST(Gpu2_AllToAllv, ForcedRemoteThroughAdoptedNccl) {
  GRAPHEP_REQUIRE_GPUS(2);
  AdoptedNcclGroup g(visibleGpus());
  ASSERT_NE(g.comm, nullptr) << "ncclCommInitAll failed";
  ScopedEnv force("GRAPHEP_FORCE_TRANSPORT", "remote");
  runAllToAllv(*g.comm, CountPattern::kRandom, (std::size_t{64} << 10) + 3, 200);
  runAllToAllv(*g.comm, CountPattern::kSomePairsZero, std::size_t{1} << 20, 50);
}

// Fixed slots with every peer remote: NCCL moves each slot straight between src and dst (no
// stage, no copy), as the MoE exchanges do; random counts per replay, poisoned destinations; and
// the misuse checks (host refusals, a table off its slot reported).
TEST(Gpu2_AllToAllv, FixedSlotsForcedRemote) {
  GRAPHEP_REQUIRE_GPUS(2);
  AdoptedNcclGroup g(visibleGpus());
  ASSERT_NE(g.comm, nullptr) << "ncclCommInitAll failed";
  ScopedEnv force("GRAPHEP_FORCE_TRANSPORT", "remote");
  runAllToAllv(*g.comm, CountPattern::kRandom, (std::size_t{64} << 10) + 3, 200, false, true);
  runAllToAllv(*g.comm, CountPattern::kSomePairsZero, (std::size_t{8} << 20) + 16, 30, false, true);
  runAllToAllvFixedSlotsMisuse(*g.comm);
}

// Fixed slots among load/store peers: the tables' offsets are the slots, the path is the usual one.
TEST(Gpu2_AllToAllv, FixedSlotsLoadStore) {
  GRAPHEP_REQUIRE_GPUS(2);
  auto comm = createLocalGroup(visibleGpus());
  runAllToAllv(*comm, CountPattern::kRandom, (std::size_t{64} << 10) + 3, 100, false, true);
  runAllToAllv(*comm, CountPattern::kRandom, (std::size_t{64} << 10) + 3, 100, true, true);
  runAllToAllvFixedSlotsMisuse(*comm);
}

TEST(Gpu2_Ring, AllGatherAndReduceScatter) {
  GRAPHEP_REQUIRE_GPUS(2);
  auto comm = createLocalGroup(visibleGpus());
  for (std::size_t chunk : {std::size_t{1}, std::size_t{4095}, std::size_t{64} << 20}) {
    runAllGatherRing(*comm, chunk, false, 1);
    runAllGatherRing(*comm, chunk, true, 1);
  }
  runAllGatherRing(*comm, std::size_t{1} << 20, true, 1000);
  runAllGatherRing(*comm, (std::size_t{4} << 20) + 16, true, 100);  // steps by the copy engine
  for (std::size_t count : {std::size_t{1}, std::size_t{1001}, std::size_t{16} << 20}) {
    runReduceScatterRing(*comm, count, false, 1);
    runReduceScatterRing(*comm, count, true, 1);
  }
  runReduceScatterRing(*comm, (std::size_t{1} << 18) + 3, false, 1000);
}

// Four ranks on each GPU: every rank has same-GPU and NVLink peers, and the movers' waiting CTAs of
// the ranks sharing a GPU must all be resident at once (engine/movers.hpp, moverLinkChannels).
TEST(Gpu2_MoversFourRanksPerGpu, SendRecv) {
  GRAPHEP_REQUIRE_GPUS(2);
  auto comm = createLocalGroup(ranksPerGpu(4));
  runSendRecvCases(*comm, standardSendRecvCases(std::size_t{64} << 20));
  runSendRecvReplays(*comm, std::size_t{1} << 20, 200, false);
  runSendRecvReplays(*comm, (std::size_t{1} << 20) + 3, 200, true, ZeroCopyEngine::kSm);
}

TEST(Gpu2_MoversFourRanksPerGpu, AllToAllv) {
  GRAPHEP_REQUIRE_GPUS(2);
  auto comm = createLocalGroup(ranksPerGpu(4));
  for (bool zeroCopy : {false, true}) {
    for (std::size_t perPeer : {(std::size_t{64} << 10) + 5, std::size_t{4} << 20}) {
      runAllToAllv(*comm, CountPattern::kEqual, perPeer, 1, zeroCopy);
      runAllToAllv(*comm, CountPattern::kRandom, perPeer, 1, zeroCopy);
    }
    runAllToAllv(*comm, CountPattern::kSomePairsZero, (std::size_t{256} << 10) + 9, 200, zeroCopy);
  }
}

// The emulated network over 2 GPUs: 2 ranks per GPU as 2 nodes (a node per GPU), 4 ranks per GPU
// as 2 and as 4 nodes (nodes inside a GPU and across the NVLink alike).
TEST(Gpu2_MoversFourRanksPerGpu, EmulatedNodesCountNetworkBytes) {
  GRAPHEP_REQUIRE_GPUS(2);
  runAllToAllvNetworkBytes(*createLocalGroup(ranksPerGpu(2)), 2);
  auto comm = createLocalGroup(ranksPerGpu(4));
  runAllToAllvNetworkBytes(*comm, 2);
  runAllToAllvNetworkBytes(*comm, 4);
}

TEST(Gpu2_MoversFourRanksPerGpu, Ring) {
  GRAPHEP_REQUIRE_GPUS(2);
  auto comm = createLocalGroup(ranksPerGpu(4));
  runAllGatherRing(*comm, (std::size_t{1} << 20) + 16, false, 1);
  runAllGatherRing(*comm, std::size_t{1} << 20, true, 100);
  runReduceScatterRing(*comm, (std::size_t{1} << 18) + 3, false, 100);
}

}  // namespace
}  // namespace graphep::test
