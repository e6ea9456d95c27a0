// The direct path's epilogue kernels (dispatch receive, combine reduce and final) launched in thread-block
// clusters: every size the launcher can fall back to gives the same bytes. The engine asks for
// GRAPHEP_EPILOGUE_CLUSTER and takes the largest power of two up to it that the GPU can place
// (engine/sm_model.hpp clusterSizeFor); each preferred size below runs the same cases, each checked
// against the CPU reference (the dispatch byte for byte, the combine bit-exact or within its bound).
#include <gtest/gtest.h>

#include <graphep/graphep.hpp>

#include <string>
#include <vector>

#include "common/gpu_env.hpp"
#include "common/moe_suite.hpp"
#include "common/nccl_comms.hpp"
#include "engine/error.hpp"
#include "kernels/moe/moe.h"

namespace graphep::test {
namespace {

// The cases run at each size: bf16 with live counts varying across ranks and calls, and fp8 in a
// replayed graph (its quantise kernel shares the epilogues' CTA count).
std::vector<MoeCase> clusterCases(int R) {
  std::vector<MoeCase> out;
  for (const MoeCase& c : moeCases(MoeCaseList::kLarge, R)) {
    if (c.cfg.path == MoePath::kThroughput && (c.name == "uniform_varying_T" || c.name == "graph_replays_fp8")) {
      out.push_back(c);
    }
  }
  return out;
}

TEST(Gpu2_MoeCluster, EveryFallbackSizeGivesTheSameBytes) {
  GRAPHEP_REQUIRE_GPUS(2);
  const std::vector<int> gpus = visibleGpus();
  auto comm = createLocalGroup(gpus);
  const std::vector<MoeCase> cases = clusterCases(comm->worldSize());
  ASSERT_EQ(cases.size(), 2u) << "the cluster cases are missing from the case list";
  GRAPHEP_CUDA_CHECK(cudaSetDevice(gpus[0]));
  // What the GPU can place, as the engine will find it: 2 must be a real cluster launch, and 16
  // (past the portable size, which the kernels do not opt out of) must not, so that asking for it
  // exercises the fallback.
  bool fits2 = false, fits16 = true;
  GRAPHEP_CUDA_CHECK(moeDirectEpilogueFits(2, 108, &fits2));
  GRAPHEP_CUDA_CHECK(moeDirectEpilogueFits(16, 96, &fits16));
  EXPECT_TRUE(fits2) << "clusters of 2 epilogue CTAs do not fit: every size below runs unclustered";
  EXPECT_FALSE(fits16) << "clusters of 16 fit: the preferred size 16 does not exercise the fallback";
  for (const char* preferred : {"1", "2", "4", "8", "16"}) {
    ScopedEnv cluster("GRAPHEP_EPILOGUE_CLUSTER", preferred);
    for (const MoeCase& c : cases) {
      SCOPED_TRACE(std::string("GRAPHEP_EPILOGUE_CLUSTER=") + preferred + ", case " + moeCaseName(c));
      runMoeCase(*comm, c);
    }
  }
}

}  // namespace
}  // namespace graphep::test
