// MoE dispatch / combine on one GPU with 1, 4 and 8 emulated ranks, against a CPU reference: one
// test instance per (topology, case), so a failure or a hang names its case and --gtest_filter
// runs one alone.
#include <gtest/gtest.h>
#include <nccl.h>

#include <graphep/graphep.hpp>

#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "common/expect_error.hpp"
#include "common/gpu_env.hpp"
#include "common/moe_suite.hpp"
#include "common/nccl_comms.hpp"
#include "engine/error.hpp"

namespace graphep::test {
namespace {

class Gpu1_Moe1Rank : public ::testing::TestWithParam<MoeCaseIndex> {};
class Gpu1_Moe4Ranks : public ::testing::TestWithParam<MoeCaseIndex> {};
class Gpu1_Moe8Ranks : public ::testing::TestWithParam<MoeCaseIndex> {};
// The same cases with the throughput path over the movers (GRAPHEP_MOE_KERNELS=movers), which the
// direct kernels replace wherever every peer is reached by load/store.
class Gpu1_Moe4RanksMovers : public ::testing::TestWithParam<MoeCaseIndex> {};
// One rank over the movers: its exchanges have no peer and skip the own block (nothing to launch).
class Gpu1_Moe1RankMovers : public ::testing::TestWithParam<MoeCaseIndex> {};
// 4 ranks over the movers with records and partials exchanged in 3 chunks (load/store channels
// moving windows of the slots; the last chunk shorter where 3 does not divide T_max).
class Gpu1_Moe4RanksMoversChunked : public ::testing::TestWithParam<MoeCaseIndex> {};
// The throughput cases on an emulated network (GRAPHEP_EMULATED_NODES): 4 ranks as 2 nodes, and
// 8 ranks as 2 and as 4 nodes, over the movers; each run's network bytes asserted (runMoeCase). The
// 8 ranks get no comm stream each on the default 8 hardware queues (moe_setup::moversStreams,
// DESIGN §5.5): the caller's stream carries their exchanges.
class Gpu1_Moe4RanksEmulatedNodes : public ::testing::TestWithParam<MoeCaseIndex> {};
class Gpu1_Moe8RanksAs2EmulatedNodes : public ::testing::TestWithParam<MoeCaseIndex> {};
class Gpu1_Moe8RanksAs4EmulatedNodes : public ::testing::TestWithParam<MoeCaseIndex> {};

TEST_P(Gpu1_Moe1Rank, Case) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0});
  runMoeCaseAt(*comm, GetParam());
}
TEST_P(Gpu1_Moe4Ranks, Case) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0, 0, 0});
  runMoeCaseAt(*comm, GetParam());
}
// A case over the movers on `ranks` emulated ranks, the records and partials in `chunks` exchanges
// ("0": the automatic count).
void runMoversCase(int ranks, const char* chunks, const MoeCaseIndex& c) {
  ScopedEnv movers("GRAPHEP_MOE_KERNELS", "movers");
  ScopedEnv chunked("GRAPHEP_EXCHANGE_CHUNKS", chunks);
  auto comm = createLocalGroup(std::vector<int>(static_cast<std::size_t>(ranks), 0));
  runMoeCaseAt(*comm, c);
}
TEST_P(Gpu1_Moe4RanksMovers, Case) {
  GRAPHEP_REQUIRE_GPUS(1);
  runMoversCase(4, "0", GetParam());
}
TEST_P(Gpu1_Moe4RanksMoversChunked, Case) {
  GRAPHEP_REQUIRE_GPUS(1);
  runMoversCase(4, "3", GetParam());
}
TEST_P(Gpu1_Moe1RankMovers, Case) {
  GRAPHEP_REQUIRE_GPUS(1);
  runMoversCase(1, "0", GetParam());
}
TEST_P(Gpu1_Moe4RanksEmulatedNodes, Case) {
  GRAPHEP_REQUIRE_GPUS(1);
  ScopedEnv emulated("GRAPHEP_EMULATED_NODES", "2");
  auto comm = createLocalGroup({0, 0, 0, 0});
  runMoeCaseAt(*comm, GetParam());
}
// 8 ranks of one GPU as `nodes` emulated nodes.
void runEightRanksAsNodes(const char* nodes, const MoeCaseIndex& c) {
  ScopedEnv emulated("GRAPHEP_EMULATED_NODES", nodes);
  auto comm = createLocalGroup(std::vector<int>(8, 0));
  runMoeCaseAt(*comm, c);
}
TEST_P(Gpu1_Moe8RanksAs2EmulatedNodes, Case) {
  GRAPHEP_REQUIRE_GPUS(1);
  runEightRanksAsNodes("2", GetParam());
}
TEST_P(Gpu1_Moe8RanksAs4EmulatedNodes, Case) {
  GRAPHEP_REQUIRE_GPUS(1);
  runEightRanksAsNodes("4", GetParam());
}
TEST_P(Gpu1_Moe8Ranks, Case) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0, 0, 0, 0, 0, 0, 0});
  runMoeCaseAt(*comm, GetParam());
}
INSTANTIATE_TEST_SUITE_P(Moe, Gpu1_Moe1Rank, ::testing::ValuesIn(moeCaseIndices(MoeCaseList::kSmall)),
                         MoeCaseIndexName());
