// pingpong: round-trip latency of a 4-byte signal between 2 ranks, graph-replayed.
//   flag-in-kernel     one kernel per rank loops kRounds round trips (st.release / ld.acquire)
//   flag-per-launch    one probe kernel launch per round trip (launch + flag cost)
//   semaphore          kernel release-add, cuStreamWaitValue32 GEQ, kernel consume, both ways
//   baseline: NCCL     grouped ncclSend/ncclRecv of 4 bytes each way, in a graph
#include <cuda_runtime.h>
#include <nccl.h>

#include <vector>

#include "bench/harness.hpp"
#include "engine/error.hpp"
#include "engine/heap.hpp"
#include "engine/semaphore.hpp"
#include "kernels/probe.h"

namespace graphep::bench {
namespace {

constexpr int kRoundsPerGraph = 100;
constexpr std::uint32_t kInKernelRounds = 1000;

long long readErrors(Ranks& r, const std::vector<unsigned long long*>& errors) {
  long long total = 0;
  for (size_t i = 0; i < errors.size(); ++i) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[i]));
    GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
    unsigned long long e = 0;
    GRAPHEP_CUDA_CHECK(cudaMemcpy(&e, errors[i], sizeof(e), cudaMemcpyDeviceToHost));
    total += static_cast<long long>(e);
  }
  return total;
}

double ncclRoundTripUs(const Options& o, Ranks& r, long long* wrong) {
  if (!r.hasNccl()) return 0;
  const int L = r.numLocal();
  std::vector<std::int32_t*> sendBuf(static_cast<size_t>(L)), recvBuf(static_cast<size_t>(L));
  for (int i = 0; i < L; ++i) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[static_cast<size_t>(i)]));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&sendBuf[static_cast<size_t>(i)], sizeof(std::int32_t)));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&recvBuf[static_cast<size_t>(i)], sizeof(std::int32_t)));
    const std::int32_t v = 0x1234 + r.rank(i);
    GRAPHEP_CUDA_CHECK(cudaMemcpy(sendBuf[static_cast<size_t>(i)], &v, sizeof(v), cudaMemcpyHostToDevice));
    GRAPHEP_CUDA_CHECK(cudaMemset(recvBuf[static_cast<size_t>(i)], 0xff, sizeof(std::int32_t)));
  }
  // One round trip: rank 0 -> rank 1, then rank 1 -> rank 0 (each half one NCCL group over the
  // local ranks of this process).
  auto half = [&](int from) {
    GRAPHEP_NCCL_CHECK(ncclGroupStart());
    for (int i = 0; i < L; ++i) {
      const int g = r.rank(i);
      if (g == from) {
        GRAPHEP_NCCL_CHECK(ncclSend(sendBuf[static_cast<size_t>(i)], 1, ncclInt32, 1 - g,
                                    r.ncclComm(i), r.streams[static_cast<size_t>(i)]));
      } else {
        GRAPHEP_NCCL_CHECK(ncclRecv(recvBuf[static_cast<size_t>(i)], 1, ncclInt32, 1 - g,
                                    r.ncclComm(i), r.streams[static_cast<size_t>(i)]));
      }
    }
    GRAPHEP_NCCL_CHECK(ncclGroupEnd());
  };
  auto execs = captureAll(r, [&] {
    for (int k = 0; k < kRoundsPerGraph; ++k) {
      half(0);
      half(1);
    }
  });
  const double us = timeIterations(r, o.warmup, o.iters, [&] { launchEach(r, execs); });
  destroyEach(r, execs);
  for (int i = 0; i < L; ++i) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[static_cast<size_t>(i)]));
    std::int32_t got = 0;
    GRAPHEP_CUDA_CHECK(cudaMemcpy(&got, recvBuf[static_cast<size_t>(i)], sizeof(got), cudaMemcpyDeviceToHost));
    *wrong += got != 0x1234 + (1 - r.rank(i));
    cudaFree(sendBuf[static_cast<size_t>(i)]);
    cudaFree(recvBuf[static_cast<size_t>(i)]);
  }
  return us / kRoundsPerGraph;
}

}  // namespace

