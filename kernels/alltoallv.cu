// alltoallv kernel family (see kernels/alltoallv.h), its launcher below.
#include "kernels/alltoallv.h"

#include "kernels/common/launch.h"
#include "kernels/common/pipe.cuh"

namespace graphep {
namespace {

constexpr int kSendBarrier = 1;
constexpr int kRecvBarrier = 2;

// Channels a transfer of `bytes` uses out of `avail`.
__device__ __forceinline__ std::uint32_t activeChannels(std::uint64_t bytes, std::uint64_t minBytes,
                                                        std::uint32_t avail) {
  const std::uint64_t want = (bytes + minBytes - 1) / minBytes;
  return static_cast<std::uint32_t>(want < 1 ? 1 : (want > avail ? avail : want));
}

// A count that does not fit its buffer is dropped (treated as 0) and reported once per rank.
__device__ std::uint64_t checkedCount(const AllToAllvParams& p, std::uint64_t offset,
                                      std::uint64_t count, std::uint64_t capacity,
                                      std::int32_t peer, bool report) {
  if (offset <= capacity && count <= capacity - offset) return count;
  if (report) {
    reportDeviceError(p.sync.error, DeviceErrorKind::kOutOfBounds, p.sync.rank, peer,
                      WaitSite::kAllToAllvBounds,
                      static_cast<std::uint32_t>(capacity > 0xffffffffull ? 0xffffffffull : capacity),
                      static_cast<std::uint32_t>((offset + count) > 0xffffffffull ? 0xffffffffull
                                                                                   : offset + count),
                      0, nullptr);
  }
  return 0;
}

// An offset that is not its peer's fixed slot (AllToAllvArgs::fixedSlots), reported as a bounds
// error: expected the slot's offset, observed the table's.
__device__ void reportSlot(const AllToAllvParams& p, std::int32_t peer, std::uint64_t slot, std::uint64_t offset) {
  auto clamp = [](std::uint64_t v) { return static_cast<std::uint32_t>(v > 0xffffffffull ? 0xffffffffull : v); };
  reportDeviceError(p.sync.error, DeviceErrorKind::kOutOfBounds, p.sync.rank, peer, WaitSite::kAllToAllvBounds,
                    clamp(slot), clamp(offset), 0, nullptr);
}

__global__ void __launch_bounds__(2 * kMaxWarpsPerRole * 32)
    allToAllvKernel(const __grid_constant__ AllToAllvParams p) {
  __shared__ int abortFlag[2];
  const int R = p.sync.numRanks;
  int peer = 0;
  while (peer + 1 <= R && blockIdx.x >= p.firstChannel[peer + 1]) ++peer;
  if (peer >= R) return;
  const std::uint32_t avail = p.firstChannel[peer + 1] - p.firstChannel[peer];
  const std::uint32_t c = blockIdx.x - p.firstChannel[peer];
  const int roleThreads = static_cast<int>(p.warpsPerRole) * 32;
  const int t = static_cast<int>(threadIdx.x);
  const bool sender = t < roleThreads;
  const int tid = sender ? t : t - roleThreads;
  if (t >= 2 * roleThreads) return;

  if (peer == p.sync.rank) {
    // Own block: a local copy by the sender role's warps, split over this peer's channels.
    if (!sender) return;
    const std::uint64_t off = p.sendOffsets[peer];
    const std::uint64_t dOff = p.recvOffsets[peer];
    std::uint64_t bytes = checkedCount(p, off, p.sendCounts[peer], p.srcBytes, peer, c == 0 && tid == 0);
    bytes = checkedCount(p, dOff, bytes, p.dstBytes, peer, c == 0 && tid == 0);
    const std::uint32_t n = activeChannels(bytes, p.minBytesPerChannel, avail);
    if (c >= n) return;
    std::uint64_t begin, end;
    channelRange(bytes, n, c, &begin, &end);
    copyBytes<LoadKind::kDefault>(p.dst + dOff + begin, p.src + off + begin, end - begin, tid,
                                  roleThreads);
    return;
  }

  if (p.remoteMask & (1u << peer)) {
    if (p.remoteInPlace) {  // NCCL moved the slot in place: check that the tables describe slots
      if (sender || c != 0 || tid != 0) return;
      const std::uint64_t slot = p.remoteStride * static_cast<std::uint64_t>(peer);
      checkedCount(p, 0, p.sendCounts[peer], p.remoteCap, peer, true);
      checkedCount(p, 0, p.recvCounts[peer], p.remoteCap, peer, true);
      if (p.sendOffsets[peer] != slot) reportSlot(p, peer, slot, p.sendOffsets[peer]);
      if (p.recvOffsets[peer] != slot) reportSlot(p, peer, slot, p.recvOffsets[peer]);
      return;
    }
    // Remote peer: its bytes arrived in the receive stage (NCCL ran before this kernel on the
    // stream); the receiver role's warps unpack them.
    if (sender) return;
    const std::uint64_t off = p.recvOffsets[peer];
    std::uint64_t bytes = checkedCount(p, 0, p.recvCounts[peer], p.remoteCap, peer, c == 0 && tid == 0);
    bytes = checkedCount(p, off, bytes, p.dstBytes, peer, c == 0 && tid == 0);
    const std::uint32_t n = activeChannels(bytes, p.minBytesPerChannel, avail);
    if (c >= n) return;
    std::uint64_t begin, end;
    channelRange(bytes, n, c, &begin, &end);
    copyBytes<LoadKind::kDefault>(p.dst + off + begin, p.remoteRecv + p.remoteCap * peer + begin,
                                  end - begin, tid, roleThreads);
    return;
  }

  PipeShape shape{0, p.numSlots, p.slotBytes};
  if (sender) {
    if (p.send[peer].peer < 0) return;
    SendLink l = p.send[peer];
    const std::uint64_t off = p.sendOffsets[peer];
    l.bytes = checkedCount(p, off, p.sendCounts[peer], p.srcBytes, peer, c == 0 && tid == 0);
    l.src = p.src + off;
    const bool zeroCopy = l.direct != nullptr && l.bytes >= p.zeroCopyMinBytes;
    if (!zeroCopy) {  // staged: a small segment (the receiver decides alike)
      l.direct = nullptr;
      l.mailbox = nullptr;
    }
    shape.numChannels = activeChannels(l.bytes, p.minBytesPerChannel,
                                       zeroCopy && avail > kZeroCopyMaxChannels ? kZeroCopyMaxChannels : avail);
    if (c >= shape.numChannels) return;
    pipeSend<NvlTransport>(p.sync, shape, l, c, kSendBarrier, tid, roleThreads, &abortFlag[0]);
  } else {
    if (p.recv[peer].peer < 0) return;
    RecvLink l = p.recv[peer];
    const std::uint64_t off = p.recvOffsets[peer];
    l.bytes = checkedCount(p, off, p.recvCounts[peer], p.dstBytes, peer, c == 0 && tid == 0);
    l.dst = p.dst + off;
    l.mailboxBase = p.dstUserOffset + off;
    const bool zeroCopy = l.direct != 0 && l.bytes >= p.zeroCopyMinBytes;
    if (!zeroCopy) {
      l.direct = 0;
      l.mailbox = nullptr;
    }
    shape.numChannels = activeChannels(l.bytes, p.minBytesPerChannel,
                                       zeroCopy && avail > kZeroCopyMaxChannels ? kZeroCopyMaxChannels : avail);
    if (c >= shape.numChannels) return;
    pipeRecv<NvlTransport, Consume::kCopy>(p.sync, shape, l, c, kRecvBarrier, tid, roleThreads,
                                           &abortFlag[1]);
  }
}

// One CTA per (remote peer, channel), the channels of firstChannel: copy the peer's segment into
// its stage. Nothing waits: the copies run at the copy's speed on as many CTAs as the peer has.
__global__ void __launch_bounds__(256) allToAllvGatherKernel(const __grid_constant__ AllToAllvParams p) {
  const int R = p.sync.numRanks;
  int peer = 0;
  while (peer + 1 <= R && blockIdx.x >= p.firstChannel[peer + 1]) ++peer;
  if (peer >= R || (p.remoteMask & (1u << peer)) == 0) return;
  const std::uint32_t avail = p.firstChannel[peer + 1] - p.firstChannel[peer];
  const std::uint32_t c = blockIdx.x - p.firstChannel[peer];
  const std::uint64_t off = p.sendOffsets[peer];
  const bool report = c == 0 && threadIdx.x == 0;
  std::uint64_t bytes = checkedCount(p, off, p.sendCounts[peer], p.srcBytes, peer, report);
  bytes = checkedCount(p, 0, bytes, p.remoteCap, peer, report);
  const std::uint32_t n = activeChannels(bytes, p.minBytesPerChannel, avail);
  if (c >= n) return;
  std::uint64_t begin, end;
  channelRange(bytes, n, c, &begin, &end);
  copyBytes<LoadKind::kDefault>(p.remoteSend + p.remoteCap * peer + begin, p.src + off + begin,
                                end - begin, static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x));
}

// The emulated network's meter and pace (GRAPHEP_EMULATED_NODES, engine/node_map.hpp), queued
// before the exchange: a thread per peer adds the bytes this call sends it to bytes[peer] where the
// peer is in networkMask (on another node); a count past src is dropped by the exchange (and
// reported there): it adds nothing. With a rate (GRAPHEP_EMULATED_NETWORK_MBPS; 0: none) the
// kernel then holds the exchange until the call's network bytes would have left at that rate
// (bytes x 1000 / MBps ns), so that no peer on another node sees them sooner.
__global__ void __launch_bounds__(kMaxRanks) allToAllvNetworkBytesKernel(const __grid_constant__ AllToAllvParams p,
                                                                         std::uint32_t networkMask,
                                                                         unsigned long long* bytes,
                                                                         std::uint32_t mbps) {
  __shared__ unsigned long long callBytes;
  const std::uint64_t start = ptx::globalTimerNs();
  const int q = static_cast<int>(threadIdx.x);
  if (q == 0) callBytes = 0;
  __syncthreads();
  if (q < p.sync.numRanks && (networkMask & (1u << q)) != 0) {
    const std::uint64_t off = p.sendOffsets[q], n = p.sendCounts[q];
    if (off <= p.srcBytes && n <= p.srcBytes - off) {
      atomicAdd(bytes + q, static_cast<unsigned long long>(n));
      atomicAdd_block(&callBytes, static_cast<unsigned long long>(n));
    }
  }
  __syncthreads();
  if (mbps == 0 || q != 0) return;
  const std::uint64_t due = start + callBytes * 1000ull / mbps;
  while (ptx::globalTimerNs() < due) __nanosleep(256);
}

}  // namespace

