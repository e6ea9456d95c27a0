// graphep::tokenLayout (DeepEP's get_dispatch_layout) on one GPU against a host count: random top-k
// ids with -1 and out-of-range entries, int32 and int64, expert counts that take the shared-memory
// histogram and ones that do not; poisoned outputs; captured in a graph and replayed with new ids.
#include <gtest/gtest.h>

#include <graphep/graphep.hpp>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/gpu_env.hpp"
#include "engine/error.hpp"

namespace graphep::test {
namespace {

struct LayoutCase {
  int T, K, E, R;
  bool int64Ids;
};

struct HostLayout {
  std::vector<int> perRank, perExpert;
  std::vector<std::uint8_t> inRank;
};

HostLayout hostLayout(const std::vector<long long>& ids, const LayoutCase& c) {
  HostLayout h;
  h.perRank.assign(static_cast<std::size_t>(c.R), 0);
  h.perExpert.assign(static_cast<std::size_t>(c.E), 0);
  h.inRank.assign(static_cast<std::size_t>(c.T) * c.R, 0);
  const int L = c.E / c.R;
  for (int t = 0; t < c.T; ++t) {
    for (int k = 0; k < c.K; ++k) {
      const long long id = ids[static_cast<std::size_t>(t) * c.K + k];
      if (id < 0 || id >= c.E) continue;
      ++h.perExpert[static_cast<std::size_t>(id)];
      h.inRank[static_cast<std::size_t>(t) * c.R + static_cast<std::size_t>(id / L)] = 1;
    }
    for (int r = 0; r < c.R; ++r) h.perRank[static_cast<std::size_t>(r)] += h.inRank[static_cast<std::size_t>(t) * c.R + r];
  }
  return h;
}

std::vector<long long> randomIds(const LayoutCase& c, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<long long> ids(static_cast<std::size_t>(c.T) * c.K);
  for (auto& id : ids) {
    const auto u = rng() % 100;
    id = u < 10 ? -1 : (u < 12 ? static_cast<long long>(c.E) + static_cast<long long>(rng() % 7) : static_cast<long long>(rng() % static_cast<std::uint64_t>(c.E)));
  }
  return ids;
}

TEST(Gpu1_TokenLayout, AgainstHostCounts) {
  GRAPHEP_REQUIRE_GPUS(1);
  GRAPHEP_CUDA_CHECK(cudaSetDevice(0));
  cudaStream_t s = nullptr;
  GRAPHEP_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::uint64_t seed = 3;
  for (const LayoutCase c : {LayoutCase{4096, 8, 256, 8, true}, LayoutCase{1000, 2, 8, 2, false},
                             LayoutCase{77, 16, 16384, 32, true}, LayoutCase{1, 1, 4, 4, false}}) {
    const std::string what = "T=" + std::to_string(c.T) + " K=" + std::to_string(c.K) + " E=" + std::to_string(c.E) +
                             " R=" + std::to_string(c.R);
    const std::size_t n = static_cast<std::size_t>(c.T) * c.K;
    void* ids = nullptr;
    int *perRank = nullptr, *perExpert = nullptr;
    bool* inRank = nullptr;
    GRAPHEP_CUDA_CHECK(cudaMalloc(&ids, n * 8));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&perRank, static_cast<std::size_t>(c.R) * 4));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&perExpert, static_cast<std::size_t>(c.E) * 4));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&inRank, static_cast<std::size_t>(c.T) * c.R));
    TokenLayoutArgs a;
    a.topkIdx = ids;
    a.indexType = c.int64Ids ? IndexType::kInt64 : IndexType::kInt32;
    a.numTokens = c.T;
    a.topK = c.K;
    a.numExperts = c.E;
    a.numRanks = c.R;
    a.tokensPerRank = perRank;
    a.tokensPerExpert = perExpert;
    a.tokenInRank = inRank;
    // Everything on s, the stream the layout runs on: a cudaMemset or pageable cudaMemcpy on the
    // legacy stream is not ordered with the non-blocking s, and its poison once landed between the
    // graph's zeroing and its counts (run 135: every count read as 0x5a5a5a5a + count).
    auto upload = [&](const std::vector<long long>& v) {
      if (c.int64Ids) {
        GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(ids, v.data(), n * 8, cudaMemcpyHostToDevice, s));
      } else {
        const std::vector<int> v32(v.begin(), v.end());
        GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(ids, v32.data(), n * 4, cudaMemcpyHostToDevice, s));
        GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(s));  // v32 goes out of scope
      }
      GRAPHEP_CUDA_CHECK(cudaMemsetAsync(perRank, 0x5a, static_cast<std::size_t>(c.R) * 4, s));
      GRAPHEP_CUDA_CHECK(cudaMemsetAsync(perExpert, 0x5a, static_cast<std::size_t>(c.E) * 4, s));
      GRAPHEP_CUDA_CHECK(cudaMemsetAsync(inRank, 0x5a, static_cast<std::size_t>(c.T) * c.R, s));
    };
    auto check = [&](const std::vector<long long>& v, const std::string& when) {
      const HostLayout want = hostLayout(v, c);
      HostLayout got;
      got.perRank.resize(want.perRank.size());
      got.perExpert.resize(want.perExpert.size());
      got.inRank.resize(want.inRank.size());
      GRAPHEP_CUDA_CHECK(cudaMemcpy(got.perRank.data(), perRank, got.perRank.size() * 4, cudaMemcpyDeviceToHost));
      GRAPHEP_CUDA_CHECK(cudaMemcpy(got.perExpert.data(), perExpert, got.perExpert.size() * 4, cudaMemcpyDeviceToHost));
      GRAPHEP_CUDA_CHECK(cudaMemcpy(got.inRank.data(), inRank, got.inRank.size(), cudaMemcpyDeviceToHost));
      EXPECT_EQ(got.perRank, want.perRank) << what << when;
      EXPECT_EQ(got.perExpert, want.perExpert) << what << when;
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < want.inRank.size(); ++i) wrong += got.inRank[i] != want.inRank[i] ? 1 : 0;
      EXPECT_EQ(wrong, 0u) << what << when << ": token-in-rank entries differ";
    };
    std::vector<long long> v = randomIds(c, ++seed);
    upload(v);
    tokenLayout(a, s);
    GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(s));
    check(v, ", eager");
    // Captured once, replayed with new ids each time.
    cudaGraph_t g = nullptr;
    cudaGraphExec_t exec = nullptr;
    GRAPHEP_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    tokenLayout(a, s);
    GRAPHEP_CUDA_CHECK(cudaStreamEndCapture(s, &g));
    GRAPHEP_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
    for (int replay = 0; replay < 3; ++replay) {
      v = randomIds(c, ++seed);
      upload(v);
      GRAPHEP_CUDA_CHECK(cudaGraphLaunch(exec, s));
      GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(s));
      check(v, ", replay " + std::to_string(replay));
    }
    GRAPHEP_CUDA_CHECK(cudaGraphExecDestroy(exec));
    GRAPHEP_CUDA_CHECK(cudaGraphDestroy(g));
    cudaFree(ids);
    cudaFree(perRank);
    cudaFree(perExpert);
    cudaFree(inRank);
  }
  // Bad arguments: named.
  TokenLayoutArgs bad;
  bad.numRanks = 3;
  bad.numExperts = 8;
  bad.topK = 2;
  try {
    tokenLayout(bad, s);
    ADD_FAILURE() << "numExperts=8 over 3 ranks accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("numExperts=8 is not a positive multiple of numRanks=3"), std::string::npos)
        << e.what();
  }
  GRAPHEP_CUDA_CHECK(cudaStreamDestroy(s));
}

}  // namespace
}  // namespace graphep::test
