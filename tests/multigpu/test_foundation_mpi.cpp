// Foundation with one process per GPU: run as `mpirun -np 2 graphep_mpi_tests`. Every process runs
// the same bodies; cross-process peers are mapped through CUDA IPC.
#include <gtest/gtest.h>
#include <mpi.h>
#include <cstdlib>
#include <string>

#include <graphep/graphep.hpp>

#include "common/gpu_env.hpp"
#include "common/moe_suite.hpp"
#include "common/stress_suite.hpp"
#include "common/mover_cases.hpp"
#include "common/mover_suite.hpp"
#include "common/nccl_comms.hpp"
#include "common/sync_suite.hpp"
#include "engine/heap.hpp"

namespace graphep::test {
namespace {

int worldSize() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

// Runs the rest of the test only with 2+ processes and a GPU for each; else skips it, or fails it
// where GRAPHEP_EXPECT_GPUS says the GPUs are there (gpuRequirement, common/gpu_env.hpp). Every
// rank takes the worst verdict of all, so that no rank runs on while another has left the test.
#define GRAPHEP_REQUIRE_MPI_GPUS()                                                        \
  do {                                                                                    \
    if (worldSize() < 2) GTEST_SKIP() << "needs mpirun -np 2 or more";                    \
    const GpuRequirement req = gpuRequirement(worldSize());                               \
    const int mine = static_cast<int>(req.verdict);                                       \
    int worst = 0;                                                                        \
    MPI_Allreduce(&mine, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);                    \
    const std::string why = mine == worst ? req.reason : std::string("see another rank"); \
    if (worst == static_cast<int>(GpuVerdict::kFail))                                     \
      GTEST_FAIL() << "one GPU per process: " << why;                                     \
    if (worst == static_cast<int>(GpuVerdict::kSkip))                                     \
      GTEST_SKIP() << "one GPU per process: " << why;                                     \
  } while (0)

TEST(Mpi_Foundation, HeapExchange) {
  GRAPHEP_REQUIRE_MPI_GPUS();
  auto comm = createMpiCommunicator(-1, /*withNccl=*/false);
  runHeapExchange(*comm, 4242);
}

TEST(Mpi_Foundation, FlagPingPongEagerNearWrap) {
  GRAPHEP_REQUIRE_MPI_GPUS();
  auto comm = createMpiCommunicator(-1, false);
  runFlagPingPong(*comm, 10000, false, kNearWrap);
}

TEST(Mpi_Foundation, FlagPingPongGraphNearWrap) {
  GRAPHEP_REQUIRE_MPI_GPUS();
  auto comm = createMpiCommunicator(-1, false);
  runFlagPingPong(*comm, 10000, true, kNearWrap);
}

TEST(Mpi_Foundation, SemaphorePingPongEagerNearWrap) {
  GRAPHEP_REQUIRE_MPI_GPUS();
  auto comm = createMpiCommunicator(-1, false);
  runSemaphorePingPong(*comm, 10000, false, kNearWrap);
}

TEST(Mpi_Foundation, SemaphorePingPongGraphNearWrap) {
  GRAPHEP_REQUIRE_MPI_GPUS();
  auto comm = createMpiCommunicator(-1, false);
  runSemaphorePingPong(*comm, 10000, true, kNearWrap);
}

TEST(Mpi_Foundation, MissingPeerTimesOutNamingThePeer) {
  GRAPHEP_REQUIRE_MPI_GPUS();
  auto comm = createMpiCommunicator(-1, false);
  runMissingPeer(*comm, 0, 1, 300);
}

TEST(Mpi_SendRecv, CasesAndReplays) {
  GRAPHEP_REQUIRE_MPI_GPUS();
  auto comm = createMpiCommunicator(-1, false);
  runSendRecvCases(*comm, standardSendRecvCases(std::size_t{64} << 20));
  runSendRecvReplays(*comm, std::size_t{1} << 20, 1000, false);
  runSendRecvReplays(*comm, (std::size_t{1} << 20) + 3, 1000, true, ZeroCopyEngine::kSm);
  runSendRecvReplays(*comm, 100, 1000, false);  // LL mode
  runSendRecvReplays(*comm, (std::size_t{4} << 20) + 3, 1000, true);  // zero-copy by the copy engine
}

TEST(Mpi_SendRecv, ForcedRemoteThroughNccl) {
  GRAPHEP_REQUIRE_MPI_GPUS();
  auto comm = createMpiCommunicator(-1, /*withNccl=*/true);
  ScopedEnv force("GRAPHEP_FORCE_TRANSPORT", "remote");
  runSendRecvCases(*comm, standardSendRecvCases(std::size_t{64} << 20));
  runSendRecvReplays(*comm, std::size_t{1} << 20, 200, false);
}

TEST(Mpi_AllToAllv, ForcedRemoteThroughNccl) {
  GRAPHEP_REQUIRE_MPI_GPUS();
  auto comm = createMpiCommunicator(-1, /*withNccl=*/true);
  ScopedEnv force("GRAPHEP_FORCE_TRANSPORT", "remote");
  runAllToAllv(*comm, CountPattern::kRandom, (std::size_t{64} << 10) + 3, 1);
  runAllToAllv(*comm, CountPattern::kSomePairsZero, std::size_t{16} << 10, 200);
  runAllToAllv(*comm, CountPattern::kRandom, (std::size_t{64} << 10) + 3, 1, false, true);  // fixed slots: in place
  runAllToAllv(*comm, CountPattern::kSomePairsZero, std::size_t{1} << 20, 100, false, true);
  runAllToAllvFixedSlotsMisuse(*comm);
}

// One test instance per case (the same on every process, in the same order).
class Mpi_Moe : public ::testing::TestWithParam<MoeCaseIndex> {};

TEST_P(Mpi_Moe, Case) {
  GRAPHEP_REQUIRE_MPI_GPUS();
  auto comm = createMpiCommunicator(-1, false);
  runMoeCaseAt(*comm, GetParam());
}
INSTANTIATE_TEST_SUITE_P(Moe, Mpi_Moe, ::testing::ValuesIn(moeCaseIndices(MoeCaseList::kLarge)), MoeCaseIndexName());

// Every peer classified remote: the engine takes the throughput path and the movers carry the
// count messages, records and partials through NCCL (fixed-capacity messages, in 3 chunks).
class Mpi_MoeRemote : public ::testing::TestWithParam<MoeCaseIndex> {};

TEST_P(Mpi_MoeRemote, Case) {
  GRAPHEP_REQUIRE_MPI_GPUS();
  auto comm = createMpiCommunicator(-1, /*withNccl=*/true);
  ScopedEnv force("GRAPHEP_FORCE_TRANSPORT", "remote");
  ScopedEnv chunks("GRAPHEP_EXCHANGE_CHUNKS", "3");
  runMoeCaseAt(*comm, GetParam());
}

std::vector<MoeCaseIndex> remoteCases() {
  std::vector<MoeCaseIndex> out;
  for (const MoeCaseIndex& i : moeCaseIndices(MoeCaseList::kSmall)) {
    for (const char* name : {"uniform_varying_T_auto", "fp8_int64_auto", "skewed_auto", "invalid_ids_auto",
                             "overflow_aligned_auto", "duplicates_auto", "graph_replays_auto"}) {
      if (i.name == name) out.push_back(i);
    }
  }
  return out;
}
INSTANTIATE_TEST_SUITE_P(Moe, Mpi_MoeRemote, ::testing::ValuesIn(remoteCases()), MoeCaseIndexName());

TEST(Mpi_MoeOverflow, BothPaths) {
  GRAPHEP_REQUIRE_MPI_GPUS();
  auto comm = createMpiCommunicator(-1, false);
  runMoeOverflow(*comm, MoePath::kLatency);
  runMoeOverflow(*comm, MoePath::kThroughput);
}

TEST(Mpi_MoeGraph, BothPaths) {
  GRAPHEP_REQUIRE_MPI_GPUS();
  auto comm = createMpiCommunicator(-1, false);
  runMoeGraphSuite(*comm, MoePath::kAuto, 40);
  runMoeGraphSuite(*comm, MoePath::kThroughput, 30);
}

// The stress in 2 processes, one GPU each (GRAPHEP_STRESS_REPLAYS scales it).
TEST(Mpi_MoeStress, BothPaths) {
  GRAPHEP_REQUIRE_MPI_GPUS();
  auto comm = createMpiCommunicator(-1, false);
  runMoeStressStandard(*comm);
}

TEST(Mpi_Ring, AllGatherAndReduceScatter) {
  GRAPHEP_REQUIRE_MPI_GPUS();
  auto comm = createMpiCommunicator(-1, false);
  runAllGatherRing(*comm, (std::size_t{1} << 20) + 16, true, 100);
  runAllGatherRing(*comm, (std::size_t{4} << 20) + 16, true, 20);  // steps by the copy engine
  runAllGatherRing(*comm, 4095, false, 1);
  runReduceScatterRing(*comm, 1001, true, 1);
  runReduceScatterRing(*comm, std::size_t{1} << 18, false, 100);
}

TEST(Mpi_Movers, BitExactAgainstNccl) {
  GRAPHEP_REQUIRE_MPI_GPUS();
  auto comm = createMpiCommunicator(-1, /*withNccl=*/true);
  runAgainstNccl(*comm, std::size_t{16} << 20);
}

TEST(Mpi_Hooks, Fp8AndWeighted) {
  GRAPHEP_REQUIRE_MPI_GPUS();
  auto comm = createMpiCommunicator(-1, false);
  runHookCase(*comm, HookCase::kFp8Records, 4101, 1);
  runHookCase(*comm, HookCase::kFp8Dequant, 300, 30);
  runHookCase(*comm, HookCase::kWeightedBf16, 70, 1);
  runHookCase(*comm, HookCase::kWeightedF32, 5, 30);
}

TEST(Mpi_AllToAllv, PatternsAndReplays) {
  GRAPHEP_REQUIRE_MPI_GPUS();
  auto comm = createMpiCommunicator(-1, false);
  runAllToAllv(*comm, CountPattern::kRandom, (std::size_t{1} << 20) + 1, 1);
  runAllToAllv(*comm, CountPattern::kSomePairsZero, (std::size_t{64} << 10) + 3, 1000);
  runAllToAllvOutOfBounds(*comm);
  runAllToAllv(*comm, CountPattern::kRandom, (std::size_t{1} << 20) + 1, 1, /*zeroCopy=*/true);
  runAllToAllv(*comm, CountPattern::kSomePairsZero, (std::size_t{64} << 10) + 3, 1000, true);
  runAllToAllvOutOfBounds(*comm, true);
  runAllToAllvZeroCopyMismatch(*comm);
}

// Ranks that disagree on the heap config fail at setup, on every rank, naming both sizes.
TEST(Mpi_Foundation, MismatchedConfigsAreRejectedOnEveryRank) {
  GRAPHEP_REQUIRE_MPI_GPUS();
  auto comm = createMpiCommunicator(-1, false);
  HeapConfig cfg;
  cfg.numRanks = comm->worldSize();
  cfg.userBytes = comm->globalRank(0) == 0 ? 4096 : (std::size_t{1} << 20);
  try {
    SymmetricHeap::create(*comm, cfg);
    FAIL() << "mismatched configs must be rejected";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("heap config differs across ranks"), std::string::npos)
        << e.what();
  }
  comm->barrier();
  runHeapExchange(*comm, 31337);  // the communicator is still usable afterwards
}

TEST(Mpi_MoeConfig, MismatchedConfigsAreRejectedOnEveryRank) {
  GRAPHEP_REQUIRE_MPI_GPUS();
  auto comm = createMpiCommunicator(-1, false);
  MoeConfig cfg;
  cfg.maxTokensPerRank = 16;
  cfg.hidden = comm->globalRank(0) == 0 ? 256 : 512;
  cfg.numExperts = 2 * comm->worldSize();
  cfg.topK = 2;
  try {
    Engine::createAll(*comm, cfg);
    FAIL() << "mismatched MoE configs must be rejected";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("MoeConfig differs across ranks: hidden is"), std::string::npos) << e.what();
  }
  comm->barrier();
}

