// MoeConfig validation on the host: every bad field is named with its value.
#include <gtest/gtest.h>

#include <string>

#include <graphep/graphep.hpp>

#include "kernels/moe.h"

namespace graphep {
namespace {

MoeConfig good() {
  MoeConfig c;
  c.maxTokensPerRank = 128;
  c.hidden = 7168;
  c.numExperts = 256;
  c.topK = 8;
  return c;
}

void expectRejected(const MoeConfig& c, int ranks, const std::string& needle) {
  try {
    Engine::validate(c, ranks);
    ADD_FAILURE() << "accepted; expected an error naming '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Unit_MoeConfig, ValidationNamesTheValue) {
  EXPECT_NO_THROW(Engine::validate(good(), 8));
  MoeConfig c = good();
  c.hidden = 7000 + 4;
  expectRejected(c, 8, "hidden=7004 is not a positive multiple of 8");
  c = good();
  c.hidden = 7168 + 8;
  c.dispatchType = DType::kFp8E4m3;
  expectRejected(c, 8, "hidden=7176 is not a multiple of 128");
  c = good();
  c.numExperts = 250;
  expectRejected(c, 8, "numExperts=250 is not divisible by the 8 ranks");
  c = good();
  c.topK = 9;
  c.numExperts = 8;
  expectRejected(c, 8, "topK=9 exceeds numExperts=8");
  c = good();
  c.topK = 0;
  expectRejected(c, 8, "topK=0");
  c = good();
  c.topK = 17;
  expectRejected(c, 8, "topK=17 exceeds the supported 16");
  c = good();
  c.maxTokensPerRank = 0;
  expectRejected(c, 8, "maxTokensPerRank=0");
  c = good();
  c.expertAlignment = 0;
  expectRejected(c, 8, "expertAlignment=0");
  c = good();
  c.recvCapacity = -1;
  expectRejected(c, 8, "recvCapacity=-1");
  c = good();
  c.smBudget = 65;
  expectRejected(c, 8, "smBudget=65");
  expectRejected(good(), 33, "world size 33");
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

TEST(Unit_MoeConfig, RecordSizes) {
  EXPECT_EQ(moePayloadBytes(7168, false), 14336u);
  EXPECT_EQ(moePayloadBytes(7168, true), 56u * 144u);  // 56 tiles of 128 e4m3 + scale + padding
  EXPECT_EQ(moeMetaBytes(8), 16u + 8u * 16u);
  EXPECT_EQ(moeCountMsgBytes(32), 272u);  // (1 + 32) x 8 = 264 -> 272
}

}  // namespace
}  // namespace graphep
