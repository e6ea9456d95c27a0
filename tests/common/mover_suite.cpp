#include "common/mover_suite.hpp"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

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
                 " channels=" + std::to_string(c.numChannels));
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
  if (replays > 1) {
    for (int l = 0; l < L; ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
      execs.push_back(captureOnStream(f.bufs[static_cast<size_t>(l)].stream,
                                      [&](cudaStream_t s) { enqueue(l, s); }));
    }
    pin = f.heap->pin();
  }
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

void runSendRecvReplays(Communicator& comm, std::size_t bytes, int replays, bool zeroCopy) {
  Fixture f(comm, bytes, std::size_t{64} << 10, kNearWrap);
  const int R = f.heap->worldSize();
  const SendRecvCase c{bytes, zeroCopy, false, 0};
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

AllToAllvArgs allToAllvArgs(const Fixture& f, int l, const CountArrays& ca, std::size_t cap) {
  const int R = f.heap->worldSize();
  AllToAllvArgs a;
  a.src = f.bufs[static_cast<size_t>(l)].src;
  a.srcBytes = cap;
  a.dst = f.bufs[static_cast<size_t>(l)].dst;
  a.dstBytes = cap;
  a.sendCounts = ca.d;
  a.sendOffsets = ca.d + R;
  a.recvCounts = ca.d + 2 * R;
  a.recvOffsets = ca.d + 3 * R;
  return a;
}

}  // namespace

void runAllToAllv(Communicator& comm, CountPattern pattern, std::size_t maxPerPeer, int replays) {
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
    AllToAllvArgs a = allToAllvArgs(f, l, ca[static_cast<size_t>(l)], cap);
    a.maxBytesPerPeer = maxPerPeer;
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
        uploadCounts(ca[static_cast<size_t>(l)], m, me, s);
        const auto& h = ca[static_cast<size_t>(l)].host;
        for (int q = 0; q < R; ++q) {
          GRAPHEP_CUDA_CHECK(launchFillPattern(f.bufs[static_cast<size_t>(l)].src + h[static_cast<size_t>(R + q)],
                                               h[static_cast<size_t>(q)], seed, me * 64 + q, s));
        }
        GRAPHEP_CUDA_CHECK(cudaMemsetAsync(f.bufs[static_cast<size_t>(l)].dst, kPoison, cap + kSlack, s));
      },
      [&](int l, cudaStream_t s, std::uint64_t seed) {
        const int me = f.heap->rank(l);
        const auto& h = ca[static_cast<size_t>(l)].host;
        for (int q = 0; q < R; ++q) {
          GRAPHEP_CUDA_CHECK(launchCountMismatches(
              f.bufs[static_cast<size_t>(l)].dst + h[static_cast<size_t>(3 * R + q)], h[static_cast<size_t>(2 * R + q)],
              seed, q * 64 + me, f.bufs[static_cast<size_t>(l)].wrong, s));
        }
      });
  for (int l = 0; l < L; ++l) {
    cudaSetDevice(f.heap->device(l));
    cudaFree(ca[static_cast<size_t>(l)].d);
  }
}

void runAllToAllvOutOfBounds(Communicator& comm) {
  const int R = comm.worldSize();
  const std::size_t perPeer = 4096;
  const std::size_t cap = perPeer * static_cast<std::size_t>(R);
  Fixture f(comm, cap, std::size_t{64} << 10, 0);
  const int L = f.heap->numLocalRanks();
  auto m = countMatrix(CountPattern::kEqual, R, perPeer, 1);
  // Rank 0 -> rank 1 asks for more than either buffer holds.
  m[0][1] = cap + 1;
  std::vector<CountArrays> ca(static_cast<size_t>(L));
  for (int l = 0; l < L; ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&ca[static_cast<size_t>(l)].d, 4 * static_cast<size_t>(R) * 8));
    uploadCounts(ca[static_cast<size_t>(l)], m, f.heap->rank(l), f.bufs[static_cast<size_t>(l)].stream,
                 perPeer);
    GRAPHEP_CUDA_CHECK(cudaMemsetAsync(f.bufs[static_cast<size_t>(l)].dst, kPoison, cap + kSlack,
                                       f.bufs[static_cast<size_t>(l)].stream));
  }
  f.syncAll();
  for (int l = 0; l < L; ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(f.heap->device(l)));
    f.movers[static_cast<size_t>(l)].allToAllv(f.bufs[static_cast<size_t>(l)].stream,
                                               allToAllvArgs(f, l, ca[static_cast<size_t>(l)], cap));
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

}  // namespace graphep::test
