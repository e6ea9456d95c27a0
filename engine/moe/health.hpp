// What Engine::checkHealth reads from a stalled latency-path rank, and what it says about it
// (a pure function: unit-tested on the CPU, wrap cases included).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace graphep::detail {

struct LatencyCounters {
  std::uint32_t dispatchStep = 0;  // llSteps[0]: the dispatch step in progress (or the next one)
  std::uint32_t combineStep = 0;   // llSteps[1]
  std::uint32_t pending = 0;       // 1: a dispatch finished, so the combine is what is running
  std::uint32_t ctas = 0;          // G: the combine's send CTAs on every rank (each adds one arrival)
  int rank = -1;                   // this rank: its own partials are reduced by its own receiver (no counter)
  std::vector<std::uint32_t> flags, combineArrivals;  // [R] each, this rank's inbox (combine: peers only)
  // The active-rank masks of the dispatch and of the combine (the last dispatch's); ranks outside
  // them are waited for by no one. The combine's arrivals expected before this step from each rank
  // (latency.expected); empty: step x G (every rank took part in every step).
  std::uint32_t dispatchLive = ~0u, combineLive = ~0u;
  std::vector<std::uint32_t> combineExpected;
  // The device barrier (Engine::barrier): this rank's count of barriers with each rank, and each
  // rank's post of it in this rank's slot; empty: not snapshot.
  std::vector<std::uint32_t> barrierPairs, barrierPosts;
};

// "; rank q's count message for dispatch step s has not arrived (flag f)", one clause per peer
// that is short of the step; a sentence saying every peer is complete when none is. A barrier
// this rank entered and a live peer has not reached comes first ("; rank q has not reached
// barrier n (its post p)"): the barrier's kernel is then what waits.
std::string describeLatencyStall(const LatencyCounters& c);

}  // namespace graphep::detail
