// Foundation on one GPU with 4 emulated ranks (a local group with a repeated device).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstdio>

#include <graphep/graphep.hpp>

#include "common/gpu_env.hpp"
#include "common/nccl_comms.hpp"
#include "common/sync_suite.hpp"
#include "engine/heap.hpp"
#include "engine/semaphore.hpp"

namespace graphep::test {
namespace {

std::unique_ptr<Communicator> fourOnOne() { return createLocalGroup({0, 0, 0, 0}); }

TEST(Gpu1_Heap, ExchangeFourEmulatedRanks) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = fourOnOne();
  runHeapExchange(*comm, 1234);
  runHeapExchange(*comm, 98765);  // fresh data, fresh heap
}

TEST(Gpu1_Sync, FlagPingPongEagerNearWrap) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = fourOnOne();
  runFlagPingPong(*comm, 10000, /*graph=*/false, kNearWrap);
}

TEST(Gpu1_Sync, FlagPingPongGraphNearWrap) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = fourOnOne();
  runFlagPingPong(*comm, 10000, /*graph=*/true, kNearWrap);
}

TEST(Gpu1_Sync, SemaphorePingPongEagerNearWrap) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = fourOnOne();
  runSemaphorePingPong(*comm, 10000, /*graph=*/false, kNearWrap);
}

// A short eager run that reports its time per round: same-GPU stream waits are the slow case.
TEST(Gpu1_Sync, SemaphorePingPongEagerShortTimed) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = fourOnOne();
  const auto t0 = std::chrono::steady_clock::now();
  runSemaphorePingPong(*comm, 100, /*graph=*/false, kNearWrap);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[ timing   ] 100 eager semaphore rounds, 4 ranks on 1 GPU: %.1f ms (%.3f ms/round)\n",
              ms, ms / 100);
}

TEST(Gpu1_Sync, SemaphorePingPongGraphNearWrap) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = fourOnOne();
  runSemaphorePingPong(*comm, 10000, /*graph=*/true, kNearWrap);
}

TEST(Gpu1_Sync, MissingPeerTimesOutNamingThePeer) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = fourOnOne();
  runMissingPeer(*comm, /*waiter=*/0, /*missing=*/2, /*timeoutMs=*/300);
}

TEST(Gpu1_Heap, ReallocateWhilePinnedIsAnError) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = fourOnOne();
  HeapConfig cfg;
  cfg.numRanks = 4;
  cfg.userBytes = 4096;
  auto heap = SymmetricHeap::create(*comm, cfg);
  char* before = heap->base(0);
  {
    SymmetricHeap::Pin pin = heap->pin();
    EXPECT_EQ(heap->numPins(), 1);
    HeapConfig bigger = cfg;
    bigger.userBytes = 1 << 20;
    try {
      heap->reallocate(bigger);
      FAIL() << "reallocate while pinned must throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::kGraphInvalidated);
      EXPECT_NE(std::string(e.what()).find("1 captured graph"), std::string::npos) << e.what();
    }
    EXPECT_EQ(heap->base(0), before) << "a failed reallocate must not move the arena";
  }
  EXPECT_EQ(heap->numPins(), 0);
  HeapConfig bigger = cfg;
  bigger.userBytes = 1 << 20;
  heap->reallocate(bigger);
  EXPECT_EQ(heap->config().userBytes, std::size_t{1} << 20);
  runHeapExchange(*comm, 5);  // the group still works after reallocation
}

TEST(Gpu1_Heap, PeerClassesOfEmulatedRanks) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = fourOnOne();
  HeapConfig cfg;
  cfg.numRanks = 4;
  auto heap = SymmetricHeap::create(*comm, cfg);
  for (int l = 0; l < 4; ++l) {
    for (int p = 0; p < 4; ++p) {
      EXPECT_EQ(heap->peerClass(l, p), l == p ? PeerClass::kSelf : PeerClass::kSameDevice);
      EXPECT_EQ(heap->peerBase(l, p), heap->base(p)) << "emulated ranks share one address space";
    }
  }
}

TEST(Gpu1_Heap, ForcedRemotePeersAreNotMapped) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = fourOnOne();
  HeapConfig cfg;
  cfg.numRanks = 4;
  std::unique_ptr<SymmetricHeap> heap;
  {
    ScopedEnv force("GRAPHEP_FORCE_TRANSPORT", "remote");
    heap = SymmetricHeap::create(*comm, cfg);
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
  try {
    ops.signal(nullptr, 0, 1u << 1);
    FAIL() << "signalling a remote peer must be refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kNotSupported);
    EXPECT_NE(std::string(e.what()).find("remote"), std::string::npos) << e.what();
  }
}

TEST(Gpu1_Heap, MismatchedRankCountIsRejected) {
  GRAPHEP_REQUIRE_GPUS(1);
  auto comm = fourOnOne();
  HeapConfig cfg;
  cfg.numRanks = 3;
  try {
    SymmetricHeap::create(*comm, cfg);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("numRanks=3"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace graphep::test
