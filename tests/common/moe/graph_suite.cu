// The MoE graph suite: captured dispatch / expert / combine graphs replayed with new inputs.
#include "common/moe/harness.cuh"

namespace graphep::test {

using namespace moe;

namespace {

// The graph suite's launches, every kind once and then at random.
enum GraphKind { kCallback, kChild, kBucket0, kBucket1, kBucket2, kBucket3, kPair, kUserGlobal, kUserThreadLocal,
                 kUserRelaxed, kGraphKinds };
constexpr int kGraphBuckets[4] = {1, 8, 33, 64};      // the live counts the bucket graphs bake in
constexpr float kExpertScale[3] = {1.0f, 2.0f, 4.0f};  // the child's three expert graphs
constexpr cudaStreamCaptureMode kUserModes[3] = {cudaStreamCaptureModeGlobal, cudaStreamCaptureModeThreadLocal,
                                                 cudaStreamCaptureModeRelaxed};

// One rank's graphs of the suite.
struct RankGraphs {
  std::unique_ptr<MoeGraph> callback, child, bucket[4], dispatch, combine;
  cudaGraphExec_t user[3] = {nullptr, nullptr, nullptr};
  cudaGraph_t experts[3] = {nullptr, nullptr, nullptr};  // x1 (one node), x2 (one node), x4 (two nodes)
  int* bucketT[4] = {nullptr, nullptr, nullptr, nullptr};
};

// Rank l's graphs of every kind: an expert callback graph; three expert graphs and a child graph
// over the first; the bucket graphs; a dispatch-only + combine-only pair; the engine's operations
// inside the caller's own capture in each mode.
void captureRankGraphs(Communicator& comm, MoeFixture& f, int l, RankGraphs& rg) {
  Engine& e = f.engine(l);
  GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
  cudaStream_t s = f.buf(l).stream;
  MoeGraphArgs args;
  args.dispatch = f.dispatchArgs(l, nullptr);
  args.out = f.buf(l).out;
  rg.callback = MoeGraph::capture(e, args, [&f, l](const DispatchLayout& v, cudaStream_t st) { f.expert(l, v, st, 1.0f); });
  for (int x = 0; x < 3; ++x) {
    GRAPHEP_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    const DispatchLayout& v = e.layout();
    if (x == 2) GRAPHEP_CUDA_CHECK(cudaMemsetAsync(v.expertOutput, 0, static_cast<std::size_t>(v.capacity) * v.hidden * 2, s));
    f.expert(l, v, s, kExpertScale[x]);
    GRAPHEP_CUDA_CHECK(cudaStreamEndCapture(s, &rg.experts[x]));
  }
  rg.child = MoeGraph::withExpertGraph(e, args, rg.experts[0]);
  for (int b = 0; b < 4; ++b) {
    GRAPHEP_CUDA_CHECK(cudaMalloc(&rg.bucketT[b], 4));
    GRAPHEP_CUDA_CHECK(cudaMemcpy(rg.bucketT[b], &kGraphBuckets[b], 4, cudaMemcpyHostToDevice));
    MoeGraphArgs ba = args;
    ba.dispatch = f.dispatchArgs(l, rg.bucketT[b]);
    rg.bucket[b] = MoeGraph::capture(e, ba, [&f, l](const DispatchLayout& v, cudaStream_t st) { f.expert(l, v, st, 1.0f); });
  }
  rg.dispatch = MoeGraph::dispatchOnly(e, args.dispatch);
  CombineArgs ca;
  ca.out = args.out;
  rg.combine = MoeGraph::combineOnly(e, ca);
  for (int m = 0; m < 3; ++m) {  // the engine's operations inside the caller's own capture
    GRAPHEP_CUDA_CHECK(cudaStreamBeginCapture(s, kUserModes[m]));
    f.enqueue(l, s);
    cudaGraph_t ug = nullptr;
    GRAPHEP_CUDA_CHECK(cudaStreamEndCapture(s, &ug));
    GRAPHEP_CUDA_CHECK(cudaGraphInstantiate(&rg.user[m], ug, 0));
    GRAPHEP_CUDA_CHECK(cudaGraphDestroy(ug));
  }
}

// Launches rank l's graph of `kind` on its stream.
void launchRankGraph(Communicator& comm, MoeFixture& f, int l, RankGraphs& rg, int kind) {
  GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
  cudaStream_t s = f.buf(l).stream;
  switch (kind) {
    case kCallback: rg.callback->launch(s); break;
    case kChild: rg.child->launch(s); break;
    case kPair:
      rg.dispatch->launch(s);
      f.expert(l, rg.dispatch->layout(), s, 1.0f);
      rg.combine->launch(s);
      break;
    case kUserGlobal:
    case kUserThreadLocal:
    case kUserRelaxed: GRAPHEP_CUDA_CHECK(cudaGraphLaunch(rg.user[kind - kUserGlobal], s)); break;
    default: rg.bucket[kind - kBucket0]->launch(s); break;
  }
}

// Every rank's inputs of iteration `it`: a bucket graph bakes its count in (the same on every
// rank); the others read each rank's own, drawn per rank (0 included: a rank silent while its
// peers send).
std::vector<Inputs> graphInputs(const MoeCase& c, int R, int kind, int it, std::mt19937& rng) {
  const bool bucket = kind >= kBucket0 && kind <= kBucket3;
  std::vector<int> Ts(static_cast<std::size_t>(R));
  for (int& t : Ts) t = bucket ? kGraphBuckets[kind - kBucket0] : static_cast<int>(rng() % 65);
  const std::uint64_t seed = 9000 + static_cast<std::uint64_t>(it) * 13;
  std::vector<Inputs> all;
  for (int q = 0; q < R; ++q) all.push_back(makeInputs(c, R, q, Ts[static_cast<std::size_t>(q)], seed));
  return all;
}

// The child graph's reinstantiations and every rank's status, then the graphs' own resources.
void finishRankGraphs(Communicator& comm, MoeFixture& f, int l, RankGraphs& rg, int expectedReinstantiations) {
  EXPECT_EQ(rg.child->reinstantiations(), expectedReinstantiations) << "rank " << comm.globalRank(l);
  const MoeStatus st = f.engine(l).status();
  EXPECT_TRUE(st.ok()) << st.describe();
  GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
  for (cudaGraphExec_t u : rg.user) cudaGraphExecDestroy(u);
  for (cudaGraph_t x : rg.experts) cudaGraphDestroy(x);
  for (int* b : rg.bucketT) cudaFree(b);
}

void runMoeGraphSuiteInLayout(Communicator& comm, const MoeCase& c, int iterations) {
  SCOPED_TRACE("MoeGraph suite, " + describeCase(c));
  const int R = comm.worldSize();
  MoeFixture f(comm, c);
  expectLayoutShape(c, f.layout(0), R);
  std::vector<RankGraphs> g(static_cast<std::size_t>(f.L()));
  for (int l = 0; l < f.L(); ++l) captureRankGraphs(comm, f, l, g[static_cast<std::size_t>(l)]);
  comm.barrier();
  std::mt19937 rng(4242);  // the same sequence on every process
  int expertNow = 0, expectedReinstantiations = 0;
  for (int it = 0; it < iterations; ++it) {
    const int kind = it < kGraphKinds ? it : static_cast<int>(rng() % kGraphKinds);
    if (kind == kChild && it >= kGraphKinds) {  // swap the experts: x1 -> x2 (in place) -> x4 (new topology) -> x1
      const int next = (expertNow + 1) % 3;
      if (next == 2 || expertNow == 2) ++expectedReinstantiations;
      for (RankGraphs& rg : g) rg.child->setExpertGraph(rg.experts[next]);
      expertNow = next;
    }
    const bool bucket = kind >= kBucket0 && kind <= kBucket3;
    const std::vector<Inputs> all = graphInputs(c, R, kind, it, rng);
    for (int l = 0; l < f.L(); ++l) {
      f.prepare(l, all[static_cast<std::size_t>(comm.globalRank(l))],
                bucket ? g[static_cast<std::size_t>(l)].bucketT[kind - kBucket0] : nullptr);
    }
    comm.barrier();
    for (int l = 0; l < f.L(); ++l) launchRankGraph(comm, f, l, g[static_cast<std::size_t>(l)], kind);
    f.syncAll();
    f.setYScale(kind == kChild ? kExpertScale[expertNow] : 1.0f);
    std::vector<RefLayout> refs;
    for (int q = 0; q < R; ++q) refs.push_back(refLayout(c, all, q, f.engine(0).layout().capacity));
    const std::string what = "iteration " + std::to_string(it) + " graph kind " + std::to_string(kind) + " T=" + std::to_string(all[0].T);
    for (int l = 0; l < f.L(); ++l) EXPECT_EQ(f.check(l, all, refs, what), 0) << what;
    comm.barrier();
  }
  for (int l = 0; l < f.L(); ++l) finishRankGraphs(comm, f, l, g[static_cast<std::size_t>(l)], expectedReinstantiations);
  comm.barrier();
}

}  // namespace

// Every layout (inEveryLayout), `iterations` shared among them: each layout launches every kind
// once and then at least 6 graphs at random (the same sequence in each layout).
void runMoeGraphSuite(Communicator& comm, MoePath path, int iterations) {
  const MoeCase c = smallCase(comm, 64, path);
  const int each = std::max(iterations / static_cast<int>(inEveryLayout(c).size()), kGraphKinds + 6);
  forEveryLayout(c, [&](const MoeCase& v) { runMoeGraphSuiteInLayout(comm, v, each); });
}


}  // namespace graphep::test
