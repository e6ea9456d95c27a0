// The MoE overflow suite: rows past a smaller capacity dropped and counted, never written out of
// bounds.
#include "common/moe/harness.cuh"

namespace graphep::test {

using namespace moe;

namespace {

// One run of the overflow suite on every rank: dispatch, the expert into the caller's `y` (exactly
// `capacity` rows each, poisoned first) unguarded, combine, and the full check. Adds each local
// rank's expected drops to `expectDropped`; returns this process's.
unsigned long long overflowRun(Communicator& comm, const MoeCase& c, MoeFixture& f, const std::vector<void*>& y,
                               int run, std::vector<unsigned long long>& expectDropped) {
  const int R = comm.worldSize();
  const std::size_t cap = static_cast<std::size_t>(f.layout(0).capacity), rowBytes = static_cast<std::size_t>(c.cfg.hidden) * 2;
  std::vector<Inputs> all;
  for (int q = 0; q < R; ++q) all.push_back(makeInputs(c, R, q, rankTokens(c, run, q), 777 + run));
  for (int l = 0; l < f.L(); ++l) {
    f.prepare(l, all[static_cast<std::size_t>(comm.globalRank(l))]);
    GRAPHEP_CUDA_CHECK(cudaMemset(y[static_cast<std::size_t>(l)], kPoison, cap * rowBytes));  // NaN
    GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  }
  comm.barrier();
  for (int l = 0; l < f.L(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    cudaStream_t s = f.buf(l).stream;
    const DispatchLayout& v = f.engine(l).dispatch(f.dispatchArgs(l, nullptr), s);
    f.expert(l, v, s, 1.0f, y[static_cast<std::size_t>(l)], /*guard=*/false);
    CombineArgs ca;
    ca.expertOutput = y[static_cast<std::size_t>(l)];
    ca.out = f.buf(l).out;
    f.engine(l).combine(ca, s);
  }
  f.syncAll();
  std::vector<RefLayout> refs;
  for (int q = 0; q < R; ++q) refs.push_back(refLayout(c, all, q, static_cast<long long>(cap)));
  unsigned long long dropped = 0;
  for (int l = 0; l < f.L(); ++l) {
    const RefLayout& ref = refs[static_cast<std::size_t>(comm.globalRank(l))];
    EXPECT_EQ(f.check(l, all, refs, "overflow run " + std::to_string(run)), 0);
    expectDropped[static_cast<std::size_t>(l)] += ref.droppedTotal;
    dropped += ref.droppedTotal;
  }
  comm.barrier();
  return dropped;
}

void runMoeOverflowInLayout(Communicator& comm, const MoeCase& c) {
  SCOPED_TRACE("overflow, " + describeCase(c));
  MoeFixture f(comm, c);
  expectLayoutShape(c, f.layout(0), comm.worldSize());
  const std::size_t cap = static_cast<std::size_t>(f.layout(0).capacity), rowBytes = static_cast<std::size_t>(c.cfg.hidden) * 2;
  std::vector<void*> y(static_cast<std::size_t>(f.L()), nullptr);  // the caller's: exactly `capacity` rows
  for (int l = 0; l < f.L(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&y[static_cast<std::size_t>(l)], cap * rowBytes));
  }
  unsigned long long droppedSeen = 0;
  std::vector<unsigned long long> expectDropped(static_cast<std::size_t>(f.L()), 0);
  for (int run = 0; run < 3; ++run) droppedSeen += overflowRun(comm, c, f, y, run, expectDropped);
  for (int l = 0; l < f.L(); ++l) {
    const MoeStatus st = f.engine(l).status();
    EXPECT_EQ(st.droppedRows, expectDropped[static_cast<std::size_t>(l)]) << st.describe();
    EXPECT_EQ(st.deviceError, "");
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    GRAPHEP_CUDA_CHECK(cudaFree(y[static_cast<std::size_t>(l)]));
  }
  if (c.cfg.receiveLayout == ReceiveLayout::kRankMajor) {  // one row per source token: nothing to drop
    EXPECT_EQ(droppedSeen, 0ull) << "the rank-major layout cannot overflow";
  } else {
    EXPECT_GT(droppedSeen, 0ull) << "the case must overflow";
  }
  comm.barrier();
}

}  // namespace

// Every layout (inEveryLayout): expert-major drops at the capacity, batched past 9 rows per expert,
// rank-major (full capacity) must drop nothing; then the aligned case, in expert-major only
// (alignment is that layout's alone).
void runMoeOverflow(Communicator& comm, MoePath path) {
  MoeCase c = smallCase(comm, 64, path);
  c.name = "overflow_memcheck";
  c.routing = Routing::kSkewed;
  c.cfg.recvCapacity = 29;  // far below what skewed routing sends every rank
  c.tokens = {64, 50, 0};
  forEveryLayout(c, [&](const MoeCase& v) { runMoeOverflowInLayout(comm, v); });
  if (::testing::Test::HasFatalFailure()) return;
  c.cfg.expertAlignment = 8;
  runMoeOverflowInLayout(comm, c);
}


}  // namespace graphep::test
