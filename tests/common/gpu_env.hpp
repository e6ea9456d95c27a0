// Skipping GPU tests with a reason when the hardware is missing.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>

#include <graphep/graphep.hpp>

namespace graphep::test {

// Replays for the mover replay tests: GRAPHEP_TEST_REPLAYS when set (gpu-check's racecheck step
// lowers it, the tool being slow), else `fallback`; never below 200, so that counters started 100
// below the 32-bit wrap still cross it.
inline int testReplays(int fallback) {
  const char* v = std::getenv("GRAPHEP_TEST_REPLAYS");
  const int n = v != nullptr && std::atoi(v) > 0 ? std::atoi(v) : fallback;
  return std::max(n, 200);
}

}  // namespace graphep::test

#define GRAPHEP_REQUIRE_GPUS(n)                                                            \
  do {                                                                                     \
    const char* graphepReason = nullptr;                                                   \
    const int graphepCount = ::graphep::cudaDeviceCountOrZero(&graphepReason);             \
    if (graphepCount < (n)) {                                                              \
      GTEST_SKIP() << "needs " << (n) << " GPU(s), found " << graphepCount                 \
                   << (graphepReason ? std::string(" (") + graphepReason + ")" : std::string()); \
    }                                                                                      \
  } while (0)
