// The CTA plan's rules (engine/moe/cta_plan.hpp), on the CPU over a grid of GPUs, budgets and
// ranks per GPU: the latency path's senders and receivers always fit the GPU's resident CTAs
// together (the receive waits for senders of every rank, so both must be resident at once), and
// ranks sharing a GPU keep to half of their share; the throughput epilogues take the SMs the
// communication leaves, or one per SM.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "engine/error.hpp"
#include "engine/moe/cta_plan.hpp"
#include "kernels/moe/moe.h"

namespace graphep {
namespace {

using moe_setup::directSharedCtas;
using moe_setup::exchangeChunks;
using moe_setup::kExchangeAutoChunks;
using moe_setup::kExchangeChunkTokens;
using moe_setup::kDirectSharedParts;
using moe_setup::kLatencyDefaultCtas;
using moe_setup::latencyReceiveCtas;
using moe_setup::latencySendCtas;
using moe_setup::moversStreams;
using moe_setup::queuesHold;
using moe_setup::throughputEpilogueCtas;

TEST(Unit_MoeCtaPlan, LatencyPartsFitTheirShareOfTheGpu) {
  for (int sms : {8, 66, 132}) {
    for (int perSm : {1, 2}) {
      for (int sharing : {1, 2, 4, 8}) {
        const int resident = perSm * sms / sharing;
        if (resident < 2) continue;  // refused by name before these rules (latencyCtas)
        for (int budget : {0, 1, 8, 24, 64}) {
          for (int epilogue : {0, 1, 16, 1024}) {
            const int send = latencySendCtas(budget, resident, sharing);
            const int receive = latencyReceiveCtas(send, epilogue, resident, sharing, sms);
            const auto where = ::testing::Message() << "sms " << sms << " x " << perSm << ", " << sharing
                                                    << " ranks on it, budget " << budget << ", epilogueSms "
                                                    << epilogue << ": send " << send << ", receive " << receive;
            EXPECT_GE(send, 1) << where;
            EXPECT_GE(receive, 1) << where;
            EXPECT_LE(send, budget > 0 ? budget : kLatencyDefaultCtas) << where;
            EXPECT_LE(send + receive, resident) << where << " (resident " << resident << ")";
            if (sharing > 1) {  // two engines in flight still fit
              EXPECT_LE(send, resident / 2) << where;
              EXPECT_LE(receive, std::max(1, resident / 2)) << where;
            }
            if (epilogue > 0) {
              EXPECT_LE(receive, epilogue) << where;
            } else if (sharing > 1) {
              EXPECT_EQ(receive, std::min(send, resident / 2)) << where << ": as many receivers as senders";
            } else {
              EXPECT_EQ(receive, std::min(sms, resident - send)) << where << ": one per SM within the room";
            }
          }
        }
      }
    }
  }
}

TEST(Unit_MoeCtaPlan, ThroughputEpiloguesTakeTheFreeSms) {
  EXPECT_EQ(throughputEpilogueCtas(24, 0, 132), 108);  // the SMs the communication CTAs leave
  EXPECT_EQ(throughputEpilogueCtas(100, 0, 132), 132);  // fewer than half left: one per SM
  EXPECT_EQ(throughputEpilogueCtas(24, 16, 132), 16);   // epilogueSms
  EXPECT_EQ(throughputEpilogueCtas(24, 500, 132), 132);  // at most one per SM
  for (int sms : {8, 66, 132}) {
    for (int comm = 1; comm <= sms; ++comm) {
      const int e = throughputEpilogueCtas(comm, 0, sms);
      EXPECT_GE(e, sms / 2) << sms << " SMs, " << comm << " communication CTAs";
      EXPECT_LE(e, sms) << sms << " SMs, " << comm << " communication CTAs";
    }
  }
}

// Ranks sharing a GPU on the direct kernels: every rank's waiting grids (at most five at once: two
// engines in flight, one in its combine's reduce, send and final, one in its dispatch's send and
// receive) fit its share of the GPU, whatever the budget asked for.
TEST(Unit_MoeCtaPlan, DirectGridsOfRanksSharingAGpuFitTheirShare) {
  for (int share = kDirectSharedParts; share <= 264; ++share) {
    for (int want : {0, 1, 4, 24, 132, 1024}) {
      const int ctas = directSharedCtas(want, share);
      const auto where = ::testing::Message() << "share " << share << ", want " << want << ": " << ctas;
      EXPECT_GE(ctas, 1) << where;
      EXPECT_LE(5 * ctas, share) << where;
      if (want > 0) {
        EXPECT_LE(ctas, want) << where;
      }
      EXPECT_EQ(ctas, want > 0 ? std::min(want, share / kDirectSharedParts) : share / kDirectSharedParts) << where;
    }
  }
  EXPECT_EQ(directSharedCtas(0, 33), 5);   // 4 ranks on 132 SMs, one CTA per SM
  EXPECT_EQ(directSharedCtas(24, 66), 11);  // the budget within a sixth of the share
  EXPECT_EQ(directSharedCtas(2, 66), 2);
}

// The movers path's chunks: asked for, within [1, T_max] and kMoeMaxChunks, and no empty chunk;
// automatic, several only where some peer is reached through NCCL and T_max holds
// kExchangeChunkTokens per chunk.
TEST(Unit_MoeCtaPlan, ExchangeChunksFollowTheRequestAndTheTokens) {
  for (int T : {1, 2, 3, 32, 1000, 1024, 2048, 4096, 16384}) {
    for (bool remote : {false, true}) {
      for (int asked = 0; asked <= kMoeMaxChunks; ++asked) {
        const int c = exchangeChunks(T, remote, asked);
        const auto where = ::testing::Message() << "T " << T << (remote ? ", remote" : ", load/store") << ", asked "
                                                << asked << ": " << c;
        EXPECT_GE(c, 1) << where;
        EXPECT_LE(c, std::min(T, kMoeMaxChunks)) << where;
        if (asked > 0) {
          EXPECT_LE(c, asked) << where;
        } else if (!remote) {
          EXPECT_EQ(c, 1) << where;
        } else {
          EXPECT_EQ(c, std::clamp(T / kExchangeChunkTokens, 1, kExchangeAutoChunks)) << where;
        }
      }
    }
  }
  // Every chunk holds list indices: chunk j starts at j * ceil(T / C) < T (an empty last chunk had
  // a window of 0 bytes, which the exchange refuses).
  for (int T = 1; T <= 200; ++T) {
    for (int asked = 1; asked <= kMoeMaxChunks; ++asked) {
      const int c = exchangeChunks(T, true, asked);
      const int per = (T + c - 1) / c;
      EXPECT_LT((c - 1) * per, T) << "T " << T << ", asked " << asked << ": " << c << " chunks of " << per;
    }
  }
  EXPECT_EQ(exchangeChunks(4, false, 3), 2);  // chunks of 2: a third would start at 4
  EXPECT_EQ(exchangeChunks(4096, true, 0), 2);
  EXPECT_EQ(exchangeChunks(16384, true, 0), 2);
  EXPECT_EQ(exchangeChunks(1024, true, 0), 1);
  EXPECT_EQ(exchangeChunks(4096, false, 0), 1);
  EXPECT_EQ(exchangeChunks(32, false, 3), 3);
}

// The movers path's streams per rank: two while every rank on the GPU keeps both in a hardware
// queue of its own, one (the caller's) when only one each fits, refused by name beyond that.
TEST(Unit_MoeCtaPlan, MoversStreamsKeepEveryRankInQueuesOfItsOwn) {
  for (int queues = 1; queues <= 32; ++queues) {
    for (int sharing = 1; sharing <= 40; ++sharing) {
      const auto where = ::testing::Message() << sharing << " ranks on a GPU of " << queues << " queues";
      EXPECT_EQ(queuesHold(sharing, queues), sharing <= queues) << where << ": the check every rank agrees on";
      if (sharing > queues) {
        EXPECT_THROW(moversStreams(sharing, queues), Error) << where;
        continue;
      }
      const int streams = moversStreams(sharing, queues);
      EXPECT_LE(streams * sharing, queues) << where;
      EXPECT_EQ(streams, 2 * sharing <= queues ? 2 : 1) << where << ": the comm stream wherever it fits";
    }
  }
  EXPECT_EQ(moversStreams(4, 8), 2);  // run 158's 4 ranks of one GPU keep their comm streams
  EXPECT_EQ(moversStreams(8, 8), 1);  // run 166's 8 ranks: 16 streams over 8 queues hung
  EXPECT_EQ(moversStreams(8, 32), 2);
  try {
    moversStreams(9, 8);
    ADD_FAILURE() << "9 ranks over 8 queues accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("9 ranks"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("CUDA_DEVICE_MAX_CONNECTIONS"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace graphep
