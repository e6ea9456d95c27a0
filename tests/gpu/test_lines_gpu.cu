// kernels/moe/lines.cuh on one GPU, apart from the engine: a warp's shares stored as tagged
// 128-byte lines and read back, in each layout the latency path uses (the dispatch's fp8 chunk:
// one round and the tiles' scales; its bf16 chunk: two rounds; the combine's partial chunk: one
// round), on fresh random shares with the outputs poisoned; the lines as stored, checked piece by
// piece against the layout lines.cuh describes; and a chunk one of whose lines carries another
// step's tag, whose read times out and reports the site, the peer, the tag waited for and the
// missing line's.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/gpu_env.hpp"
#include "kernels/moe/lines.cuh"

namespace graphep::test {
namespace {

constexpr std::uint32_t kTag = 0x80000005u, kOtherTag = 0x80000007u;
constexpr int kPeer = 3;

// One warp: its shares in[32 r + lane] (and, kScales, tile lane / 8's scale) stored as lines at
// `lines` with kTag, then (with `poisonLine` >= 0, that line's tag word first overwritten with
// kOtherTag) read back with `waitTag` into out and scalesOut; *landed: readLines' answer.
template <int kRounds, bool kScales>
__global__ void storeThenRead(const uint4* in, const float* scalesIn, uint4* lines, int poisonLine, std::uint32_t waitTag, SyncHandle h,
                              uint4* out, float* scalesOut, int* landed) {
  const int lane = static_cast<int>(threadIdx.x);
  uint4 v[kRounds];
  for (int r = 0; r < kRounds; ++r) v[r] = in[32 * r + lane];
  moe_lines::storeLines<kRounds, kScales>(lines, lane, v, kScales ? scalesIn[lane / 8] : 0.f, kTag);
  __syncwarp();
  if (poisonLine >= 0 && lane == 0) {
    ptx::stVolatileV4(lines + 8 * poisonLine + 7, make_uint4(0u, 0u, kOtherTag, kOtherTag));
  }
  __syncwarp();
  uint4 o[kRounds];
  for (int r = 0; r < kRounds; ++r) o[r] = make_uint4(0xdeadbeefu, 0xdeadbeefu, 0xdeadbeefu, 0xdeadbeefu);
  float scale = -1.f;
  const bool ok = moe_lines::readLines<kRounds, kScales>(h, lines, lane, waitTag, kPeer, WaitSite::kMoeCombine, o, scale);
  for (int r = 0; r < kRounds; ++r) out[32 * r + lane] = o[r];
  scalesOut[lane] = scale;
  if (lane == 0) *landed = ok ? 1 : 0;
}

bool same(const uint4& a, const uint4& b) { return a.x == b.x && a.y == b.y && a.z == b.z && a.w == b.w; }

// A rank's error sink and a SyncHandle around it (timeout `timeoutNs`), freed with it.
struct Sink {
  DeviceErrorRecord* record = nullptr;
  std::uint32_t* words = nullptr;
  SyncHandle handle{};
  explicit Sink(std::uint64_t timeoutNs) {
    EXPECT_EQ(cudaHostAlloc(&record, sizeof(DeviceErrorRecord), cudaHostAllocMapped), cudaSuccess);
    *record = DeviceErrorRecord{};
    EXPECT_EQ(cudaMalloc(&words, kDeviceErrorWords * sizeof(std::uint32_t)), cudaSuccess);
    EXPECT_EQ(cudaMemset(words, 0, kDeviceErrorWords * sizeof(std::uint32_t)), cudaSuccess);
    DeviceErrorRecord* mapped = nullptr;
    EXPECT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&mapped), record, 0), cudaSuccess);
    handle.rank = 0;
    handle.numRanks = 1;
    handle.timeoutNs = timeoutNs;
    handle.trapOnTimeout = 0;
    handle.error = DeviceErrorSink{mapped, words};
  }
  ~Sink() {
    cudaFreeHost(record);
    cudaFree(words);
  }
};

struct Result {
  std::vector<uint4> lines, out;
  std::vector<float> scales;
  int landed = -1;
};

