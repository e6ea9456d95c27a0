// The premise of the latency dispatch's 128-byte payload lines (kernels/moe/latency.cu; NCCL's
// LL128 layout): a line that one warp instruction stores, 8 lanes of 16 bytes, lands whole for a
// reader's load of one warp instruction, so a reader that sees a line's tag word holds the whole
// line. The PTX memory model does not promise it (it makes 8-byte accesses single-copy atomic),
// so it is tested here on the machine's GPUs: a writer rewrites every line round after round
// while a reader checks each line it sees against the round its tag word names. A control writer
// stores the tag word alone, then the data after a pause: the reader must see those lines torn,
// which shows that the check can see tearing at all. Lines are stored and loaded by whole warps
// (8 lanes a line, four lines an instruction, as a chunk's rounds) and by 8 active lanes alone
// (one line an instruction, as a chunk's spill line: kernels/moe/lines.cuh).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstdint>

#include "common/gpu_env.hpp"
#include "kernels/common/ptx.cuh"

namespace graphep::test {
namespace {

constexpr int kLines = 512;           // 64 KB of lines
constexpr unsigned kRounds = 4000;    // every line rewritten this many times
constexpr int kThreads = 128;         // 4 warps a CTA, a warp 4 lines at a time
constexpr int kCtas = 4;
constexpr std::uint64_t kReaderBudgetNs = 2'000'000'000ull;

// Data word i (< 15) of `line` in round `round`: a hash, never 0.
__host__ __device__ inline std::uint64_t lineWord(unsigned line, unsigned round, int i) {
  std::uint64_t x = (static_cast<std::uint64_t>(line) << 40) ^ (static_cast<std::uint64_t>(round) << 8) ^ static_cast<unsigned>(i);
  x *= 0x9E3779B97F4A7C15ull;
  x ^= x >> 29;
  return x | 1u;
}

__device__ inline uint4 pieceOf(std::uint64_t lo, std::uint64_t hi) {
  return make_uint4(static_cast<std::uint32_t>(lo), static_cast<std::uint32_t>(lo >> 32), static_cast<std::uint32_t>(hi),
                    static_cast<std::uint32_t>(hi >> 32));
}

// How a warp covers its group of four lines: whole (lanes 8k .. 8k + 7 store or load line k,
// piece lane % 8: four lines an instruction), or by 8 active lanes (lanes 0-7 line k in pass k,
// the other lanes idle: one line an instruction).
__device__ inline int passes(bool eightLanes) { return eightLanes ? 4 : 1; }
__device__ inline bool laneActive(bool eightLanes, int lane) { return !eightLanes || lane < 8; }
__device__ inline unsigned lineOf(bool eightLanes, int group, int pass, int lane) {
  return 4u * static_cast<unsigned>(group) + static_cast<unsigned>(eightLanes ? pass : lane / 8);
}

// Rounds 1 .. rounds of every line, each piece lane % 8 of its line (piece 7's high word: the
// tag, the round). tagFirst (the control): the tag word alone first, then every piece's data
// after a pause.
__global__ void writeLines(uint4* lines, unsigned rounds, bool tagFirst, bool eightLanes) {
  const int lane = static_cast<int>(threadIdx.x % 32), piece = lane % 8;
  const int warp = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) / 32), warps = static_cast<int>(gridDim.x * blockDim.x / 32);
  for (unsigned r = 1; r <= rounds; ++r) {
    for (int group = warp; group < kLines / 4; group += warps) {
      for (int pass = 0; pass < passes(eightLanes); ++pass) {
        if (!laneActive(eightLanes, lane)) continue;
        const unsigned line = lineOf(eightLanes, group, pass, lane);
        uint4* at = lines + 8u * line + static_cast<unsigned>(piece);
        const std::uint64_t lo = lineWord(line, r, 2 * piece);
        const std::uint64_t hi = piece == 7 ? r : lineWord(line, r, 2 * piece + 1);
        if (!tagFirst) {
          ptx::stVolatileV4(at, pieceOf(lo, hi));  // the line: one instruction of 8 lanes
          continue;
        }
        if (piece == 7) {
          auto* tag = reinterpret_cast<volatile std::uint64_t*>(at) + 1;
          *tag = hi;
        }
        __nanosleep(2000);
        auto* words = reinterpret_cast<volatile std::uint64_t*>(at);
        words[0] = lo;
        if (piece != 7) words[1] = hi;
      }
    }
  }
}

