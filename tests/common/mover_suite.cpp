#include "common/mover_suite.hpp"

#include "common/bf16.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>

#include "common/expect_error.hpp"
#include "common/graph_util.hpp"
#include "common/nccl_comms.hpp"
#include "common/sync_suite.hpp"
#include "common/sync_test_kernels.h"
#include "engine/error.hpp"
#include "engine/heap.hpp"
#include "engine/movers.hpp"

namespace graphep::test {
namespace {

constexpr unsigned char kPoison = 0xa5;
constexpr std::size_t kSlack = 64;  // poisoned bytes after every destination: overruns show

struct RankBuffers {
  char* src = nullptr;
  char* dst = nullptr;  // staged destination (cudaMalloc); zero-copy uses the user region
  unsigned long long* wrong = nullptr;
  cudaStream_t stream = nullptr;
};

struct Fixture {
  Fixture(Communicator& comm, std::size_t maxBytes, std::size_t slotBytes, std::uint32_t start) {
    HeapConfig cfg;
    cfg.numRanks = comm.worldSize();
    cfg.userBytes = maxBytes + kSlack;
    cfg.moverSlotBytes = slotBytes;
    cfg.counterStart = start;
    heap = SymmetricHeap::create(comm, cfg);
    for (int l = 0; l < heap->numLocalRanks(); ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(heap->device(l)));
      GRAPHEP_CUDA_CHECK(preloadTestKernels());
      RankBuffers b;
      GRAPHEP_CUDA_CHECK(cudaMalloc(&b.src, maxBytes + kSlack));
      GRAPHEP_CUDA_CHECK(cudaMalloc(&b.dst, maxBytes + kSlack));
      GRAPHEP_CUDA_CHECK(cudaMalloc(&b.wrong, sizeof(unsigned long long)));
      GRAPHEP_CUDA_CHECK(cudaStreamCreateWithFlags(&b.stream, cudaStreamNonBlocking));
      bufs.push_back(b);
    }
    MoverOptions options;
    options.maxRemoteBytesPerPeer = maxBytes;  // used only where peers are remote
    // Lower than the defaults, so that mid-size cases cover the copy engine and zero-copy alltoallv
    // chosen automatically (the defaults are tuned for speed, docs/PERFORMANCE.md).
    options.copyEngineMinBytes = std::size_t{1} << 20;
    options.allToAllvZeroCopyMinBytes = std::size_t{16} << 10;
    movers = Movers::createAll(*heap, options);
  }
  ~Fixture() {
    for (int l = 0; l < static_cast<int>(bufs.size()); ++l) {
      cudaSetDevice(heap->device(l));
      cudaFree(bufs[l].src);
      cudaFree(bufs[l].dst);
      cudaFree(bufs[l].wrong);
      cudaStreamDestroy(bufs[l].stream);
    }
  }
  void syncAll() {
    for (int l = 0; l < heap->numLocalRanks(); ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(heap->device(l)));
      GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
    }
    heap->comm().barrier();
  }
  std::unique_ptr<SymmetricHeap> heap;
  std::vector<Movers> movers;
  std::vector<RankBuffers> bufs;
};

// Who sends to whom: a ring step, or only 0 -> 1.
SendRecvArgs argsFor(const Fixture& f, int l, const SendRecvCase& c, char* dst) {
  const int R = f.heap->worldSize();
  const int me = f.heap->rank(l);
  SendRecvArgs a;
  a.numChannels = c.numChannels;
  a.zeroCopyEngine = c.engine;
  const bool sends = !c.unidirectional || me == 0;
  const bool recvs = !c.unidirectional || me == 1;
  const int prev = (me + R - 1) % R;
  if (sends) {
    a.sendPeer = (me + 1) % R;
    a.src = f.bufs[static_cast<size_t>(l)].src;
    a.sendBytes = c.bytes + c.sizeStep * static_cast<std::size_t>(me);
    if (c.zeroCopy) a.sendToUserOffset = 0;
  }
  if (recvs) {
    a.recvPeer = prev;
    a.dst = dst;
    a.recvBytes = c.bytes + c.sizeStep * static_cast<std::size_t>(prev);
    a.recvZeroCopy = c.zeroCopy;
  }
  return a;
}

char* dstFor(const Fixture& f, int l, bool zeroCopy) {
  return zeroCopy ? f.heap->user(l) : f.bufs[static_cast<size_t>(l)].dst;
}

}  // namespace

void runSendRecvCases(Communicator& comm, const std::vector<SendRecvCase>& cases,
                      std::size_t slotBytes) {
  const int R = comm.worldSize();
  std::size_t maxBytes = 16;
  for (const auto& c : cases) maxBytes = std::max(maxBytes, c.bytes + c.sizeStep * (R - 1));
  Fixture f(comm, maxBytes, slotBytes, 0);
  const int L = f.heap->numLocalRanks();
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const SendRecvCase& c = cases[ci];
    const std::uint64_t seed = 1000 + ci * 7919;
    SCOPED_TRACE("bytes=" + std::to_string(c.bytes) + " step=" + std::to_string(c.sizeStep) +
                 (c.zeroCopy ? " zero-copy" : " staged") +
                 (c.unidirectional ? " unidirectional" : " ring") +
                 " channels=" + std::to_string(c.numChannels) +
                 " engine=" + std::to_string(static_cast<int>(c.engine)));
    for (int l = 0; l < L; ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
      const auto& b = f.bufs[static_cast<size_t>(l)];
      const std::size_t mine = c.bytes + c.sizeStep * static_cast<std::size_t>(f.heap->rank(l));
      GRAPHEP_CUDA_CHECK(launchFillPattern(b.src, mine, seed, f.heap->rank(l), b.stream));
      GRAPHEP_CUDA_CHECK(cudaMemsetAsync(dstFor(f, l, c.zeroCopy), kPoison, maxBytes + kSlack, b.stream));
      GRAPHEP_CUDA_CHECK(cudaMemsetAsync(b.wrong, 0, sizeof(unsigned long long), b.stream));
    }
    f.syncAll();
    {
      NcclGroupIfAny group(comm);
      for (int l = 0; l < L; ++l) {
        GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
        f.movers[static_cast<size_t>(l)].sendRecv(f.bufs[static_cast<size_t>(l)].stream,
                                                  argsFor(f, l, c, dstFor(f, l, c.zeroCopy)));
      }
    }
    f.syncAll();
    for (int l = 0; l < L; ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
      const int me = f.heap->rank(l);
      const auto& b = f.bufs[static_cast<size_t>(l)];
      const bool recvs = !c.unidirectional || me == 1;
      const int prev = (me + R - 1) % R;
      const std::size_t got = recvs ? c.bytes + c.sizeStep * static_cast<std::size_t>(prev) : 0;
      char* dst = dstFor(f, l, c.zeroCopy);
      if (recvs) {
        GRAPHEP_CUDA_CHECK(launchCountMismatches(dst, got, seed, prev, b.wrong, b.stream));
      }
      GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(b.stream));
      unsigned long long wrong = 0;
      GRAPHEP_CUDA_CHECK(cudaMemcpy(&wrong, b.wrong, sizeof(wrong), cudaMemcpyDeviceToHost));
      EXPECT_EQ(wrong, 0ull) << "rank " << me << ": " << wrong << " of " << got
                             << " bytes wrong";
      // Nothing beyond the received range may be touched (a rank that receives nothing keeps
      // its whole destination poisoned).
      std::vector<unsigned char> tail(kSlack + (recvs ? 0 : c.bytes));
      GRAPHEP_CUDA_CHECK(cudaMemcpy(tail.data(), dst + got, tail.size(), cudaMemcpyDeviceToHost));
      const long long touched = std::count_if(tail.begin(), tail.end(),
                                              [](unsigned char x) { return x != kPoison; });
      EXPECT_EQ(touched, 0) << "rank " << me << ": " << touched << " bytes outside the range written";
      EXPECT_EQ(f.heap->errorMessage(l), "") << "rank " << me;
    }
    f.heap->comm().barrier();
  }
}

