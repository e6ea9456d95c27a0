// Foundation on 2 GPUs in one process: a local group over devices {0, 1} (direct pointers with
// peer access) and NCCL communicators adopted from the caller (the embedding path).
#include <gtest/gtest.h>

#include <nccl.h>

#include <graphep/graphep.hpp>

#include "common/gpu_env.hpp"
#include "common/nccl_comms.hpp"
#include "common/sync_suite.hpp"
#include "engine/heap.hpp"

namespace graphep::test {
namespace {

enum class TwoGpuKind { kLocalGroup, kAdoptedNccl };

class Gpu2_Foundation : public ::testing::TestWithParam<TwoGpuKind> {
 protected:
  void SetUp() override {
    GRAPHEP_REQUIRE_GPUS(2);
    if (GetParam() == TwoGpuKind::kLocalGroup) {
      comm_ = createLocalGroup({0, 1});
    } else {
      nccl_ = std::make_unique<CallerNcclComms>();
      ASSERT_NE(nccl_->comms[0], nullptr) << "ncclCommInitAll failed";
      comm_ = adoptNcclComms(nccl_->comms);
    }
  }
  void TearDown() override {
    comm_.reset();  // before the adopted comms it borrows
    nccl_.reset();
  }
  std::unique_ptr<CallerNcclComms> nccl_;
  std::unique_ptr<Communicator> comm_;
};

TEST_P(Gpu2_Foundation, HeapExchange) {
  runHeapExchange(*comm_, 777);
  HeapConfig cfg;
  cfg.numRanks = 2;
  auto heap = SymmetricHeap::create(*comm_, cfg);
  for (int l = 0; l < 2; ++l) {
    const PeerClass c = heap->peerClass(l, 1 - l);
    EXPECT_TRUE(c == PeerClass::kNvLink || c == PeerClass::kPcie) << peerClassName(c);
  }
}

TEST_P(Gpu2_Foundation, FlagPingPongEagerNearWrap) {
  runFlagPingPong(*comm_, 10000, false, kNearWrap);
}
TEST_P(Gpu2_Foundation, FlagPingPongGraphNearWrap) {
  runFlagPingPong(*comm_, 10000, true, kNearWrap);
}
TEST_P(Gpu2_Foundation, SemaphorePingPongEagerNearWrap) {
  runSemaphorePingPong(*comm_, 10000, false, kNearWrap);
}
TEST_P(Gpu2_Foundation, SemaphorePingPongGraphNearWrap) {
  runSemaphorePingPong(*comm_, 10000, true, kNearWrap);
}
TEST_P(Gpu2_Foundation, MissingPeerTimesOutNamingThePeer) {
  runMissingPeer(*comm_, 1, 0, 300);
}

INSTANTIATE_TEST_SUITE_P(InProcess, Gpu2_Foundation,
                         ::testing::Values(TwoGpuKind::kLocalGroup, TwoGpuKind::kAdoptedNccl),
                         [](const auto& info) {
                           return info.param == TwoGpuKind::kLocalGroup ? "LocalGroup"
                                                                        : "AdoptedNccl";
                         });

}  // namespace
}  // namespace graphep::test
