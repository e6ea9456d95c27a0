// MoeConfig validation on the host (every bad field is named with its value), and the watchdog's
// diagnosis of a stalled latency-path rank.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <graphep/graphep.hpp>

#include "common/expect_error.hpp"
#include "engine/moe/health.hpp"
#include "engine/moe/plan.hpp"
#include "engine/semaphore.hpp"
#include "kernels/moe/moe.h"

namespace graphep {
namespace {

MoeConfig good() { return {.maxTokensPerRank = 128, .hidden = 7168, .numExperts = 256, .topK = 8}; }

void expectRejected(const MoeConfig& c, int ranks, const std::string& needle) {
  test::expectError([&] { Engine::validate(c, ranks); }, Status::kInvalidArgument, needle);
}

TEST(Unit_MoeConfig, ValidationNamesTheValue) {
  EXPECT_NO_THROW(Engine::validate(good(), 8));
  // Each bad config, as a change to good(), and the words its refusal must contain.
  struct Bad {
    void (*change)(MoeConfig&);
    const char* words;
  };
  const Bad bad[] = {
      {[](MoeConfig& c) { c.hidden = 7000 + 4; }, "hidden=7004 is not a positive multiple of 8"},
      {[](MoeConfig& c) { c.hidden = 7168 + 8; c.dispatchType = DType::kFp8E4m3; },
       "hidden=7176 is not a multiple of 128"},
      {[](MoeConfig& c) { c.hidden = 65536 + 128; }, "hidden=65664 exceeds the supported 65536"},
      {[](MoeConfig& c) { c.numExperts = 250; }, "numExperts=250 is not divisible by the 8 ranks"},
      {[](MoeConfig& c) { c.topK = 9; c.numExperts = 8; }, "topK=9 exceeds numExperts=8"},
      {[](MoeConfig& c) { c.topK = 0; }, "topK=0"},
      {[](MoeConfig& c) { c.topK = 17; }, "topK=17 exceeds the supported 16"},
      {[](MoeConfig& c) { c.maxTokensPerRank = 0; }, "maxTokensPerRank=0"},
      {[](MoeConfig& c) { c.expertAlignment = 0; }, "expertAlignment=0"},
      {[](MoeConfig& c) { c.recvCapacity = -1; }, "recvCapacity=-1"},
      {[](MoeConfig& c) { c.smBudget = 65; }, "smBudget=65"},
      {[](MoeConfig& c) { c.receiveLayout = ReceiveLayout::kBatched; c.recvCapacity = 100; },
       "recvCapacity=100: the batched layout's capacity is E_local x rowsPerExpert"},
      {[](MoeConfig& c) { c.receiveLayout = ReceiveLayout::kBatched; c.expertAlignment = 8; },
       "expertAlignment=8 does not apply to the batched layout"},
      {[](MoeConfig& c) { c.receiveLayout = ReceiveLayout::kRankMajor; c.recvCapacity = 100; },
       "recvCapacity=100: the rank-major layout's capacity is worldSize x maxTokensPerRank"},
      {[](MoeConfig& c) { c.receiveLayout = ReceiveLayout::kRankMajor; c.expertAlignment = 4; },
       "expertAlignment=4 does not apply to the rank-major layout"},
      {[](MoeConfig& c) { c.receiveLayout = ReceiveLayout::kRankMajor; c.rowsPerExpert = 8; },
       "rowsPerExpert=8 applies to the batched layout only"},
      {[](MoeConfig& c) { c.receiveLayout = static_cast<ReceiveLayout>(3); },
       "receiveLayout=3 is not a ReceiveLayout"},
      {[](MoeConfig& c) { c.rowsPerExpert = 64; }, "rowsPerExpert=64 applies to the batched layout only"},
      {[](MoeConfig& c) { c.receiveLayout = ReceiveLayout::kBatched; c.rowsPerExpert = -1; },
       "rowsPerExpert=-1 is negative"},
      {[](MoeConfig& c) { c.receiveLayout = ReceiveLayout::kBatched; c.rowsPerExpert = 1ll << 30; },
       "rowsPerExpert=1073741824: 32 local experts"},
      {[](MoeConfig& c) { c.epilogueSms = -1; }, "epilogueSms=-1"},
      {[](MoeConfig& c) { c.epilogueSms = 1025; }, "epilogueSms=1025"},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.words);
    MoeConfig c = good();
    b.change(c);
    expectRejected(c, 8, b.words);
  }
  MoeConfig c = good();
  c.receiveLayout = ReceiveLayout::kBatched;
  for (const long long huge : {1ll << 62, 3ll << 61, std::numeric_limits<long long>::max()}) {
    c.rowsPerExpert = huge;  // a product that would wrap is refused, not accepted
    expectRejected(c, 8, "exceed 2^31 - 1 rows (lower rowsPerExpert)");
  }
  expectRejected(good(), 33, "world size 33");
}

// Rank 0 of a world of 2, whose peer's setup block is given: the allgather returns this rank's
// block and the peer's (or this rank's twice, recording it, when none is given).
class TwoRankComm : public Communicator {
 public:
  std::vector<char> peer;  // the peer's block; empty: the same as this rank's
  std::vector<char> sent;  // this rank's last block
  int worldSize() const override { return 2; }
  int numLocalRanks() const override { return 1; }
  int globalRank(int) const override { return 0; }
  int device(int) const override { return 0; }
  const char* kind() const override { return "test"; }
  void allgather(const void* send, void* recv, std::size_t bytes) override {
    sent.assign(static_cast<const char*>(send), static_cast<const char*>(send) + bytes);
    std::memcpy(recv, send, bytes);
    std::memcpy(static_cast<char*>(recv) + bytes, peer.empty() ? send : peer.data(), bytes);
  }
  void barrier() override {}
};

TEST(Unit_MoeConfig, EveryFieldComparedAcrossRanks) {
  // Each field changed on the peer alone is refused, named with both values.
  struct Change {
    const char* name;
    void (*apply)(MoeConfig&);
  };
  const Change changes[] = {
      {"hidden", [](MoeConfig& c) { c.hidden = 2048; }},
      {"smBudget", [](MoeConfig& c) { c.smBudget = 32; }},
      {"counterStart", [](MoeConfig& c) { c.counterStart = 7; }},
      {"shrinkOnTimeout", [](MoeConfig& c) { c.shrinkOnTimeout = true; }},
  };
  for (const Change& change : changes) {
    MoeConfig theirs = good();
    change.apply(theirs);
    TwoRankComm recorder;
    moe_setup::requireSameConfig(recorder, theirs);  // the same on both ranks: accepted
    TwoRankComm comm;
    comm.peer = recorder.sent;
    test::expectError([&] { moe_setup::requireSameConfig(comm, good()); }, Status::kInvalidArgument,
                      std::string("MoeConfig differs across ranks: ") + change.name);
  }
  TwoRankComm same;
  moe_setup::requireSameConfig(same, good());
}

// A config whose symmetric heap passes the heap's limit is refused naming the caller's fields, not
// the heap's internal ones; and the largest hidden with the largest capacity is refused by name,
// not as an internal error of the sizes.
TEST(Unit_MoeConfig, HugeConfigsNamedByTheirFields) {
  MoeConfig big{.maxTokensPerRank = 1 << 20, .hidden = 16384, .numExperts = 256, .topK = 8};
  test::expectError([&] { Engine::memoryRequirements(big, 32); }, Status::kInvalidArgument,
                    "maxTokensPerRank=1048576, hidden=16384, topK=8, world size 32), past the heap's limit");
  MoeConfig wide{.maxTokensPerRank = 1, .hidden = 2147483520, .numExperts = 1, .topK = 1};
  wide.recvCapacity = (1ll << 31) - 1;
  test::expectError([&] { Engine::memoryRequirements(wide, 1); }, Status::kInvalidArgument,
                    "hidden=2147483520 exceeds the supported 65536");
}

TEST(Unit_MoeConfig, WorstCaseCapacity) {
  MoeConfig c = good();
  // 128 tokens x 8 ranks x min(8, 32 local experts) rows.
  EXPECT_EQ(Engine::worstCaseCapacity(c, 8), 128 * 8 * 8);
  c.numExperts = 16;  // 2 local experts: a token takes at most 2 rows per rank
  EXPECT_EQ(Engine::worstCaseCapacity(c, 8), 128 * 8 * 2);
  c.expertAlignment = 16;  // plus up to 15 padding rows per local expert
  EXPECT_EQ(Engine::worstCaseCapacity(c, 8), 128 * 8 * 2 + 2 * 15);
}

TEST(Unit_MoeConfig, ReceiveCapacityPerLayout) {
  MoeConfig c = good();
  EXPECT_EQ(Engine::receiveCapacity(c, 8), Engine::worstCaseCapacity(c, 8));
  c.recvCapacity = 1000;
  EXPECT_EQ(Engine::receiveCapacity(c, 8), 1000);
  c = good();
  c.receiveLayout = ReceiveLayout::kBatched;  // 32 local experts x (8 ranks x 128 tokens) rows
  EXPECT_EQ(Engine::receiveCapacity(c, 8), 32 * 8 * 128);
  c.rowsPerExpert = 40;
  EXPECT_EQ(Engine::receiveCapacity(c, 8), 32 * 40);
  // The memory query follows the capacity.
  MoeConfig small = c;
  small.rowsPerExpert = 20;
  EXPECT_LT(Engine::memoryRequirements(small, 8).privateBytes, Engine::memoryRequirements(c, 8).privateBytes);
  c = good();
  c.receiveLayout = ReceiveLayout::kRankMajor;  // one row per (source token, rank)
  EXPECT_EQ(Engine::receiveCapacity(c, 8), 8 * 128);
  EXPECT_GT(Engine::memoryRequirements(c, 8).privateBytes, 0u);
}

TEST(Unit_MoeConfig, RecordSizes) {
  EXPECT_EQ(moePayloadBytes(7168, false), 14336u);
  EXPECT_EQ(moePayloadBytes(7168, true), 56u * 144u);  // 56 tiles of 128 e4m3 + scale + padding
  EXPECT_EQ(moeMetaBytes(8), 16u + 8u * 16u);
  EXPECT_EQ(moeCountMsgBytes(32), 272u);  // (1 + 32) x 8 = 264 -> 272
}

}  // namespace
}  // namespace graphep