INSTANTIATE_TEST_SUITE_P(Moe, Gpu1_Moe4Ranks, ::testing::ValuesIn(moeCaseIndices(MoeCaseList::kSmall)),
                         MoeCaseIndexName());
INSTANTIATE_TEST_SUITE_P(Moe, Gpu1_Moe4RanksMovers, ::testing::ValuesIn(throughputCaseIndices()), MoeCaseIndexName());
INSTANTIATE_TEST_SUITE_P(Moe, Gpu1_Moe1RankMovers, ::testing::ValuesIn(throughputCaseIndices()), MoeCaseIndexName());
INSTANTIATE_TEST_SUITE_P(Moe, Gpu1_Moe4RanksMoversChunked, ::testing::ValuesIn(throughputCaseIndices()),
                         MoeCaseIndexName());
INSTANTIATE_TEST_SUITE_P(Moe, Gpu1_Moe8Ranks, ::testing::ValuesIn(moeCaseIndices(MoeCaseList::kSmall)),
                         MoeCaseIndexName());
INSTANTIATE_TEST_SUITE_P(Moe, Gpu1_Moe4RanksEmulatedNodes, ::testing::ValuesIn(throughputCaseIndices()),
                         MoeCaseIndexName());
INSTANTIATE_TEST_SUITE_P(Moe, Gpu1_Moe8RanksAs2EmulatedNodes, ::testing::ValuesIn(throughputCaseIndices()),
                         MoeCaseIndexName());
INSTANTIATE_TEST_SUITE_P(Moe, Gpu1_Moe8RanksAs4EmulatedNodes, ::testing::ValuesIn(throughputCaseIndices()),
                         MoeCaseIndexName());

// Engine::memoryRequirements, computed before anything is allocated, equals what createAll
// allocated: the symmetric heap and the local buffers of every rank, on both paths, bf16 and fp8,
// the worst-case capacity and a smaller one, with profiling.
TEST(Gpu1_MoeMemory, QueryEqualsAllocation) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0});
  for (MoePath path : {MoePath::kAuto, MoePath::kThroughput}) {
    for (DType type : {DType::kBf16, DType::kFp8E4m3}) {
      for (long long capacity : {0ll, 300ll}) {
        const MoeConfig c{.maxTokensPerRank = 128, .hidden = 1024, .numExperts = 16, .topK = 4,
                          .dispatchType = type, .recvCapacity = capacity, .path = path,
                          .profile = capacity > 0};
        const MoeMemory want = Engine::memoryRequirements(c, comm->worldSize());
        auto engines = Engine::createAll(*comm, c);
        for (const auto& e : engines) {
          EXPECT_EQ(e->path(), want.path);
          EXPECT_EQ(e->symmetricHeapBytes(), want.symmetricHeapBytes);
          EXPECT_EQ(e->privateBytes(), want.privateBytes);
        }
      }
    }
  }
}