// Runs storeThenRead on fresh shares (seeded), returns what it stored and read.
template <int kRounds, bool kScales>
Result run(std::uint64_t seed, int poisonLine, std::uint32_t waitTag, const Sink& sink, std::vector<uint4>& in, std::vector<float>& scales) {
  constexpr int kPieces = moe_lines::kPieces<kRounds>;
  std::mt19937_64 rng(seed);
  in.assign(32 * kRounds, uint4{});
  for (uint4& v : in) v = make_uint4(static_cast<std::uint32_t>(rng()), static_cast<std::uint32_t>(rng()), static_cast<std::uint32_t>(rng()),
                                     static_cast<std::uint32_t>(rng()));
  scales.assign(4, 0.f);
  for (float& s : scales) s = std::uniform_real_distribution<float>(0.001f, 4.f)(rng);
  uint4 *dIn = nullptr, *dLines = nullptr, *dOut = nullptr;
  float *dScales = nullptr, *dScalesOut = nullptr;
  int* dLanded = nullptr;
  Result res;
  EXPECT_EQ(cudaMalloc(&dIn, in.size() * sizeof(uint4)), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&dLines, kPieces * sizeof(uint4)), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&dOut, in.size() * sizeof(uint4)), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&dScales, 4 * sizeof(float)), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&dScalesOut, 32 * sizeof(float)), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&dLanded, sizeof(int)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(dIn, in.data(), in.size() * sizeof(uint4), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(dScales, scales.data(), 4 * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemset(dLines, 0xa5, kPieces * sizeof(uint4)), cudaSuccess);  // poison: no tag, no data
  EXPECT_EQ(cudaMemset(dOut, 0x5a, in.size() * sizeof(uint4)), cudaSuccess);
  EXPECT_EQ(cudaMemset(dScalesOut, 0x5a, 32 * sizeof(float)), cudaSuccess);
  EXPECT_EQ(cudaMemset(dLanded, 0xff, sizeof(int)), cudaSuccess);  // -1: the kernel never said
  storeThenRead<kRounds, kScales><<<1, 32>>>(dIn, dScales, dLines, poisonLine, waitTag, sink.handle, dOut, dScalesOut, dLanded);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  res.lines.resize(kPieces);
  res.out.resize(in.size());
  res.scales.resize(32);
  EXPECT_EQ(cudaMemcpy(res.lines.data(), dLines, kPieces * sizeof(uint4), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(res.out.data(), dOut, in.size() * sizeof(uint4), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(res.scales.data(), dScalesOut, 32 * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(&res.landed, dLanded, sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(dIn);
  cudaFree(dLines);
  cudaFree(dOut);
  cudaFree(dScales);
  cudaFree(dScalesOut);
  cudaFree(dLanded);
  return res;
}

// The lines as lines.cuh lays them out, from the shares, counted piece by piece: round r's piece
// L is lane L's share (a line's last lane: its first 8 bytes, then the tag); spill piece k < 2
// kRounds the cut halves of lanes 16 (k % 2) + 7 and + 15 of round k / 2; with kScales piece 2
// the four scales; the other spill pieces zero; every line's last piece ends with the tag.
template <int kRounds, bool kScales>
int wrongPieces(const std::vector<uint4>& in, const std::vector<float>& scales, const std::vector<uint4>& lines) {
  int wrong = 0;
  for (int r = 0; r < kRounds; ++r) {
    for (int l = 0; l < 32; ++l) {
      const uint4 s = in[static_cast<std::size_t>(32 * r + l)];
      const uint4 want = l % 8 == 7 ? make_uint4(s.x, s.y, kTag, kTag) : s;
      wrong += same(lines[static_cast<std::size_t>(32 * r + l)], want) ? 0 : 1;
    }
  }
  for (int k = 0; k < 8; ++k) {
    uint4 want = make_uint4(0u, 0u, 0u, 0u);
    if (k < 2 * kRounds) {
      const uint4 a = in[static_cast<std::size_t>(32 * (k / 2) + 16 * (k % 2) + 7)];
      const uint4 b = in[static_cast<std::size_t>(32 * (k / 2) + 16 * (k % 2) + 15)];
      want = make_uint4(a.z, a.w, b.z, b.w);
    }
    if (kScales && k == 2) {
      auto bits = [&](int i) {
        std::uint32_t u;
        std::memcpy(&u, &scales[static_cast<std::size_t>(i)], 4);
        return u;
      };
      want = make_uint4(bits(0), bits(1), bits(2), bits(3));
    }
    if (k == 7) want = make_uint4(want.x, want.y, kTag, kTag);
    wrong += same(lines[static_cast<std::size_t>(32 * kRounds + k)], want) ? 0 : 1;
  }
  return wrong;
}

template <int kRounds, bool kScales>
void roundTrip(const char* what) {
  SCOPED_TRACE(what);
  Sink sink(1'000'000'000ull);
  for (std::uint64_t seed = 1; seed <= 8; ++seed) {
    std::vector<uint4> in;
    std::vector<float> scales;
    const Result res = run<kRounds, kScales>(seed, -1, kTag, sink, in, scales);
    EXPECT_EQ(res.landed, 1) << "seed " << seed;
    EXPECT_EQ((wrongPieces<kRounds, kScales>(in, scales, res.lines)), 0) << "seed " << seed << ": pieces not as lines.cuh lays them out";
    int wrong = 0;
    for (std::size_t i = 0; i < in.size(); ++i) wrong += same(res.out[i], in[i]) ? 0 : 1;
    EXPECT_EQ(wrong, 0) << "seed " << seed << ": " << wrong << " of " << in.size() << " shares read back wrong";
    if (kScales) {
      int bad = 0;
      for (int l = 0; l < 32; ++l) bad += res.scales[static_cast<std::size_t>(l)] == scales[static_cast<std::size_t>(l / 8)] ? 0 : 1;
      EXPECT_EQ(bad, 0) << "seed " << seed << ": " << bad << " lanes read another tile's scale";
    }
  }
  EXPECT_EQ(sink.record->state, 0u) << "a read of landed lines reported an error";
}

TEST(Gpu1_Lines, DispatchFp8ChunkRoundTrips) {
  GRAPHEP_REQUIRE_GPUS(1);
  roundTrip<1, true>("one round and the scales (the dispatch's fp8 chunk)");
}

TEST(Gpu1_Lines, DispatchBf16ChunkRoundTrips) {
  GRAPHEP_REQUIRE_GPUS(1);
  roundTrip<2, false>("two rounds (the dispatch's bf16 chunk)");
}

TEST(Gpu1_Lines, PartialChunkRoundTrips) {
  GRAPHEP_REQUIRE_GPUS(1);
  roundTrip<1, false>("one round (the combine's partial chunk)");
}

// Each line in turn (the spill line last) carries another step's tag: the read waits for it,
// times out, and reports the site, the peer, the tag waited for and the one that line carries.
TEST(Gpu1_Lines, ALineOfAnotherStepTimesOutByName) {
  GRAPHEP_REQUIRE_GPUS(1);
  constexpr int kRounds = 2, kLines = moe_lines::kPieces<kRounds> / 8;
  for (int line = 0; line < kLines; ++line) {
    SCOPED_TRACE("line " + std::to_string(line) + (line == kLines - 1 ? " (the spill line)" : ""));
    Sink sink(2'000'000ull);  // 2 ms
    std::vector<uint4> in;
    std::vector<float> scales;
    const Result res = run<kRounds, false>(100 + static_cast<std::uint64_t>(line), line, kTag, sink, in, scales);
    EXPECT_EQ(res.landed, 0) << "a chunk with a line of another step was taken as landed";
    ASSERT_EQ(sink.record->state, 2u) << "no error recorded";
    EXPECT_EQ(sink.record->kind, static_cast<std::uint32_t>(DeviceErrorKind::kTimeout));
    EXPECT_EQ(sink.record->site, static_cast<std::uint32_t>(WaitSite::kMoeCombine));
    EXPECT_EQ(sink.record->peer, kPeer);
    EXPECT_EQ(sink.record->expected, kTag);
    EXPECT_EQ(sink.record->observed, kOtherTag) << "the report names another line's tag than the missing one's";
    EXPECT_GE(sink.record->elapsedNs, 2'000'000ull);
  }
}

}  // namespace
}  // namespace graphep::test