namespace {

// Captures enqueue(l, stream) once per local rank (each on its own stream) and pins the heap while
// the graphs live.
template <class Enqueue>
std::vector<cudaGraphExec_t> captureRanks(Fixture& f, Enqueue enqueue, SymmetricHeap::Pin* pin) {
  std::vector<cudaGraphExec_t> execs;
  for (int l = 0; l < f.heap->numLocalRanks(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
    execs.push_back(captureOnStream(f.bufs[static_cast<size_t>(l)].stream,
                                    [&](cudaStream_t s) { enqueue(l, s); }));
  }
  *pin = f.heap->pin();
  return execs;
}

// Runs `enqueue` once per rank per run: eagerly when replays == 1, else captured once and
// replayed. Before each run `prepare(l, stream, seed)` refreshes inputs (outside any graph); after
// each run `check(l, stream, seed)` counts wrong results on the device.
template <class Enqueue, class Prepare, class Check>
void runChecked(Fixture& f, int replays, Enqueue enqueue, Prepare prepare, Check check) {
  const int L = f.heap->numLocalRanks();
  std::vector<cudaGraphExec_t> execs;
  SymmetricHeap::Pin pin;
  for (int l = 0; l < L; ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
    GRAPHEP_CUDA_CHECK(cudaMemset(f.bufs[static_cast<size_t>(l)].wrong, 0, sizeof(unsigned long long)));
  }
  if (replays > 1) execs = captureRanks(f, enqueue, &pin);
  f.syncAll();
  for (int i = 0; i < replays; ++i) {
    const std::uint64_t seed = 4242 + static_cast<std::uint64_t>(i) * 977;
    for (int l = 0; l < L; ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
      cudaStream_t s = f.bufs[static_cast<size_t>(l)].stream;
      prepare(l, s, seed);
      if (replays > 1) {
        GRAPHEP_CUDA_CHECK(cudaGraphLaunch(execs[static_cast<size_t>(l)], s));
      } else {
        enqueue(l, s);
      }
      check(l, s, seed);
    }
  }
  f.syncAll();
  for (int l = 0; l < L; ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
    unsigned long long wrong = 0;
    GRAPHEP_CUDA_CHECK(cudaMemcpy(&wrong, f.bufs[static_cast<size_t>(l)].wrong, sizeof(wrong),
                                  cudaMemcpyDeviceToHost));
    EXPECT_EQ(wrong, 0ull) << "rank " << f.heap->rank(l) << ": " << wrong << " wrong over "
                           << replays << " run(s)";
    EXPECT_EQ(f.heap->errorMessage(l), "") << "rank " << f.heap->rank(l);
    if (!execs.empty()) cudaGraphExecDestroy(execs[static_cast<size_t>(l)]);
  }
  f.heap->comm().barrier();
}

}  // namespace

void runSendRecvReplays(Communicator& comm, std::size_t bytes, int replays, bool zeroCopy,
                        ZeroCopyEngine engine) {
  Fixture f(comm, bytes, std::size_t{64} << 10, kNearWrap);
  const int R = f.heap->worldSize();
  const SendRecvCase c{bytes, zeroCopy, false, 0, 0, engine};
  runChecked(
      f, replays,
      [&](int l, cudaStream_t s) {
        f.movers[static_cast<size_t>(l)].sendRecv(s, argsFor(f, l, c, dstFor(f, l, zeroCopy)));
      },
      [&](int l, cudaStream_t s, std::uint64_t seed) {
        GRAPHEP_CUDA_CHECK(launchFillPattern(f.bufs[static_cast<size_t>(l)].src, bytes, seed,
                                             f.heap->rank(l), s));
        GRAPHEP_CUDA_CHECK(cudaMemsetAsync(dstFor(f, l, zeroCopy), kPoison, bytes, s));
      },
      [&](int l, cudaStream_t s, std::uint64_t seed) {
        GRAPHEP_CUDA_CHECK(launchCountMismatches(dstFor(f, l, zeroCopy), bytes, seed,
                                                 (f.heap->rank(l) + R - 1) % R,
                                                 f.bufs[static_cast<size_t>(l)].wrong, s));
      });
}

void runAllGatherRing(Communicator& comm, std::size_t chunkBytes, bool zeroCopy, int replays) {
  const int R = comm.worldSize();
  const std::size_t total = chunkBytes * static_cast<std::size_t>(R);
  Fixture f(comm, total, std::size_t{64} << 10, kNearWrap);
  auto out = [&](int l) { return zeroCopy ? f.heap->user(l) : f.bufs[static_cast<size_t>(l)].dst; };
  runChecked(
      f, replays,
      [&](int l, cudaStream_t s) {
        f.movers[static_cast<size_t>(l)].allGatherRing(s, f.bufs[static_cast<size_t>(l)].src, out(l),
                                                       chunkBytes, zeroCopy);
      },
      [&](int l, cudaStream_t s, std::uint64_t seed) {
        GRAPHEP_CUDA_CHECK(launchFillPattern(f.bufs[static_cast<size_t>(l)].src, chunkBytes, seed,
                                             f.heap->rank(l), s));
        GRAPHEP_CUDA_CHECK(cudaMemsetAsync(out(l), kPoison, total, s));
      },
      [&](int l, cudaStream_t s, std::uint64_t seed) {
        for (int q = 0; q < R; ++q) {
          GRAPHEP_CUDA_CHECK(launchCountMismatches(out(l) + chunkBytes * static_cast<std::size_t>(q),
                                                   chunkBytes, seed, q,
                                                   f.bufs[static_cast<size_t>(l)].wrong, s));
        }
      });
}

void runReduceScatterRing(Communicator& comm, std::size_t count, bool bf16, int replays) {
  const int R = comm.worldSize();
  const std::size_t elem = bf16 ? 2 : 4;
  const std::size_t chunk = count * elem;
  Fixture f(comm, chunk * static_cast<std::size_t>(R), std::size_t{64} << 10, kNearWrap);
  std::vector<char*> scratch(static_cast<size_t>(f.heap->numLocalRanks()));
  for (int l = 0; l < f.heap->numLocalRanks(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&scratch[static_cast<size_t>(l)], chunk + 16));
  }
  const Consume kind = bf16 ? Consume::kAddBf16 : Consume::kAddF32;
  runChecked(
      f, replays,
      [&](int l, cudaStream_t s) {
        f.movers[static_cast<size_t>(l)].reduceScatterRing(s, f.bufs[static_cast<size_t>(l)].src,
                                                           f.bufs[static_cast<size_t>(l)].dst,
                                                           scratch[static_cast<size_t>(l)], count,
                                                           kind);
      },
      [&](int l, cudaStream_t s, std::uint64_t seed) {
        GRAPHEP_CUDA_CHECK(launchFillElems(f.bufs[static_cast<size_t>(l)].src, count * R, bf16, seed,
                                           f.heap->rank(l), s));
        GRAPHEP_CUDA_CHECK(cudaMemsetAsync(f.bufs[static_cast<size_t>(l)].dst, kPoison, chunk, s));
      },
      [&](int l, cudaStream_t s, std::uint64_t seed) {
        GRAPHEP_CUDA_CHECK(launchCountSumMismatches(f.bufs[static_cast<size_t>(l)].dst, count, bf16,
                                                    seed, R, count * f.heap->rank(l),
                                                    f.bufs[static_cast<size_t>(l)].wrong, s));
      });
  for (int l = 0; l < f.heap->numLocalRanks(); ++l) {
    cudaSetDevice(f.heap->device(l));
    cudaFree(scratch[static_cast<size_t>(l)]);
  }
}

