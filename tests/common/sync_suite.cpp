#include "common/sync_suite.hpp"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <random>
#include <string>
#include <vector>

#include "common/graph_util.hpp"
#include "common/sync_test_kernels.h"
#include "engine/error.hpp"
#include "engine/heap.hpp"
#include "engine/semaphore.hpp"
#include "engine/topology.hpp"
#include "engine/watchdog.hpp"
#include "kernels/probe.h"

namespace graphep::test {
namespace {

constexpr std::uint32_t kPoison = 0xdeadbeefu;

std::vector<std::uint32_t> rankWords(std::uint64_t seed, int rank, std::size_t n) {
  std::mt19937_64 rng(seed * 1000003ull + static_cast<std::uint64_t>(rank));
  std::vector<std::uint32_t> v(n);
  for (auto& x : v) {
    x = static_cast<std::uint32_t>(rng());
    if (x == kPoison) x ^= 1u;
  }
  return v;
}

void syncAll(const SymmetricHeap& heap) {
  for (int l = 0; l < heap.numLocalRanks(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(heap.device(l)));
    GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  }
}

std::vector<std::uint32_t> readWords(const void* src, std::size_t n) {
  std::vector<std::uint32_t> v(n);
  GRAPHEP_CUDA_CHECK(cudaMemcpy(v.data(), src, n * 4, cudaMemcpyDeviceToHost));
  return v;
}

struct Streams {
  explicit Streams(const SymmetricHeap& heap) {
    for (int l = 0; l < heap.numLocalRanks(); ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(heap.device(l)));
      cudaStream_t s;
      GRAPHEP_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      streams.push_back(s);
      devices.push_back(heap.device(l));
    }
  }
  ~Streams() {
    for (size_t i = 0; i < streams.size(); ++i) {
      cudaSetDevice(devices[i]);
      cudaStreamDestroy(streams[i]);
    }
  }
  std::vector<cudaStream_t> streams;
  std::vector<int> devices;
};

// Captures `enqueue(local, stream)` for every local rank into its own graph.
template <class F>
std::vector<cudaGraphExec_t> captureRound(const SymmetricHeap& heap, Streams& st, F&& enqueue) {
  std::vector<cudaGraphExec_t> execs;
  for (int l = 0; l < heap.numLocalRanks(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(heap.device(l)));
    execs.push_back(captureOnStream(st.streams[static_cast<size_t>(l)],
                                    [&](cudaStream_t s) { enqueue(l, s); }));
  }
  return execs;
}

void destroyExecs(const SymmetricHeap& heap, std::vector<cudaGraphExec_t>& execs) {
  for (size_t l = 0; l < execs.size(); ++l) {
    cudaSetDevice(heap.device(static_cast<int>(l)));
    cudaGraphExecDestroy(execs[l]);
  }
  execs.clear();
}

// Runs `rounds` rounds of `enqueue(local, stream)` on every local rank: eagerly, or by capturing one
// round per rank once (pinning the heap) and replaying it. Ends with every device synchronised and
// a barrier across processes.
template <class F>
void runRounds(SymmetricHeap& heap, Streams& st, int rounds, bool graph, F&& enqueue) {
  std::vector<cudaGraphExec_t> execs;
  SymmetricHeap::Pin pin;
  if (graph) {
    execs = captureRound(heap, st, enqueue);
    pin = heap.pin();
  }
  for (int r = 0; r < rounds; ++r) {
    for (int l = 0; l < heap.numLocalRanks(); ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(heap.device(l)));
      if (graph) {
        GRAPHEP_CUDA_CHECK(cudaGraphLaunch(execs[static_cast<size_t>(l)],
                                           st.streams[static_cast<size_t>(l)]));
      } else {
        enqueue(l, st.streams[static_cast<size_t>(l)]);
      }
    }
  }
  syncAll(heap);
  heap.comm().barrier();
  destroyExecs(heap, execs);
}

}  // namespace

