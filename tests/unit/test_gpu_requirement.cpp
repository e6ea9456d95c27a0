// CPU unit tests: when a GPU test runs, skips or fails (gpuRequirement, common/gpu_env.hpp).
#include <gtest/gtest.h>

#include <string>

#include "common/gpu_env.hpp"

namespace graphep::test {
namespace {

TEST(Unit_GpuRequirement, RunsWhenTheGpusArePresentWhateverTheVariable) {
  for (const char* expect : {static_cast<const char*>(nullptr), "", "0", "2", "8"}) {
    const GpuRequirement r = gpuRequirement(2, 2, nullptr, expect);
    EXPECT_EQ(r.verdict, GpuVerdict::kRun) << (expect ? expect : "(unset)");
    EXPECT_EQ(r.reason, "");
  }
  EXPECT_EQ(gpuRequirement(2, 8, nullptr, "2").verdict, GpuVerdict::kRun);
}

TEST(Unit_GpuRequirement, SkipsWithAReasonWithoutTheVariable) {
  for (const char* expect : {static_cast<const char*>(nullptr), ""}) {
    const GpuRequirement r = gpuRequirement(1, 0, "cudaErrorNoDevice", expect);
    EXPECT_EQ(r.verdict, GpuVerdict::kSkip);
    EXPECT_EQ(r.reason, "needs 1 GPU(s), found 0 (cudaErrorNoDevice)");
  }
  EXPECT_EQ(gpuRequirement(2, 1, nullptr, nullptr).reason, "needs 2 GPU(s), found 1");
}

// The hole this closes: a broken driver on a GPU machine read as a skip, and the run was green.
TEST(Unit_GpuRequirement, FailsNamingTheCudaErrorWhenTheMachineHasTheGpus) {
  const GpuRequirement r = gpuRequirement(1, 0, "cudaErrorInsufficientDriver", "2");
  EXPECT_EQ(r.verdict, GpuVerdict::kFail);
  EXPECT_EQ(r.reason,
            "needs 1 GPU(s), found 0 (cudaErrorInsufficientDriver), but GRAPHEP_EXPECT_GPUS=2: a "
            "GPU this machine has is missing or unusable");
  const GpuRequirement some = gpuRequirement(2, 1, nullptr, "2");  // found 1 of 2
  EXPECT_EQ(some.verdict, GpuVerdict::kFail);
  EXPECT_NE(some.reason.find("needs 2 GPU(s), found 1, but GRAPHEP_EXPECT_GPUS=2"),
            std::string::npos)
      << some.reason;
}

TEST(Unit_GpuRequirement, SkipsATestNeedingMoreGpusThanTheMachineHas) {
  const GpuRequirement r = gpuRequirement(4, 2, nullptr, "2");
  EXPECT_EQ(r.verdict, GpuVerdict::kSkip);
  EXPECT_EQ(r.reason, "needs 4 GPU(s), found 2 (GRAPHEP_EXPECT_GPUS=2)");
  EXPECT_EQ(gpuRequirement(1, 0, "cudaErrorNoDevice", "0").verdict, GpuVerdict::kSkip);
}

TEST(Unit_GpuRequirement, ABadVariableIsANamedFailure) {
  for (const char* bad : {"two", "2x", "-1", "4097", " ", "99999999999999999999"}) {
    for (int found : {0, 8}) {
      const GpuRequirement r = gpuRequirement(1, found, nullptr, bad);
      EXPECT_EQ(r.verdict, GpuVerdict::kFail) << bad;
      EXPECT_EQ(r.reason, std::string("GRAPHEP_EXPECT_GPUS='") + bad +
                              "' is not a GPU count (an integer 0..4096)");
    }
  }
}

// The verdicts order so that the worst over MPI ranks is their maximum.
TEST(Unit_GpuRequirement, VerdictsOrderRunSkipFail) {
  EXPECT_LT(static_cast<int>(GpuVerdict::kRun), static_cast<int>(GpuVerdict::kSkip));
  EXPECT_LT(static_cast<int>(GpuVerdict::kSkip), static_cast<int>(GpuVerdict::kFail));
}

}  // namespace
}  // namespace graphep::test