// The same on emulated nodes (4 ranks as 2): the node-aware engine's larger records and
// forwarding areas counted, and the flat engine's figures where GRAPHEP_NODE_AWARE=off.
TEST(Gpu1_MoeMemory, QueryEqualsAllocationOnEmulatedNodes) {
  GRAPHEP_REQUIRE_GPUS(1);
  ScopedEnv emulated("GRAPHEP_EMULATED_NODES", "2");
  auto comm = createLocalGroup({0, 0, 0, 0});
  MoeMemory flat;
  for (const char* aware : {"off", "auto"}) {
    ScopedEnv setting("GRAPHEP_NODE_AWARE", aware);
    const MoeConfig c{.maxTokensPerRank = 128, .hidden = 1024, .numExperts = 16, .topK = 4,
                      .path = MoePath::kThroughput};
    const MoeMemory want = Engine::memoryRequirements(c, comm->worldSize());
    if (std::string(aware) == "off") {
      flat = want;
    } else {
      EXPECT_GT(want.symmetricHeapBytes, flat.symmetricHeapBytes) << "the node-aware heap holds the forwarded records";
    }
    auto engines = Engine::createAll(*comm, c);
    for (const auto& e : engines) {
      EXPECT_EQ(e->symmetricHeapBytes(), want.symmetricHeapBytes) << "GRAPHEP_NODE_AWARE=" << aware;
      EXPECT_EQ(e->privateBytes(), want.privateBytes) << "GRAPHEP_NODE_AWARE=" << aware;
    }
  }
}

class Gpu1_Moe : public FourEmulatedRanks {};
class Gpu1_MoeOverflow : public FourEmulatedRanks {};
class Gpu1_MoeFaults : public FourEmulatedRanks {};

TEST_F(Gpu1_Moe, MisuseFourEmulatedRanksLatency) {
  runMoeMisuse(*comm_, MoePath::kAuto);
}

TEST_F(Gpu1_Moe, MisuseFourEmulatedRanksThroughput) {
  runMoeMisuse(*comm_, MoePath::kThroughput);
}

// Overflow with an expert that reads and writes exactly the documented rows into a buffer of
// exactly the capacity (gpu-check runs this under compute-sanitizer memcheck).
TEST_F(Gpu1_MoeOverflow, FourEmulatedRanksLatency) {
  runMoeOverflow(*comm_, MoePath::kLatency);
}

TEST_F(Gpu1_MoeOverflow, FourEmulatedRanksThroughput) {
  runMoeOverflow(*comm_, MoePath::kThroughput);
}

TEST_F(Gpu1_MoeFaults, MissingRankLatency) {
  runMoeMissingRank(*comm_, MoePath::kAuto, true);
}

// The throughput path's direct kernels on ranks sharing a GPU take the mask and recover.
TEST_F(Gpu1_MoeFaults, MissingRankThroughput) {
  runMoeMissingRank(*comm_, MoePath::kThroughput, true);
}

// Over the movers (GRAPHEP_MOE_KERNELS=movers) the throughput path takes no mask: recover is refused by name.
TEST_F(Gpu1_MoeFaults, MissingRankThroughputOverTheMovers) {
  ScopedEnv movers("GRAPHEP_MOE_KERNELS", "movers");
  runMoeMissingRank(*comm_, MoePath::kThroughput, false);
}

// The missing rank and the recovery among 7 survivors on one GPU.
TEST(Gpu1_MoeFaults8, MissingRankLatencyEightEmulatedRanks) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0, 0, 0, 0, 0, 0, 0});
  runMoeMissingRank(*comm, MoePath::kAuto, true);
}
TEST_F(Gpu1_MoeFaults, ShrinkOnTimeout) {
  runMoeShrinkOnTimeout(*comm_);
}
TEST(Gpu1_MoeFaults8, ShrinkOnTimeoutEightEmulatedRanks) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0, 0, 0, 0, 0, 0, 0});
  runMoeShrinkOnTimeout(*comm);
}
TEST(Gpu1_MoeFaults8, MissingRankThroughputEightEmulatedRanks) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0, 0, 0, 0, 0, 0, 0});
  runMoeMissingRank(*comm, MoePath::kThroughput, true);
}