namespace {

std::vector<std::vector<std::uint64_t>> countMatrix(CountPattern pattern, int R, std::size_t maxPerPeer,
                                                    std::uint64_t seed) {
  std::vector<std::vector<std::uint64_t>> m(static_cast<size_t>(R), std::vector<std::uint64_t>(static_cast<size_t>(R)));
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int a = 0; a < R; ++a) {
    for (int b = 0; b < R; ++b) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      std::uint64_t v = 0;
      switch (pattern) {
        case CountPattern::kEqual: v = maxPerPeer; break;
        case CountPattern::kRandom: v = x % (maxPerPeer + 1); break;
        case CountPattern::kSomePairsZero: v = ((a + 2 * b) % 3 == 0) ? 0 : x % (maxPerPeer + 1); break;
        case CountPattern::kEmpty: v = 0; break;
      }
      m[static_cast<size_t>(a)][static_cast<size_t>(b)] = v;
    }
  }
  return m;
}

// Device count/offset arrays of one rank: sendCounts | sendOffsets | recvCounts | recvOffsets.
struct CountArrays {
  std::uint64_t* d = nullptr;
  std::vector<std::uint64_t> host;
};

// Offsets are packed prefix sums, or q * stride when stride > 0.
void uploadCounts(CountArrays& ca, const std::vector<std::vector<std::uint64_t>>& m, int me,
                  cudaStream_t stream, std::uint64_t stride = 0) {
  const int R = static_cast<int>(m.size());
  ca.host.assign(4 * static_cast<size_t>(R), 0);
  std::uint64_t so = 0, ro = 0;
  for (int q = 0; q < R; ++q) {
    ca.host[static_cast<size_t>(q)] = m[static_cast<size_t>(me)][static_cast<size_t>(q)];
    ca.host[static_cast<size_t>(R + q)] = stride > 0 ? q * stride : so;
    so += m[static_cast<size_t>(me)][static_cast<size_t>(q)];
    ca.host[static_cast<size_t>(2 * R + q)] = m[static_cast<size_t>(q)][static_cast<size_t>(me)];
    ca.host[static_cast<size_t>(3 * R + q)] = stride > 0 ? q * stride : ro;
    ro += m[static_cast<size_t>(q)][static_cast<size_t>(me)];
  }
  // Pageable source: the copy is staged before the call returns, so the vector may change after.
  GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(ca.d, ca.host.data(), ca.host.size() * 8, cudaMemcpyHostToDevice, stream));
}

// The destination: the rank's own buffer, or (zero-copy) its user region.
char* allToAllvDst(const Fixture& f, int l, bool zeroCopy) {
  return zeroCopy ? f.heap->user(l) : f.bufs[static_cast<size_t>(l)].dst;
}

AllToAllvArgs allToAllvArgs(const Fixture& f, int l, const CountArrays& ca, std::size_t cap,
                            bool zeroCopy) {
  const int R = f.heap->worldSize();
  AllToAllvArgs a;
  a.src = f.bufs[static_cast<size_t>(l)].src;
  a.srcBytes = cap;
  a.dst = allToAllvDst(f, l, zeroCopy);
  a.dstBytes = cap;
  a.zeroCopy = zeroCopy;
  a.sendCounts = ca.d;
  a.sendOffsets = ca.d + R;
  a.recvCounts = ca.d + 2 * R;
  a.recvOffsets = ca.d + 3 * R;
  return a;
}

// Every local rank's count arrays of matrix m with offsets q * stride, allocated and uploaded on
// its stream (the caller frees them).
std::vector<CountArrays> slotCounts(Fixture& f, const std::vector<std::vector<std::uint64_t>>& m, std::size_t stride) {
  std::vector<CountArrays> ca(static_cast<size_t>(f.heap->numLocalRanks()));
  for (int l = 0; l < f.heap->numLocalRanks(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&ca[static_cast<size_t>(l)].d, 4 * m.size() * 8));
    uploadCounts(ca[static_cast<size_t>(l)], m, f.heap->rank(l), f.bufs[static_cast<size_t>(l)].stream, stride);
  }
  return ca;
}

}  // namespace

void runAllToAllv(Communicator& comm, CountPattern pattern, std::size_t maxPerPeer, int replays,
                  bool zeroCopy, bool fixedSlots) {
  SCOPED_TRACE(zeroCopy ? "alltoallv zero-copy" : "alltoallv staged");
  SCOPED_TRACE(fixedSlots ? "fixed slots" : "packed offsets");
  const int R = comm.worldSize();
  const std::size_t cap = maxPerPeer * static_cast<std::size_t>(R);
  Fixture f(comm, cap, std::size_t{64} << 10, kNearWrap);
  const int L = f.heap->numLocalRanks();
  std::vector<CountArrays> ca(static_cast<size_t>(L));
  for (int l = 0; l < L; ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&ca[static_cast<size_t>(l)].d, 4 * static_cast<size_t>(R) * 8));
  }
  std::vector<std::vector<std::uint64_t>> m;
  auto args = [&](int l) {
    AllToAllvArgs a = allToAllvArgs(f, l, ca[static_cast<size_t>(l)], cap, zeroCopy);
    a.maxBytesPerPeer = maxPerPeer;
    a.fixedSlots = fixedSlots;
    return a;
  };
  std::uint64_t lastSeed = ~0ull;
  runChecked(
      f, replays,
      [&](int l, cudaStream_t s) { f.movers[static_cast<size_t>(l)].allToAllv(s, args(l)); },
      [&](int l, cudaStream_t s, std::uint64_t seed) {
        if (seed != lastSeed) {
          m = countMatrix(pattern, R, maxPerPeer, seed);
          lastSeed = seed;
        }
        const int me = f.heap->rank(l);
        uploadCounts(ca[static_cast<size_t>(l)], m, me, s, fixedSlots ? maxPerPeer : 0);
        const auto& h = ca[static_cast<size_t>(l)].host;
        for (int q = 0; q < R; ++q) {
          GRAPHEP_CUDA_CHECK(launchFillPattern(f.bufs[static_cast<size_t>(l)].src + h[static_cast<size_t>(R + q)],
                                               h[static_cast<size_t>(q)], seed, me * 64 + q, s));
        }
        GRAPHEP_CUDA_CHECK(cudaMemsetAsync(allToAllvDst(f, l, zeroCopy), kPoison, cap + kSlack, s));
      },
      [&](int l, cudaStream_t s, std::uint64_t seed) {
        const int me = f.heap->rank(l);
        const auto& h = ca[static_cast<size_t>(l)].host;
        for (int q = 0; q < R; ++q) {
          GRAPHEP_CUDA_CHECK(launchCountMismatches(
              allToAllvDst(f, l, zeroCopy) + h[static_cast<size_t>(3 * R + q)], h[static_cast<size_t>(2 * R + q)],
              seed, q * 64 + me, f.bufs[static_cast<size_t>(l)].wrong, s));
        }
      });
  for (int l = 0; l < L; ++l) {
    cudaSetDevice(f.heap->device(l));
    cudaFree(ca[static_cast<size_t>(l)].d);
  }
}

