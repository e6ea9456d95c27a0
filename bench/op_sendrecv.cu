// sendrecv: bidirectional exchange of S bytes between 2 ranks (each sends S to the other),
// graph-replayed. algbw = S / time (per direction; nccl-tests' sendrecv busbw = algbw).
//   staged      through per-channel staging slots in the receiver's heap
//   zero-copy   straight into the receiver's symmetric destination
//   baseline    NCCL grouped ncclSend + ncclRecv, captured in a graph
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>

#include "bench/harness.hpp"
#include "engine/error.hpp"
#include "engine/heap.hpp"
#include "engine/movers.hpp"

namespace graphep::bench {
namespace {

// Device-side fill with a rank- and size-dependent byte pattern, and a mismatch count.
__global__ void fillKernel(unsigned char* p, std::size_t n, unsigned salt) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    p[i] = static_cast<unsigned char>((i * 2654435761u + salt) >> 7);
}
__global__ void checkKernel(const unsigned char* p, std::size_t n, unsigned salt,
                            unsigned long long* wrong) {
  unsigned long long bad = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    bad += p[i] != static_cast<unsigned char>((i * 2654435761u + salt) >> 7);
  if (bad) atomicAdd(wrong, bad);
}

long long verify(Ranks& r, const std::vector<char*>& dst, std::size_t bytes,
                 unsigned long long* wrongBuf[2], unsigned saltOf[2]) {
  long long total = 0;
  for (int i = 0; i < 2; ++i) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[i]));
    GRAPHEP_CUDA_CHECK(cudaMemset(wrongBuf[i], 0, sizeof(unsigned long long)));
    if (bytes > 0) checkKernel<<<1024, 256, 0, r.streams[i]>>>(
        reinterpret_cast<unsigned char*>(dst[i]), bytes, saltOf[1 - i], wrongBuf[i]);
    GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(r.streams[i]));
    unsigned long long w = 0;
    GRAPHEP_CUDA_CHECK(cudaMemcpy(&w, wrongBuf[i], sizeof(w), cudaMemcpyDeviceToHost));
    total += static_cast<long long>(w);
  }
  return total;
}

}  // namespace

std::vector<Row> runSendRecv(const Options& o, Ranks& r) {
  HeapConfig cfg;
  cfg.numRanks = 2;
  cfg.userBytes = o.maxBytes;
  cfg.moverSlotBytes = std::size_t{64} << 10;
  auto heap = SymmetricHeap::create(*r.comm, cfg);
  std::vector<Movers> movers = Movers::createAll(*heap);
  std::vector<char*> src(2), dst(2);
  unsigned long long* wrong[2];
  unsigned salt[2] = {0x1234u, 0xbeefu};
  for (int i = 0; i < 2; ++i) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[i]));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&src[i], std::max<std::size_t>(o.maxBytes, 16)));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&dst[i], std::max<std::size_t>(o.maxBytes, 16)));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&wrong[i], sizeof(unsigned long long)));
    fillKernel<<<1024, 256, 0, r.streams[i]>>>(reinterpret_cast<unsigned char*>(src[i]),
                                                o.maxBytes, salt[i]);
    GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(r.streams[i]));
  }
  std::vector<Row> rows;
  for (std::size_t bytes = o.minBytes; bytes <= o.maxBytes;
       bytes = std::max<std::size_t>(bytes + 1, static_cast<std::size_t>(bytes * o.factor))) {
    progress(("sendrecv " + std::to_string(bytes)).c_str());
    const int channels = o.sms > 0 ? o.sms : movers[0].channelsFor(bytes);
    // NCCL baseline.
    double ncclUs = 0;
    if (r.nccl) {
      auto execs = captureAll(r, [&] {
        GRAPHEP_NCCL_CHECK(ncclGroupStart());
        for (int i = 0; i < 2; ++i) {
          GRAPHEP_NCCL_CHECK(ncclSend(src[i], bytes, ncclChar, 1 - i, r.nccl->ncclComm(i), r.streams[i]));
          GRAPHEP_NCCL_CHECK(ncclRecv(dst[i], bytes, ncclChar, 1 - i, r.nccl->ncclComm(i), r.streams[i]));
        }
        GRAPHEP_NCCL_CHECK(ncclGroupEnd());
      });
      ncclUs = timeIterations(r, o.warmup, o.iters, [&] { launchEach(r, execs); });
      destroyEach(r, execs);
    }
    for (bool zeroCopy : {false, true}) {
      for (int i = 0; i < 2; ++i) {
        GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[i]));
        GRAPHEP_CUDA_CHECK(cudaMemset(zeroCopy ? heap->user(i) : dst[i], 0xa5, bytes));
      }
      auto execs = captureEach(r, [&](int i, cudaStream_t s) {
        SendRecvArgs a;
        a.sendPeer = 1 - i;
        a.src = src[i];
        a.sendBytes = bytes;
        a.recvPeer = 1 - i;
        a.dst = zeroCopy ? heap->user(i) : dst[i];
        a.recvBytes = bytes;
        a.numChannels = channels;
        if (zeroCopy) {
          a.sendToUserOffset = 0;
          a.recvZeroCopy = true;
        }
        movers[static_cast<size_t>(i)].sendRecv(s, a);
      });
      const double us = timeIterations(r, o.warmup, o.iters, [&] { launchEach(r, execs); });
      destroyEach(r, execs);
      std::vector<char*> out{zeroCopy ? heap->user(0) : dst[0], zeroCopy ? heap->user(1) : dst[1]};
      const long long w = o.check ? verify(r, out, bytes, wrong, salt) : 0;
      Row row{"sendrecv", std::string(zeroCopy ? "zero-copy" : "staged") + " ch=" + std::to_string(channels),
              bytes, us, us > 0 ? static_cast<double>(bytes) / (us * 1e3) : 0, w, ncclUs, ""};
      printRow(row);
      rows.push_back(row);
    }
    for (int i = 0; i < 2; ++i) {
      const std::string err = heap->errorMessage(i);
      GRAPHEP_REQUIRE(err.empty(), Status::kRemoteError, "device error: %s", err.c_str());
    }
  }
  for (int i = 0; i < 2; ++i) {
    cudaSetDevice(r.devices[i]);
    cudaFree(src[i]);
    cudaFree(dst[i]);
    cudaFree(wrong[i]);
  }
  return rows;
}

}  // namespace graphep::bench
