// Foundation on one GPU with 4 emulated ranks (a local group with a repeated device).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstdio>

#include <graphep/graphep.hpp>

#include "common/expect_error.hpp"
#include "common/gpu_env.hpp"
#include "common/nccl_comms.hpp"
#include "common/sync_suite.hpp"
#include "engine/heap.hpp"
#include "engine/semaphore.hpp"

namespace graphep::test {
namespace {

class Gpu1_Heap : public FourEmulatedRanks {};
class Gpu1_Sync : public FourEmulatedRanks {};

TEST_F(Gpu1_Heap, ExchangeFourEmulatedRanks) {
  runHeapExchange(*comm_, 1234);
  runHeapExchange(*comm_, 98765);  // fresh data, fresh heap
}

TEST_F(Gpu1_Sync, FlagPingPongEagerNearWrap) {
  runFlagPingPong(*comm_, 10000, /*graph=*/false, kNearWrap);
}

TEST_F(Gpu1_Sync, FlagPingPongGraphNearWrap) {
  runFlagPingPong(*comm_, 10000, /*graph=*/true, kNearWrap);
}

TEST_F(Gpu1_Sync, SemaphorePingPongEagerNearWrap) {
  runSemaphorePingPong(*comm_, 10000, /*graph=*/false, kNearWrap);
}

// A short eager run that reports its time per round: same-GPU stream waits are the slow case.
TEST_F(Gpu1_Sync, SemaphorePingPongEagerShortTimed) {
  const auto t0 = std::chrono::steady_clock::now();
  runSemaphorePingPong(*comm_, 100, /*graph=*/false, kNearWrap);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[ timing   ] 100 eager semaphore rounds, 4 ranks on 1 GPU: %.1f ms (%.3f ms/round)\n",
              ms, ms / 100);
}

TEST_F(Gpu1_Sync, SemaphorePingPongGraphNearWrap) {
  runSemaphorePingPong(*comm_, 10000, /*graph=*/true, kNearWrap);
}

TEST_F(Gpu1_Sync, MissingPeerTimesOutNamingThePeer) {
  runMissingPeer(*comm_, /*waiter=*/0, /*missing=*/2, /*timeoutMs=*/300);
}

TEST_F(Gpu1_Heap, ReallocateWhilePinnedIsAnError) {
  const HeapConfig cfg{.numRanks = 4, .userBytes = 4096};
  HeapConfig bigger = cfg;
  bigger.userBytes = 1 << 20;
  auto heap = SymmetricHeap::create(*comm_, cfg);
  char* before = heap->base(0);
  {
    SymmetricHeap::Pin pin = heap->pin();
    EXPECT_EQ(heap->numPins(), 1);
    expectError([&] { heap->reallocate(bigger); }, Status::kGraphInvalidated, "1 captured graph");
    EXPECT_EQ(heap->base(0), before) << "a failed reallocate must not move the arena";
  }
  EXPECT_EQ(heap->numPins(), 0);
  heap->reallocate(bigger);
  EXPECT_EQ(heap->config().userBytes, std::size_t{1} << 20);
  runHeapExchange(*comm_, 5);  // the group still works after reallocation
}

TEST_F(Gpu1_Heap, PeerClassesOfEmulatedRanks) {
  const HeapConfig cfg{.numRanks = 4};
  auto heap = SymmetricHeap::create(*comm_, cfg);
  for (int l = 0; l < 4; ++l) {
    for (int p = 0; p < 4; ++p) {
      EXPECT_EQ(heap->peerClass(l, p), l == p ? PeerClass::kSelf : PeerClass::kSameDevice);
      EXPECT_EQ(heap->peerBase(l, p), heap->base(p)) << "emulated ranks share one address space";
    }
  }
}

TEST_F(Gpu1_Heap, ForcedRemotePeersAreNotMapped) {
  const HeapConfig cfg{.numRanks = 4};
  std::unique_ptr<SymmetricHeap> heap;
  {
    ScopedEnv force("GRAPHEP_FORCE_TRANSPORT", "remote");
    heap = SymmetricHeap::create(*comm_, cfg);
  }
  for (int l = 0; l < 4; ++l) {
    for (int p = 0; p < 4; ++p) {
      EXPECT_EQ(heap->peerClass(l, p), l == p ? PeerClass::kSelf : PeerClass::kRemote);
      EXPECT_EQ(heap->peerBase(l, p) == nullptr, l != p) << l << " -> " << p;
    }
  }
  const SyncHandle h = heap->syncHandle(0);
  EXPECT_EQ(h.peerFlagInbox[1], nullptr);
  EXPECT_NE(h.peerFlagInbox[0], nullptr);
  // Load/store signalling to a remote peer is refused with a message naming the peer class.
  SemaphoreOps ops(*heap, 0);
  expectError([&] { ops.signal(nullptr, 0, 1u << 1); }, Status::kNotSupported, "remote");
}

TEST_F(Gpu1_Heap, MismatchedRankCountIsRejected) {
  const HeapConfig cfg{.numRanks = 3};
  expectError([&] { SymmetricHeap::create(*comm_, cfg); }, Status::kInvalidArgument, "numRanks=3");
}

}  // namespace
}  // namespace graphep::test