void runAllToAllvOutOfBounds(Communicator& comm, bool zeroCopy) {
  SCOPED_TRACE(zeroCopy ? "alltoallv zero-copy" : "alltoallv staged");
  const int R = comm.worldSize();
  const std::size_t perPeer = 4096;
  const std::size_t cap = perPeer * static_cast<std::size_t>(R);
  Fixture f(comm, cap, std::size_t{64} << 10, 0);
  const int L = f.heap->numLocalRanks();
  auto m = countMatrix(CountPattern::kEqual, R, perPeer, 1);
  // Rank 0 -> rank 1 asks for more than either buffer holds.
  m[0][1] = cap + 1;
  std::vector<CountArrays> ca = slotCounts(f, m, perPeer);
  for (int l = 0; l < L; ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
    GRAPHEP_CUDA_CHECK(cudaMemsetAsync(allToAllvDst(f, l, zeroCopy), kPoison, cap + kSlack,
                                       f.bufs[static_cast<size_t>(l)].stream));
  }
  f.syncAll();
  for (int l = 0; l < L; ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
    f.movers[static_cast<size_t>(l)].allToAllv(
        f.bufs[static_cast<size_t>(l)].stream,
        allToAllvArgs(f, l, ca[static_cast<size_t>(l)], cap, zeroCopy));
  }
  f.syncAll();
  for (int l = 0; l < L; ++l) {
    const int me = f.heap->rank(l);
    const DeviceErrorRecord rec = f.heap->errorRecord(l);
    if (me == 0 || me == 1) {
      EXPECT_EQ(rec.kind, static_cast<std::uint32_t>(DeviceErrorKind::kOutOfBounds)) << "rank " << me;
      EXPECT_EQ(rec.peer, me == 0 ? 1 : 0) << "rank " << me;
      EXPECT_NE(f.heap->errorMessage(l).find("dropped"), std::string::npos) << f.heap->errorMessage(l);
    } else {
      EXPECT_EQ(f.heap->errorMessage(l), "") << "rank " << me;
    }
    cudaSetDevice(f.heap->device(l));
    cudaFree(ca[static_cast<size_t>(l)].d);
  }
}

void runAllToAllvNetworkBytes(Communicator& comm, int nodes) {
  SCOPED_TRACE("emulated network of " + std::to_string(nodes) + " nodes");
  const ScopedEnv emulated("GRAPHEP_EMULATED_NODES", std::to_string(nodes).c_str());
  const int R = comm.worldSize(), size = R / nodes;
  const std::size_t perPeer = 8192;
  const std::size_t cap = perPeer * static_cast<std::size_t>(R);
  Fixture f(comm, cap, std::size_t{64} << 10, 0);
  const int L = f.heap->numLocalRanks();
  std::vector<std::vector<std::uint64_t>> want(static_cast<size_t>(L), std::vector<std::uint64_t>(static_cast<size_t>(R)));
  std::vector<CountArrays> ca;
  std::uint64_t total = 0;
  for (int run = 0; run < 2; ++run) {
    const auto m = countMatrix(CountPattern::kRandom, R, perPeer, 11 + static_cast<std::uint64_t>(run));
    if (run == 0) {
      ca = slotCounts(f, m, perPeer);
    } else {
      for (int l = 0; l < L; ++l) {
        GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
        uploadCounts(ca[static_cast<size_t>(l)], m, f.heap->rank(l), f.bufs[static_cast<size_t>(l)].stream, perPeer);
      }
    }
    f.syncAll();
    for (int l = 0; l < L; ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
      f.movers[static_cast<size_t>(l)].allToAllv(f.bufs[static_cast<size_t>(l)].stream,
                                                 allToAllvArgs(f, l, ca[static_cast<size_t>(l)], cap, false));
      const int me = f.heap->rank(l);
      for (int q = 0; q < R; ++q) {
        if (me / size == q / size) continue;  // the same node: no network
        want[static_cast<size_t>(l)][static_cast<size_t>(q)] += m[static_cast<size_t>(me)][static_cast<size_t>(q)];
        total += m[static_cast<size_t>(me)][static_cast<size_t>(q)];
      }
    }
    f.syncAll();
  }
  EXPECT_GT(total, 0u) << "the counts sent nothing between nodes: the check would be empty";
  for (int l = 0; l < L; ++l) {
    const int me = f.heap->rank(l);
    EXPECT_EQ(f.movers[static_cast<size_t>(l)].networkBytes(), want[static_cast<size_t>(l)]) << "rank " << me;
    EXPECT_EQ(f.heap->errorMessage(l), "") << "rank " << me;
    f.movers[static_cast<size_t>(l)].resetNetworkBytes();
    EXPECT_EQ(f.movers[static_cast<size_t>(l)].networkBytes(), std::vector<std::uint64_t>(static_cast<size_t>(R), 0))
        << "rank " << me << " after resetNetworkBytes";
    cudaSetDevice(f.heap->device(l));
    cudaFree(ca[static_cast<size_t>(l)].d);
  }
}

void runAllToAllvNetworkPace(Communicator& comm, int nodes, int mbps) {
  SCOPED_TRACE("emulated network of " + std::to_string(nodes) + " nodes at " + std::to_string(mbps) + " MB/s");
  const ScopedEnv emulated("GRAPHEP_EMULATED_NODES", std::to_string(nodes).c_str());
  const ScopedEnv rate("GRAPHEP_EMULATED_NETWORK_MBPS", std::to_string(mbps).c_str());
  const int R = comm.worldSize(), size = R / nodes;
  const std::size_t perPeer = std::size_t{1} << 20;
  const std::size_t cap = perPeer * static_cast<std::size_t>(R);
  Fixture f(comm, cap, std::size_t{64} << 10, 0);
  const int L = f.heap->numLocalRanks();
  std::vector<CountArrays> ca = slotCounts(f, countMatrix(CountPattern::kEqual, R, perPeer, 1), perPeer);
  std::vector<std::array<cudaEvent_t, 2>> ev(static_cast<size_t>(L));
  f.syncAll();
  for (int l = 0; l < L; ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
    for (cudaEvent_t& e : ev[static_cast<size_t>(l)]) GRAPHEP_CUDA_CHECK(cudaEventCreate(&e));
    const cudaStream_t s = f.bufs[static_cast<size_t>(l)].stream;
    GRAPHEP_CUDA_CHECK(cudaEventRecord(ev[static_cast<size_t>(l)][0], s));
    f.movers[static_cast<size_t>(l)].allToAllv(s, allToAllvArgs(f, l, ca[static_cast<size_t>(l)], cap, false));
    GRAPHEP_CUDA_CHECK(cudaEventRecord(ev[static_cast<size_t>(l)][1], s));
  }
  f.syncAll();
  for (int l = 0; l < L; ++l) {
    const int me = f.heap->rank(l);
    const std::uint64_t sent = static_cast<std::uint64_t>(R - size) * perPeer;  // every peer of another node
    const std::vector<std::uint64_t> bytes = f.movers[static_cast<size_t>(l)].networkBytes();
    EXPECT_EQ(std::accumulate(bytes.begin(), bytes.end(), std::uint64_t{0}), sent) << "rank " << me;
    float ms = 0;
    GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
    GRAPHEP_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[static_cast<size_t>(l)][0], ev[static_cast<size_t>(l)][1]));
    const double due = static_cast<double>(sent) / mbps / 1000.0;  // ms at the cap
    // The cap is a floor (the pace waits at least that long; the timer's ticks are coarse), and
    // no unit slip (us for ns) past it: far below 100 times the floor, sanitizers included.
    EXPECT_GE(ms, 0.95 * due) << "rank " << me << ": " << sent << " bytes between nodes at " << mbps << " MB/s";
    EXPECT_LT(ms, 100.0 * due) << "rank " << me << ": " << sent << " bytes between nodes at " << mbps << " MB/s";
    EXPECT_EQ(f.heap->errorMessage(l), "") << "rank " << me;
    for (cudaEvent_t e : ev[static_cast<size_t>(l)]) cudaEventDestroy(e);
    cudaFree(ca[static_cast<size_t>(l)].d);
  }
}