void runHeapExchange(Communicator& comm, std::uint64_t seed) {
  const int R = comm.worldSize();
  const std::size_t n = (1u << 16) + 7;  // odd tail on purpose
  // user region: published [n] | inbox [R][n] (peers write) | readback [R][n] (local writes)
  auto heap = SymmetricHeap::create(comm, {.numRanks = R, .userBytes = (1 + 2 * static_cast<std::size_t>(R)) * n * 4});
  const int L = heap->numLocalRanks();
  auto published = [&](char* user) { return reinterpret_cast<std::uint32_t*>(user); };
  auto inbox = [&](char* user, int src) { return published(user) + n * (1 + src); };
  auto readback = [&](char* user, int p) { return published(user) + n * (1 + R + p); };

  for (int l = 0; l < L; ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(heap->device(l)));
    const auto words = rankWords(seed, heap->rank(l), n);
    GRAPHEP_CUDA_CHECK(cudaMemcpy(published(heap->user(l)), words.data(), n * 4,
                                  cudaMemcpyHostToDevice));
    const std::vector<std::uint32_t> poison(2 * R * n, kPoison);
    GRAPHEP_CUDA_CHECK(cudaMemcpy(inbox(heap->user(l), 0), poison.data(), poison.size() * 4,
                                  cudaMemcpyHostToDevice));
  }
  syncAll(*heap);
  comm.barrier();

  Streams st(*heap);
  for (int l = 0; l < L; ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(heap->device(l)));
    const int me = heap->rank(l);
    for (int p = 0; p < R; ++p) {
      EXPECT_TRUE(isLoadStore(heap->peerClass(l, p)))
          << "rank " << me << " sees rank " << p << " as " << peerClassName(heap->peerClass(l, p));
      char* peerUser = heap->peerUser(l, p);
      if (peerUser == nullptr) continue;
      // Remote read: the peer's published words into my readback slot.
      GRAPHEP_CUDA_CHECK(launchCopyWords(published(peerUser), readback(heap->user(l), p), n,
                                         st.streams[static_cast<size_t>(l)]));
      // Remote write: my published words into the peer's inbox slot for me.
      GRAPHEP_CUDA_CHECK(launchCopyWords(published(heap->user(l)), inbox(peerUser, me), n,
                                         st.streams[static_cast<size_t>(l)]));
    }
  }
  syncAll(*heap);
  comm.barrier();

  for (int l = 0; l < L; ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(heap->device(l)));
    const int me = heap->rank(l);
    for (int p = 0; p < R; ++p) {
      const auto expected = rankWords(seed, p, n);
      const auto got = readWords(readback(heap->user(l), p), n);
      const auto got2 = readWords(inbox(heap->user(l), p), n);
      long long wrongRead = 0, wrongWrite = 0;
      for (std::size_t i = 0; i < n; ++i) {
        wrongRead += got[i] != expected[i];
        wrongWrite += got2[i] != expected[i];
      }
      EXPECT_EQ(wrongRead, 0) << "rank " << me << " reading rank " << p << ": " << wrongRead
                              << " of " << n << " words wrong";
      EXPECT_EQ(wrongWrite, 0) << "rank " << p << " writing into rank " << me << ": "
                               << wrongWrite << " of " << n << " words wrong";
    }
  }
  comm.barrier();
}

void runFlagPingPong(Communicator& comm, int rounds, bool graph, std::uint32_t counterStart) {
  const int R = comm.worldSize();
  auto heap = SymmetricHeap::create(comm, {.numRanks = R, .counterStart = counterStart});
  const int L = heap->numLocalRanks();
  constexpr std::uint32_t kChannel = 3;
  Streams st(*heap);
  std::vector<unsigned long long*> errors(static_cast<size_t>(L));
  for (int l = 0; l < L; ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(heap->device(l)));
    GRAPHEP_CUDA_CHECK(preloadProbeKernels());
    GRAPHEP_CUDA_CHECK(cudaMalloc(&errors[static_cast<size_t>(l)], sizeof(unsigned long long)));
    GRAPHEP_CUDA_CHECK(cudaMemset(errors[static_cast<size_t>(l)], 0, sizeof(unsigned long long)));
  }
  syncAll(*heap);
  comm.barrier();

  runRounds(*heap, st, rounds, graph, [&](int l, cudaStream_t s) {
    // One round per launch: the test exercises the device-resident steps across launches.
    GRAPHEP_CUDA_CHECK(launchFlagPingPong(heap->syncHandle(l), kChannel, 1,
                                          errors[static_cast<size_t>(l)], s));
  });

  const std::uint32_t expected = counterStart + static_cast<std::uint32_t>(rounds);
  for (int l = 0; l < L; ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(heap->device(l)));
    const int me = heap->rank(l);
    EXPECT_EQ(heap->errorMessage(l), "") << "rank " << me;
    unsigned long long e = 0;
    GRAPHEP_CUDA_CHECK(cudaMemcpy(&e, errors[static_cast<size_t>(l)], sizeof(e),
                                  cudaMemcpyDeviceToHost));
    EXPECT_EQ(e, 0ull) << "rank " << me << ": " << e << " waits saw a lost/extra signal or failed";
    const SyncHandle h = heap->syncHandle(l);
    const auto steps = readWords(h.flagStep + h.flagIndex(kChannel, 0), static_cast<size_t>(R));
    const auto inbox = readWords(h.flagInbox + h.flagIndex(kChannel, 0), static_cast<size_t>(R));
    for (int p = 0; p < R; ++p) {
      const std::uint32_t want = p == me ? counterStart : expected;
      EXPECT_EQ(steps[static_cast<size_t>(p)], want) << "rank " << me << " step with " << p;
      EXPECT_EQ(inbox[static_cast<size_t>(p)], want) << "rank " << me << " inbox from " << p;
    }
    GRAPHEP_CUDA_CHECK(cudaFree(errors[static_cast<size_t>(l)]));
  }
  comm.barrier();
}

