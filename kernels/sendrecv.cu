// sendrecv kernel family (see kernels/sendrecv.h), its launcher below.
#include "kernels/sendrecv.h"

#include "kernels/common/copy.cuh"
#include "kernels/common/flags.cuh"

namespace graphep {
namespace {

__device__ __forceinline__ void roleBarrier(int id, int nthreads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(nthreads) : "memory");
}

constexpr int kSendBarrier = 1;
constexpr int kRecvBarrier = 2;

__device__ std::uint32_t numChunks(std::uint64_t bytes, std::uint32_t slotBytes) {
  return static_cast<std::uint32_t>((bytes + slotBytes - 1) / slotBytes);
}

// Zero-copy launches take at least one step even when empty, so each launch has its own ready
// value (see sendRole).
__device__ std::uint32_t zeroCopySteps(std::uint64_t bytes, std::uint32_t slotBytes) {
  const std::uint32_t n = numChunks(bytes, slotBytes);
  return n > 0 ? n : 1u;
}

__device__ void sendRole(const SendRecvParams& p, std::uint32_t c, int tid, int nthreads,
                         int* abortFlag) {
  std::uint64_t begin, end;
  channelRange(p.sendBytes, p.numChannels, c, &begin, &end);
  const std::uint32_t step0 = p.sendStep[c];
  if (p.sendDirect != nullptr) {
    // Zero-copy: every launch advances the steps by at least one, so "ready >= step0 + 1" is
    // posted by this launch's receiver and by nothing earlier (not even the initial value): the
    // destination is written only after the receiver's stream finished with it.
    const std::uint32_t n = zeroCopySteps(end - begin, p.slotBytes);
    if (tid == 0) {
      *abortFlag =
          flagWait(p.sync, p.sendReady + c, step0 + 1u, p.sendPeer, WaitSite::kMoverReady) ? 0 : 1;
    }
    roleBarrier(kSendBarrier, nthreads);
    if (*abortFlag) return;
    copyBytes<LoadKind::kDefault>(p.sendDirect + begin, p.src + begin, end - begin, tid, nthreads);
    roleBarrier(kSendBarrier, nthreads);
    if (tid == 0) {
      flagPost(p.sendHead + c, step0 + n);
      p.sendStep[c] = step0 + n;
    }
    return;
  }
  const std::uint32_t n = numChunks(end - begin, p.slotBytes);
  char* slots = p.sendStaging + static_cast<std::uint64_t>(c) * p.numSlots * p.slotBytes;
  for (std::uint32_t k = 0; k < n; ++k) {
    const std::uint32_t s = step0 + k;
    if (tid == 0) {
      // Slot s % numSlots is free once the receiver consumed chunk s - numSlots.
      *abortFlag = flagWait(p.sync, p.sendTail + c, s + 1u - p.numSlots, p.sendPeer,
                            WaitSite::kMoverSlotFree)
                       ? 0
                       : 1;
    }
    roleBarrier(kSendBarrier, nthreads);
    if (*abortFlag) return;
    const std::uint64_t off = begin + static_cast<std::uint64_t>(k) * p.slotBytes;
    const std::uint64_t len = end - off < p.slotBytes ? end - off : p.slotBytes;
    copyBytes<LoadKind::kDefault>(slots + static_cast<std::uint64_t>(s & (p.numSlots - 1)) * p.slotBytes,
                                  p.src + off, len, tid, nthreads);
    // Every thread's stores precede the barrier; thread 0's fence + release publish them.
    roleBarrier(kSendBarrier, nthreads);
    if (tid == 0) flagPost(p.sendHead + c, s + 1u);
  }
  if (tid == 0) p.sendStep[c] = step0 + n;
}

// The consume hook: what the receiver does with one chunk (slot -> dst at `off`).
template <Consume kConsume>
__device__ __forceinline__ void consumeChunk(const SendRecvParams& p, const char* slot,
                                             std::uint64_t off, std::uint64_t len, int tid,
                                             int nthreads) {
  if constexpr (kConsume == Consume::kCopy) {
    copyBytes<LoadKind::kCacheGlobal>(p.dst + off, slot, len, tid, nthreads);
  } else if constexpr (kConsume == Consume::kAddF32) {
    addElems<float>(p.dst + off, slot, p.recvAddend + off, len, tid, nthreads);
  } else {
    addElems<__nv_bfloat16>(p.dst + off, slot, p.recvAddend + off, len, tid, nthreads);
  }
}

template <Consume kConsume>
__device__ void recvRole(const SendRecvParams& p, std::uint32_t c, int tid, int nthreads,
                         int* abortFlag) {
  std::uint64_t begin, end;
  channelRange(p.recvBytes, p.numChannels, c, &begin, &end);
  const std::uint32_t step0 = p.recvStep[c];
  if (p.recvDirect) {
    const std::uint32_t n = zeroCopySteps(end - begin, p.slotBytes);
    if (tid == 0) {
      // Everything this stream ran before is done with dst: the sender may overwrite it.
      flagPost(p.recvReady + c, step0 + 1u);
      const bool ok = flagWait(p.sync, p.recvHead + c, step0 + n, p.recvPeer, WaitSite::kMoverData);
      // No slot was used: keep the tail in step for later staged launches on this channel.
      if (ok) flagPost(p.recvTail + c, step0 + n);
      p.recvStep[c] = step0 + n;
    }
    return;
  }
  const std::uint32_t n = numChunks(end - begin, p.slotBytes);
  const char* slots = p.recvStaging + static_cast<std::uint64_t>(c) * p.numSlots * p.slotBytes;
  for (std::uint32_t k = 0; k < n; ++k) {
    const std::uint32_t s = step0 + k;
    if (tid == 0) {
      *abortFlag =
          flagWait(p.sync, p.recvHead + c, s + 1u, p.recvPeer, WaitSite::kMoverData) ? 0 : 1;
    }
    roleBarrier(kRecvBarrier, nthreads);
    if (*abortFlag) return;
    const std::uint64_t off = begin + static_cast<std::uint64_t>(k) * p.slotBytes;
    const std::uint64_t len = end - off < p.slotBytes ? end - off : p.slotBytes;
    consumeChunk<kConsume>(p, slots + static_cast<std::uint64_t>(s & (p.numSlots - 1)) * p.slotBytes,
                           off, len, tid, nthreads);
    // All reads of the slot precede the barrier; the fence in flagPost orders them before the
    // release that hands the slot back to the sender.
    roleBarrier(kRecvBarrier, nthreads);
    if (tid == 0) flagPost(p.recvTail + c, s + 1u);
  }
  if (tid == 0) p.recvStep[c] = step0 + n;
}

template <Consume kConsume>
__global__ void __launch_bounds__(2 * kMaxWarpsPerRole * 32)
    sendRecvKernel(const __grid_constant__ SendRecvParams p) {
  __shared__ int abortFlag[2];
  const int roleThreads = static_cast<int>(p.warpsPerRole) * 32;
  const int t = static_cast<int>(threadIdx.x);
  if (t < roleThreads) {
    if (p.sendPeer >= 0) sendRole(p, blockIdx.x, t, roleThreads, &abortFlag[0]);
  } else if (t < 2 * roleThreads) {
    if (p.recvPeer >= 0) {
      recvRole<kConsume>(p, blockIdx.x, t - roleThreads, roleThreads, &abortFlag[1]);
    }
  }
}

}  // namespace

cudaError_t launchSendRecv(const SendRecvParams& p, cudaStream_t stream) {
  if (p.warpsPerRole < 1 || p.warpsPerRole > kMaxWarpsPerRole || p.numChannels < 1 ||
      p.numSlots < 1 || (p.numSlots & (p.numSlots - 1)) != 0 || p.slotBytes == 0 ||
      p.slotBytes % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(p.numChannels), block(2 * p.warpsPerRole * 32);
  switch (p.consume) {
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
