// allgather: S = total output bytes per rank (nccl-tests convention); each of the R ranks
// contributes S / R. algbw = S / time, busbw = algbw * (R - 1) / R.
//   ring staged / ring zero-copy   Movers::allGatherRing (R - 1 sendRecv steps; with 2 ranks the
//                                  one step also copies the own chunk, so it stays on the SMs)
//   baseline                       ncclAllGather, captured in a graph
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <string>

#include "bench/harness.hpp"
#include "engine/error.hpp"
#include "engine/heap.hpp"
#include "engine/movers.hpp"

namespace graphep::bench {

std::vector<Row> runAllGather(const Options& o, Ranks& r) {
  const int R = r.worldSize();
  MoverBench mb = makeMoverBench(o, r, o.maxBytes);
  auto& heap = mb.heap;
  auto& movers = mb.movers;
  std::vector<char*> in(static_cast<size_t>(r.numLocal())), out(static_cast<size_t>(r.numLocal()));
  auto salt = [](int rank) { return 0x51u + 0x56u * static_cast<unsigned>(rank); };
  for (int i = 0; i < r.numLocal(); ++i) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[static_cast<size_t>(i)]));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&in[static_cast<size_t>(i)], std::max<std::size_t>(o.maxBytes / R, 16)));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&out[static_cast<size_t>(i)], std::max<std::size_t>(o.maxBytes, 16)));
    fillBytes(in[static_cast<size_t>(i)], o.maxBytes / R, salt(r.rank(i)), r.streams[static_cast<size_t>(i)]);
    GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(r.streams[static_cast<size_t>(i)]));
  }
  std::vector<Row> rows;
  for (std::size_t total = o.minBytes; total <= o.maxBytes;
       total = std::max<std::size_t>(total + 1, static_cast<std::size_t>(total * o.factor))) {
    const std::size_t chunk = total / R;
    progress(("allgather " + std::to_string(total)).c_str());
    double ncclUs = 0;
    if (r.hasNccl()) {
      auto execs = captureOpsAll(o, r, [&] {
        GRAPHEP_NCCL_CHECK(ncclGroupStart());
        for (int i = 0; i < r.numLocal(); ++i) {
          GRAPHEP_NCCL_CHECK(ncclAllGather(in[static_cast<size_t>(i)], out[static_cast<size_t>(i)], chunk,
                                           ncclChar, r.ncclComm(i), r.streams[static_cast<size_t>(i)]));
        }
        GRAPHEP_NCCL_CHECK(ncclGroupEnd());
      });
      ncclUs = timeOps(o, r, execs);
    }
    for (bool zeroCopy : {false, true}) {
      auto target = [&](int i) { return zeroCopy ? heap->user(i) : out[static_cast<size_t>(i)]; };
      for (int i = 0; i < r.numLocal(); ++i) {  // the NCCL run filled `out`: poison so graphep must write it
        GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[static_cast<size_t>(i)]));
        GRAPHEP_CUDA_CHECK(cudaMemset(target(i), 0xa5, chunk * R));
      }
      auto execs = captureOps(o, r, [&](int i, cudaStream_t s) {
        movers[static_cast<size_t>(i)].allGatherRing(s, in[static_cast<size_t>(i)], target(i), chunk, zeroCopy);
      });
      const double us = timeOps(o, r, execs);
      long long w = 0;
      for (int i = 0; o.check && i < r.numLocal(); ++i) {
        for (int q = 0; q < R; ++q) w += checkBytes(r, i, target(i) + chunk * q, chunk, salt(q));
      }
      addMoverRow(rows, r, "allgather", zeroCopy ? "ring zero-copy" : "ring staged", chunk * R, us,
                  BusBw::kCollective, w, ncclUs);
    }
    requireNoDeviceError(*heap);
  }
  freeEach(r, in, out);
  return rows;
}

}  // namespace graphep::bench