void runSemaphorePingPong(Communicator& comm, int rounds, bool graph,
                          std::uint32_t counterStart) {
  const int R = comm.worldSize();
  auto heap = SymmetricHeap::create(comm, {.numRanks = R, .counterStart = counterStart});
  const int L = heap->numLocalRanks();
  constexpr int kChannel = 5;
  Streams st(*heap);
  std::vector<SemaphoreOps> ops;
  for (int l = 0; l < L; ++l) ops.emplace_back(*heap, l);

  // One round for rank `me`: ping every higher rank; answer every lower rank's ping; collect the
  // pongs of the higher ranks. No cycle: every ping is sent before any wait of the round.
  auto enqueue = [&](int l, cudaStream_t s) {
    const int me = heap->rank(l);
    std::uint32_t higher = 0;
    for (int p = me + 1; p < R; ++p) higher |= 1u << p;
    if (higher != 0) ops[static_cast<size_t>(l)].signal(s, kChannel, higher);
    for (int p = 0; p < me; ++p) {
      ops[static_cast<size_t>(l)].wait(s, kChannel, p, 1);
      ops[static_cast<size_t>(l)].consume(s, kChannel, p, 1);
      ops[static_cast<size_t>(l)].signal(s, kChannel, 1u << p);
    }
    for (int p = me + 1; p < R; ++p) {
      ops[static_cast<size_t>(l)].wait(s, kChannel, p, 1);
      ops[static_cast<size_t>(l)].consume(s, kChannel, p, 1);
    }
  };
  syncAll(*heap);
  comm.barrier();
  runRounds(*heap, st, rounds, graph, enqueue);

  const std::uint32_t expected = counterStart + static_cast<std::uint32_t>(rounds);
  for (int l = 0; l < L; ++l) {
    const int me = heap->rank(l);
    EXPECT_EQ(heap->errorMessage(l), "") << "rank " << me;
    for (int p = 0; p < R; ++p) {
      if (p == me) continue;
      const SemaphoreCounts c = ops[static_cast<size_t>(l)].read(kChannel, p);
      EXPECT_EQ(c.count, 0u) << "rank " << me << " semaphore from " << p
                             << " holds unconsumed (extra) signals";
      EXPECT_EQ(c.arrived, expected) << "rank " << me << " arrivals from " << p << " (lost or extra: "
                                     << static_cast<std::int32_t>(c.arrived - expected) << ")";
      EXPECT_EQ(c.consumed, expected) << "rank " << me << " consumed from " << p;
    }
  }
  comm.barrier();
}