// The device barrier on both paths (the throughput path on its direct kernels), a late rank, a
// skipped barrier with and without shrink on timeout.
TEST_F(Gpu1_MoeFaults, Barrier) {
  runMoeBarrier(*comm_, MoePath::kAuto);
  runMoeBarrier(*comm_, MoePath::kThroughput);
}
TEST(Gpu1_MoeFaults8, BarrierEightEmulatedRanks) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0, 0, 0, 0, 0, 0, 0});
  runMoeBarrier(*comm, MoePath::kAuto);
}
// Over the movers there is no load/store barrier: refused by name.
TEST_F(Gpu1_MoeFaults, BarrierOverTheMoversIsRefused) {
  ScopedEnv movers("GRAPHEP_MOE_KERNELS", "movers");
  runMoeBarrier(*comm_, MoePath::kThroughput);
}

TEST_F(Gpu1_MoeFaults, WatchdogAndGraphLifetime) {
  runMoeWatchdog(*comm_);
  runMoeGraphOutlivesEngine(*comm_);
}

// The latency path's limits, by name: more than 256 tokens per rank.
TEST(Gpu1_MoePath, LatencyRefusesMoreThan256Tokens) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = createLocalGroup({0, 0});
  MoeConfig cfg{.maxTokensPerRank = 257, .hidden = 256, .numExperts = 8, .topK = 2,
                .path = MoePath::kLatency};
  // Refused with a message that names the limit and the value.
  expectError([&] { Engine::createAll(*comm, cfg); }, Status::kInvalidArgument,
              "path=kLatency needs maxTokensPerRank <= 256");
  expectError([&] { Engine::createAll(*comm, cfg); }, Status::kInvalidArgument, "maxTokensPerRank=257");
  cfg.maxTokensPerRank = 256;  // the limit itself is served by the latency path, and kAuto picks it
  EXPECT_EQ(Engine::createAll(*comm, cfg)[0]->path(), MoePath::kLatency);
  cfg.path = MoePath::kAuto;
  EXPECT_EQ(Engine::createAll(*comm, cfg)[0]->path(), MoePath::kLatency);
  cfg.maxTokensPerRank = 257;  // past it, kAuto falls back to the throughput path
  EXPECT_EQ(Engine::createAll(*comm, cfg)[0]->path(), MoePath::kThroughput);
}

// The movers path's comm stream and an open capture (runMoeOpenCaptureRefused), on 2 emulated ranks.
TEST(Gpu1_MoeGraph, MoversOpenCaptureRefusesAnotherStream) {
  GRAPHEP_REQUIRE_GPUS(1);
  ScopedEnv movers("GRAPHEP_MOE_KERNELS", "movers");
  auto comm = createLocalGroup({0, 0});
  runMoeOpenCaptureRefused(*comm);
}

// Peers that only NCCL could reach in a group with no NCCL communicators (a local group with every
// peer forced remote): createAll is refused by name before any NCCL group opens, so none is left
// open on this thread (an open group would queue every later NCCL call here unrun: a later
// ncclCommInitAll then returns communicators of 0 ranks). ncclGroupEnd then finds no group.
TEST(Gpu1_MoePath, RemotePeersWithoutNcclRefusedWithNoNcclGroupLeftOpen) {
  GRAPHEP_REQUIRE_GPUS(1);
  const ScopedEnv force("GRAPHEP_FORCE_TRANSPORT", "remote");
  auto comm = createLocalGroup({0, 0});
  MoeConfig cfg{.maxTokensPerRank = 300, .hidden = 256, .numExperts = 8, .topK = 2};
  expectError([&] { Engine::createAll(*comm, cfg); }, Status::kNotSupported,
              "reaches rank 1 only as a remote peer, but its 'local-group' communicator has no NCCL communicator");
  EXPECT_EQ(ncclGroupEnd(), ncclInvalidUsage) << "an NCCL group was left open on this thread";
}

// Strict mode traps after counting, which kills the CUDA context: each case runs in a child
// process (a death test, re-executed rather than forked, so no live context is inherited). The
// child routes device printf to stderr, where the death test reads the engine's message.
enum class StrictFault { kNone, kInvalidId, kOverflow, kClampedCount };

