// The CTA plan's rules (engine/moe/cta_plan.hpp), on the CPU over a grid of GPUs, budgets and
// ranks per GPU: the latency path's senders and receivers always fit the GPU's resident CTAs
// together (the receive waits for senders of every rank, so both must be resident at once), and
// ranks sharing a GPU keep to half of their share; the throughput epilogues take the SMs the
// communication leaves, or one per SM.
#include <gtest/gtest.h>

#include <algorithm>

#include "engine/moe/cta_plan.hpp"

namespace graphep {
namespace {

using moe_setup::kLatencyDefaultCtas;
using moe_setup::latencyReceiveCtas;
using moe_setup::latencySendCtas;
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

}  // namespace
}  // namespace graphep