std::vector<Row> runPingPong(const Options& o, Ranks& r) {
  GRAPHEP_REQUIRE(r.worldSize() == 2, Status::kInvalidArgument,
                  "pingpong measures a round trip between 2 ranks; it was started with %d (use --ranks 2, "
                  "CUDA_VISIBLE_DEVICES or mpirun -np 2)", r.worldSize());
  HeapConfig cfg;
  cfg.numRanks = 2;
  auto heap = SymmetricHeap::create(*r.comm, cfg);
  const int L = r.numLocal();
  std::vector<unsigned long long*> errors(static_cast<size_t>(L));
  for (int i = 0; i < L; ++i) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[static_cast<size_t>(i)]));
    GRAPHEP_CUDA_CHECK(preloadProbeKernels());
    GRAPHEP_CUDA_CHECK(cudaMalloc(&errors[i], sizeof(unsigned long long)));
    GRAPHEP_CUDA_CHECK(cudaMemset(errors[i], 0, sizeof(unsigned long long)));
    GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());  // landed before the (non-blocking) probe streams use it
  }
  long long ncclWrong = 0;
  progress("nccl baseline");
  const double ncclUs = ncclRoundTripUs(o, r, &ncclWrong);
  std::vector<Row> rows;

  {  // flag-in-kernel
    progress("flag-in-kernel");
    auto execs = captureEach(r, [&](int i, cudaStream_t s) {
      GRAPHEP_CUDA_CHECK(launchFlagPingPong(heap->syncHandle(i), 0, kInKernelRounds, errors[i], s));
    });
    const double us = timeIterations(r, o.warmup, o.iters, [&] { launchEach(r, execs); });
    destroyEach(r, execs);
    rows.push_back({"pingpong", "flag-in-kernel", 4, us / kInKernelRounds, 0, 0,
                    totalOverRanks(r, readErrors(r, errors)), ncclUs, "per round trip"});
  }
  {  // flag-per-launch
    progress("flag-per-launch");
    auto execs = captureEach(r, [&](int i, cudaStream_t s) {
      for (int k = 0; k < kRoundsPerGraph; ++k)
        GRAPHEP_CUDA_CHECK(launchFlagPingPong(heap->syncHandle(i), 1, 1, errors[i], s));
    });
    const double us = timeIterations(r, o.warmup, o.iters, [&] { launchEach(r, execs); });
    destroyEach(r, execs);
    rows.push_back({"pingpong", "flag-per-launch", 4, us / kRoundsPerGraph, 0, 0,
                    totalOverRanks(r, readErrors(r, errors)), ncclUs, "per round trip, 1 launch each"});
  }
  {  // semaphore
    progress("semaphore");
    std::vector<SemaphoreOps> ops;
    for (int i = 0; i < L; ++i) ops.emplace_back(*heap, i);
    constexpr int kCh = 0;
    auto execs = captureEach(r, [&](int i, cudaStream_t s) {
      const SemaphoreOps& op = ops[static_cast<size_t>(i)];
      const int g = r.rank(i);
      for (int k = 0; k < kRoundsPerGraph; ++k) {
        if (g == 0) {
          op.signal(s, kCh, 1u << 1);
          op.wait(s, kCh, 1, 1);
          op.consume(s, kCh, 1, 1);
        } else {
          op.wait(s, kCh, 0, 1);
          op.consume(s, kCh, 0, 1);
          op.signal(s, kCh, 1u << 0);
        }
      }
    });
    const double us = timeIterations(r, o.warmup, o.iters, [&] { launchEach(r, execs); });
    destroyEach(r, execs);
    long long wrong = 0;
    const std::uint32_t expected =
        static_cast<std::uint32_t>((o.warmup + o.iters) * kRoundsPerGraph);
    for (int i = 0; i < L; ++i) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[static_cast<size_t>(i)]));
      GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
      const SemaphoreCounts c = ops[static_cast<size_t>(i)].read(kCh, 1 - r.rank(i));
      wrong += c.count != 0;
      wrong += std::llabs(static_cast<long long>(c.arrived) - expected);
      wrong += std::llabs(static_cast<long long>(c.consumed) - expected);
    }
    rows.push_back({"pingpong", "semaphore", 4, us / kRoundsPerGraph, 0, 0, totalOverRanks(r, wrong), ncclUs,
                    "per round trip: signal+wait+consume each way"});
  }
  requireNoDeviceError(*heap);
  for (int i = 0; i < L; ++i) {
    cudaSetDevice(r.devices[static_cast<size_t>(i)]);
    cudaFree(errors[static_cast<size_t>(i)]);
  }
  if (ncclUs > 0) rows.push_back({"pingpong", "nccl-sendrecv (baseline)", 4, ncclUs, 0, 0, totalOverRanks(r, ncclWrong),
                                  ncclUs, "grouped send/recv each way"});
  for (const Row& row : rows) printRow(row);
  return rows;
}

}  // namespace graphep::bench