void strictChild(MoePath path, StrictFault fault) {
  dup2(STDERR_FILENO, STDOUT_FILENO);  // device printf goes through stdout
  auto comm = createLocalGroup({0});
  MoeConfig cfg{.maxTokensPerRank = 16, .hidden = 128, .numExperts = 8, .topK = 2, .strict = true,
                .path = path};
  if (fault == StrictFault::kOverflow) cfg.recvCapacity = 5;  // 16 tokens x 2 slots arrive
  auto engines = Engine::createAll(*comm, cfg);
  GRAPHEP_CUDA_CHECK(cudaSetDevice(comm->device(0)));
  void *x = nullptr, *idx = nullptr, *out = nullptr;
  float* w = nullptr;
  int* n = nullptr;
  GRAPHEP_CUDA_CHECK(cudaMalloc(&x, 16 * 128 * 2));
  GRAPHEP_CUDA_CHECK(cudaMemset(x, 0x3c, 16 * 128 * 2));  // every value bf16 0x3c3c (0.0115): finite
  std::vector<int> ids(32);
  for (int t = 0; t < 16; ++t) {  // two distinct valid experts per token
    ids[static_cast<std::size_t>(2 * t)] = t % 8;
    ids[static_cast<std::size_t>(2 * t + 1)] = (t + 1) % 8;
  }
  if (fault == StrictFault::kInvalidId) ids[7] = 999;  // token 3, slot 1
  GRAPHEP_CUDA_CHECK(cudaMalloc(&idx, ids.size() * 4));
  GRAPHEP_CUDA_CHECK(cudaMemcpy(idx, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  const std::vector<float> hw(32, 0.5f);
  GRAPHEP_CUDA_CHECK(cudaMalloc(&w, 32 * 4));
  GRAPHEP_CUDA_CHECK(cudaMemcpy(w, hw.data(), 32 * 4, cudaMemcpyHostToDevice));
  const int live = fault == StrictFault::kClampedCount ? 99 : 16;
  GRAPHEP_CUDA_CHECK(cudaMalloc(&n, 4));
  GRAPHEP_CUDA_CHECK(cudaMemcpy(n, &live, 4, cudaMemcpyHostToDevice));
  GRAPHEP_CUDA_CHECK(cudaMalloc(&out, 16 * 128 * 2));
  DispatchArgs a;
  a.x = x;
  a.topkIdx = idx;
  a.topkWeights = w;
  a.numTokens = n;
  CombineArgs ca;
  ca.out = out;
  // The trap surfaces at the synchronisation, or as a failed launch of a later kernel.
  cudaError_t e = cudaSuccess;
  try {
    engines[0]->dispatch(a, nullptr);
    e = cudaDeviceSynchronize();
    if (e == cudaSuccess) {
      engines[0]->combine(ca, nullptr);
      e = cudaDeviceSynchronize();
    }
  } catch (const Error& err) {
    std::fprintf(stderr, "strict child: %s\n", err.what());
    e = cudaErrorLaunchFailure;
  }
  std::fflush(stdout);
  if (e == cudaSuccess) {
    std::fprintf(stderr, "strict child: no trap\n");
    std::_Exit(0);
  }
  std::fprintf(stderr, "strict child: the device trapped (%s)\n", cudaGetErrorName(e));
  std::_Exit(3);
}

TEST(Gpu1_MoeStrict, TrapsOnInvalidIdOverflowAndClampInAChild) {
  GRAPHEP_REQUIRE_GPUS(1);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  for (MoePath path : {MoePath::kLatency, MoePath::kThroughput}) {
    SCOPED_TRACE(path == MoePath::kLatency ? "latency path" : "throughput path");
    EXPECT_EXIT(strictChild(path, StrictFault::kNone), ::testing::ExitedWithCode(0), "no trap");
    EXPECT_EXIT(strictChild(path, StrictFault::kInvalidId), ::testing::ExitedWithCode(3),
                "topk_idx\\[3\\]\\[1\\] = 999 is outside \\[-1, 8\\) \\(strict mode\\)");
    EXPECT_EXIT(strictChild(path, StrictFault::kOverflow), ::testing::ExitedWithCode(3),
                "past the capacity of 5 rows \\(strict mode\\)");
    EXPECT_EXIT(strictChild(path, StrictFault::kClampedCount), ::testing::ExitedWithCode(3),
                "live token count 99 is outside \\[0, 16\\] \\(strict mode\\)");
  }
}

}  // namespace
}  // namespace graphep::test
