// sendrecv: move bytes to one peer and from one peer (they may differ: rings compose from it), over
// per-(peer, channel) staging slots with monotonic head/tail flags, or zero-copy straight into the
// peer's symmetric destination. One launch is capturable and replayable forever: the chunk steps
// live in device memory and only grow.
//
//   sender role (warps [0, W)):            receiver role (warps [W, 2W)):
//     wait tail >= s + 1 - slots             wait head >= s + 1
//     copy chunk s -> peer staging slot      copy slot -> dst
//     post head = s + 1 (peer memory)        post tail = s + 1 (peer memory)
//
// Each role synchronises only its own warps with its own named barrier (ids 1 and 2): never a
// CTA-wide barrier, since one role may have no work or finish early.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/sync_handle.h"

namespace graphep {

inline constexpr int kMaxWarpsPerRole = 8;

// What the receiver does with each arriving chunk (the consume hook). Reductions read `addend` at
// the same offset as dst and write dst = chunk + addend, accumulating in fp32.
enum class Consume : std::uint32_t { kCopy = 0, kAddF32 = 1, kAddBf16 = 2 };

// Element size of a consume kind (1 for copies).
__host__ __device__ inline std::uint32_t consumeElemBytes(Consume c) {
  return c == Consume::kAddF32 ? 4u : (c == Consume::kAddBf16 ? 2u : 1u);
}

// Bytes of `bytes` that channel `b` of `numChannels` moves: contiguous, 16-byte-aligned splits.
__host__ __device__ inline void channelRange(std::uint64_t bytes, std::uint32_t numChannels,
                                             std::uint32_t b, std::uint64_t* begin,
                                             std::uint64_t* end) {
  std::uint64_t per = (bytes + numChannels - 1) / numChannels;
  per = (per + 15) & ~std::uint64_t{15};
  const std::uint64_t lo = static_cast<std::uint64_t>(b) * per;
  *begin = lo < bytes ? lo : bytes;
  *end = *begin + per < bytes ? *begin + per : bytes;
}

struct SendRecvParams {
  SyncHandle sync;  // rank, wait bound, error record
  std::uint32_t numChannels;   // CTAs; identical on both ends of each transfer
  std::uint32_t numSlots;      // staging slots per channel (power of two)
  std::uint32_t slotBytes;     // staging slot size (multiple of 16)
  std::uint32_t warpsPerRole;  // 1..kMaxWarpsPerRole

  // Send role; sendPeer < 0 disables it.
  std::int32_t sendPeer;
  const char* src;
  std::uint64_t sendBytes;
  char* sendStaging;            // sendPeer's staging for source = this rank: [channel][slot][slotBytes]
  char* sendDirect;             // zero-copy: the destination in sendPeer's memory, else nullptr
  std::uint32_t* sendHead;      // sendPeer's head flags for this rank: [channel]
  const std::uint32_t* sendTail;   // this rank's tail flags from sendPeer: [channel]
  const std::uint32_t* sendReady;  // this rank's ready flags from sendPeer: [channel]
  std::uint32_t* sendStep;      // this rank's steps toward sendPeer: [channel]

  // Receive role; recvPeer < 0 disables it.
  std::int32_t recvPeer;
  char* dst;
  std::uint64_t recvBytes;
  std::int32_t recvDirect;         // zero-copy: recvPeer writes into dst itself
  Consume consume;                 // copy, or reduce with recvAddend (staged only)
  const char* recvAddend;          // reductions: this rank's operand, same layout as dst
  const char* recvStaging;         // this rank's staging for source = recvPeer
  const std::uint32_t* recvHead;   // this rank's head flags from recvPeer: [channel]
  std::uint32_t* recvTail;         // recvPeer's tail flags for this rank: [channel]
  std::uint32_t* recvReady;        // recvPeer's ready flags for this rank: [channel]
  std::uint32_t* recvStep;         // this rank's steps from recvPeer: [channel]
};

// Launches one CTA of 2 * warpsPerRole warps per channel. The caller (engine/movers.cpp) has
// validated every field; this returns cudaErrorInvalidValue for a configuration it cannot run.
cudaError_t launchSendRecv(const SendRecvParams& p, cudaStream_t stream);

// Loads the kernel on the current device (setup only; see preloadSemaphoreKernels).
cudaError_t preloadSendRecvKernels();

}  // namespace graphep
