// The MoE misuse, missing-rank, watchdog and graph-lifetime suites: bad input named, a dead peer
// reported, buffers kept alive by graphs.
#include "common/expect_error.hpp"
#include "common/gpu_env.hpp"
#include "common/moe/harness.cuh"
#include "kernels/common/ptx.cuh"

namespace graphep::test {

using namespace moe;

namespace {

// Bad pointers: named errors, thrown before anything is enqueued (so no peer waits on them).
void misuseBadPointers(Communicator& comm, MoeFixture& f, MoeFixture& other) {
  Engine& e = f.engine(0);
  GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(0)));
  cudaStream_t s = f.buf(0).stream;
  DispatchArgs a = f.dispatchArgs(0, nullptr);
  a.x = nullptr;
  expectError([&] { e.dispatch(a, s); }, Status::kInvalidArgument, "dispatch: x");
  a = f.dispatchArgs(0, nullptr);
  a.x = static_cast<const char*>(a.x) + 2;
  expectError([&] { e.dispatch(a, s); }, Status::kInvalidArgument, "is not 16-byte aligned");
  void* pinned = nullptr;
  GRAPHEP_CUDA_CHECK(cudaMallocHost(&pinned, 4096));
  a = f.dispatchArgs(0, nullptr);
  a.topkIdx = pinned;
  expectError([&] { e.dispatch(a, s); }, Status::kInvalidArgument, "host memory");
  std::vector<float> hostWeights(64);
  a = f.dispatchArgs(0, nullptr);
  a.topkWeights = hostWeights.data();
  expectError([&] { e.dispatch(a, s); }, Status::kInvalidArgument, "dispatch: topkWeights");
  GRAPHEP_CUDA_CHECK(cudaFreeHost(pinned));
  CombineArgs ca;
  expectError([&] { e.combine(ca, s); }, Status::kInvalidArgument, "combine: out");
  ca.out = f.buf(0).out;
  ca.expertOutput = other.engine(0).layout().expertOutput;
  expectError([&] { e.combine(ca, s); }, Status::kInvalidArgument, "another engine");
}

