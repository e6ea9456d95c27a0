// Skipping GPU tests with a reason when the hardware is missing.
#pragma once

#include <gtest/gtest.h>

#include <graphep/graphep.hpp>

#define GRAPHEP_REQUIRE_GPUS(n)                                                            \
  do {                                                                                     \
    const char* graphepReason = nullptr;                                                   \
    const int graphepCount = ::graphep::cudaDeviceCountOrZero(&graphepReason);             \
    if (graphepCount < (n)) {                                                              \
      GTEST_SKIP() << "needs " << (n) << " GPU(s), found " << graphepCount                 \
                   << (graphepReason ? std::string(" (") + graphepReason + ")" : std::string()); \
    }                                                                                      \
  } while (0)