void runAllToAllvFixedSlotsMisuse(Communicator& comm) {
  const int R = comm.worldSize();
  const std::size_t perPeer = 4096;
  const std::size_t cap = perPeer * static_cast<std::size_t>(R);
  Fixture f(comm, cap, std::size_t{64} << 10, 0);
  const int L = f.heap->numLocalRanks();
  std::vector<CountArrays> ca = slotCounts(f, countMatrix(CountPattern::kEqual, R, perPeer, 1), perPeer);
  f.syncAll();
  auto args = [&](int l) {
    AllToAllvArgs a = allToAllvArgs(f, l, ca[static_cast<size_t>(l)], cap, false);
    a.maxBytesPerPeer = perPeer;
    a.fixedSlots = true;
    return a;
  };
  for (int l = 0; l < L; ++l) {  // refused before anything is enqueued
    AllToAllvArgs a = args(l);
    a.maxBytesPerPeer = 0;
    expectError([&] { f.movers[static_cast<size_t>(l)].allToAllv(f.bufs[static_cast<size_t>(l)].stream, a); },
                Status::kInvalidArgument, "fixedSlots needs maxBytesPerPeer > 0");
    a = args(l);
    a.dstBytes = cap - 1;
    expectError([&] { f.movers[static_cast<size_t>(l)].allToAllv(f.bufs[static_cast<size_t>(l)].stream, a); },
                Status::kInvalidArgument, "dstBytes=" + std::to_string(cap - 1));
  }
  bool anyRemote = false;
  for (int l = 0; l < L; ++l) {
    for (int q = 0; q < R; ++q) anyRemote |= f.heap->peerClass(l, q) == PeerClass::kRemote;
  }
  if (!anyRemote || R < 2) return;  // the device check is the remote peers'
  // Rank 0's table puts its segment to rank 1 at offset 0, not at its slot (perPeer).
  for (int l = 0; l < L; ++l) {
    if (f.heap->rank(l) != 0) continue;
    ca[static_cast<size_t>(l)].host[static_cast<size_t>(R + 1)] = 0;
    GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
    GRAPHEP_CUDA_CHECK(cudaMemcpy(ca[static_cast<size_t>(l)].d, ca[static_cast<size_t>(l)].host.data(),
                                  ca[static_cast<size_t>(l)].host.size() * 8, cudaMemcpyHostToDevice));
  }
  SymmetricHeap::Pin pin;
  std::vector<cudaGraphExec_t> execs =
      captureRanks(f, [&](int l, cudaStream_t s) { f.movers[static_cast<size_t>(l)].allToAllv(s, args(l)); }, &pin);
  f.syncAll();
  for (int l = 0; l < L; ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
    GRAPHEP_CUDA_CHECK(cudaGraphLaunch(execs[static_cast<size_t>(l)], f.bufs[static_cast<size_t>(l)].stream));
  }
  f.syncAll();
  for (int l = 0; l < L; ++l) {
    const int me = f.heap->rank(l);
    const DeviceErrorRecord rec = f.heap->errorRecord(l);
    if (me == 0) {
      EXPECT_EQ(rec.kind, static_cast<std::uint32_t>(DeviceErrorKind::kOutOfBounds)) << f.heap->errorMessage(l);
      EXPECT_EQ(rec.peer, 1) << f.heap->errorMessage(l);
      EXPECT_EQ(rec.expected, perPeer) << f.heap->errorMessage(l);
      EXPECT_EQ(rec.observed, 0u) << f.heap->errorMessage(l);
    } else {
      EXPECT_EQ(f.heap->errorMessage(l), "") << "rank " << me;
    }
    cudaGraphExecDestroy(execs[static_cast<size_t>(l)]);
    cudaSetDevice(f.heap->device(l));
    cudaFree(ca[static_cast<size_t>(l)].d);
  }
  f.heap->comm().barrier();
}

void runAllToAllvZeroCopyMismatch(Communicator& comm) {
  const int R = comm.worldSize();
  // 20000 and 19999 bytes: both above the fixture's zero-copy threshold (16 KiB) and both on 2
  // channels of 10000 B, so only channel 1 disagrees (10000 sent, 9999 expected).
  const std::size_t perPeer = 20000, channelBytes = 10000;
  const std::size_t cap = perPeer * static_cast<std::size_t>(R);
  Fixture f(comm, cap, std::size_t{64} << 10, 0);
  const int L = f.heap->numLocalRanks();
  auto m = countMatrix(CountPattern::kEqual, R, perPeer, 1);
  std::vector<CountArrays> ca(static_cast<size_t>(L));
  for (int l = 0; l < L; ++l) {
    const int me = f.heap->rank(l);
    cudaStream_t s = f.bufs[static_cast<size_t>(l)].stream;
    GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&ca[static_cast<size_t>(l)].d, 4 * static_cast<size_t>(R) * 8));
    uploadCounts(ca[static_cast<size_t>(l)], m, me, s, perPeer);
    for (int q = 0; q < R; ++q) {
      const std::size_t off = perPeer * static_cast<std::size_t>(q);
      GRAPHEP_CUDA_CHECK(launchFillPattern(f.bufs[static_cast<size_t>(l)].src + off, perPeer, 77,
                                           me * 64 + q, s));
    }
    if (me == 1) {  // rank 1 expects one byte less from rank 0 than rank 0 sends
      const std::uint64_t fewer = perPeer - 1;
      GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(ca[static_cast<size_t>(l)].d + 2 * R + 0, &fewer, 8,
                                         cudaMemcpyHostToDevice, s));
    }
    GRAPHEP_CUDA_CHECK(cudaMemsetAsync(allToAllvDst(f, l, true), kPoison, cap + kSlack, s));
    GRAPHEP_CUDA_CHECK(cudaMemsetAsync(f.bufs[static_cast<size_t>(l)].wrong, 0, 8, s));
    GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(s));
  }
  f.syncAll();
  for (int l = 0; l < L; ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
    f.movers[static_cast<size_t>(l)].allToAllv(
        f.bufs[static_cast<size_t>(l)].stream, allToAllvArgs(f, l, ca[static_cast<size_t>(l)], cap, true));
  }
  f.syncAll();  // returns: the receiver's wait completes although channel 1 sent nothing
  for (int l = 0; l < L; ++l) {
    const int me = f.heap->rank(l);
    const DeviceErrorRecord rec = f.heap->errorRecord(l);
    if (me == 0) {
      EXPECT_EQ(rec.kind, static_cast<std::uint32_t>(DeviceErrorKind::kCountMismatch));
      EXPECT_EQ(rec.site, static_cast<std::uint32_t>(WaitSite::kZeroCopyExtent));
      EXPECT_EQ(rec.peer, 1);
      EXPECT_EQ(rec.expected, channelBytes - 1);
      EXPECT_EQ(rec.observed, channelBytes);
      EXPECT_NE(f.heap->errorMessage(l).find("expects 9999"), std::string::npos) << f.heap->errorMessage(l);
    } else {
      EXPECT_EQ(f.heap->errorMessage(l), "") << "rank " << me;
    }
    if (me == 1) {
      // Rank 0's channel 0 arrived intact; its channel 1 wrote nothing (still poisoned).
      char* seg = allToAllvDst(f, l, true);
      GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
      GRAPHEP_CUDA_CHECK(launchCountMismatches(seg, channelBytes, 77, 0 * 64 + 1,
                                               f.bufs[static_cast<size_t>(l)].wrong,
                                               f.bufs[static_cast<size_t>(l)].stream));
      GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(f.bufs[static_cast<size_t>(l)].stream));
      unsigned long long wrong = 0;
      GRAPHEP_CUDA_CHECK(cudaMemcpy(&wrong, f.bufs[static_cast<size_t>(l)].wrong, 8, cudaMemcpyDeviceToHost));
      EXPECT_EQ(wrong, 0ull);
      std::vector<unsigned char> rest(channelBytes - 1);
      GRAPHEP_CUDA_CHECK(cudaMemcpy(rest.data(), seg + channelBytes, rest.size(), cudaMemcpyDeviceToHost));
      EXPECT_EQ(std::count(rest.begin(), rest.end(), kPoison), static_cast<long>(rest.size()));
    }
    cudaSetDevice(f.heap->device(l));
    cudaFree(ca[static_cast<size_t>(l)].d);
  }
}