namespace graphep::test {
namespace {

detail::LatencyCounters stalled(std::uint32_t step, std::uint32_t G, int R) {
  detail::LatencyCounters c;
  c.dispatchStep = step;
  c.combineStep = step;
  c.ctas = G;
  c.flags.assign(static_cast<std::size_t>(R), step + 1u);  // every count message in
  c.combineArrivals.assign(static_cast<std::size_t>(R), step * G);
  return c;
}

TEST(Unit_MoeHealth, NamesThePeerAndWhatIsMissing) {
  detail::LatencyCounters c = stalled(7, 24, 4);
  // Every count message in: the records carry no counter, and the device error names a late one.
  std::string m = detail::describeLatencyStall(c);
  EXPECT_NE(m.find("every peer's count message is in"), std::string::npos) << m;
  EXPECT_NE(m.find("names the record's peer"), std::string::npos) << m;
  c.flags[3] = 7;  // rank 3 has not posted its count message for step 7
  m = detail::describeLatencyStall(c);
  EXPECT_NE(m.find("rank 3's count message for dispatch step 7 has not arrived (flag 7)"), std::string::npos) << m;
  EXPECT_EQ(m.find("rank 0"), std::string::npos) << m;
  c = stalled(7, 24, 2);
  c.pending = 1;  // the dispatch finished: the combine is stuck
  c.combineArrivals = {7 * 24 + 3, 8 * 24};
  m = detail::describeLatencyStall(c);
  EXPECT_NE(m.find("3 of rank 0's 24 CTAs have delivered their partials for combine step 7"), std::string::npos) << m;
  EXPECT_EQ(m.find("rank 1"), std::string::npos) << m;
  c.rank = 1;  // rank 1's own combine counter is never posted (its receiver reduces its own rows)
  c.combineArrivals = {8 * 24, 7 * 24};
  EXPECT_NE(detail::describeLatencyStall(c).find("every peer's counters are complete"), std::string::npos);
}

// A barrier this rank entered (its pair counts at 5) that rank 2 has not reached (its post 4)
// comes first; rank 3 outside the mask, and this rank itself, are not waited for; once every
// post is in, the step's counters speak again.
TEST(Unit_MoeHealth, NamesAPeerThatHasNotReachedTheBarrier) {
  detail::LatencyCounters c = stalled(7, 24, 4);
  c.rank = 0;
  c.flags[1] = 7;  // also short of the step: the barrier comes first
  c.barrierPairs = {0, 5, 5, 5};
  c.barrierPosts = {0, 5, 4, 4};
  c.dispatchLive = 0b0111;
  std::string m = detail::describeLatencyStall(c);
  EXPECT_NE(m.find("; rank 2 has not reached barrier 5 (its post 4)"), std::string::npos) << m;
  EXPECT_EQ(m.find("rank 3"), std::string::npos) << m;
  EXPECT_EQ(m.find("count message"), std::string::npos) << m;
  c.barrierPosts = {0, 5, 5, 4};
  m = detail::describeLatencyStall(c);
  EXPECT_NE(m.find("rank 1's count message for dispatch step 7"), std::string::npos) << m;
}

// The static memory query: validates first, picks the path createAll starts from, and its private
// bytes grow with the receive capacity by exactly the per-row buffers (recv_x, scales, four
// metadata words, the bf16 expert output), up to one 256-byte alignment per region.
TEST(Unit_MoeMemory, PathAndPerRowBytes) {
  MoeConfig c = good();
  c.hidden = 7000 + 4;
  test::expectError([&] { Engine::memoryRequirements(c, 8); }, Status::kInvalidArgument, "hidden=7004");
  c = good();
  const MoeMemory latency = Engine::memoryRequirements(c, 8);
  EXPECT_EQ(latency.path, MoePath::kLatency);
  EXPECT_EQ(latency.ncclStagingBytes, 0u);
  EXPECT_GT(latency.symmetricHeapBytes, 0u);
  c.path = MoePath::kThroughput;
  const MoeMemory throughput = Engine::memoryRequirements(c, 8);
  EXPECT_EQ(throughput.path, MoePath::kThroughput);
  // No staging: NCCL moves the exchanges' fixed slots in place.
  EXPECT_EQ(throughput.ncclStagingBytes, 0u);
  c = good();
  c.maxTokensPerRank = 512;  // past the latency path's limit
  EXPECT_EQ(Engine::memoryRequirements(c, 8).path, MoePath::kThroughput);

  for (DType t : {DType::kBf16, DType::kFp8E4m3}) {
    c = good();
    c.dispatchType = t;
    // recv_x, the scales (kept by a bf16 engine too, for its fp8 dispatches), the row metadata,
    // the expert outputs.
    const std::size_t H = 7168, perRow = (t == DType::kFp8E4m3 ? H : 2 * H) + H / 128 * 4 + 4 * 4 + 2 * H;
    c.recvCapacity = 1000;
    const std::size_t small = Engine::memoryRequirements(c, 8).privateBytes;
    c.recvCapacity = 3000;
    const std::size_t large = Engine::memoryRequirements(c, 8).privateBytes;
    EXPECT_GE(large - small + 7 * 256, 2000 * perRow) << static_cast<int>(t);
    EXPECT_LE(large - small, 2000 * perRow + 7 * 256) << static_cast<int>(t);
  }
}

// Under an active-rank mask (issue 30): a rank outside it is waited for by no one, so it is never
// named; the others' combine partials are measured against the arrivals expected of them
// (latency.expected), which fall behind step x G by G for every step they sat out.
TEST(Unit_MoeHealth, OnlyTheRanksInTheMaskAgainstTheirExpectedCounts) {
  detail::LatencyCounters c = stalled(7, 24, 4);
  c.combineExpected.assign(4, 7 * 24);
  c.flags[2] = 3;  // rank 2 is outside the mask: its old flag is not missing
  c.dispatchLive = 0b1011;
  EXPECT_NE(detail::describeLatencyStall(c).find("every peer's count message is in"), std::string::npos)
      << detail::describeLatencyStall(c);
  c.flags[1] = 7;  // rank 1, in the mask, has not posted step 7's
  std::string m = detail::describeLatencyStall(c);
  EXPECT_NE(m.find("rank 1's count message for dispatch step 7 has not arrived"), std::string::npos) << m;
  EXPECT_EQ(m.find("rank 2"), std::string::npos) << m;
  c = stalled(7, 24, 3);
  c.pending = 1;
  c.combineExpected = {6 * 24, 7 * 24, 7 * 24};
  c.combineArrivals = {6 * 24 + 5, 8 * 24, 0};
  c.combineLive = 0b011;  // rank 2 outside the last dispatch's mask
  m = detail::describeLatencyStall(c);
  EXPECT_NE(m.find("5 of rank 0's 24 CTAs have delivered their partials for combine step 7"), std::string::npos) << m;
  EXPECT_EQ(m.find("rank 2"), std::string::npos) << m;
  c = stalled(7, 24, 3);  // rank 1 outside its own mask: its dispatch uses no rank and waits for none
  c.rank = 1;
  c.dispatchLive = 0;
  c.flags[0] = 3;
  m = detail::describeLatencyStall(c);
  EXPECT_NE(m.find("outside the active-rank mask and waits for no peer"), std::string::npos) << m;
}

TEST(Unit_MoeHealth, AcrossTheWrap) {
  // Step 2^32 - 1: complete counters have wrapped to small values; a late peer still reads as late.
  detail::LatencyCounters c = stalled(0xffffffffu, 24, 3);
  EXPECT_EQ(c.flags[0], 0u);
  EXPECT_NE(detail::describeLatencyStall(c).find("every peer's count message is in"), std::string::npos);
  c.flags[2] = 0xffffffffu;
  const std::string m = detail::describeLatencyStall(c);
  EXPECT_NE(m.find("rank 2's count message for dispatch step 4294967295 has not arrived"), std::string::npos) << m;
  EXPECT_EQ(m.find("rank 0"), std::string::npos) << m;
  EXPECT_EQ(m.find("rank 1"), std::string::npos) << m;
}

TEST(Unit_SemaphoreHealth, NamesTheShortSource) {
  const std::vector<SemaphoreWait> waits = {{3, 0, 1}, {3, 2, 2}, {5, 1, 1}};
  std::vector<SemaphoreCounts> counts = {{1, 9, 8}, {2, 7, 5}, {4, 4, 0}};
  EXPECT_NE(detail::describeSemaphoreStall(waits, counts).find("no semaphore word is short"), std::string::npos);
  counts[1] = {1, 6, 5};  // rank 2 signalled once of the two waited for
  const std::string m = detail::describeSemaphoreStall(waits, counts);
  EXPECT_NE(m.find("semaphore channel 3: rank 2 has not signalled (count 1 of the 2 waited for; arrived 6, consumed 5)"),
            std::string::npos)
      << m;
  EXPECT_EQ(m.find("rank 0"), std::string::npos) << m;
  EXPECT_EQ(m.find("rank 1"), std::string::npos) << m;
}

// The enum names every message and report uses (include/graphep/moe.hpp).
TEST(Unit_MoeConfig, PathAndLayoutNames) {
  EXPECT_STREQ(name(MoePath::kAuto), "auto");
  EXPECT_STREQ(name(MoePath::kLatency), "latency");
  EXPECT_STREQ(name(MoePath::kThroughput), "throughput");
  EXPECT_STREQ(name(static_cast<MoePath>(7)), "?");
  EXPECT_STREQ(name(ReceiveLayout::kExpertMajor), "expert-major");
  EXPECT_STREQ(name(ReceiveLayout::kBatched), "batched");
  EXPECT_STREQ(name(ReceiveLayout::kRankMajor), "rank-major");
  EXPECT_STREQ(name(static_cast<ReceiveLayout>(3)), "?");
}

}  // namespace
}  // namespace graphep::test