// One process stops launching: the other fails within the timeout naming it; the watchdog.
TEST(Mpi_MoeFaults, MissingRankAndWatchdog) {
  GRAPHEP_REQUIRE_MPI_GPUS();
  auto comm = createMpiCommunicator(-1, false);
  runMoeMissingRank(*comm, MoePath::kAuto, true);
  runMoeShrinkOnTimeout(*comm);
  runMoeMissingRank(*comm, MoePath::kThroughput, true);  // the direct kernels
  runMoeWatchdog(*comm);
  runMoeGraphOutlivesEngine(*comm);
}

TEST(Mpi_MoeFaults, Barrier) {
  GRAPHEP_REQUIRE_MPI_GPUS();
  auto comm = createMpiCommunicator(-1, false);
  runMoeBarrier(*comm, MoePath::kAuto);
  runMoeBarrier(*comm, MoePath::kThroughput);
}

TEST(Mpi_Moe, Misuse) {
  GRAPHEP_REQUIRE_MPI_GPUS();
  auto comm = createMpiCommunicator(-1, false);
  runMoeMisuse(*comm, MoePath::kAuto);
  runMoeMisuse(*comm, MoePath::kThroughput);
}

// The same bodies over NCCL communicators made from an MPI-broadcast unique id.
TEST(Mpi_Foundation, NcclFromUniqueIdHeapExchangeAndPingPong) {
  GRAPHEP_REQUIRE_MPI_GPUS();
  auto comm = createMpiCommunicator(-1, /*withNccl=*/true);
  ASSERT_NE(comm->ncclComm(0), nullptr);
  auto nccl = adoptNcclComms({comm->ncclComm(0)});
  EXPECT_EQ(nccl->worldSize(), comm->worldSize());
  EXPECT_EQ(nccl->globalRank(0), comm->globalRank(0));
  runHeapExchange(*nccl, 99);
  runFlagPingPong(*nccl, 1000, true, kNearWrap);
}

}  // namespace
}  // namespace graphep::test

