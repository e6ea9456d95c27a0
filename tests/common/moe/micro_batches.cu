// The MoE micro-batch suite: several engines' operations interleaved on one stream.
#include "common/moe/harness.cuh"

namespace graphep::test {

using namespace moe;

namespace {

void runMoeMicroBatchesInLayout(Communicator& comm, const MoeCase& c, int rounds) {
  SCOPED_TRACE("two micro-batches in flight, " + describeCase(c));
  const int R = comm.worldSize();
  MoeFixture a(comm, c), b(comm, c);  // two engines: two buffer sets
  expectLayoutShape(c, a.layout(0), R);
  for (int round = 0; round < rounds; ++round) {
    const int Ta = 1 + round * 13 % 64, Tb = 64 - round * 7 % 64;
    std::vector<Inputs> inA, inB;
    for (int q = 0; q < R; ++q) {
      inA.push_back(makeInputs(c, R, q, Ta, 700 + round));
      inB.push_back(makeInputs(c, R, q, Tb, 900 + round));
    }
    for (int l = 0; l < a.L(); ++l) {
      a.prepare(l, inA[static_cast<std::size_t>(comm.globalRank(l))]);
      b.prepare(l, inB[static_cast<std::size_t>(comm.globalRank(l))]);
    }
    comm.barrier();
    for (int l = 0; l < a.L(); ++l) {  // B's operations start while A's are in flight (its own stream)
      GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
      a.enqueue(l, a.buf(l).stream);
      b.enqueue(l, b.buf(l).stream);
    }
    a.syncAll();
    b.syncAll();
    std::vector<RefLayout> refA, refB;
    for (int q = 0; q < R; ++q) {
      refA.push_back(refLayout(c, inA, q, a.engine(0).layout().capacity));
      refB.push_back(refLayout(c, inB, q, b.engine(0).layout().capacity));
    }
    for (int l = 0; l < a.L(); ++l) {
      EXPECT_EQ(a.check(l, inA, refA, "micro-batch A round " + std::to_string(round)), 0);
      EXPECT_EQ(b.check(l, inB, refB, "micro-batch B round " + std::to_string(round)), 0);
    }
    comm.barrier();
  }
}

}  // namespace

// Every layout (inEveryLayout), each all `rounds` (a few: the rounds differ in their counts).
void runMoeMicroBatches(Communicator& comm, MoePath path, int rounds, int smBudget) {
  MoeCase c = smallCase(comm, 64, path);
  c.cfg.smBudget = smBudget;
  forEveryLayout(c, [&](const MoeCase& v) { runMoeMicroBatchesInLayout(comm, v, rounds); });
}


}  // namespace graphep::test
