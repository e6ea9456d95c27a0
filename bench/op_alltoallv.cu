// alltoallv with equal counts: S = bytes each rank sends in total, S / R to every rank (itself
// included). algbw = S / time, busbw = algbw * (R - 1) / R (nccl-tests alltoall).
//   graphep     Movers::allToAllv, counts and offsets in device memory: staged ("equal counts"),
//               or zero-copy into the user region ("equal counts zero-copy")
//   baseline    NCCL grouped ncclSend/ncclRecv to every rank (nccl-tests' alltoall), in a graph
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "bench/harness.hpp"
#include "engine/error.hpp"
#include "engine/heap.hpp"
#include "engine/movers.hpp"

namespace graphep::bench {

std::vector<Row> runAllToAllv(const Options& o, Ranks& r) {
  const int R = r.worldSize();
  // The heap holds the zero-copy destination; a remote peer's segments (at most maxBytes / R)
  // travel through NCCL stages of that size.
  const std::size_t most = std::max<std::size_t>(o.maxBytes, 16);
  MoverBench mb = makeMoverBench(o, r, most, (most + R - 1) / R);
  auto& heap = mb.heap;
  auto& movers = mb.movers;
  std::vector<char*> src(static_cast<size_t>(r.numLocal())), dst(static_cast<size_t>(r.numLocal()));
  std::vector<std::uint64_t*> counts(static_cast<size_t>(r.numLocal()));  // sendCounts | sendOffsets | recvCounts | recvOffsets
  const std::size_t cap = std::max<std::size_t>(o.maxBytes, 16);
  for (int i = 0; i < r.numLocal(); ++i) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[static_cast<size_t>(i)]));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&src[static_cast<size_t>(i)], cap));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&dst[static_cast<size_t>(i)], cap));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&counts[static_cast<size_t>(i)], 4 * R * sizeof(std::uint64_t)));
  }
  // Segment (q -> i) of a size-S run is filled with salt 0x100 * q + i from index 0.
  auto salt = [](int q, int i) { return 0x100u * static_cast<unsigned>(q) + static_cast<unsigned>(i); };
  std::vector<Row> rows;
  for (std::size_t total = o.minBytes; total <= o.maxBytes;
       total = std::max<std::size_t>(total + 1, static_cast<std::size_t>(total * o.factor))) {
    const std::size_t per = total / R;
    progress(("alltoallv " + std::to_string(total)).c_str());
    for (int i = 0; i < r.numLocal(); ++i) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[static_cast<size_t>(i)]));
      std::vector<std::uint64_t> h(4 * static_cast<size_t>(R));
      for (int q = 0; q < R; ++q) {
        h[static_cast<size_t>(q)] = per;
        h[static_cast<size_t>(R + q)] = per * q;
        h[static_cast<size_t>(2 * R + q)] = per;
        h[static_cast<size_t>(3 * R + q)] = per * q;
        fillBytes(src[static_cast<size_t>(i)] + per * q, per, salt(r.rank(i), q), r.streams[static_cast<size_t>(i)]);
      }
      GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(counts[static_cast<size_t>(i)], h.data(), h.size() * 8, cudaMemcpyHostToDevice,
                                         r.streams[static_cast<size_t>(i)]));  // on the stream the movers use
      GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(r.streams[static_cast<size_t>(i)]));
    }
    const double ncclUs = ncclAllToAllvUs(o, r, src, dst, [per](int, int) { return per; });
    for (bool zeroCopy : {false, true}) {
      auto out = [&](int i) { return zeroCopy ? heap->user(i) : dst[static_cast<size_t>(i)]; };
      for (int i = 0; i < r.numLocal(); ++i) {
        GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[static_cast<size_t>(i)]));
        GRAPHEP_CUDA_CHECK(cudaMemset(out(i), 0xa5, cap));
      }
      auto execs = captureOps(o, r, [&](int i, cudaStream_t s) {
        AllToAllvArgs a;
        const std::uint64_t* d = counts[static_cast<size_t>(i)];
        a.src = src[static_cast<size_t>(i)];
        a.srcBytes = cap;
        a.dst = out(i);
        a.dstBytes = cap;
        a.sendCounts = d;
        a.sendOffsets = d + R;
        a.recvCounts = d + 2 * R;
        a.recvOffsets = d + 3 * R;
        a.maxBytesPerPeer = per;
        a.channelsPerPeer = o.sms;
        a.zeroCopy = zeroCopy;
        movers[static_cast<size_t>(i)].allToAllv(s, a);
      });
      const double us = timeOps(o, r, execs);
      long long w = 0;
      for (int i = 0; o.check && i < r.numLocal(); ++i) {
        for (int q = 0; q < R; ++q) w += checkBytes(r, i, out(i) + per * q, per, salt(q, r.rank(i)));
      }
      addMoverRow(rows, r, "alltoallv", zeroCopy ? "equal counts zero-copy" : "equal counts", per * R, us,
                  BusBw::kCollective, w, ncclUs);
    }
    requireNoDeviceError(*heap);
  }
  freeEach(r, src, dst, counts);
  return rows;
}

}  // namespace graphep::bench
