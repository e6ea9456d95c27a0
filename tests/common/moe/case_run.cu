// The MoE case suite's run of one case in every layout (runMoeCase): dispatch, expert, combine,
// eagerly or replayed from a captured graph, every output against the host reference.
#include "common/gpu_env.hpp"
#include "common/moe/harness.cuh"
#include "common/moe/step_trace.hpp"
#include "engine/env.hpp"
#include "engine/moe/plan.hpp"

namespace graphep::test {

using namespace moe;

namespace {
void runMoeCaseInLayout(Communicator& comm, const MoeCase& c);

// Run `run`'s active-rank mask of a case on R ranks: its listed masks first (every rank when it
// has none, or none left), then random non-empty ones, the same on every process (drawn from the
// run's number).
std::uint32_t caseMask(const MoeCase& c, int run, int R) {
  if (c.masks.empty()) return allRanksMask(R);
  if (static_cast<std::size_t>(run) >= c.masks.size()) {
    std::mt19937 pick(static_cast<std::uint32_t>(run) * 2654435761u + 17u);
    return 1u + static_cast<std::uint32_t>(pick() % allRanksMask(R));  // 1 .. every rank
  }
  const std::uint32_t m = c.masks[static_cast<std::size_t>(run)] & allRanksMask(R);
  return m != 0 ? m : allRanksMask(R);
}

// The emulated network (GRAPHEP_EMULATED_NODES: `nodes` nodes of R / nodes consecutive ranks):
// what one dispatch and combine of rank r over the movers send each rank q on another node. The
// count message, then in the flat scheme one record per token with an expert on q and one partial
// back per token of q with an expert on r; node-aware (several ranks per node, GRAPHEP_NODE_AWARE
// not off), only to q with r's index in its node (r is its landing rank and it is r's): one record
// per token of r with an expert on q's node, and one partial per token of q with an expert on r's
// node. Zero for q on r's node.
// Whether R ranks on the emulated nodes run the node-aware dispatch and combine.
bool nodeAwareExpected(int R) { return nodeAwareSize(R) > 0; }

std::vector<std::uint64_t> networkBytesOf(const MoeConfig& cfg, const std::vector<Inputs>& all, int r, int nodes) {
  const int R = static_cast<int>(all.size()), size = R / nodes, Lx = cfg.numExperts / R;
  const bool aware = nodeAwareExpected(R);
  const moe_setup::MoeSizes z = moe_setup::moeSizes(cfg, R, aware);
  // Tokens of `from` with an expert on a rank in [first, first + count).
  auto tokens = [&](int from, int first, int count) {
    const Inputs& in = all[static_cast<std::size_t>(from)];
    std::uint64_t n = 0;
    for (int t = 0; t < liveCount(cfg, in.T); ++t) {
      bool hit = false;
      for (int k = 0; k < cfg.topK; ++k) {
        const long long id = in.idx[static_cast<std::size_t>(t) * static_cast<std::size_t>(cfg.topK) + static_cast<std::size_t>(k)];
        hit |= id >= 0 && id < cfg.numExperts && id / Lx >= first && id / Lx < first + count;
      }
      n += hit ? 1 : 0;
    }
    return n;
  };
  std::vector<std::uint64_t> bytes(static_cast<std::size_t>(R), 0);
  for (int q = 0; q < R; ++q) {
    if (q / size == r / size) continue;
    const bool pair = q % size == r % size;  // node-aware: each is the other's landing rank
    const std::uint64_t records = !aware ? tokens(r, q, 1) : pair ? tokens(r, q / size * size, size) : 0;
    const std::uint64_t partials = !aware ? tokens(q, r, 1) : pair ? tokens(q, r / size * size, size) : 0;
    bytes[static_cast<std::size_t>(q)] = z.cntMsgBytes + records * z.recBytes + partials * z.rowBytes;
  }
  return bytes;
}

}  // namespace

// Every case in each receive layout (inEveryLayout).
void runMoeCase(Communicator& comm, const MoeCase& c) {
  forEveryLayout(c, [&](const MoeCase& v) { runMoeCaseInLayout(comm, v); });
}

namespace {
void runMoeCaseInLayout(Communicator& comm, const MoeCase& c) {
  SCOPED_TRACE(describeCase(c));
  const int R = comm.worldSize();
  MoeFixture f(comm, c);
  for (int l = 0; l < f.L(); ++l) {
    EXPECT_EQ(f.engine(l).path(), expectedPath(c.cfg, comm)) << "rank " << comm.globalRank(l);
  }
  // GRAPHEP_MASK_REPLAYS: the replays of a graph case with masks (the mask flipped every replay).
  const int replays = c.replays > 0 && !c.masks.empty()
                          ? static_cast<int>(replaysFromEnv("GRAPHEP_MASK_REPLAYS", c.replays))
                          : c.replays;
  const int runs = replays > 0 ? replays : static_cast<int>(c.tokens.size());
  std::vector<cudaGraphExec_t> execs;
  if (c.replays > 0) {
    for (int l = 0; l < f.L(); ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
      execs.push_back(captureOnStream(f.buf(l).stream, [&](cudaStream_t s) { f.enqueue(l, s); }));
    }
  }
  const std::size_t nl = static_cast<std::size_t>(f.L());
  std::vector<unsigned long long> expectInvalid(nl, 0), expectDropped(nl, 0), expectClamped(nl, 0);
  std::vector<int> firstInvalidRun(nl, -1), firstClamped(nl, 0);
  std::map<int, std::vector<Inputs>> firstInvalidInputs;  // the inputs of each rank's first run with invalid ids
  std::vector<std::vector<unsigned long long>> expectTotals(nl);
  // The masks are set where the engine takes them: the latency path and the direct throughput path
  // (a direct engine that took none would run its mask cases unmasked, unseen: asserted).
  const bool takesMask = f.engine(0).activeRanksDevice() != nullptr;
  const bool direct = f.engine(0).directBlockFlags().blocksPerRank > 0;
  EXPECT_EQ(takesMask, f.engine(0).path() == MoePath::kLatency || direct);
  if (f.engine(0).path() == MoePath::kThroughput) {
    EXPECT_EQ(direct, expectedDirect()) << "the throughput path's kernels: direct " << direct;
  }
  const bool masks = !c.masks.empty() && takesMask;
  // The emulated network's bytes, per run (its engines run over the movers: checked above).
  const int nodes = static_cast<int>(env::kEmulatedNodes.get());
  const bool metered = nodes > 0 && f.engine(0).path() == MoePath::kThroughput;
  std::vector<std::vector<unsigned long long>> masked(static_cast<std::size_t>(R), std::vector<unsigned long long>(static_cast<std::size_t>(R), 0));
  for (int run = 0; run < runs; ++run) {
    const std::uint64_t seed = 5000 + static_cast<std::uint64_t>(run) * 31;
    std::vector<Inputs> all;
    for (int q = 0; q < R; ++q) all.push_back(makeInputs(c, R, q, rankTokens(c, run, q), seed));
    for (int l = 0; l < f.L(); ++l) f.prepare(l, all[static_cast<std::size_t>(comm.globalRank(l))]);
    const std::uint32_t mask = caseMask(c, run, R);
    // What the engines see under the mask (every input as it is without one); the reference's.
    const std::vector<Inputs> seen = masks ? underMask(c, all, mask, masked) : all;
    if (metered) {
      for (int l = 0; l < f.L(); ++l) f.engine(l).resetNetworkBytes();
    }
    comm.barrier();
    for (int l = 0; l < f.L(); ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
      if (masks) f.engine(l).setActiveRanks(mask, f.buf(l).stream);
      if (c.replays > 0) {
        GRAPHEP_CUDA_CHECK(cudaGraphLaunch(execs[static_cast<std::size_t>(l)], f.buf(l).stream));
      } else {
        f.enqueue(l, f.buf(l).stream);
      }
    }
    f.syncAll();
    // Every rank's expected layout, once per run (the capacity is the same on every rank).
    std::vector<RefLayout> refs;
    for (int q = 0; q < R; ++q) refs.push_back(refLayout(c, seen, q, f.layout(0).capacity));
    expectLayoutShape(c, f.layout(0), R);
    for (int l = 0; l < f.L(); ++l) {
      const std::size_t ls = static_cast<std::size_t>(l);
      const int r = comm.globalRank(l);
      const Inputs& mine = all[static_cast<std::size_t>(r)];
      const std::string what = "run " + std::to_string(run) + " T=" + std::to_string(mine.T) +
                               (masks ? " mask=" + std::to_string(mask) : std::string());
      EXPECT_EQ(f.check(l, seen, refs, what), 0) << what << " rank " << r;
      if (metered) {
        EXPECT_EQ(f.engine(l).networkBytes(), networkBytesOf(c.cfg, seen, r, nodes))
            << what << " rank " << r << ": the bytes sent to each rank on another node";
      }
      const unsigned long long invalid = invalidCount(c.cfg, mine);
      if (invalid > 0 && firstInvalidRun[ls] < 0) firstInvalidRun[ls] = run;
      expectInvalid[ls] += invalid;
      if (mine.T > c.cfg.maxTokensPerRank || mine.T < 0) {
        if (expectClamped[ls]++ == 0) firstClamped[ls] = mine.T;
      }
      const RefLayout& ref = refs[static_cast<std::size_t>(r)];
      expectDropped[ls] += ref.droppedTotal;
      auto& tot = expectTotals[ls];
      tot.resize(ref.routed.size(), 0);
      for (std::size_t j = 0; j < ref.routed.size(); ++j) tot[j] += static_cast<unsigned long long>(ref.routed[j]);
    }
    for (int l = 0; l < f.L(); ++l) {
      if (firstInvalidRun[static_cast<std::size_t>(l)] == run) firstInvalidInputs[run] = all;
    }
    comm.barrier();
  }
  for (int l = 0; l < f.L(); ++l) {
    const std::size_t ls = static_cast<std::size_t>(l);
    const MoeStatus st = f.engine(l).status();
    const int r = comm.globalRank(l);
    EXPECT_EQ(st.invalidExpertIds, expectInvalid[ls]) << "rank " << r;
    EXPECT_EQ(st.droppedRows, expectDropped[ls]) << "rank " << r;
    EXPECT_EQ(st.clampedTokenCounts, expectClamped[ls]) << "rank " << r;
    for (int d = 0; d < R; ++d) {
      EXPECT_EQ(st.maskedEntries[static_cast<std::size_t>(d)],
                masked[static_cast<std::size_t>(r)][static_cast<std::size_t>(d)])
          << "rank " << r << "'s entries for rank " << d << " left out by the active-rank mask";
    }
    if (expectClamped[ls] > 0) EXPECT_EQ(st.firstClampedCount, firstClamped[ls]) << "rank " << r;
    if (firstInvalidRun[ls] >= 0) {
      const Inputs& in = firstInvalidInputs.at(firstInvalidRun[ls])[static_cast<std::size_t>(r)];
      EXPECT_TRUE(isInvalidEntry(c.cfg, in, st.firstInvalidId, st.firstInvalidToken, st.firstInvalidSlot))
          << "rank " << r << ": the first invalid id recorded, topk_idx[" << st.firstInvalidToken << "]["
          << st.firstInvalidSlot << "] = " << st.firstInvalidId << ", is not an invalid entry of run "
          << firstInvalidRun[ls];
      EXPECT_NE(st.describe().find("topk_idx[" + std::to_string(st.firstInvalidToken) + "]"), std::string::npos)
          << st.describe();
    }
    EXPECT_EQ(st.deviceError, "") << "rank " << r;
    std::vector<unsigned long long> totals(expectTotals[ls].size());
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    GRAPHEP_CUDA_CHECK(cudaMemcpy(totals.data(), f.engine(l).layout().expertTotals, totals.size() * 8,
                                  cudaMemcpyDeviceToHost));
    EXPECT_EQ(totals, expectTotals[ls]) << "rank " << r << ": cumulative expert totals";
    if (c.cfg.profile) {  // every kernel of the path ran, in order, each span well formed
      const std::vector<MoeKernelSpan> spans = f.engine(l).timeline();
      std::vector<std::string> names;
      for (const MoeKernelSpan& sp : spans) names.push_back(sp.kernel);
      // Throughput: six kernels over the movers (seven node-aware: the forwards), or with the direct
      // dispatch and combine (every peer by load/store, one rank per GPU) six, seven for fp8 (the
      // quantise kernel), plus the receive's two phases;
      // latency: the dispatch's route and records (sender), layout and expand (receiver), the
      // combine's reduce of the peers' records (sender), then its own rows and sums (receiver).
      const std::vector<std::vector<std::string>> want =
          f.engine(l).path() == MoePath::kLatency
              ? std::vector<std::vector<std::string>>{{"latency route", "latency records", "latency layout",
                                                       "latency expand", "latency combine", "latency combine own rows",
                                                       "latency combine receive"}}
              : std::vector<std::vector<std::string>>{
                    nodeAwareExpected(R)
                        ? std::vector<std::string>{"route", "pack", "offsets", "expand", "forward", "combine reduce",
                                                   "node sum", "combine final"}
                        : std::vector<std::string>{"route", "pack", "offsets", "expand", "combine reduce",
                                                   "combine final"},
                    {"route", "direct send", "direct receive", "direct own rows", "direct peers' rows",
                     "direct combine reduce", "direct combine send", "direct combine final"},
                    {"route", "direct quantise", "direct send", "direct receive", "direct own rows",
                     "direct peers' rows", "direct combine reduce", "direct combine send", "direct combine final"}};
      EXPECT_NE(std::find(want.begin(), want.end(), names), want.end())
          << "rank " << r << ": the kernels that ran: " << ::testing::PrintToString(names);
      // Phases start in this order; on the latency path each kernel's receive part runs beside its
      // send part (CTAs of their own), so only the phases within one part are ordered. The
      // node-aware forwards run on the comm stream beside the expansion of this rank's own records,
      // so they are ordered after the exchange's offsets only.
      const std::map<std::string, std::string> after = {{"latency records", "latency route"},
                                                        {"latency expand", "latency layout"},
                                                        {"latency combine receive", "latency combine own rows"}};
      for (std::size_t k = 0; k < spans.size(); ++k) {
        EXPECT_LE(spans[k].startUs, spans[k].endUs) << spans[k].kernel;
        if (k == 0) continue;
        if (f.engine(l).path() != MoePath::kLatency) {
          const std::size_t prev = names[k - 1] == "forward" ? k - 2 : names[k] == "forward" ? k - 2 : k - 1;
          EXPECT_LE(spans[prev].startUs, spans[k].startUs) << spans[k].kernel;
        } else if (after.count(names[k]) != 0) {
          const std::size_t before = static_cast<std::size_t>(
              std::find(names.begin(), names.end(), after.at(names[k])) - names.begin());
          ASSERT_LT(before, k) << names[k];
          EXPECT_LE(spans[before].startUs, spans[k].startUs) << spans[k].kernel;
        }
      }
      if (f.engine(l).path() == MoePath::kLatency) expectStepTrace(f.engine(l).stepTrace(), r);
    }
    if (!execs.empty()) cudaGraphExecDestroy(execs[ls]);
  }
  comm.barrier();
}
}  // namespace


}  // namespace graphep::test