namespace {


// Fresh inputs of one rank for one run, reproducible on every process from (seed, rank).
struct HookInputs {
  std::vector<unsigned char> src;     // what the rank sends
  std::vector<unsigned char> addend;  // weighted: the rank's own operand
  std::vector<float> weights;         // weighted: one per row
};

HookInputs hookInputs(HookCase kind, std::size_t units, std::size_t unitBytes, std::uint64_t seed,
                      int rank) {
  std::mt19937_64 rng(seed * 1000003u + static_cast<std::uint64_t>(rank));
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  HookInputs in;
  const std::size_t bytes = units * unitBytes;
  in.src.resize(bytes);
  if (kind == HookCase::kFp8Records || kind == HookCase::kFp8Dequant) {
    for (std::size_t t = 0; t < units; ++t) {
      // Each tile its own magnitude (2^-8 .. 2^8), one all-zero tile, one tile with outliers.
      const float mag = std::ldexp(1.f, static_cast<int>(rng() % 17) - 8);
      for (std::size_t k = 0; k < 128; ++k) {
        float x = t == 2 ? 0.f : u(rng) * mag;
        if (t == 3 && k % 31 == 0) x *= 1000.f;
        const std::uint16_t b = bf16Bits(x);
        std::memcpy(&in.src[(t * 128 + k) * 2], &b, 2);
      }
    }
    return in;
  }
  const bool bf16 = kind == HookCase::kWeightedBf16;
  in.addend.resize(bytes);
  for (std::size_t i = 0; i < bytes / (bf16 ? 2 : 4); ++i) {
    const float a = u(rng) * 4.f, b = u(rng) * 4.f;
    if (bf16) {
      const std::uint16_t x = bf16Bits(a), y = bf16Bits(b);
      std::memcpy(&in.src[2 * i], &x, 2);
      std::memcpy(&in.addend[2 * i], &y, 2);
    } else {
      std::memcpy(&in.src[4 * i], &a, 4);
      std::memcpy(&in.addend[4 * i], &b, 4);
    }
  }
  in.weights.resize(units);
  for (float& w : in.weights) w = (u(rng) + 1.f) * 0.5f;
  return in;
}

// The reference of what rank `me` holds after receiving `from`'s src.
std::vector<unsigned char> hookExpected(HookCase kind, std::size_t units, const HookInputs& from,
                                        const HookInputs& me) {
  std::vector<unsigned char> out;
  if (kind == HookCase::kFp8Records || kind == HookCase::kFp8Dequant) {
    const bool records = kind == HookCase::kFp8Records;
    out.assign(units * (records ? 144 : 256), 0);
    for (std::size_t t = 0; t < units; ++t) {
      float v[128], amax = 0.f;
      for (int k = 0; k < 128; ++k) {
        std::uint16_t b;
        std::memcpy(&b, &from.src[(t * 128 + k) * 2], 2);
        v[k] = bf16Value(b);
        amax = std::max(amax, std::fabs(v[k]));
      }
      const float scale = amax > 0.f ? amax / 448.f : 1.f;
      const float inv = 1.f / scale;
      for (int k = 0; k < 128; ++k) {
        const __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(v[k] * inv, __NV_SATFINITE, __NV_E4M3);
        if (records) {
          out[t * 144 + k] = q;
        } else {
          const float x = __half2float(__half(__nv_cvt_fp8_to_halfraw(q, __NV_E4M3))) * scale;
          const std::uint16_t b = bf16Bits(x);
          std::memcpy(&out[(t * 128 + k) * 2], &b, 2);
        }
      }
      if (records) std::memcpy(&out[t * 144 + 128], &scale, 4);
    }
    return out;
  }
  const bool bf16 = kind == HookCase::kWeightedBf16;
  const std::size_t elem = bf16 ? 2 : 4;
  const std::size_t n = from.src.size() / elem;
  const std::size_t perRow = n / units;
  out.resize(from.src.size());
  for (std::size_t i = 0; i < n; ++i) {
    const float w = me.weights[i / perRow];
    if (bf16) {
      std::uint16_t r, a;
      std::memcpy(&r, &from.src[2 * i], 2);
      std::memcpy(&a, &me.addend[2 * i], 2);
      const std::uint16_t x = bf16Bits(std::fma(w, bf16Value(r), bf16Value(a)));
      std::memcpy(&out[2 * i], &x, 2);
    } else {
      float r, a;
      std::memcpy(&r, &from.src[4 * i], 4);
      std::memcpy(&a, &me.addend[4 * i], 4);
      const float x = std::fma(w, r, a);
      std::memcpy(&out[4 * i], &x, 4);
    }
  }
  return out;
}

}  // namespace

