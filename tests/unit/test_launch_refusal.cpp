// A launcher's refusal names the limit it breaks, with the values, in the engine's error
// (kernels/common/launch.h, engine/error.cpp). The refusals below are checked before any CUDA
// call, so they run without a GPU.
#include <gtest/gtest.h>

#include <string>

#include <graphep/graphep.hpp>

#include "engine/error.hpp"
#include "kernels/common/launch.h"
#include "kernels/moe/moe.h"
#include "kernels/probe.h"

namespace graphep {
namespace {

MoeParams latencyParams() {
  MoeParams p{};
  p.shape.numRanks = 2;
  p.shape.topK = 8;
  p.shape.localExperts = 8;
  p.shape.numExperts = 16;
  p.shape.maxTokens = 128;
  p.grid.budgetCtas = 4;
  p.grid.epilogueCtas = 4;
  p.latency.phase = kMoeLatencySend | kMoeLatencyReceive;
  return p;
}

// The launcher's status and the message the engine's check throws for it.
std::string refusalOf(cudaError_t e) {
  EXPECT_EQ(e, cudaErrorInvalidValue);
  try {
    GRAPHEP_CUDA_CHECK(e);
  } catch (const Error& err) {
    return err.what();
  }
  return "(no error thrown)";
}

TEST(Unit_LaunchRefusal, NamesTheLimitAndTheValue) {
  MoeParams p = latencyParams();
  p.shape.maxTokens = 300;
  std::string why = refusalOf(launchMoeLatencyDispatch(p, nullptr));
  EXPECT_NE(why.find("launchMoeLatencyDispatch: maxTokens 300 (at most 256"), std::string::npos) << why;

  p = latencyParams();
  p.latency.phase = 0;
  why = refusalOf(launchMoeLatencyCombine(p, nullptr));
  EXPECT_NE(why.find("launchMoeLatencyCombine: latency.phase 0"), std::string::npos) << why;

  // The store-into-peers paths' shared limits (moeCheckLimits), named for the launcher that met them.
  p = latencyParams();
  p.shape.topK = kMoeMaxTopK + 1;
  why = refusalOf(launchMoeDirectSend(p, nullptr));
  EXPECT_NE(why.find("launchMoeDirectSend: topK 17 (at most 16)"), std::string::npos) << why;
  p = latencyParams();
  p.shape.localExperts = kMoeMaxLocalExperts + 1;
  why = refusalOf(launchMoeLatencyDispatch(p, nullptr));
  EXPECT_NE(why.find("launchMoeLatencyDispatch: localExperts 1025 (at most 1024)"), std::string::npos) << why;

  p = latencyParams();
  p.shape.topK = kMoeMaxTopK + 1;
  why = refusalOf(launchMoeRoute(p, nullptr));
  EXPECT_NE(why.find("topK 17 (0 to 16)"), std::string::npos) << why;

  p = latencyParams();
  p.grid.epilogueCtas = 0;
  why = refusalOf(launchMoePack(p, MoeSources::kPeers, MoeRange{0, 1}, nullptr));
  EXPECT_NE(why.find("grid.epilogueCtas 0 (at least 1)"), std::string::npos) << why;

  MoeTokenLayoutParams t{};
  t.numRanks = 3;
  t.numExperts = 16;
  t.topK = 2;
  why = refusalOf(launchMoeTokenLayout(t, nullptr));
  EXPECT_NE(why.find("numExperts 16 (a multiple of numRanks 3)"), std::string::npos) << why;

  why = refusalOf(launchPushProbe(nullptr, nullptr, 20, 1, nullptr));
  EXPECT_NE(why.find("20 bytes"), std::string::npos) << why;
}

TEST(Unit_LaunchRefusal, IsTakenOnceAndOnlyForInvalidValue) {
  MoeParams p = latencyParams();
  p.grid.epilogueCtas = 0;
  EXPECT_EQ(launchMoeExpand(p, MoeSources::kPeers, MoeRange{0, 1}, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(takeLaunchRefusal().find("launchMoeExpand"), std::string::npos);
  EXPECT_EQ(takeLaunchRefusal(), "");  // cleared once read
  // Another CUDA error does not carry a refusal left from an earlier launch.
  EXPECT_EQ(launchMoeExpand(p, MoeSources::kPeers, MoeRange{0, 1}, nullptr), cudaErrorInvalidValue);
  try {
    GRAPHEP_CUDA_CHECK(cudaErrorMemoryAllocation);
    FAIL() << "no error thrown";
  } catch (const Error& err) {
    EXPECT_EQ(std::string(err.what()).find("launchMoeExpand"), std::string::npos) << err.what();
  }
}

}  // namespace
}  // namespace graphep
