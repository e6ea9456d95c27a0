// Skipping GPU tests with a reason when the hardware is missing, and failing them instead when the
// machine is known to have it.
//
// GRAPHEP_EXPECT_GPUS=N (a test variable, not the library's: scripts/gpu-check.sh sets it to the
// GPU count nvidia-smi lists) says this machine has N usable GPUs. A test that needs n GPUs:
//
//   found >= n                      run
//   variable unset or empty         skip, naming n, the count found and the CUDA error (CI: no GPU)
//   variable set, n <= N, found < n FAIL, naming the same: a broken driver or a hidden GPU must not
//                                   pass as a skip
//   variable set, n > N             skip (e.g. a 4-GPU test on a 2-GPU machine)
//   variable not a count 0..4096    FAIL, naming the value (whatever the GPUs)
#pragma once

#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cerrno>
#include <cstdlib>
#include <graphep/graphep.hpp>
#include <memory>
#include <string>
#include <vector>

namespace graphep::test {

inline constexpr const char* kExpectGpusVar = "GRAPHEP_EXPECT_GPUS";

// Ordered so that the worst over several ranks is the maximum (MPI_MAX in the MPI tests).
enum class GpuVerdict : int { kRun = 0, kSkip = 1, kFail = 2 };

struct GpuRequirement {
  GpuVerdict verdict;
  std::string reason;  // empty for kRun
};

// The rule above as a pure function. `needed`: GPUs the test needs; `found`, `cudaReason`: what
// cudaDeviceCountOrZero returned and its reason (nullptr when none); `expectEnv`: the value of
// GRAPHEP_EXPECT_GPUS (nullptr when unset).
inline GpuRequirement gpuRequirement(int needed, int found, const char* cudaReason,
                                     const char* expectEnv) {
  std::string seen = "needs " + std::to_string(needed) + " GPU(s), found " + std::to_string(found);
  if (cudaReason != nullptr && *cudaReason != '\0') seen += std::string(" (") + cudaReason + ")";
  const bool set = expectEnv != nullptr && *expectEnv != '\0';
  long expected = 0;
  if (set) {
    char* end = nullptr;
    errno = 0;
    expected = std::strtol(expectEnv, &end, 10);
    if (end == expectEnv || *end != '\0' || errno != 0 || expected < 0 || expected > 4096) {
      return {GpuVerdict::kFail, std::string(kExpectGpusVar) + "='" + expectEnv +
                                     "' is not a GPU count (an integer 0..4096)"};
    }
  }
  if (found >= needed) return {GpuVerdict::kRun, {}};
  if (!set) return {GpuVerdict::kSkip, seen};
  const std::string says = std::string(kExpectGpusVar) + "=" + std::to_string(expected);
  if (needed <= expected) {
    return {GpuVerdict::kFail,
            seen + ", but " + says + ": a GPU this machine has is missing or unusable"};
  }
  return {GpuVerdict::kSkip, seen + " (" + says + ")"};
}

// The rule for this process: counts the visible GPUs and reads GRAPHEP_EXPECT_GPUS.
inline GpuRequirement gpuRequirement(int needed) {
  const char* why = nullptr;
  const int found = ::graphep::cudaDeviceCountOrZero(&why);
  return gpuRequirement(needed, found, why, std::getenv(kExpectGpusVar));
}

// Whether the environment variable `var` is set to `value`.
inline bool envIs(const char* var, const char* value) {
  const char* v = std::getenv(var);
  return v != nullptr && std::string(v) == value;
}

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

// Whether every two of `devices` take the latency path's 128-byte lines whole (the engine's
// takesWholeLines): the same GPU, or P2P with native atomics (NVLink), not PCIe. The engine
// refuses the latency path across other peers, and its kAuto takes the throughput path.
inline bool gpusTakeWholeLines(const std::vector<int>& devices) {
  for (int i : devices) {
    for (int j : devices) {
      if (i == j) continue;
      int can = 0, atomics = 0;
      if (cudaDeviceCanAccessPeer(&can, i, j) != cudaSuccess || can == 0) return false;
      if (cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, i, j) != cudaSuccess || atomics == 0) {
        return false;
      }
    }
  }
  return true;
}

// `perGpu` ranks on each visible GPU, in GPU order (0, 0, ..., 1, 1, ...): ranks with both
// same-GPU and NVLink peers.
inline std::vector<int> ranksPerGpu(int perGpu) {
  std::vector<int> d;
  for (int g : visibleGpus()) d.insert(d.end(), static_cast<std::size_t>(perGpu), g);
  return d;
}

}  // namespace graphep::test

// Runs the rest of the test (or SetUp) only with `n` GPUs; else skips or fails it by the rule
// above.
#define GRAPHEP_REQUIRE_GPUS(n)                                                            \
  do {                                                                                     \
    const ::graphep::test::GpuRequirement graphepReq = ::graphep::test::gpuRequirement(n); \
    if (graphepReq.verdict == ::graphep::test::GpuVerdict::kFail)                          \
      GTEST_FAIL() << graphepReq.reason;                                                   \
    if (graphepReq.verdict == ::graphep::test::GpuVerdict::kSkip)                          \
      GTEST_SKIP() << graphepReq.reason;                                                   \
  } while (0)

namespace graphep::test {

// The fixture of the one-GPU tests of four ranks emulated on GPU 0 (a local group with a repeated
// device): the group is made in SetUp once the GPU is known to be there, so each test's body is
// only what it runs on it.
class FourEmulatedRanks : public ::testing::Test {
 protected:
  void SetUp() override {
    GRAPHEP_REQUIRE_GPUS(1);
    comm_ = createLocalGroup({0, 0, 0, 0});
  }
  std::unique_ptr<Communicator> comm_;
};

}  // namespace graphep::test