// Repeated operations: dispatch A (the inputs already uploaded), dispatch B, expert, combine,
// expert x2, combine on every rank: both orders are defined (nothing counted, nothing hangs) and
// each does what moe.hpp says. A dispatch over an uncombined one replaces it: the layout and the
// first combine are B's. A combine with no new dispatch combines the last dispatch again: the
// second combine is B's with the new expert outputs.
void repeatedOperations(Communicator& comm, const MoeCase& c, MoeFixture& f) {
  const int R = comm.worldSize();
  std::vector<Inputs> inB;
  for (int q = 0; q < R; ++q) inB.push_back(makeInputs(c, R, q, 32 - 5 * q % 32, 4712));
  for (int l = 0; l < f.L(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    f.engine(l).dispatch(f.dispatchArgs(l, nullptr), f.buf(l).stream);
  }
  f.syncAll();
  for (int l = 0; l < f.L(); ++l) f.prepare(l, inB[static_cast<std::size_t>(comm.globalRank(l))]);
  comm.barrier();
  for (int l = 0; l < f.L(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    const DispatchLayout& v = f.engine(l).dispatch(f.dispatchArgs(l, nullptr), f.buf(l).stream);
    f.expert(l, v, f.buf(l).stream, 1.0f);
    CombineArgs ca;
    ca.out = f.buf(l).out;
    f.engine(l).combine(ca, f.buf(l).stream);
  }
  f.syncAll();
  std::vector<RefLayout> refs;
  for (int q = 0; q < R; ++q) refs.push_back(refLayout(c, inB, q, f.layout(0).capacity));
  for (int l = 0; l < f.L(); ++l) EXPECT_EQ(f.check(l, inB, refs, "a dispatch over an uncombined one"), 0);
  comm.barrier();
  for (int l = 0; l < f.L(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    GRAPHEP_CUDA_CHECK(cudaMemset(f.buf(l).out, kPoison,
                                  static_cast<std::size_t>(c.cfg.maxTokensPerRank) * c.cfg.hidden * 2));
    GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  }
  comm.barrier();
  for (int l = 0; l < f.L(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    f.expert(l, f.layout(l), f.buf(l).stream, 2.0f);
    CombineArgs ca;
    ca.out = f.buf(l).out;
    f.engine(l).combine(ca, f.buf(l).stream);
  }
  f.syncAll();
  f.setYScale(2.0f);
  for (int l = 0; l < f.L(); ++l) {
    EXPECT_EQ(f.checkCombine(l, inB, refs, "a combine with no new dispatch"), 0);
    const MoeStatus st = f.engine(l).status();
    EXPECT_TRUE(st.ok()) << st.describe();  // dispatch -> dispatch and combine -> combine are defined
  }
  f.setYScale(1.0f);
  comm.barrier();
}

// NaN and infinite weights (of `in`) propagate to their tokens' outputs; every other token stays
// correct.
void misuseNonFiniteWeights(Communicator& comm, const MoeCase& c, MoeFixture& f, std::vector<Inputs> in) {
  const int R = comm.worldSize();
  for (Inputs& x : in) {
    x.w[0] = std::numeric_limits<float>::quiet_NaN();                   // token 0, slot 0
    x.w[static_cast<std::size_t>(c.cfg.topK)] = std::numeric_limits<float>::infinity();  // token 1, slot 0
  }
  for (int l = 0; l < f.L(); ++l) f.prepare(l, in[static_cast<std::size_t>(comm.globalRank(l))]);
  comm.barrier();
  for (int l = 0; l < f.L(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    f.enqueue(l, f.buf(l).stream);
  }
  f.syncAll();
  f.setNonFiniteTokens({0, 1});
  std::vector<RefLayout> refs;
  for (int q = 0; q < R; ++q) refs.push_back(refLayout(c, in, q, f.engine(0).layout().capacity));
  for (int l = 0; l < f.L(); ++l) {
    EXPECT_EQ(f.check(l, in, refs, "non-finite weights"), 0);
    const MoeStatus st = f.engine(l).status();
    EXPECT_TRUE(st.ok()) << st.describe();
  }
  comm.barrier();
}

void runMoeMisuseInLayout(Communicator& comm, const MoeCase& c) {
  SCOPED_TRACE("misuse, " + describeCase(c));
  const int R = comm.worldSize();
  MoeFixture f(comm, c), other(comm, c);
  expectLayoutShape(c, f.layout(0), R);
  std::vector<Inputs> in = f.prepareEvery(32, 4711);
  comm.barrier();
  misuseBadPointers(comm, f, other);
  repeatedOperations(comm, c, f);
  misuseNonFiniteWeights(comm, c, f, std::move(in));
}

}  // namespace

// Every layout (inEveryLayout). The suite tests no config validation (Engine::validate's layout
// rules, rowsPerExpert among them, are tests/unit/test_moe_config.cpp's), so nothing here differs
// by layout but the rows the stand-in expert reads and the reference it is checked against.
void runMoeMisuse(Communicator& comm, MoePath path) {
  forEveryLayout(smallCase(comm, 32, path), [&](const MoeCase& c) { runMoeMisuseInLayout(comm, c); });
}

namespace {

// One step of every rank (each replays its graph), every output exact.
void goodStep(Communicator& comm, const MoeCase& c, MoeFixture& f, const std::vector<cudaGraphExec_t>& execs) {
  const std::vector<Inputs> good = f.prepareEvery(32, 98);
  comm.barrier();
  for (int l = 0; l < f.L(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    GRAPHEP_CUDA_CHECK(cudaGraphLaunch(execs[static_cast<std::size_t>(l)], f.buf(l).stream));
  }
  f.syncAll();
  std::vector<RefLayout> refs;
  for (int q = 0; q < comm.worldSize(); ++q) refs.push_back(refLayout(c, good, q, f.layout(0).capacity));
  for (int l = 0; l < f.L(); ++l) EXPECT_EQ(f.check(l, good, refs, "the good step"), 0) << "rank " << comm.globalRank(l);
  comm.barrier();
}

// The survivors (every rank but `missing`) replay their graphs `replays` times on fresh inputs,
// each replay's outputs against the reference of the inputs with the missing rank's experts left
// out; `masked` accumulates the entries that reference drops per (rank, destination). The wrong
// elements in all.
long long replayAmongSurvivors(Communicator& comm, const MoeCase& c, MoeFixture& f,
                               const std::vector<cudaGraphExec_t>& execs, int missing, long long replays,
                               std::uint64_t seed, const std::string& label,
                               std::vector<std::vector<unsigned long long>>& masked) {
  const int R = comm.worldSize();
  const std::uint32_t mask = allRanksMask(R) & ~(1u << missing);
  auto survivor = [&](int l) { return comm.globalRank(l) != missing; };
  const std::vector<int> tokens = {32, 17, 1, 0, 32, 9};
  long long wrong = 0;
  for (long long i = 0; i < replays && wrong == 0; ++i) {
    std::vector<Inputs> all;
    for (int q = 0; q < R; ++q) {
      const int T = tokens[static_cast<std::size_t>(i + q) % tokens.size()];
      all.push_back(makeInputs(c, R, q, T, seed + static_cast<std::uint64_t>(i) * 13));
    }
    const std::vector<Inputs> seen = underMask(c, all, mask, masked);
    for (int l = 0; l < f.L(); ++l) {
      if (survivor(l)) f.prepare(l, all[static_cast<std::size_t>(comm.globalRank(l))]);
    }
    comm.barrier();
    for (int l = 0; l < f.L(); ++l) {
      if (!survivor(l)) continue;
      GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
      GRAPHEP_CUDA_CHECK(cudaGraphLaunch(execs[static_cast<std::size_t>(l)], f.buf(l).stream));
    }
    f.syncAll();
    std::vector<RefLayout> refs;
    for (int q = 0; q < R; ++q) refs.push_back(refLayout(c, seen, q, f.layout(0).capacity));
    for (int l = 0; l < f.L(); ++l) {
      if (!survivor(l)) continue;
      const std::string what = "replay " + std::to_string(i) + " " + label;
      const long long n = f.check(l, seen, refs, what);
      EXPECT_EQ(n, 0) << what << ", rank " << comm.globalRank(l);
      wrong += n;
    }
    comm.barrier();
  }
  return wrong;
}

// After the missing rank was named (an engine with an active-rank mask: the latency path, the
// direct throughput path): every survivor recovers with the mask that leaves it out
// (Engine::recover; every local rank before any enqueues work) and replays the graph it captured
// before the failure, nothing recaptured, with fresh inputs into poisoned outputs; every
// survivor's outputs are checked against the reference of the inputs the mask leaves (the missing
// rank's experts add nothing, though its messages, records and partials of the good step before
// the failure lie in the survivors' memory), and each survivor's status counts the entries routed
// to the missing rank. GRAPHEP_RECOVERY_REPLAYS sets the replays (default 12).
void recoverAndReplay(Communicator& comm, const MoeCase& c, MoeFixture& f, const std::vector<cudaGraphExec_t>& execs,
                      int missing) {
  const int R = comm.worldSize();
  const std::uint32_t mask = allRanksMask(R) & ~(1u << missing);
  auto survivor = [&](int l) { return comm.globalRank(l) != missing; };
  for (int l = 0; l < f.L(); ++l) {
    if (!survivor(l)) continue;
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    f.engine(l).recover(mask, f.buf(l).stream);
    EXPECT_FALSE(f.engine(l).failed()) << "rank " << comm.globalRank(l);
  }
  std::vector<std::vector<unsigned long long>> masked(static_cast<std::size_t>(R),
                                                      std::vector<unsigned long long>(static_cast<std::size_t>(R), 0));
  replayAmongSurvivors(comm, c, f, execs, missing, replaysFromEnv("GRAPHEP_RECOVERY_REPLAYS", 12), 7000,
                       "after the recovery", masked);
  for (int l = 0; l < f.L(); ++l) {
    if (!survivor(l)) continue;
    const int r = comm.globalRank(l);
    const MoeStatus st = f.engine(l).status();
    EXPECT_TRUE(st.ok()) << "rank " << r << ": " << st.describe();
    for (int d = 0; d < R; ++d) {
      EXPECT_EQ(st.maskedEntries[static_cast<std::size_t>(d)], masked[static_cast<std::size_t>(r)][static_cast<std::size_t>(d)])
          << "rank " << r << "'s entries for rank " << d;
    }
    EXPECT_GT(masked[static_cast<std::size_t>(r)][static_cast<std::size_t>(missing)], 0ull)
        << "rank " << r << " routed nothing to the missing rank: its masking is untested";
  }
}

void missingRankInLayout(Communicator& comm, const MoeCase& c, bool expectRecovery) {
  SCOPED_TRACE("a rank that never launches, " + describeCase(c));
  const int missing = comm.worldSize() - 1;
  MoeFixture f(comm, c);
  ASSERT_EQ(f.engine(0).path(), expectedPath(c.cfg, comm));  // a fallback would skip the recovery
  // The engines with an active-rank mask recover (the latency path, the direct throughput path):
  // each rank's graph, captured before the failure, is replayed after.
  const bool recovers = f.engine(0).activeRanksDevice() != nullptr;
  ASSERT_EQ(recovers, expectRecovery) << "the engines " << (recovers ? "take" : "take no") << " active-rank mask";
  std::vector<cudaGraphExec_t> execs(static_cast<std::size_t>(f.L()), nullptr);
  for (int l = 0; recovers && l < f.L(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    execs[static_cast<std::size_t>(l)] = captureOnStream(f.buf(l).stream, [&](cudaStream_t s) { f.enqueue(l, s); });
  }
  if (recovers) {  // one good step of every rank first: the missing rank's messages, records and
                   // partials then lie in the survivors' memory, which the recovery must not use
    goodStep(comm, c, f, execs);
  }
  f.prepareEvery(32, 99);
  comm.barrier();
  for (int l = 0; l < f.L(); ++l) {
    if (comm.globalRank(l) == missing) continue;  // this rank never launches
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    f.engine(l).dispatch(f.dispatchArgs(l, nullptr), f.buf(l).stream);
  }
  for (int l = 0; l < f.L(); ++l) {
    if (comm.globalRank(l) == missing) continue;
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(f.buf(l).stream));  // returns: every wait is bounded
    const MoeStatus st = f.engine(l).status();
    EXPECT_NE(st.deviceError.find("peer " + std::to_string(missing)), std::string::npos)
        << "rank " << comm.globalRank(l) << ": " << st.deviceError;
    EXPECT_TRUE(f.engine(l).failed());
    expectError([&] { f.engine(l).dispatch(f.dispatchArgs(l, nullptr), f.buf(l).stream); }, Status::kRemoteError,
                "failed state");
  }
  comm.barrier();
  if (recovers && !::testing::Test::HasFailure()) recoverAndReplay(comm, c, f, execs, missing);
  for (int l = 0; !recovers && l < f.L(); ++l) {  // the movers' engines: no mask, refused by name
    if (comm.globalRank(l) == missing) continue;
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    expectError([&] { f.engine(l).recover(allRanksMask(comm.worldSize()) & ~(1u << missing), f.buf(l).stream); },
                Status::kNotSupported, "over the movers");
  }
  for (cudaGraphExec_t e : execs) {
    if (e != nullptr) GRAPHEP_CUDA_CHECK(cudaGraphExecDestroy(e));
  }
}  // the engines are destroyed here, without waiting on the missing rank

}  // namespace

// Shrink on timeout (MoeConfig::shrinkOnTimeout, latency path): after a good step of every rank,
// the last rank sits out one step. The survivors' step completes without a failure, exact for the
// experts left (the missing rank's add nothing), the missing rank is out of their active-rank mask
// and in MoeStatus::shrunkRanks; then the same graphs replay among the survivors, exact, the
// missing rank's entries masked from the start. Nobody calls recover.
void shrinkInLayout(Communicator& comm, MoeCase c) {
  c.cfg.shrinkOnTimeout = true;
  SCOPED_TRACE("shrink on timeout, a rank that sits out a step, " + describeCase(c));
  const int R = comm.worldSize(), missing = R - 1;
  const std::uint32_t mask = allRanksMask(R) & ~(1u << missing);
  MoeFixture f(comm, c);
  ASSERT_EQ(f.engine(0).path(), MoePath::kLatency);
  std::vector<cudaGraphExec_t> execs(static_cast<std::size_t>(f.L()), nullptr);
  for (int l = 0; l < f.L(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    execs[static_cast<std::size_t>(l)] = captureOnStream(f.buf(l).stream, [&](cudaStream_t s) { f.enqueue(l, s); });
  }
  std::vector<std::vector<unsigned long long>> sentAnyway(static_cast<std::size_t>(R),
                                                          std::vector<unsigned long long>(static_cast<std::size_t>(R), 0));
  goodStep(comm, c, f, execs);  // the missing rank's messages of this step then lie in the survivors' memory
  // The step it sits out: its entries are sent (the mask still held it), so they are not counted as masked.
  EXPECT_EQ(replayAmongSurvivors(comm, c, f, execs, missing, 1, 6000, "the missing rank sat out", sentAnyway), 0);
  for (int l = 0; l < f.L(); ++l) {
    if (comm.globalRank(l) == missing) continue;
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    const MoeStatus st = f.engine(l).status();
    EXPECT_FALSE(f.engine(l).failed()) << "rank " << comm.globalRank(l) << ": " << st.describe();
    EXPECT_TRUE(st.ok()) << "rank " << comm.globalRank(l) << ": " << st.describe();
    EXPECT_EQ(st.shrunkRanks, 1u << missing) << "rank " << comm.globalRank(l);
    EXPECT_NE(st.describe().find("rank(s) " + std::to_string(missing)), std::string::npos) << st.describe();
    std::uint32_t live = 0;
    GRAPHEP_CUDA_CHECK(cudaMemcpy(&live, f.engine(l).activeRanksDevice(), 4, cudaMemcpyDeviceToHost));
    EXPECT_EQ(live, mask) << "rank " << comm.globalRank(l) << "'s active-rank mask";
  }
  std::vector<std::vector<unsigned long long>> masked(static_cast<std::size_t>(R),
                                                      std::vector<unsigned long long>(static_cast<std::size_t>(R), 0));
  replayAmongSurvivors(comm, c, f, execs, missing, replaysFromEnv("GRAPHEP_RECOVERY_REPLAYS", 12), 8000,
                       "after the shrink", masked);
  for (int l = 0; l < f.L(); ++l) {
    if (comm.globalRank(l) == missing) continue;
    const int r = comm.globalRank(l);
    const MoeStatus st = f.engine(l).status();
    EXPECT_TRUE(st.ok()) << "rank " << r << ": " << st.describe();
    EXPECT_EQ(st.maskedEntries[static_cast<std::size_t>(missing)],
              masked[static_cast<std::size_t>(r)][static_cast<std::size_t>(missing)])
        << "rank " << r << "'s entries for the missing rank";
  }
  for (cudaGraphExec_t e : execs) GRAPHEP_CUDA_CHECK(cudaGraphExecDestroy(e));
}

namespace {
// Holds its stream for `ns` nanoseconds (a rank that comes late to a barrier).
__global__ void holdKernel(unsigned long long ns) {
  const std::uint64_t start = ptx::globalTimerNs();
  do {
    __nanosleep(10000);
  } while (ptx::globalTimerNs() - start < ns);
}

// Barriers while the last rank is outside the mask of every rank (it calls them too: outside its
// own mask it takes part in none), then every rank back: each pair's count is where both left it,
// so the barriers after it pass with no failure (a single count for every pair would leave the
// last rank behind the others and their next barrier would time out on it).
void barriersWithTheLastRankLeftOut(Communicator& comm, MoeFixture& f) {
  const int R = comm.worldSize(), last = R - 1;
  for (const std::uint32_t mask : {allRanksMask(R) & ~(1u << last), allRanksMask(R)}) {
    for (int l = 0; l < f.L(); ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
      f.engine(l).setActiveRanks(mask, f.buf(l).stream);
      for (int b = 0; b < 3; ++b) f.engine(l).barrier(f.buf(l).stream);
    }
    f.syncAll();
    for (int l = 0; l < f.L(); ++l) {  // status(): the device's record (failed() only knows what was read)
      const MoeStatus st = f.engine(l).status();
      EXPECT_TRUE(st.ok() && !f.engine(l).failed())
          << "rank " << comm.globalRank(l) << " after barriers with the mask 0x" << std::hex << mask << std::dec << ": "
          << st.describe();
    }
  }
  comm.barrier();
}

// Rank 0 comes to the barrier 50 ms late: no other rank's barrier returns before it came (the
// other ranks' streams take at least 40 ms from the common start; causality, not speed).
void barrierWaitsForTheLateRank(Communicator& comm, MoeFixture& f) {
  comm.barrier();
  const auto start = std::chrono::steady_clock::now();
  for (int l = 0; l < f.L(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    if (comm.globalRank(l) == 0) holdKernel<<<1, 1, 0, f.buf(l).stream>>>(50ull * 1000 * 1000);
    f.engine(l).barrier(f.buf(l).stream);
  }
  for (int l = 0; l < f.L(); ++l) {
    if (comm.globalRank(l) == 0) continue;
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(f.buf(l).stream));
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
    EXPECT_GE(ms.count(), 40) << "rank " << comm.globalRank(l) << "'s barrier returned before rank 0 reached it";
  }
  f.syncAll();
  comm.barrier();
}

// The last rank skips one barrier: with shrinkOnTimeout the others' barrier completes with it
// masked and no failure, and their next barrier passes among them; without, they fail naming it
// and the barrier.
void barrierWithoutTheLastRank(Communicator& comm, MoeCase c, bool shrink) {
  c.cfg.shrinkOnTimeout = shrink;
  SCOPED_TRACE(std::string("a rank that skips a barrier, shrink on timeout ") + (shrink ? "on" : "off"));
  const int R = comm.worldSize(), last = R - 1;
  MoeFixture f(comm, c);
  comm.barrier();
  for (int round = 0; round < (shrink ? 2 : 1); ++round) {
    const auto start = std::chrono::steady_clock::now();
    for (int l = 0; l < f.L(); ++l) {
      if (comm.globalRank(l) == last) continue;
      GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
      f.engine(l).barrier(f.buf(l).stream);
    }
    for (int l = 0; l < f.L(); ++l) {
      if (comm.globalRank(l) == last) continue;
      GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
      GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(f.buf(l).stream));  // returns: every wait is bounded
      const MoeStatus st = f.engine(l).status();
      const std::string who = "rank " + std::to_string(comm.globalRank(l)) + ", round " + std::to_string(round);
      if (round == 1) {  // the masked rank is waited for by no one: nowhere near the 300 ms timeout
        const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
        EXPECT_LT(ms.count(), 150) << who << ": the barrier after the shrink waited for the masked rank";
      }
      if (!shrink) {
        EXPECT_TRUE(f.engine(l).failed()) << who;
        EXPECT_NE(st.deviceError.find("peer " + std::to_string(last)), std::string::npos) << who << ": " << st.deviceError;
        EXPECT_NE(st.deviceError.find("moe barrier"), std::string::npos) << who << ": " << st.deviceError;
        continue;
      }
      EXPECT_FALSE(f.engine(l).failed()) << who << ": " << st.describe();
      EXPECT_TRUE(st.ok()) << who << ": " << st.describe();
      EXPECT_EQ(st.shrunkRanks, 1u << last) << who;
      std::uint32_t live = 0;
      GRAPHEP_CUDA_CHECK(cudaMemcpy(&live, f.engine(l).activeRanksDevice(), 4, cudaMemcpyDeviceToHost));
      EXPECT_EQ(live, allRanksMask(R) & ~(1u << last)) << who << "'s active-rank mask";
    }
  }
  comm.barrier();
}
}  // namespace

void runMoeBarrier(Communicator& comm, MoePath path) {
  ScopedEnv timeout("GRAPHEP_TIMEOUT_MS", "300");  // read when the engines' heap is created
  const MoeCase c = smallCase(comm, 32, path);
  SCOPED_TRACE("device barrier, " + describeCase(c));
  {
    MoeFixture f(comm, c);
    ASSERT_EQ(f.engine(0).path(), expectedPath(c.cfg, comm));
    if (f.engine(0).activeRanksDevice() == nullptr) {  // the throughput path over the movers
      for (int l = 0; l < f.L(); ++l) {
        expectError([&] { f.engine(l).barrier(f.buf(l).stream); }, Status::kNotSupported, "no load/store barrier");
      }
      return;
    }
    barriersWithTheLastRankLeftOut(comm, f);
    barrierWaitsForTheLateRank(comm, f);
    // Barriers around the operations of a captured graph, replayed: every result exact, no failure.
    std::vector<cudaGraphExec_t> execs(static_cast<std::size_t>(f.L()), nullptr);
    for (int l = 0; l < f.L(); ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
      execs[static_cast<std::size_t>(l)] = captureOnStream(f.buf(l).stream, [&](cudaStream_t s) {
        f.engine(l).barrier(s);
        f.enqueue(l, s);
        f.engine(l).barrier(s);
      });
    }
    for (int replay = 0; replay < 3; ++replay) goodStep(comm, c, f, execs);
    for (int l = 0; l < f.L(); ++l) {
      const MoeStatus st = f.engine(l).status();
      EXPECT_TRUE(st.ok() && !f.engine(l).failed()) << "rank " << comm.globalRank(l) << ": " << st.describe();
    }
    for (cudaGraphExec_t e : execs) GRAPHEP_CUDA_CHECK(cudaGraphExecDestroy(e));
  }
  if (comm.worldSize() < 2) return;
  if (expectedPath(c.cfg, comm) == MoePath::kLatency) barrierWithoutTheLastRank(comm, c, true);
  barrierWithoutTheLastRank(comm, c, false);
}

void runMoeMissingRank(Communicator& comm, MoePath path, bool recovers) {
  ScopedEnv timeout("GRAPHEP_TIMEOUT_MS", "300");  // read when the engines' heap is created
  forEveryLayout(smallCase(comm, 32, path), [&](const MoeCase& c) { missingRankInLayout(comm, c, recovers); });
}

void runMoeShrinkOnTimeout(Communicator& comm) {
  ScopedEnv timeout("GRAPHEP_TIMEOUT_MS", "300");  // read when the engines' heap is created
  forEveryLayout(smallCase(comm, 32, MoePath::kAuto), [&](const MoeCase& c) { shrinkInLayout(comm, c); });
}

void runMoeWatchdog(Communicator& comm) {
  ScopedEnv timeout("GRAPHEP_TIMEOUT_MS", "20000");  // the device waits outlast the watchdog
  const MoeCase c = smallCase(comm, 32, MoePath::kLatency);
  SCOPED_TRACE("host watchdog, " + describeCase(c));
  const int late = comm.worldSize() - 1;
  MoeFixture f(comm, c);
  f.prepareEvery(32, 98);
  comm.barrier();
  int lateLocal = -1;
  for (int l = 0; l < f.L(); ++l) {
    if (comm.globalRank(l) == late) {
      lateLocal = l;
      continue;  // launches only after the watchdog has looked
    }
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    f.engine(l).dispatch(f.dispatchArgs(l, nullptr), f.buf(l).stream);
  }
  for (int l = 0; l < f.L(); ++l) {
    if (l == lateLocal) continue;
    const HealthReport h = f.engine(l).checkHealth(f.buf(l).stream, std::chrono::milliseconds(200));
    EXPECT_FALSE(h.ok);
    EXPECT_NE(h.message.find("rank " + std::to_string(late) + "'s count message"), std::string::npos) << h.message;
    EXPECT_TRUE(f.engine(l).failed());
  }
  comm.barrier();
  if (lateLocal >= 0) {  // the late rank arrives: the others complete, and stay failed
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(lateLocal)));
    f.engine(lateLocal).dispatch(f.dispatchArgs(lateLocal, nullptr), f.buf(lateLocal).stream);
  }
  f.syncAll();
  for (int l = 0; l < f.L(); ++l) {
    if (l == lateLocal) {
      EXPECT_TRUE(f.engine(l).checkHealth(f.buf(l).stream, std::chrono::milliseconds(1000)).ok);
      continue;
    }
    expectError([&] { f.engine(l).combine(CombineArgs{nullptr, f.buf(l).out}, f.buf(l).stream); },
                Status::kRemoteError, "failed state");
  }
  comm.barrier();
}

void runMoeOpenCaptureRefused(Communicator& comm) {
  const MoeCase c = smallCase(comm, 32, MoePath::kThroughput);
  SCOPED_TRACE("an open capture of the movers path, " + describeCase(c));
  MoeFixture f(comm, c);
  const std::vector<Inputs> in = f.prepareEvery(32, 4242);
  std::vector<cudaStream_t> other(static_cast<std::size_t>(f.L()));
  std::vector<cudaGraphExec_t> execs(static_cast<std::size_t>(f.L()), nullptr);
  for (int l = 0; l < f.L(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    GRAPHEP_CUDA_CHECK(cudaStreamCreateWithFlags(&other[static_cast<std::size_t>(l)], cudaStreamNonBlocking));
    cudaStream_t s = f.buf(l).stream;
    GRAPHEP_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    f.engine(l).dispatch(f.dispatchArgs(l, nullptr), s);
    expectError([&] { f.engine(l).combine(CombineArgs{nullptr, f.buf(l).out}, other[static_cast<std::size_t>(l)]); },
                Status::kInvalidArgument, "part of a stream capture");
    EXPECT_FALSE(f.engine(l).failed()) << "rank " << comm.globalRank(l);
    cudaGraph_t g = nullptr;
    GRAPHEP_CUDA_CHECK(cudaStreamEndCapture(s, &g));
    GRAPHEP_CUDA_CHECK(cudaGraphInstantiate(&execs[static_cast<std::size_t>(l)], g, 0));
    GRAPHEP_CUDA_CHECK(cudaGraphDestroy(g));
  }
  comm.barrier();
  for (int l = 0; l < f.L(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    GRAPHEP_CUDA_CHECK(cudaGraphLaunch(execs[static_cast<std::size_t>(l)], f.buf(l).stream));
    f.expert(l, f.engine(l).layout(), f.buf(l).stream, 1.0f);
    f.engine(l).combine(CombineArgs{nullptr, f.buf(l).out}, f.buf(l).stream);
  }
  f.syncAll();
  std::vector<RefLayout> refs;
  for (int q = 0; q < comm.worldSize(); ++q) refs.push_back(refLayout(c, in, q, f.layout(0).capacity));
  for (int l = 0; l < f.L(); ++l) {
    EXPECT_EQ(f.check(l, in, refs, "after a refused call during an open capture"), 0);
    GRAPHEP_CUDA_CHECK(cudaGraphExecDestroy(execs[static_cast<std::size_t>(l)]));
    GRAPHEP_CUDA_CHECK(cudaStreamDestroy(other[static_cast<std::size_t>(l)]));
  }
  comm.barrier();
}

void runMoeGraphOutlivesEngine(Communicator& comm) {
  const MoeCase c = smallCase(comm, 64, MoePath::kAuto);
  SCOPED_TRACE("MoeGraph replayed after its Engine object is destroyed, " + describeCase(c));
  const int R = comm.worldSize();
  MoeFixture f(comm, c);
  std::vector<std::unique_ptr<MoeGraph>> graphs;
  for (int l = 0; l < f.L(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    MoeGraphArgs args;
    args.dispatch = f.dispatchArgs(l, nullptr);
    args.out = f.buf(l).out;
    graphs.push_back(MoeGraph::capture(f.engine(l), args,
                                       [&f, l](const DispatchLayout& v, cudaStream_t s) { f.expert(l, v, s, 1.0f); }));
  }
  comm.barrier();
  f.dropEngines();
  for (int round = 0; round < 3; ++round) {
    const std::vector<Inputs> in = f.prepareEvery(64 - 20 * round, 300 + round);
    comm.barrier();
    for (int l = 0; l < f.L(); ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
      graphs[static_cast<std::size_t>(l)]->launch(f.buf(l).stream);
    }
    f.syncAll();
    std::vector<RefLayout> refs;
    for (int q = 0; q < R; ++q) refs.push_back(refLayout(c, in, q, f.layout(0).capacity));
    for (int l = 0; l < f.L(); ++l) EXPECT_EQ(f.check(l, in, refs, "after the Engine objects were destroyed"), 0);
    comm.barrier();
  }
  graphs.clear();  // the engines' buffers go with the last graph
  comm.barrier();
}


}  // namespace graphep::test
