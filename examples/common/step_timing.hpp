// How the main job times its decode steps: CUDA events around each step's graph launches, and a
// StepProbe whose events a profiled copy of a rank's graph records (event-record nodes) at the
// points of a step, for the breakdown of where a step's time goes.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "common/cuda_raii.hpp"

namespace graphep::example {

inline double percentile(const std::vector<double>& sorted, double p) {
  return sorted[std::min(sorted.size() - 1, static_cast<std::size_t>(p * static_cast<double>(sorted.size())))];
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return percentile(v, 0.5);
}

inline void printStepTimes(const char* what, const std::vector<double>& sortedUs) {
  std::printf("%s: p50 %.1f  p90 %.1f  p99 %.1f  max %.1f us per step (%zu graph replays)\n", what,
              percentile(sortedUs, 0.5), percentile(sortedUs, 0.9), percentile(sortedUs, 0.99), sortedUs.back(),
              sortedUs.size());
}

// `steps` decode steps, each enqueued by launchStep() between two events on `timed` (a stream of
// `device`), so each time is the step's GPU time on that stream while the host runs ahead. After
// every checkEvery-th step and the last, check(step) runs. Returns the step times, sorted (us).
template <class Launch, class Check>
std::vector<double> timeDecodeSteps(int steps, int checkEvery, int device, cudaStream_t timed, Launch&& launchStep,
                                    Check&& check) {
  const DeviceGuard guard(device);
  std::vector<Event> begin, end;
  for (int s = 0; s < steps; ++s) {
    begin.push_back(makeEvent(device));
    end.push_back(makeEvent(device));
  }
  for (int s = 0; s < steps; ++s) {
    GRAPHEP_EXAMPLE_CUDA_CHECK(cudaEventRecord(begin[s].get(), timed));
    launchStep();
    GRAPHEP_EXAMPLE_CUDA_CHECK(cudaEventRecord(end[s].get(), timed));
    if ((s + 1) % checkEvery == 0 || s == steps - 1) check(static_cast<std::uint32_t>(s));
  }
  std::vector<double> us;
  for (int s = 0; s < steps; ++s) {
    GRAPHEP_EXAMPLE_CUDA_CHECK(cudaEventSynchronize(end[s].get()));
    us.push_back(elapsedUs(begin[s], end[s]));
  }
  std::sort(us.begin(), us.end());
  return us;
}

// The points of a step, in order, and the segments between them.
enum class StepPoint : int { kStart, kRouted, kDispatched, kGathered, kComputed, kScattered, kCombined };
constexpr int kNumStepPoints = 7;
constexpr std::array<const char*, kNumStepPoints - 1> kStepSegments = {"route",        "dispatch", "gather",
                                                                       "expert GEMMs", "scatter",  "combine"};

class StepProbe {
 public:
  explicit StepProbe(int device) {
    for (int p = 0; p < kNumStepPoints; ++p) events_.push_back(makeEvent(device));
  }

  cudaEvent_t event(StepPoint point) const { return events_[static_cast<int>(point)].get(); }

  // Capturable: an event-record node for `point` when captured (recorded by every replay).
  void mark(StepPoint point, cudaStream_t stream) const {
    GRAPHEP_EXAMPLE_CUDA_CHECK(cudaEventRecordWithFlags(event(point), stream, cudaEventRecordExternal));
  }

  // After a profiled replay completed: its segment times.
  void collect() {
    for (int p = 0; p + 1 < kNumStepPoints; ++p) segments_[p].push_back(elapsedUs(events_[p], events_[p + 1]));
  }

  // The median of each segment over the collected replays (us).
  double medianUs(StepPoint from) const { return median(segments_[static_cast<int>(from)]); }

  int replays() const { return static_cast<int>(segments_[0].size()); }

  // "segment t | ... = total" of the medians.
  void printBreakdown() const {
    double total = 0;
    for (int p = 0; p + 1 < kNumStepPoints; ++p) {
      const double us = median(segments_[p]);
      total += us;
      std::printf(" %s %.1f%s", kStepSegments[p], us, p + 2 < kNumStepPoints ? " |" : "");
    }
    std::printf(" = %.1f\n", total);
  }

 private:
  std::vector<Event> events_;
  std::array<std::vector<double>, kNumStepPoints - 1> segments_;
};

}  // namespace graphep::example
