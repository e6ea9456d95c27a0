// The sendrecv case matrix every configuration runs.
#pragma once

#include <vector>

#include "common/mover_suite.hpp"

namespace graphep::test {

inline std::vector<SendRecvCase> standardSendRecvCases(std::size_t maxBytes) {
  std::vector<SendRecvCase> cases;
  for (std::size_t bytes : {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{4095},
                            std::size_t{64} << 10, std::size_t{1} << 20, std::size_t{64} << 20,
                            std::size_t{1} << 30}) {
    if (bytes > maxBytes) continue;
    cases.push_back({bytes, false, false, 0});  // staged ring, adaptive channels
    cases.push_back({bytes, true, false, 0});   // zero-copy ring
    cases.push_back({bytes, false, true, 0});   // staged, rank 0 -> 1 only
  }
  cases.push_back({(std::size_t{1} << 20) + 5, false, false, 1});   // one channel, odd size
  cases.push_back({(std::size_t{3} << 20) + 13, false, false, 16});  // every channel, odd size
  // Every rank sends a different size: LL, single-channel and multi-channel staged directions mix.
  cases.push_back({4000, false, false, 0, (std::size_t{300} << 10) + 7});
  cases.push_back({4000, true, false, 0, (std::size_t{300} << 10) + 7});
  // Zero-copy by the copy engine (automatically from 1 MiB in these tests' fixture) and by the SMs,
  // forced both ways; the size step mixes an SM direction (4000 B) with copy-engine ones on the
  // same ranks.
  cases.push_back({0, true, false, 0, 0, ZeroCopyEngine::kCopyEngine});
  cases.push_back({4095, true, false, 0, 0, ZeroCopyEngine::kCopyEngine});
  cases.push_back({4095, true, true, 0, 0, ZeroCopyEngine::kCopyEngine});
  cases.push_back({4000, true, false, 0, (std::size_t{3} << 20) + 7});
  if (maxBytes >= (std::size_t{64} << 20)) {
    cases.push_back({std::size_t{64} << 20, true, false, 0, 0, ZeroCopyEngine::kSm});
    cases.push_back({(std::size_t{64} << 20) + 1, true, true, 0, 0, ZeroCopyEngine::kCopyEngine});
  }
  return cases;
}

}  // namespace graphep::test