// The exit code is the same on every rank, since mpirun returns the first non-zero one: 1 when a
// test failed on any rank, 77 (the ctest entries' SKIP_RETURN_CODE) when every test that ran was
// skipped on every rank, 0 otherwise. One skipped test thus hides no failure beside it. Every rank
// prints its own report (a failure on rank 1 must be visible too).
// The fast tier's selection (GRAPHEP_TIER=fast, scripts/gpu-check.sh) when no --gtest_filter is
// given: the bootstrap, the flag and semaphore protocols, each mover through NCCL, one MoE case
// per path (load/store peers and every peer remote), graphs, misuse and a missing peer.
constexpr const char* kFastTier =
    "Mpi_Foundation.HeapExchange:Mpi_Foundation.SemaphorePingPongGraphNearWrap:"
    "Mpi_Foundation.MissingPeerTimesOutNamingThePeer:Mpi_SendRecv.ForcedRemoteThroughNccl:"
    "Mpi_AllToAllv.ForcedRemoteThroughNccl:Moe/Mpi_Moe.Case/uniform_varying_T_*:"
    "Moe/Mpi_MoeRemote.Case/uniform_varying_T_*:Mpi_MoeGraph.BothPaths:Mpi_Moe.Misuse";

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  const char* tier = std::getenv("GRAPHEP_TIER");
  if (tier != nullptr && std::string(tier) == "fast" && GTEST_FLAG_GET(filter) == "*") GTEST_FLAG_SET(filter, kFastTier);
  const int rc = RUN_ALL_TESTS();
  const ::testing::UnitTest& unit = *::testing::UnitTest::GetInstance();
  const bool allSkipped =
      unit.test_to_run_count() > 0 && unit.skipped_test_count() == unit.test_to_run_count();
  const int mine[2] = {rc != 0 ? 1 : 0, allSkipped ? 0 : 1};  // {failed, not all skipped}
  int any[2] = {0, 0};
  MPI_Allreduce(mine, any, 2, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any[0] != 0 ? 1 : any[1] != 0 ? 0 : 77;
}