namespace {

// A captured stream-memory-op wait on `missing`'s semaphore, which never signals: the wait cannot
// time out on the device, so the host watchdog must find it, name the peer and refuse new work;
// release() must then let the stream drain, with the verdict in the rank's error record.
void checkSemaphoreWatchdog(SymmetricHeap& heap, int l, int missing, long long timeoutMs) {
  constexpr int kChannel = 3;
  const int me = heap.rank(l);
  SemaphoreOps ops(heap, l);
  cudaStream_t s;
  GRAPHEP_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  EXPECT_TRUE(ops.watch(s, std::chrono::milliseconds(timeoutMs)).ok) << "an idle stream is healthy";
  cudaGraphExec_t exec = captureOnStream(s, [&](cudaStream_t cs) {
    ops.wait(cs, kChannel, missing, 2);
    ops.consume(cs, kChannel, missing, 2);
  });
  GRAPHEP_CUDA_CHECK(cudaGraphLaunch(exec, s));
  const auto t0 = std::chrono::steady_clock::now();
  const HealthReport r = ops.watch(s, std::chrono::milliseconds(timeoutMs));
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_FALSE(r.ok) << "a stream stuck on a memop wait must be reported";
  EXPECT_GE(ms, static_cast<double>(timeoutMs) * 0.9);
  EXPECT_LT(ms, static_cast<double>(timeoutMs) + 5000.0) << "the watchdog took " << ms << " ms";
  const std::string who = "semaphore channel " + std::to_string(kChannel) + ": rank " +
                          std::to_string(missing) + " has not signalled (count 0 of the 2";
  EXPECT_NE(r.message.find(who), std::string::npos) << r.message;
  EXPECT_NE(r.message.find("rank " + std::to_string(me) + ": the work on stream"), std::string::npos) << r.message;
  EXPECT_TRUE(ops.failed());
  try {
    ops.signal(s, kChannel, 1u << missing);
    ADD_FAILURE() << "a failed rank's semaphores accepted a signal";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kRemoteError) << e.what();
    EXPECT_NE(std::string(e.what()).find("has not signalled"), std::string::npos) << e.what();
  }
  ops.release();  // lifts the wait: the stream must drain
  cudaEvent_t ev;
  GRAPHEP_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  EXPECT_TRUE(detail::streamFinishesWithin(s, ev, std::chrono::milliseconds(10000)))
      << "the stream still waits after release()";
  const DeviceErrorRecord rec = heap.errorRecord(l);
  EXPECT_EQ(rec.kind, static_cast<std::uint32_t>(DeviceErrorKind::kAborted));
  EXPECT_EQ(rec.peer, missing);
  EXPECT_EQ(rec.expected, 2u);
  EXPECT_EQ(rec.observed, 0u);
  EXPECT_NE(heap.errorMessage(l).find("aborted by its host watchdog"), std::string::npos)
      << heap.errorMessage(l);
  GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(s));
  GRAPHEP_CUDA_CHECK(cudaEventDestroy(ev));
  GRAPHEP_CUDA_CHECK(cudaGraphExecDestroy(exec));
  GRAPHEP_CUDA_CHECK(cudaStreamDestroy(s));
  heap.clearError(l);
}

}  // namespace

void runMissingPeer(Communicator& comm, int waiter, int missing, long long timeoutMs) {
  auto heap = SymmetricHeap::create(comm, {.numRanks = comm.worldSize(), .timeoutMs = timeoutMs});
  for (int l = 0; l < heap->numLocalRanks(); ++l) {
    if (heap->rank(l) != waiter) continue;
    GRAPHEP_CUDA_CHECK(cudaSetDevice(heap->device(l)));
    int* result = nullptr;
    GRAPHEP_CUDA_CHECK(cudaMalloc(&result, sizeof(int)));
    GRAPHEP_CUDA_CHECK(cudaMemset(result, 0xff, sizeof(int)));
    const auto t0 = std::chrono::steady_clock::now();
    GRAPHEP_CUDA_CHECK(launchWaitForPeer(heap->syncHandle(l), 1, missing, result, nullptr));
    GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    int r = -1;
    GRAPHEP_CUDA_CHECK(cudaMemcpy(&r, result, sizeof(int), cudaMemcpyDeviceToHost));
    GRAPHEP_CUDA_CHECK(cudaFree(result));
    EXPECT_EQ(r, 0) << "the wait for a peer that never signals must fail";
    EXPECT_GE(ms, static_cast<double>(timeoutMs) * 0.9);
    EXPECT_LT(ms, static_cast<double>(timeoutMs) + 5000.0) << "the bounded wait took " << ms << " ms";
    const DeviceErrorRecord rec = heap->errorRecord(l);
    EXPECT_EQ(rec.kind, static_cast<std::uint32_t>(DeviceErrorKind::kTimeout));
    EXPECT_EQ(rec.rank, waiter);
    EXPECT_EQ(rec.peer, missing);
    EXPECT_EQ(rec.site, static_cast<std::uint32_t>(WaitSite::kFlag));
    EXPECT_EQ(rec.expected, rec.observed + 1u);
    const std::string msg = heap->errorMessage(l);
    EXPECT_NE(msg.find("waiting for peer " + std::to_string(missing)), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank " + std::to_string(waiter)), std::string::npos) << msg;
    heap->clearError(l);
    EXPECT_EQ(heap->errorMessage(l), "");
    checkSemaphoreWatchdog(*heap, l, missing, timeoutMs);
  }
  comm.barrier();
}

}  // namespace graphep::test
