// MoE dispatch / combine on 2 or more GPUs driven from one process (one rank per visible GPU),
// against a CPU reference.
#include <gtest/gtest.h>


#include <graphep/graphep.hpp>

#include "common/gpu_env.hpp"
#include "common/moe_suite.hpp"
#include "common/stress_suite.hpp"
#include "engine/error.hpp"

namespace graphep::test {
namespace {

TEST(Gpu2_Moe, LocalGroupCases) {
  GRAPHEP_REQUIRE_GPUS(2);
  auto comm = createLocalGroup(visibleGpus());
  for (const MoeCase& c : standardMoeCases(comm->worldSize(), true)) runMoeCase(*comm, c);
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
  cfg.numExperts = 4;
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

TEST(Gpu2_MoeFaults, MissingRankWatchdogAndGraphLifetime) {
  GRAPHEP_REQUIRE_GPUS(2);
  auto comm = createLocalGroup(visibleGpus());
  runMoeMissingRank(*comm, MoePath::kAuto);
  runMoeMissingRank(*comm, MoePath::kThroughput);
  runMoeWatchdog(*comm);
  runMoeGraphOutlivesEngine(*comm);
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

}  // namespace
}  // namespace graphep::test