// Reads every line again and again (one instruction of 8 lanes a line) until each has shown the
// last round or the budget is spent: counts the lines seen with a round's tag, those seen before
// the last round, and those torn (a word not the round's its tag names).
__global__ void readLines(const uint4* lines, unsigned rounds, bool eightLanes, unsigned long long* counts) {
  const int lane = static_cast<int>(threadIdx.x % 32), piece = lane % 8;
  const int warp = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) / 32), warps = static_cast<int>(gridDim.x * blockDim.x / 32);
  const std::uint64_t start = ptx::globalTimerNs();
  unsigned long long seen = 0, early = 0, torn = 0;
  bool done = false;
  // The budget decided by lane 0 for the warp, so that its lanes leave together.
  while (!done && __shfl_sync(0xffffffffu, ptx::globalTimerNs() - start < kReaderBudgetNs, 0)) {
    done = true;
    for (int group = warp; group < kLines / 4; group += warps) {
      for (int pass = 0; pass < passes(eightLanes); ++pass) {
        const bool active = laneActive(eightLanes, lane);
        const unsigned line = lineOf(eightLanes, group, pass, lane);
        const uint4 v = active ? ptx::ldVolatileV4(lines + 8u * line + static_cast<unsigned>(piece)) : make_uint4(0u, 0u, 0u, 0u);
        const std::uint64_t lo = static_cast<std::uint64_t>(v.y) << 32 | v.x, hi = static_cast<std::uint64_t>(v.w) << 32 | v.z;
        const std::uint64_t tag = __shfl_sync(0xffffffffu, hi, (lane & ~7) + 7);  // the line's tag word
        bool bad = false;  // an idle lane of an 8-lane pass loaded nothing: nothing to check
        if (active && tag != 0 && tag <= rounds) {
          const unsigned r = static_cast<unsigned>(tag);
          bad = lo != lineWord(line, r, 2 * piece) || (piece != 7 && hi != lineWord(line, r, 2 * piece + 1));
        } else if (active && tag != 0) {
          bad = true;  // not a round at all
        }
        const unsigned tornLanes = __ballot_sync(0xffffffffu, bad);
        if (piece == 0 && active) {
          const bool lineTorn = ((tornLanes >> (lane & ~7)) & 0xffu) != 0;
          if (tag != 0) ++seen;
          if (tag != 0 && tag < rounds) ++early;
          if (lineTorn) ++torn;
        }
        done = done && __all_sync(0xffffffffu, !active || tag == rounds);
      }
    }
  }
  if (piece == 0) {
    atomicAdd(&counts[0], seen);
    atomicAdd(&counts[1], early);
    atomicAdd(&counts[2], torn);
  }
}

struct Counts {
  unsigned long long seen, early, torn;
};

// Lines in `home`'s memory, written from `writer` (peer access when they differ) while `home`
// reads them; each kernel on its own stream. Everything a launch could wait for is done first
// (peer access, streams, both kernels loaded: a kernel loaded lazily while the reader spins may
// wait for it), then the reader starts, then the writer.
void race(int home, int writer, bool tagFirst, bool eightLanes, Counts& c) {
  ASSERT_EQ(cudaSetDevice(writer), cudaSuccess);
  if (writer != home) {
    const cudaError_t e = cudaDeviceEnablePeerAccess(home, 0);
    ASSERT_TRUE(e == cudaSuccess || e == cudaErrorPeerAccessAlreadyEnabled) << cudaGetErrorString(e);
    (void)cudaGetLastError();
  }
  cudaStream_t writeStream = nullptr, readStream = nullptr;
  cudaFuncAttributes attr{};
  ASSERT_EQ(cudaStreamCreateWithFlags(&writeStream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaFuncGetAttributes(&attr, writeLines), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(home), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&readStream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaFuncGetAttributes(&attr, readLines), cudaSuccess);
  uint4* lines = nullptr;
  unsigned long long* counts = nullptr;
  ASSERT_EQ(cudaMalloc(&lines, kLines * 128), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&counts, 3 * sizeof(unsigned long long)), cudaSuccess);
  ASSERT_EQ(cudaMemset(lines, 0, kLines * 128), cudaSuccess);
  ASSERT_EQ(cudaMemset(counts, 0, 3 * sizeof(unsigned long long)), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  readLines<<<kCtas, kThreads, 0, readStream>>>(lines, kRounds, eightLanes, counts);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(writer), cudaSuccess);
  writeLines<<<kCtas, kThreads, 0, writeStream>>>(lines, kRounds, tagFirst, eightLanes);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(writeStream), cudaSuccess);
  ASSERT_EQ(cudaStreamDestroy(writeStream), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(home), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(readStream), cudaSuccess);
  ASSERT_EQ(cudaStreamDestroy(readStream), cudaSuccess);
  unsigned long long h[3] = {};
  ASSERT_EQ(cudaMemcpy(h, counts, sizeof(h), cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaFree(lines), cudaSuccess);
  ASSERT_EQ(cudaFree(counts), cudaSuccess);
  c = Counts{h[0], h[1], h[2]};
}

// The reader saw the writer's rounds go by (early lines: the race took place), and no line torn;
// the control writer's lines were seen torn. Whole warps, then 8 active lanes.
void checkPremise(int home, int writer) {
  if (writer != home && !gpusTakeWholeLines({writer, home})) {
    GTEST_SKIP() << "GPUs " << writer << " and " << home << " are not joined with native P2P atomics (PCIe or no P2P): "
                 << "the latency path, whose lines this checks, takes no such peer";
  }
  for (const bool eightLanes : {false, true}) {
    SCOPED_TRACE(eightLanes ? "8 active lanes a line, one line an instruction" : "whole warps, four lines an instruction");
    Counts control{};
    ASSERT_NO_FATAL_FAILURE(race(home, writer, true, eightLanes, control));
    EXPECT_GT(control.early, 100u) << "the control's reader saw too few rounds before the last: no race";
    EXPECT_GT(control.torn, 0u) << "the control writer's lines (tag first, data after a pause) were never seen torn: "
                                   "the check cannot see tearing";
    Counts lines{};
    ASSERT_NO_FATAL_FAILURE(race(home, writer, false, eightLanes, lines));
    EXPECT_GT(lines.early, 100u) << "the reader saw too few rounds before the last (" << lines.early << "): no race";
    EXPECT_EQ(lines.torn, 0u) << lines.torn << " of " << lines.seen << " lines seen torn: a 128-byte line stored by one "
                              << "warp instruction did not land whole";
  }
}

TEST(Gpu2_LinePremise, LinesFromAPeerLandWhole) {
  GRAPHEP_REQUIRE_GPUS(2);
  checkPremise(0, 1);
}

TEST(Gpu1_LinePremise, LinesFromThisGpuLandWhole) {
  GRAPHEP_REQUIRE_GPUS(1);
  checkPremise(0, 0);
}

}  // namespace
}  // namespace graphep::test
