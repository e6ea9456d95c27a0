// MoE dispatch / combine on 2 or more GPUs driven from one process, against a CPU reference: one
// rank per visible GPU; four ranks per GPU (ranks with both same-GPU and NVLink peers); and every
// peer forced remote over the caller's NCCL communicators. One test instance per (topology, case).
#include <gtest/gtest.h>

#include <graphep/graphep.hpp>

#include <memory>
#include <vector>

#include "common/gpu_env.hpp"
#include "common/moe_suite.hpp"
#include "common/nccl_comms.hpp"
#include "common/stress_suite.hpp"
#include "engine/error.hpp"

namespace graphep::test {
namespace {

class Gpu2_Moe : public ::testing::TestWithParam<MoeCaseIndex> {};
class Gpu2_MoeFourRanksPerGpu : public ::testing::TestWithParam<MoeCaseIndex> {};
// The throughput cases on an emulated network over 2 GPUs: 2 ranks per GPU as 2 nodes (a node per
// GPU) and 4 ranks per GPU as 2; each run's bytes between nodes against the flat scheme's.
class Gpu2_MoeEmulatedNodes : public ::testing::TestWithParam<MoeCaseIndex> {};

TEST_P(Gpu2_Moe, Case) {
  GRAPHEP_REQUIRE_GPUS(2);
  auto comm = createLocalGroup(visibleGpus());
  runMoeCaseAt(*comm, GetParam());
}
INSTANTIATE_TEST_SUITE_P(Moe, Gpu2_Moe, ::testing::ValuesIn(moeCaseIndices(MoeCaseList::kLarge)), MoeCaseIndexName());

TEST_P(Gpu2_MoeFourRanksPerGpu, Case) {
  GRAPHEP_REQUIRE_GPUS(2);
  auto comm = createLocalGroup(ranksPerGpu(4));
  runMoeCaseAt(*comm, GetParam());
}
INSTANTIATE_TEST_SUITE_P(Moe, Gpu2_MoeFourRanksPerGpu, ::testing::ValuesIn(moeCaseIndices(MoeCaseList::kSmall)),
                         MoeCaseIndexName());
INSTANTIATE_TEST_SUITE_P(Mixed, Gpu2_MoeFourRanksPerGpu,
                         ::testing::ValuesIn(moeCaseIndices(MoeCaseList::kMixedPlacement)), MoeCaseIndexName());

TEST_P(Gpu2_MoeEmulatedNodes, Case) {
  GRAPHEP_REQUIRE_GPUS(2);
  ScopedEnv emulated("GRAPHEP_EMULATED_NODES", "2");
  for (int perGpu : {2, 4}) {
    SCOPED_TRACE(std::to_string(perGpu) + " ranks per GPU");
    auto comm = createLocalGroup(ranksPerGpu(perGpu));
    runMoeCaseAt(*comm, GetParam());
  }
}
INSTANTIATE_TEST_SUITE_P(Moe, Gpu2_MoeEmulatedNodes, ::testing::ValuesIn(throughputCaseIndices()), MoeCaseIndexName());

TEST(Gpu2_MoeFourRanksPerGpu, GraphsBothPaths) {
  GRAPHEP_REQUIRE_GPUS(2);
  auto comm = createLocalGroup(ranksPerGpu(4));
  runMoeGraphSuite(*comm, MoePath::kAuto, 24);
  runMoeGraphSuite(*comm, MoePath::kThroughput, 16);
}

// Misuse on 2 GPUs, plus a pointer on the other rank's GPU.
TEST(Gpu2_Moe, MisuseAndWrongDevice) {
  GRAPHEP_REQUIRE_GPUS(2);
  auto comm = createLocalGroup(visibleGpus());
  runMoeMisuse(*comm, MoePath::kAuto);
  runMoeMisuse(*comm, MoePath::kThroughput);
  MoeConfig cfg;
  cfg.maxTokensPerRank = 16;
  cfg.hidden = 256;
  cfg.numExperts = 4 * comm->worldSize();
  cfg.topK = 2;
  auto engines = Engine::createAll(*comm, cfg);
  void* onGpu1 = nullptr;
  GRAPHEP_CUDA_CHECK(cudaSetDevice(1));
  GRAPHEP_CUDA_CHECK(cudaMalloc(&onGpu1, 16 * 256 * 2));
  GRAPHEP_CUDA_CHECK(cudaSetDevice(0));
  DispatchArgs a;
  a.x = onGpu1;  // rank 0 runs on GPU 0
  try {
    engines[0]->dispatch(a, nullptr);
    ADD_FAILURE() << "a pointer on another GPU must be rejected";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("lives on device 1, but this rank runs on device 0"), std::string::npos)
        << e.what();
  }
  GRAPHEP_CUDA_CHECK(cudaFree(onGpu1));
}

TEST(Gpu2_MoeOverflow, BothPaths) {
  GRAPHEP_REQUIRE_GPUS(2);
  auto comm = createLocalGroup(visibleGpus());
  runMoeOverflow(*comm, MoePath::kLatency);
  runMoeOverflow(*comm, MoePath::kThroughput);
}

TEST(Gpu2_MoeFaults, MissingRankWatchdogAndGraphLifetime) {
  GRAPHEP_REQUIRE_GPUS(2);
  auto comm = createLocalGroup(visibleGpus());
  runMoeMissingRank(*comm, MoePath::kAuto, true);
  runMoeShrinkOnTimeout(*comm);
  runMoeMissingRank(*comm, MoePath::kThroughput, true);  // the direct kernels
  runMoeWatchdog(*comm);
  runMoeGraphOutlivesEngine(*comm);
}

TEST(Gpu2_MoeFaults, Barrier) {
  GRAPHEP_REQUIRE_GPUS(2);
  auto comm = createLocalGroup(visibleGpus());
  runMoeBarrier(*comm, MoePath::kAuto);
  runMoeBarrier(*comm, MoePath::kThroughput);
}

TEST(Gpu2_MoeGraph, LocalGroupBothPaths) {
  GRAPHEP_REQUIRE_GPUS(2);
  auto comm = createLocalGroup(visibleGpus());
  runMoeGraphSuite(*comm, MoePath::kAuto, 60);
  runMoeGraphSuite(*comm, MoePath::kThroughput, 40);
}

TEST(Gpu2_MoeMicroBatches, LocalGroupBothPaths) {
  GRAPHEP_REQUIRE_GPUS(2);
  auto comm = createLocalGroup(visibleGpus());
  runMoeMicroBatches(*comm, MoePath::kAuto, 6, 0);
  runMoeMicroBatches(*comm, MoePath::kThroughput, 4, 0);
}

TEST(Gpu2_MoeStress, LocalGroupBothPaths) {
  GRAPHEP_REQUIRE_GPUS(2);
  auto comm = createLocalGroup(visibleGpus());
  runMoeStressStandard(*comm);
}

// Every peer forced remote, in one process over the caller's NCCL communicators (one rank per
// GPU): the throughput path carries counts, records and partials through NCCL. The graph suite
// (capture, replays, every graph kind) and the cases with drops, alignment, duplicates, invalid
// ids and replays; the latency path refused by name.
class Gpu2_MoeRemote : public ::testing::TestWithParam<MoeCaseIndex> {};

// The caller's NCCL communicators, one rank per visible GPU, with every peer forced remote (the
// variable is set before the communicator and its heap exist), and the records and partials
// exchanged in 3 chunks (the last one shorter where 3 does not divide T_max).
struct RemoteGroup {
  ScopedEnv force{"GRAPHEP_FORCE_TRANSPORT", "remote"};
  ScopedEnv chunks{"GRAPHEP_EXCHANGE_CHUNKS", "3"};
  CallerNcclComms nccl{visibleGpus()};
  std::unique_ptr<Communicator> comm = nccl.comms[0] != nullptr ? adoptNcclComms(nccl.comms) : nullptr;
};

TEST_P(Gpu2_MoeRemote, Case) {
  GRAPHEP_REQUIRE_GPUS(2);
  RemoteGroup g;
  ASSERT_NE(g.comm, nullptr) << "ncclCommInitAll failed";
  Communicator& comm = *g.comm;
  runMoeCaseAt(comm, GetParam());
}

std::vector<MoeCaseIndex> remoteCases() {
  std::vector<MoeCaseIndex> out;
  for (const MoeCaseIndex& i : moeCaseIndices(MoeCaseList::kSmall)) {
    for (const char* name : {"uniform_varying_T_auto", "fp8_int64_auto", "skewed_throughput", "invalid_ids_auto",
                             "aligned_auto", "overflow_aligned_throughput", "overflow_auto", "duplicates_auto",
                             "graph_replays_auto", "graph_replays_overflow_throughput"}) {
      if (i.name == name) out.push_back(i);
    }
  }
  return out;
}
INSTANTIATE_TEST_SUITE_P(Moe, Gpu2_MoeRemote, ::testing::ValuesIn(remoteCases()), MoeCaseIndexName());

TEST(Gpu2_MoeRemote, GraphSuite) {
  GRAPHEP_REQUIRE_GPUS(2);
  RemoteGroup g;
  ASSERT_NE(g.comm, nullptr) << "ncclCommInitAll failed";
  Communicator& comm = *g.comm;
  runMoeGraphSuite(comm, MoePath::kAuto, 24);  // kAuto: the throughput path, every peer remote
}

TEST(Gpu2_MoeRemote, LatencyPathRefusedByName) {
  GRAPHEP_REQUIRE_GPUS(2);
  RemoteGroup g;
  ASSERT_NE(g.comm, nullptr) << "ncclCommInitAll failed";
  Communicator& comm = *g.comm;
  MoeConfig cfg;
  cfg.maxTokensPerRank = 32;
  cfg.hidden = 256;
  cfg.numExperts = 4 * comm.worldSize();
  cfg.topK = 2;
  cfg.path = MoePath::kLatency;
  try {
    Engine::createAll(comm, cfg);
    ADD_FAILURE() << "the latency path must be refused when peers are reached only through NCCL";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kNotSupported);
    EXPECT_NE(std::string(e.what()).find("path=kLatency needs every peer on this GPU or over NVLink"), std::string::npos)
        << e.what();
  }
  cfg.path = MoePath::kAuto;
  EXPECT_EQ(Engine::createAll(comm, cfg)[0]->path(), MoePath::kThroughput);
}

}  // namespace
}  // namespace graphep::test
