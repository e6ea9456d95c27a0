// sendrecv: every rank sends S bytes to the next rank and receives S from the previous one (a
// ring shift, as nccl-tests' sendrecv; with 2 ranks a bidirectional exchange), graph-replayed.
// algbw = S / time (per direction; nccl-tests' sendrecv busbw = algbw).
//   staged      through per-channel staging slots in the receiver's heap
//   zero-copy   straight into the receiver's symmetric destination, by the SMs ("zero-copy") or by
//               the copy engine ("zero-copy CE", from 64 KiB up: a memcpy between two flag launches)
//   baseline    NCCL grouped ncclSend + ncclRecv, captured in a graph
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>

#include "bench/harness.hpp"
#include "engine/error.hpp"
#include "engine/heap.hpp"
#include "engine/movers.hpp"

namespace graphep::bench {

std::vector<Row> runSendRecv(const Options& o, Ranks& r) {
  MoverBench mb = makeMoverBench(o, r, o.maxBytes);
  auto& heap = mb.heap;
  auto& movers = mb.movers;
  std::vector<char*> src(static_cast<size_t>(r.numLocal())), dst(static_cast<size_t>(r.numLocal()));
  const int R = r.worldSize();
  auto next = [&](int i) { return (r.rank(i) + 1) % R; };
  auto prev = [&](int i) { return (r.rank(i) + R - 1) % R; };
  auto salt = [](int rank) { return 0x1234u + 0x9e37u * static_cast<unsigned>(rank); };
  for (int i = 0; i < r.numLocal(); ++i) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[i]));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&src[i], std::max<std::size_t>(o.maxBytes, 16)));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&dst[i], std::max<std::size_t>(o.maxBytes, 16)));
    fillBytes(src[i], o.maxBytes, salt(r.rank(i)), r.streams[i]);
    GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(r.streams[i]));
  }
  std::vector<Row> rows;
  for (std::size_t bytes = o.minBytes; bytes <= o.maxBytes;
       bytes = std::max<std::size_t>(bytes + 1, static_cast<std::size_t>(bytes * o.factor))) {
    progress(("sendrecv " + std::to_string(bytes)).c_str());
    // --sms fixes the channel count; 0 lets each transfer choose (LL over several channels when
    // small). The row names the mode and channel count that actually ran.
    const int channels = o.sms > 0 ? o.sms : movers[0].channelsFor(bytes);
    const int zeroCopyChannels = o.sms > 0 ? o.sms : movers[0].channelsFor(bytes, /*zeroCopy=*/true);
    const int llChannels = movers[0].llChannelsFor(bytes, o.sms);
    // NCCL baseline.
    double ncclUs = 0;
    if (r.hasNccl()) {
      auto execs = captureOpsAll(o, r, [&] {
        GRAPHEP_NCCL_CHECK(ncclGroupStart());
        for (int i = 0; i < r.numLocal(); ++i) {
          GRAPHEP_NCCL_CHECK(ncclSend(src[i], bytes, ncclChar, next(i), r.ncclComm(i), r.streams[i]));
          GRAPHEP_NCCL_CHECK(ncclRecv(dst[i], bytes, ncclChar, prev(i), r.ncclComm(i), r.streams[i]));
        }
        GRAPHEP_NCCL_CHECK(ncclGroupEnd());
      });
      ncclUs = timeOps(o, r, execs);
    }
    for (int variant = 0; variant < 3; ++variant) {
      const bool zeroCopy = variant > 0;
      const bool ce = variant == 2;
      if (ce && bytes < (std::size_t{64} << 10)) continue;
      for (int i = 0; i < r.numLocal(); ++i) {
        GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[i]));
        GRAPHEP_CUDA_CHECK(cudaMemset(zeroCopy ? heap->user(i) : dst[i], 0xa5, bytes));
        movers[static_cast<size_t>(i)].resetProfile();
      }
      auto execs = captureOps(o, r, [&](int i, cudaStream_t s) {
        SendRecvArgs a;
        a.sendPeer = next(i);
        a.src = src[i];
        a.sendBytes = bytes;
        a.recvPeer = prev(i);
        a.dst = zeroCopy ? heap->user(i) : dst[i];
        a.recvBytes = bytes;
        a.numChannels = o.sms;
        if (zeroCopy) {
          a.sendToUserOffset = 0;
          a.recvZeroCopy = true;
          a.zeroCopyEngine = ce ? ZeroCopyEngine::kCopyEngine : ZeroCopyEngine::kSm;
        }
        movers[static_cast<size_t>(i)].sendRecv(s, a);
      });
      const double us = timeOps(o, r, execs);
      if (o.profile && !zeroCopy && llChannels == 0) printProfile("sendrecv staged", bytes, movers[0].profile());
      long long w = 0;
      for (int i = 0; o.check && i < r.numLocal(); ++i) {
        w += checkBytes(r, i, zeroCopy ? heap->user(i) : dst[i], bytes, salt(prev(i)));
      }
      addMoverRow(rows, r, "sendrecv",
                  ce         ? std::string("zero-copy CE")
                  : zeroCopy ? "zero-copy ch=" + std::to_string(zeroCopyChannels)
                           : (llChannels > 0 ? "LL ch=" + std::to_string(llChannels)
                                             : "staged ch=" + std::to_string(channels)),
                  bytes, us, BusBw::kAlgBw, w, ncclUs);
    }
    requireNoDeviceError(*heap);
  }
  freeEach(r, src, dst);
  return rows;
}

}  // namespace graphep::bench
