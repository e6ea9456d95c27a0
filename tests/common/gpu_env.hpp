// Skipping GPU tests with a reason when the hardware is missing.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <vector>

#include <graphep/graphep.hpp>

namespace graphep::test {

// A replay count from the environment variable `var` when set to a positive number, else
// `fallback` (GRAPHEP_STRESS_REPLAYS: the MoeGraph stress; GRAPHEP_TEST_REPLAYS: the mover replay
// test, which gpu-check's racecheck step lowers, the tool being slow).
inline long long replaysFromEnv(const char* var, long long fallback) {
  const char* v = std::getenv(var);
  return v != nullptr && std::atoll(v) > 0 ? std::atoll(v) : fallback;
}

// Every visible GPU, 0 .. n-1 (CUDA_VISIBLE_DEVICES picks them): the in-process multi-GPU MoE
// and mover tests run one rank per GPU over all of them (2 on a 2-GPU machine, 8 on an 8-GPU one).
inline std::vector<int> visibleGpus() {
  std::vector<int> d(static_cast<std::size_t>(::graphep::cudaDeviceCountOrZero(nullptr)));
  for (std::size_t i = 0; i < d.size(); ++i) d[i] = static_cast<int>(i);
  return d;
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
