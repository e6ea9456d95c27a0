// pingpong: round-trip latency of a 4-byte signal between 2 ranks, graph-replayed.
//   flag-in-kernel     one kernel per rank loops kRounds round trips (st.release / ld.acquire)
//   flag-per-launch    one probe kernel launch per round trip (launch + flag cost)
//   semaphore          kernel release-add, cuStreamWaitValue32 GEQ, kernel consume, both ways
//   baseline: NCCL     grouped ncclSend/ncclRecv of 4 bytes each way, in a graph
#include <cuda_runtime.h>
#include <nccl.h>

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
  if (!r.nccl) return 0;
  std::int32_t* buf[2][2];  // [rank][0: send, 1: recv]
  for (int i = 0; i < 2; ++i) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[i]));
    for (int j = 0; j < 2; ++j) GRAPHEP_CUDA_CHECK(cudaMalloc(&buf[i][j], sizeof(std::int32_t)));
    const std::int32_t v = 0x1234 + i;
    GRAPHEP_CUDA_CHECK(cudaMemcpy(buf[i][0], &v, sizeof(v), cudaMemcpyHostToDevice));
    GRAPHEP_CUDA_CHECK(cudaMemset(buf[i][1], 0xff, sizeof(std::int32_t)));
  }
  auto execs = captureAll(r, [&] {
    for (int k = 0; k < kRoundsPerGraph; ++k) {
      GRAPHEP_NCCL_CHECK(ncclGroupStart());
      GRAPHEP_NCCL_CHECK(ncclSend(buf[0][0], 1, ncclInt32, 1, r.nccl->ncclComm(0), r.streams[0]));
      GRAPHEP_NCCL_CHECK(ncclRecv(buf[1][1], 1, ncclInt32, 0, r.nccl->ncclComm(1), r.streams[1]));
      GRAPHEP_NCCL_CHECK(ncclGroupEnd());
      GRAPHEP_NCCL_CHECK(ncclGroupStart());
      GRAPHEP_NCCL_CHECK(ncclSend(buf[1][0], 1, ncclInt32, 0, r.nccl->ncclComm(1), r.streams[1]));
      GRAPHEP_NCCL_CHECK(ncclRecv(buf[0][1], 1, ncclInt32, 1, r.nccl->ncclComm(0), r.streams[0]));
      GRAPHEP_NCCL_CHECK(ncclGroupEnd());
    }
  });
  const double us = timeIterations(r, o.warmup, o.iters, [&] { launchEach(r, execs); });
  destroyEach(r, execs);
  for (int i = 0; i < 2; ++i) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[i]));
    std::int32_t got = 0;
    GRAPHEP_CUDA_CHECK(cudaMemcpy(&got, buf[i][1], sizeof(got), cudaMemcpyDeviceToHost));
    *wrong += got != 0x1234 + (1 - i);
    for (int j = 0; j < 2; ++j) cudaFree(buf[i][j]);
  }
  return us / kRoundsPerGraph;
}

}  // namespace

std::vector<Row> runPingPong(const Options& o, Ranks& r) {
  HeapConfig cfg;
  cfg.numRanks = 2;
  auto heap = SymmetricHeap::create(*r.comm, cfg);
  std::vector<unsigned long long*> errors(2);
  for (int i = 0; i < 2; ++i) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[i]));
    GRAPHEP_CUDA_CHECK(preloadProbeKernels());
    GRAPHEP_CUDA_CHECK(cudaMalloc(&errors[i], sizeof(unsigned long long)));
    GRAPHEP_CUDA_CHECK(cudaMemset(errors[i], 0, sizeof(unsigned long long)));
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
                    readErrors(r, errors), ncclUs, "per round trip"});
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
                    readErrors(r, errors), ncclUs, "per round trip, 1 launch each"});
  }
  {  // semaphore
    progress("semaphore");
    std::vector<SemaphoreOps> ops{SemaphoreOps(*heap, 0), SemaphoreOps(*heap, 1)};
    constexpr int kCh = 0;
    auto execs = captureEach(r, [&](int i, cudaStream_t s) {
      for (int k = 0; k < kRoundsPerGraph; ++k) {
        if (i == 0) {
          ops[0].signal(s, kCh, 1u << 1);
          ops[0].wait(s, kCh, 1, 1);
          ops[0].consume(s, kCh, 1, 1);
        } else {
          ops[1].wait(s, kCh, 0, 1);
          ops[1].consume(s, kCh, 0, 1);
          ops[1].signal(s, kCh, 1u << 0);
        }
      }
    });
    const double us = timeIterations(r, o.warmup, o.iters, [&] { launchEach(r, execs); });
    destroyEach(r, execs);
    long long wrong = 0;
    const std::uint32_t expected =
        static_cast<std::uint32_t>((o.warmup + o.iters) * kRoundsPerGraph);
    for (int i = 0; i < 2; ++i) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[i]));
      GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
      const SemaphoreCounts c = ops[static_cast<size_t>(i)].read(kCh, 1 - i);
      wrong += c.count != 0;
      wrong += std::llabs(static_cast<long long>(c.arrived) - expected);
      wrong += std::llabs(static_cast<long long>(c.consumed) - expected);
    }
    rows.push_back({"pingpong", "semaphore", 4, us / kRoundsPerGraph, 0, 0, wrong, ncclUs,
                    "per round trip: signal+wait+consume each way"});
  }
  for (int i = 0; i < 2; ++i) {
    const std::string err = heap->errorMessage(i);
    GRAPHEP_REQUIRE(err.empty(), Status::kRemoteError, "device error: %s", err.c_str());
    cudaSetDevice(r.devices[i]);
    cudaFree(errors[i]);
  }
  if (ncclUs > 0) rows.push_back({"pingpong", "nccl-sendrecv (baseline)", 4, ncclUs, 0, 0, ncclWrong,
                                  ncclUs, "grouped send/recv each way"});
  for (const Row& row : rows) printRow(row);
  return rows;
}

}  // namespace graphep::bench