cudaError_t launchAllToAllvNetworkBytes(const AllToAllvParams& p, std::uint32_t networkMask, unsigned long long* bytes,
                                        std::uint32_t mbps, cudaStream_t stream) {
  GRAPHEP_LAUNCH_REQUIRE(bytes != nullptr, "no network byte counters for peers 0x%x", networkMask);
  allToAllvNetworkBytesKernel<<<1, kMaxRanks, 0, stream>>>(p, networkMask, bytes, mbps);
  return cudaGetLastError();
}

cudaError_t launchAllToAllvGather(const AllToAllvParams& p, cudaStream_t stream) {
  if (p.remoteMask == 0) return cudaSuccess;
  GRAPHEP_LAUNCH_REQUIRE(p.remoteSend != nullptr && p.remoteCap != 0,
                         "remote peers (mask 0x%llx) with no staging (%llu bytes per peer)",
                         static_cast<unsigned long long>(p.remoteMask), static_cast<unsigned long long>(p.remoteCap));
  allToAllvGatherKernel<<<p.firstChannel[p.sync.numRanks], 256, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launchAllToAllv(const AllToAllvParams& p, cudaStream_t stream) {
  const unsigned blocks = p.firstChannel[p.sync.numRanks];
  GRAPHEP_LAUNCH_REQUIRE(p.warpsPerRole >= 1 && p.warpsPerRole <= static_cast<unsigned>(kMaxWarpsPerRole),
                         "warpsPerRole %u (1 to %d)", p.warpsPerRole, kMaxWarpsPerRole);
  GRAPHEP_LAUNCH_REQUIRE(blocks != 0 && p.minBytesPerChannel != 0, "%u channels, minBytesPerChannel %llu (both nonzero)",
                         blocks, static_cast<unsigned long long>(p.minBytesPerChannel));
  GRAPHEP_LAUNCH_REQUIRE(p.numSlots >= 1 && (p.numSlots & (p.numSlots - 1)) == 0 && p.slotBytes != 0 && p.slotBytes % 16 == 0,
                         "%u slots of %u bytes (a power-of-two count, slots a nonzero multiple of 16 bytes)",
                         p.numSlots, p.slotBytes);
  allToAllvKernel<<<blocks, 2 * p.warpsPerRole * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t allToAllvCtasPerSm(int threads, int* ctas) {
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas, allToAllvKernel, threads, 0);
}

cudaError_t preloadAllToAllvKernels() {
  return preloadKernels(allToAllvKernel, allToAllvGatherKernel, allToAllvNetworkBytesKernel);
}

}  // namespace graphep