void runHookCase(Communicator& comm, HookCase kind, std::size_t units, int replays) {
  const int R = comm.worldSize();
  const bool fp8 = kind == HookCase::kFp8Records || kind == HookCase::kFp8Dequant;
  const std::size_t unitBytes = fp8 ? 256 : (kind == HookCase::kWeightedBf16 ? 14336 : 16384);
  const std::size_t bytes = units * unitBytes;
  const std::size_t outBytes = kind == HookCase::kFp8Records ? units * 144 : bytes;
  Fixture f(comm, bytes, std::size_t{64} << 10, kNearWrap);
  const int L = f.heap->numLocalRanks();
  std::vector<char*> addend(static_cast<size_t>(L)), weights(static_cast<size_t>(L));
  for (int l = 0; l < L; ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&addend[static_cast<size_t>(l)], bytes + 16));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&weights[static_cast<size_t>(l)], units * sizeof(float) + 16));
  }
  auto enqueue = [&](int l, cudaStream_t s) {
    const int me = f.heap->rank(l);
    SendRecvArgs a;
    a.sendPeer = (me + 1) % R;
    a.src = f.bufs[static_cast<size_t>(l)].src;
    a.sendBytes = bytes;
    a.recvPeer = (me + R - 1) % R;
    a.dst = f.bufs[static_cast<size_t>(l)].dst;
    a.recvBytes = bytes;
    if (fp8) {
      a.wire = Wire::kFp8E4m3;
      a.consume = kind == HookCase::kFp8Dequant ? Consume::kFp8ToBf16 : Consume::kCopy;
    } else {
      a.consume = kind == HookCase::kWeightedBf16 ? Consume::kWeightedAddBf16 : Consume::kWeightedAddF32;
      a.addend = addend[static_cast<size_t>(l)];
      a.weights = reinterpret_cast<const float*>(weights[static_cast<size_t>(l)]);
      a.rowBytes = unitBytes;
    }
    f.movers[static_cast<size_t>(l)].sendRecv(s, a);
  };
  std::vector<cudaGraphExec_t> execs;
  SymmetricHeap::Pin pin;
  if (replays > 1) execs = captureRanks(f, enqueue, &pin);
  long long wrongTotal = 0;
  for (int run = 0; run < replays; ++run) {
    const std::uint64_t seed = 777 + static_cast<std::uint64_t>(run) * 131;
    std::vector<HookInputs> inputs;
    for (int l = 0; l < L; ++l) {
      const int me = f.heap->rank(l);
      inputs.push_back(hookInputs(kind, units, unitBytes, seed, me));
      const HookInputs& in = inputs.back();
      const RankBuffers& b = f.bufs[static_cast<size_t>(l)];
      GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
      GRAPHEP_CUDA_CHECK(cudaMemcpy(b.src, in.src.data(), bytes, cudaMemcpyHostToDevice));
      if (!fp8) {
        GRAPHEP_CUDA_CHECK(cudaMemcpy(addend[static_cast<size_t>(l)], in.addend.data(), bytes,
                                      cudaMemcpyHostToDevice));
        GRAPHEP_CUDA_CHECK(cudaMemcpy(weights[static_cast<size_t>(l)], in.weights.data(),
                                      units * sizeof(float), cudaMemcpyHostToDevice));
      }
      GRAPHEP_CUDA_CHECK(cudaMemset(b.dst, kPoison, bytes + kSlack));
    }
    f.syncAll();
    for (int l = 0; l < L; ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
      cudaStream_t s = f.bufs[static_cast<size_t>(l)].stream;
      if (replays > 1) {
        GRAPHEP_CUDA_CHECK(cudaGraphLaunch(execs[static_cast<size_t>(l)], s));
      } else {
        enqueue(l, s);
      }
    }
    f.syncAll();
    for (int l = 0; l < L; ++l) {
      const int me = f.heap->rank(l);
      const HookInputs from = hookInputs(kind, units, unitBytes, seed, (me + R - 1) % R);
      const std::vector<unsigned char> want = hookExpected(kind, units, from, inputs[static_cast<size_t>(l)]);
      std::vector<unsigned char> got(outBytes + kSlack);
      GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
      GRAPHEP_CUDA_CHECK(cudaMemcpy(got.data(), f.bufs[static_cast<size_t>(l)].dst, got.size(),
                                    cudaMemcpyDeviceToHost));
      long long wrong = 0;
      for (std::size_t i = 0; i < outBytes; ++i) wrong += got[i] != want[i];
      for (std::size_t i = outBytes; i < got.size(); ++i) wrong += got[i] != kPoison;
      EXPECT_EQ(wrong, 0) << "rank " << me << " run " << run << ": " << wrong << " of "
                          << outBytes << " bytes wrong (or written past the end)";
      wrongTotal += wrong;
      EXPECT_EQ(f.heap->errorMessage(l), "") << "rank " << me;
    }
    if (wrongTotal > 0) break;  // one failing run says enough
  }
  for (int l = 0; l < L; ++l) {
    cudaSetDevice(f.heap->device(l));
    if (!execs.empty()) cudaGraphExecDestroy(execs[static_cast<size_t>(l)]);
    cudaFree(addend[static_cast<size_t>(l)]);
    cudaFree(weights[static_cast<size_t>(l)]);
  }
  f.heap->comm().barrier();
}

void runHookSuite(Communicator& comm) {
  for (HookCase kind : {HookCase::kFp8Records, HookCase::kFp8Dequant}) {
    for (std::size_t tiles : {std::size_t{1}, std::size_t{37}, std::size_t{4101}}) {
      SCOPED_TRACE("fp8 kind=" + std::to_string(static_cast<int>(kind)) + " tiles=" + std::to_string(tiles));
      runHookCase(comm, kind, tiles, 1);
    }
    runHookCase(comm, kind, 300, 30);
  }
  for (HookCase kind : {HookCase::kWeightedBf16, HookCase::kWeightedF32}) {
    for (std::size_t rows : {std::size_t{1}, std::size_t{3}, std::size_t{70}}) {
      SCOPED_TRACE("weighted kind=" + std::to_string(static_cast<int>(kind)) + " rows=" + std::to_string(rows));
      runHookCase(comm, kind, rows, 1);
    }
    runHookCase(comm, kind, 5, 30);
  }
}

