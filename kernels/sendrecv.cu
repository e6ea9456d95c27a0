// sendrecv kernel family (see kernels/sendrecv.h), its launcher below.
#include "kernels/sendrecv.h"

#include "kernels/common/pipe.cuh"

namespace graphep {
namespace {

constexpr int kSendBarrier = 1;
constexpr int kRecvBarrier = 2;

template <Consume kConsume>
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
    if (p.send.ll) {
      pipeSendLL<NvlTransport>(p.sync, p.sendShape, p.send, blockIdx.x, kSendBarrier, t,
                               roleThreads, &abortFlag[0]);
    } else {
      pipeSend<NvlTransport>(p.sync, p.sendShape, p.send, blockIdx.x, kSendBarrier, t,
                             roleThreads, &abortFlag[0]);
    }
  } else if (t < 2 * roleThreads) {
    if (p.recv.peer < 0 || blockIdx.x >= p.recvShape.numChannels) return;
    if (p.recv.ll) {
      pipeRecvLL<NvlTransport, kConsume>(p.sync, p.recvShape, p.recv, blockIdx.x, kRecvBarrier,
                                         t - roleThreads, roleThreads, &abortFlag[1]);
    } else {
      pipeRecv<NvlTransport, kConsume>(p.sync, p.recvShape, p.recv, blockIdx.x, kRecvBarrier,
                                       t - roleThreads, roleThreads, &abortFlag[1]);
    }
  }
}

}  // namespace

cudaError_t launchSendRecv(const SendRecvParams& p, cudaStream_t stream) {
  for (const PipeShape& s : {p.sendShape, p.recvShape}) {
    if (s.numChannels < 1 || s.numSlots < 1 || (s.numSlots & (s.numSlots - 1)) != 0 ||
        s.slotBytes == 0 || s.slotBytes % 16 != 0) {
      return cudaErrorInvalidValue;
    }
  }
  if (p.warpsPerRole < 1 || p.warpsPerRole > kMaxWarpsPerRole) return cudaErrorInvalidValue;
  const unsigned channels = p.sendShape.numChannels > p.recvShape.numChannels
                                ? p.sendShape.numChannels
                                : p.recvShape.numChannels;
  if (p.localBytes > 0 && (p.localChannels == 0 || p.localSrc == nullptr || p.localDst == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(channels + p.localChannels), block(2 * p.warpsPerRole * 32);
  switch (p.recv.consume) {
    case Consume::kCopy:
      sendRecvKernel<Consume::kCopy><<<grid, block, 0, stream>>>(p);
      break;
    case Consume::kAddF32:
      sendRecvKernel<Consume::kAddF32><<<grid, block, 0, stream>>>(p);
      break;
    case Consume::kAddBf16:
      sendRecvKernel<Consume::kAddBf16><<<grid, block, 0, stream>>>(p);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t preloadSendRecvKernels() {
  cudaFuncAttributes a{};
  for (const void* fn : {reinterpret_cast<const void*>(sendRecvKernel<Consume::kCopy>),
                         reinterpret_cast<const void*>(sendRecvKernel<Consume::kAddF32>),
                         reinterpret_cast<const void*>(sendRecvKernel<Consume::kAddBf16>)}) {
    const cudaError_t e = cudaFuncGetAttributes(&a, fn);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace graphep
