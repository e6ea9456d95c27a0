// sendrecv kernel family (see kernels/sendrecv.h), its launcher below.
#include "kernels/sendrecv.h"

#include <type_traits>

#include "kernels/common/launch.h"
#include "kernels/common/pipe.cuh"

namespace graphep {
namespace {

constexpr int kSendBarrier = 1;
constexpr int kRecvBarrier = 2;

template <Wire kWire, Consume kConsume>
__global__ void __launch_bounds__(2 * kMaxWarpsPerRole * 32)
    sendRecvKernel(const __grid_constant__ SendRecvParams p) {
  __shared__ int abortFlag[2];
  const int roleThreads = static_cast<int>(p.warpsPerRole) * 32;
  const int t = static_cast<int>(threadIdx.x);
  const std::uint32_t transferCtas = p.sendShape.numChannels > p.recvShape.numChannels
                                         ? p.sendShape.numChannels
                                         : p.recvShape.numChannels;
  if (blockIdx.x >= transferCtas) {  // the local copy: every thread of the CTA
    std::uint64_t begin, end;
    channelRange(p.localBytes, p.localChannels, blockIdx.x - transferCtas, &begin, &end);
    copyBytes<LoadKind::kDefault>(p.localDst + begin, p.localSrc + begin, end - begin, t,
                                  static_cast<int>(blockDim.x));
    return;
  }
  if (t < roleThreads) {
    if (p.send.peer < 0 || blockIdx.x >= p.sendShape.numChannels) return;
    if (p.send.ce != CePhase::kNone) {
      if (t == 0) pipeSendCe<NvlTransport>(p.sync, p.send);
      return;
    }
    if constexpr (kWire == Wire::kFp8E4m3) {
      pipeSendTiled<NvlTransport, ProduceFp8E4m3, kFp8TileSrcBytes, kFp8TileWireBytes>(
          p.sync, p.sendShape, p.send, blockIdx.x, kSendBarrier, t, roleThreads, &abortFlag[0]);
    } else if (p.send.ll) {
      pipeSendLL<NvlTransport>(p.sync, p.sendShape, p.send, blockIdx.x, kSendBarrier, t,
                               roleThreads, &abortFlag[0]);
    } else {
      pipeSend<NvlTransport>(p.sync, p.sendShape, p.send, blockIdx.x, kSendBarrier, t,
                             roleThreads, &abortFlag[0]);
    }
  } else if (t < 2 * roleThreads) {
    if (p.recv.peer < 0 || blockIdx.x >= p.recvShape.numChannels) return;
    const int tid = t - roleThreads;
    if (p.recv.ce != CePhase::kNone) {
      if (tid == 0) pipeRecvCe<NvlTransport>(p.sync, p.recv);
      return;
    }
    if constexpr (kWire == Wire::kFp8E4m3) {
      using Hook = std::conditional_t<kConsume == Consume::kFp8ToBf16, ConsumeFp8ToBf16, ConsumeWire>;
      pipeRecvTiled<NvlTransport, Hook, Fp8WireRegs, loadFp8Wire, kFp8TileSrcBytes,
                    kFp8TileWireBytes>(p.sync, p.recvShape, p.recv, blockIdx.x, kRecvBarrier, tid,
                                       roleThreads, &abortFlag[1]);
    } else if (p.recv.ll) {
      pipeRecvLL<NvlTransport, kConsume>(p.sync, p.recvShape, p.recv, blockIdx.x, kRecvBarrier,
                                         tid, roleThreads, &abortFlag[1]);
    } else {
      pipeRecv<NvlTransport, kConsume>(p.sync, p.recvShape, p.recv, blockIdx.x, kRecvBarrier, tid,
                                       roleThreads, &abortFlag[1]);
    }
  }
}

using SendRecvKernelFn = void (*)(SendRecvParams);

// Every (wire format, consume hook) pair the family is built for.
constexpr struct {
  Wire wire;
  Consume consume;
  SendRecvKernelFn fn;
} kKernels[] = {
    {Wire::kBytes, Consume::kCopy, sendRecvKernel<Wire::kBytes, Consume::kCopy>},
    {Wire::kBytes, Consume::kAddF32, sendRecvKernel<Wire::kBytes, Consume::kAddF32>},
    {Wire::kBytes, Consume::kAddBf16, sendRecvKernel<Wire::kBytes, Consume::kAddBf16>},
    {Wire::kBytes, Consume::kWeightedAddF32, sendRecvKernel<Wire::kBytes, Consume::kWeightedAddF32>},
    {Wire::kBytes, Consume::kWeightedAddBf16, sendRecvKernel<Wire::kBytes, Consume::kWeightedAddBf16>},
    {Wire::kFp8E4m3, Consume::kCopy, sendRecvKernel<Wire::kFp8E4m3, Consume::kCopy>},
    {Wire::kFp8E4m3, Consume::kFp8ToBf16, sendRecvKernel<Wire::kFp8E4m3, Consume::kFp8ToBf16>},
};

}  // namespace

bool sendRecvSupports(Wire wire, Consume consume) {
  for (const auto& k : kKernels) {
    if (k.wire == wire && k.consume == consume) return true;
  }
  return false;
}

cudaError_t launchSendRecv(const SendRecvParams& p, cudaStream_t stream) {
  for (const PipeShape& s : {p.sendShape, p.recvShape}) {
    GRAPHEP_LAUNCH_REQUIRE(s.numChannels >= 1 && s.numSlots >= 1 && (s.numSlots & (s.numSlots - 1)) == 0 &&
                               s.slotBytes != 0 && s.slotBytes % 16 == 0,
                           "a pipe of %u channels, %u slots of %u bytes (at least 1 channel, a power-of-two slot "
                           "count, slots a nonzero multiple of 16 bytes)", s.numChannels, s.numSlots, s.slotBytes);
  }
  GRAPHEP_LAUNCH_REQUIRE(p.warpsPerRole >= 1 && p.warpsPerRole <= static_cast<std::uint32_t>(kMaxWarpsPerRole),
                         "warpsPerRole %u (1 to %d)", p.warpsPerRole, kMaxWarpsPerRole);
  GRAPHEP_LAUNCH_REQUIRE(p.localBytes == 0 || (p.localChannels != 0 && p.localSrc != nullptr && p.localDst != nullptr),
                         "a local copy of %llu bytes with %u channels and %s buffers", static_cast<unsigned long long>(p.localBytes),
                         p.localChannels, p.localSrc != nullptr && p.localDst != nullptr ? "both" : "missing");
  GRAPHEP_LAUNCH_REQUIRE(p.send.ce == CePhase::kNone || (p.send.direct != nullptr && p.sendShape.numChannels == 1),
                         "a copy-engine send needs a direct destination and 1 channel (has %u)", p.sendShape.numChannels);
  GRAPHEP_LAUNCH_REQUIRE(p.recv.ce == CePhase::kNone || (p.recv.direct && p.recvShape.numChannels == 1),
                         "a copy-engine receive needs a direct source and 1 channel (has %u)", p.recvShape.numChannels);
  GRAPHEP_LAUNCH_REQUIRE(p.wire != Wire::kFp8E4m3 || (!p.send.ll && !p.recv.ll && !p.send.direct && !p.recv.direct &&
                                                      p.sendShape.slotBytes >= kFp8TileWireBytes),
                         "an fp8 wire is staged only, in slots of at least %u bytes (has %u)",
                         static_cast<unsigned>(kFp8TileWireBytes), p.sendShape.slotBytes);
  const unsigned channels = p.sendShape.numChannels > p.recvShape.numChannels
                                ? p.sendShape.numChannels
                                : p.recvShape.numChannels;
  const dim3 grid(channels + p.localChannels), block(2 * p.warpsPerRole * 32);
  for (const auto& k : kKernels) {
    if (k.wire == p.wire && k.consume == p.recv.consume) {
      k.fn<<<grid, block, 0, stream>>>(p);
      return cudaGetLastError();
    }
  }
  return refuseLaunch(__func__, "no kernel for wire %d with consume %d", static_cast<int>(p.wire), static_cast<int>(p.recv.consume));
}

cudaError_t sendRecvCtasPerSm(int threads, int* ctas) {
  int least = 1 << 30;
  for (const auto& k : kKernels) {
    int n = 0;
    const cudaError_t e =
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, reinterpret_cast<const void*>(k.fn), threads, 0);
    if (e != cudaSuccess) return e;
    least = n < least ? n : least;
  }
  *ctas = least;
  return cudaSuccess;
}

cudaError_t preloadSendRecvKernels() {
  cudaFuncAttributes a{};
  for (const auto& k : kKernels) {
    const cudaError_t e = cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(k.fn));
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace graphep