void runAgainstNccl(Communicator& comm, std::size_t maxBytes) {
  ASSERT_NE(comm.ncclComm(0), nullptr) << "runAgainstNccl needs a communicator with NCCL comms";
  const int R = comm.worldSize();
  const std::size_t cap = maxBytes * static_cast<std::size_t>(R);
  Fixture f(comm, cap, std::size_t{64} << 10, 0);
  const int L = f.heap->numLocalRanks();
  std::vector<char*> ref(static_cast<size_t>(L)), scratch(static_cast<size_t>(L));
  std::vector<CountArrays> ca(static_cast<size_t>(L));
  for (int l = 0; l < L; ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&ref[static_cast<size_t>(l)], cap + kSlack));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&scratch[static_cast<size_t>(l)], maxBytes + kSlack));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&ca[static_cast<size_t>(l)].d, 4 * static_cast<size_t>(R) * 8));
  }
  auto stream = [&](int l) { return f.bufs[static_cast<size_t>(l)].stream; };
  // Runs graphep(l, stream) on every rank into `out(l)`, then nccl(l, stream, comm) in one NCCL
  // group into ref, and counts the bytes of [0, bytes(l)) that differ.
  auto compare = [&](const std::string& what, auto out, auto bytes, auto graphep, auto nccl) {
    SCOPED_TRACE(what);
    for (int l = 0; l < L; ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
      GRAPHEP_CUDA_CHECK(cudaMemsetAsync(out(l), 0xa5, cap + kSlack, stream(l)));
      GRAPHEP_CUDA_CHECK(cudaMemsetAsync(ref[static_cast<size_t>(l)], 0x5a, cap + kSlack, stream(l)));
      GRAPHEP_CUDA_CHECK(cudaMemsetAsync(f.bufs[static_cast<size_t>(l)].wrong, 0, 8, stream(l)));
    }
    f.syncAll();
    for (int l = 0; l < L; ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
      graphep(l, stream(l));
    }
    GRAPHEP_NCCL_CHECK(ncclGroupStart());
    for (int l = 0; l < L; ++l) nccl(l, stream(l), f.heap->comm().ncclComm(l));
    GRAPHEP_NCCL_CHECK(ncclGroupEnd());
    for (int l = 0; l < L; ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
      GRAPHEP_CUDA_CHECK(launchCountDiffs(out(l), ref[static_cast<size_t>(l)], bytes(l),
                                          f.bufs[static_cast<size_t>(l)].wrong, stream(l)));
    }
    f.syncAll();
    for (int l = 0; l < L; ++l) {
      unsigned long long wrong = 0;
      GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
      GRAPHEP_CUDA_CHECK(cudaMemcpy(&wrong, f.bufs[static_cast<size_t>(l)].wrong, 8, cudaMemcpyDeviceToHost));
      EXPECT_EQ(wrong, 0ull) << "rank " << f.heap->rank(l) << ": " << wrong << " of " << bytes(l)
                             << " bytes differ from NCCL";
      EXPECT_EQ(f.heap->errorMessage(l), "") << "rank " << f.heap->rank(l);
    }
    f.heap->comm().barrier();
  };
  auto dstOf = [&](int l) { return f.bufs[static_cast<size_t>(l)].dst; };
  auto srcOf = [&](int l) { return f.bufs[static_cast<size_t>(l)].src; };
  std::vector<std::size_t> sizes{1, 3, 4095, std::size_t{64} << 10, std::size_t{1} << 20, maxBytes};
  sizes.erase(std::remove_if(sizes.begin(), sizes.end(), [&](std::size_t b) { return b > maxBytes; }),
              sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  std::uint64_t seed = 90001;
  for (std::size_t S : sizes) {
    const std::string tag = " S=" + std::to_string(S);
    ++seed;
    for (int l = 0; l < L; ++l) {  // fresh data: a new seed for every size
      GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
      GRAPHEP_CUDA_CHECK(launchFillPattern(srcOf(l), cap, seed, f.heap->rank(l), stream(l)));
    }
    // Staged (LL when small), zero-copy by the SMs, zero-copy by the copy engine.
    for (int mode = 0; mode < 3; ++mode) {
      auto out = [&](int l) { return mode > 0 ? f.heap->user(l) : dstOf(l); };
      compare(
          std::string("sendrecv ring ") + (mode == 0 ? "staged" : mode == 1 ? "zero-copy SM" : "zero-copy CE") + tag,
          out, [&](int) { return S; },
          [&](int l, cudaStream_t s) {
            const int me = f.heap->rank(l);
            SendRecvArgs a;
            a.sendPeer = (me + 1) % R;
            a.src = srcOf(l);
            a.sendBytes = S;
            a.recvPeer = (me + R - 1) % R;
            a.dst = out(l);
            a.recvBytes = S;
            if (mode > 0) {
              a.sendToUserOffset = 0;
              a.recvZeroCopy = true;
              a.zeroCopyEngine = mode == 1 ? ZeroCopyEngine::kSm : ZeroCopyEngine::kCopyEngine;
            }
            f.movers[static_cast<size_t>(l)].sendRecv(s, a);
          },
          [&](int l, cudaStream_t s, ncclComm_t c) {
            const int me = f.heap->rank(l);
            GRAPHEP_NCCL_CHECK(ncclSend(srcOf(l), S, ncclChar, (me + 1) % R, c, s));
            GRAPHEP_NCCL_CHECK(ncclRecv(ref[static_cast<size_t>(l)], S, ncclChar, (me + R - 1) % R, c, s));
          });
    }
    for (bool zeroCopy : {false, true}) {
      auto out = [&](int l) { return zeroCopy ? f.heap->user(l) : dstOf(l); };
      compare(
          std::string("all-gather ring ") + (zeroCopy ? "zero-copy" : "staged") + tag, out,
          [&](int) { return S * static_cast<std::size_t>(R); },
          [&](int l, cudaStream_t s) {
            f.movers[static_cast<size_t>(l)].allGatherRing(s, srcOf(l), out(l), S, zeroCopy);
          },
          [&](int l, cudaStream_t s, ncclComm_t c) {
            GRAPHEP_NCCL_CHECK(ncclAllGather(srcOf(l), ref[static_cast<size_t>(l)], S, ncclChar, c, s));
          });
    }
    for (bool bf16 : {false, true}) {
      const std::size_t elem = bf16 ? 2 : 4;
      const std::size_t count = S / elem;
      if (count == 0) continue;
      for (int l = 0; l < L; ++l) {  // values whose sums are exact in both types
        GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
        GRAPHEP_CUDA_CHECK(launchFillElems(srcOf(l), count * R, bf16, seed, f.heap->rank(l), stream(l)));
      }
      compare(
          std::string("reduce-scatter ") + (bf16 ? "bf16" : "fp32") + tag, dstOf,
          [&](int) { return count * elem; },
          [&](int l, cudaStream_t s) {
            f.movers[static_cast<size_t>(l)].reduceScatterRing(s, srcOf(l), dstOf(l),
                                                               scratch[static_cast<size_t>(l)], count,
                                                               bf16 ? Consume::kAddBf16 : Consume::kAddF32);
          },
          [&](int l, cudaStream_t s, ncclComm_t c) {
            GRAPHEP_NCCL_CHECK(ncclReduceScatter(srcOf(l), ref[static_cast<size_t>(l)], count,
                                                 bf16 ? ncclBfloat16 : ncclFloat32, ncclSum, c, s));
          });
    }
    for (int l = 0; l < L; ++l) {  // src held the reductions' inputs: fresh bytes for alltoallv
      GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
      GRAPHEP_CUDA_CHECK(launchFillPattern(srcOf(l), cap, seed + 7, f.heap->rank(l), stream(l)));
    }
    const auto m = countMatrix(CountPattern::kRandom, R, S, seed);
    for (int l = 0; l < L; ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
      uploadCounts(ca[static_cast<size_t>(l)], m, f.heap->rank(l), stream(l));
    }
    for (bool zeroCopy : {false, true}) {
      compare(
          std::string("alltoallv random counts") + (zeroCopy ? " zero-copy" : " staged") + tag,
          [&](int l) { return allToAllvDst(f, l, zeroCopy); },
          [&](int l) {
            std::uint64_t total = 0;
            for (int q = 0; q < R; ++q) total += ca[static_cast<size_t>(l)].host[static_cast<size_t>(2 * R + q)];
            return static_cast<std::size_t>(total);
          },
          [&](int l, cudaStream_t s) {
            f.movers[static_cast<size_t>(l)].allToAllv(
                s, allToAllvArgs(f, l, ca[static_cast<size_t>(l)], cap, zeroCopy));
          },
          [&](int l, cudaStream_t s, ncclComm_t c) {
            const auto& h = ca[static_cast<size_t>(l)].host;
            for (int q = 0; q < R; ++q) {
              GRAPHEP_NCCL_CHECK(ncclSend(srcOf(l) + h[static_cast<size_t>(R + q)], h[static_cast<size_t>(q)],
                                          ncclChar, q, c, s));
              GRAPHEP_NCCL_CHECK(ncclRecv(ref[static_cast<size_t>(l)] + h[static_cast<size_t>(3 * R + q)],
                                          h[static_cast<size_t>(2 * R + q)], ncclChar, q, c, s));
            }
          });
    }
  }
  for (int l = 0; l < L; ++l) {
    cudaSetDevice(f.heap->device(l));
    cudaFree(ref[static_cast<size_t>(l)]);
    cudaFree(scratch[static_cast<size_t>(l)]);
    cudaFree(ca[static_cast<size_t>(l)].d);
  }
}

}  // namespace graphep::test
