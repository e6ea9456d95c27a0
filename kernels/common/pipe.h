// Plain (host + device) types of the pipelined point-to-point protocol; the device roles that use
// them are in kernels/common/pipe.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace graphep {

// Warps per role (sender, receiver) in one mover CTA, at most: CTAs have 2 * this many warps.
inline constexpr int kMaxWarpsPerRole = 8;

// The wire format of a transfer (what the sender's produce hook writes; kernels/common/hooks.cuh).
enum class Wire : std::uint32_t {
  kBytes = 0,    // the source bytes as they are (the copy produce hook)
  kFp8E4m3 = 1,  // bf16 source quantised to e4m3 with one fp32 scale per 128 values
};

// kFp8E4m3: a tile is 128 bf16 values (256 source bytes) and travels as one 144-byte record:
// 128 e4m3 bytes, the fp32 scale, 12 zero bytes (16-byte aligned records).
inline constexpr std::uint64_t kFp8TileValues = 128;
inline constexpr std::uint64_t kFp8TileSrcBytes = 256;
inline constexpr std::uint64_t kFp8TileWireBytes = 144;

// What the receiver does with each arriving chunk (the consume hook).
//   kBytes wire:    kCopy, kAddF32 / kAddBf16 (dst = received + addend),
//                   kWeightedAddF32 / kWeightedAddBf16 (dst = addend + weights[row] * received,
//                   row = byte offset / rowBytes; one fp32 fma, rounded once)
//   kFp8E4m3 wire:  kCopy (dst gets the 144-byte records), kFp8ToBf16 (dst gets bf16 values)
enum class Consume : std::uint32_t {
  kCopy = 0,
  kAddF32 = 1,
  kAddBf16 = 2,
  kWeightedAddF32 = 3,
  kWeightedAddBf16 = 4,
  kFp8ToBf16 = 5,
};

// Element size of a byte-format reduction (byte counts must be multiples of it); 1 for copies.
__host__ __device__ inline std::uint32_t consumeElemBytes(Consume c) {
  switch (c) {
    case Consume::kAddF32:
    case Consume::kWeightedAddF32:
      return 4u;
    case Consume::kAddBf16:
    case Consume::kWeightedAddBf16:
      return 2u;
    default:
      return 1u;
  }
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

// The protocol's arithmetic, shared by the device roles (pipe.cuh) and the host model test.
// Chunks a range of `bytes` takes in staged mode.
__host__ __device__ inline std::uint32_t pipeChunks(std::uint64_t bytes, std::uint32_t slotBytes) {
  return static_cast<std::uint32_t>((bytes + slotBytes - 1) / slotBytes);
}
// Steps a zero-copy launch takes: at least one, so every launch has its own ready value.
__host__ __device__ inline std::uint32_t zeroCopySteps(std::uint64_t bytes, std::uint32_t slotBytes) {
  const std::uint32_t n = pipeChunks(bytes, slotBytes);
  return n > 0 ? n : 1u;
}
// Tail value the sender needs before writing chunk s: slot s % numSlots was consumed.
__host__ __device__ inline std::uint32_t slotFreeTarget(std::uint32_t s, std::uint32_t numSlots) {
  return s + 1u - numSlots;
}
// Slot of chunk s (numSlots is a power of two, so this survives the 32-bit wrap).
__host__ __device__ inline std::uint32_t slotOf(std::uint32_t s, std::uint32_t numSlots) {
  return s & (numSlots - 1u);
}
// Ready value a zero-copy receiver posts at the start of a launch whose first step is step0.
__host__ __device__ inline std::uint32_t readyValue(std::uint32_t step0) { return step0 + 1u; }

// LL (low-latency) mode for small transfers: one step per launch and channel, data written as
// 16-byte lines {data, flag, data, flag} into one of the channel's two halves (slotOf(step, 2)) of
// the receiver's LL region;
// the flag says which step wrote the line, so no head flag and no fence are needed. Flag values
// are never 0 (the region starts zeroed): step + 1, with 0 remapped to 1 (1 cannot occur
// otherwise in that half, whose steps all have the same parity).
__host__ __device__ inline std::uint32_t llFlag(std::uint32_t step) {
  const std::uint32_t f = step + 1u;
  return f == 0u ? 1u : f;
}
// LL lines (8 data bytes each) for `bytes`, and the bytes of one LL half for a data capacity.
__host__ __device__ inline std::uint64_t llLines(std::uint64_t bytes) { return (bytes + 7) / 8; }
__host__ __device__ inline std::uint64_t llHalfBytes(std::uint64_t capacity) {
  return llLines(capacity) * 16;
}

// Channels an LL transfer of `bytes` takes when each channel carries at most llBytes: both ends
// derive it from the byte count alone.
__host__ __device__ inline std::uint32_t llChannels(std::uint64_t bytes, std::uint64_t llBytes) {
  const std::uint64_t n = (bytes + llBytes - 1) / llBytes;
  return n > 0 ? static_cast<std::uint32_t>(n) : 1u;
}

// Bytes per channel an automatic LL transfer aims for (more channels poll fewer lines each);
// the per-channel capacity (HeapConfig.moverLLBytes) bounds it from below. 2 KiB: 4 KiB in 4.36
// us on 2 channels against 4.52 on one and 4.64 on four (docs/PERFORMANCE.md).
inline constexpr std::uint64_t kLLBytesPerChannel = 2048;

// Channels of an LL transfer of `bytes`, or 0 when it does not go as LL: each channel carries at
// most llBytes (its LL halves' capacity) and there are `blocks` channels. numChannels > 0 is the
// caller's count (LL when every channel's range fits); 0 chooses about kLLBytesPerChannel per
// channel. Both ends derive the same answer from the same arguments.
__host__ __device__ inline std::uint32_t llChannelsFor(std::uint64_t bytes, std::uint32_t numChannels,
                                                       std::uint64_t llBytes, std::uint32_t blocks) {
  if (llBytes == 0) return 0;
  if (numChannels > 0) {
    std::uint64_t begin, end;
    channelRange(bytes, numChannels, 0, &begin, &end);  // channel 0's range is the longest
    return end - begin <= llBytes ? numChannels : 0;
  }
  const std::uint32_t need = llChannels(bytes, llBytes);  // what the capacity requires
  if (need > blocks) return 0;
  const std::uint32_t want = llChannels(bytes, kLLBytesPerChannel);
  const std::uint32_t capped = want < blocks ? want : blocks;
  return capped > need ? capped : need;
}

// Bytes per channel the movers aim for when they choose a channel count (sendrecv's channelsFor,
// alltoallv's run-time masking): enough CTAs that mid-size transfers are not latency-bound.
inline constexpr std::uint64_t kBytesPerChannel = std::uint64_t{16} << 10;

// Automatic channel caps below the heap's channel count (HeapConfig.moverBlocks, 32): SM zero-copy
// and LL transfers measured no faster on more than 16 CTAs (zero-copy 4 MiB: 24.8 us on 16, 26.5
// on 32), while staged transfers gain (4 MiB: 28.1 -> 22.8 us).
inline constexpr std::uint32_t kZeroCopyMaxChannels = 16;
inline constexpr std::uint32_t kLLMaxChannels = 16;
// Ranks sharing one GPU (emulated ranks) share its SMs, and every rank's waiting CTAs must be
// resident at once (a mover CTA of 512 threads fills an SM): few channels each.
inline constexpr std::uint32_t kSameDeviceMaxChannels = 4;

// Channels of a transfer of `bytes` when the caller leaves the choice (one per kBytesPerChannel,
// at least one, at most `cap`): both ends derive it from the byte count alone.
__host__ __device__ inline std::uint32_t autoChannels(std::uint64_t bytes, std::uint32_t cap) {
  const std::uint64_t want = (bytes + kBytesPerChannel - 1) / kBytesPerChannel;
  return want < 1 ? 1u : (want > cap ? cap : static_cast<std::uint32_t>(want));
}

// Optional phase profile of staged transfers (MoverOptions.profile): thread 0 of each role adds,
// once per launch, the nanoseconds it spent per phase and the chunks it moved. Words:
// [0] wait (the peer's flag and the role barrier), [1] copy (its share and the role barrier),
// [2] publish (fence and flag store), [3] chunks; the sender's in ProfileCounters.send, the
// receiver's in .recv.
struct ProfileCounters {
  unsigned long long send[4];
  unsigned long long recv[4];
};

struct PipeShape {
  std::uint32_t numChannels;  // channels the link's bytes are split over
  std::uint32_t numSlots;     // staging slots per channel (power of two)
  std::uint32_t slotBytes;    // staging slot size (multiple of 16)
};

// One direction of one link as the sender sees it (pointers already offset to this link).
// Copy-engine zero-copy (CePhase): the bytes of a zero-copy transfer move in a memcpy between two
// launches of the kernel, which run the protocol's flags around it on channel 0 as one step:
//   kBefore  sender waits ready >= s0 + 1; receiver posts ready = s0 + 1
//   kAfter   (after the copy, in stream order) sender posts head = s0 + 1; receiver waits for it
//            and posts tail = s0 + 1; both advance their step to s0 + 1
enum class CePhase : std::int32_t { kNone = 0, kBefore = 1, kAfter = 2 };

struct SendLink {
  std::int32_t peer;
  std::int32_t ll;           // LL mode (small transfer): write lines into llRegion
  CePhase ce;                // copy-engine zero-copy: this launch's phase (direct is set)
  const char* src;
  std::uint64_t bytes;
  char* staging;             // peer's slots for this rank: [channel][slot][slotBytes]
  char* direct;              // zero-copy destination in the peer's memory, or nullptr
  // Zero-copy to a receiver that publishes where its bytes land (alltoallv): [channel] {offset
  // from direct, bytes} in local memory, written by the receiver before its ready flag; nullptr:
  // direct + the channel's range is the destination.
  const std::uint64_t* mailbox;
  std::uint32_t* head;       // peer's head flags for this rank: [channel]
  const std::uint32_t* tail;   // local tail flags from the peer: [channel]
  const std::uint32_t* ready;  // local ready flags from the peer: [channel]
  std::uint32_t* step;       // local steps toward the peer: [channel]
  char* llRegion;            // peer's LL region for this rank: [channel][2 halves][llHalf]
  std::uint64_t llHalf;
  unsigned long long* profile;  // ProfileCounters::send of this rank, or nullptr
};

struct RecvLink {
  std::int32_t peer;
  std::int32_t ll;           // LL mode: poll lines in llRegion
  CePhase ce;                // copy-engine zero-copy: this launch's phase (direct is set)
  char* dst;
  std::uint64_t bytes;
  std::int32_t direct;       // zero-copy: the peer writes into dst itself
  std::uint64_t* mailbox;    // zero-copy: the peer's mailbox for this rank ([channel][2]), or nullptr
  std::uint64_t mailboxBase; // offset of dst from the sender's direct base (with mailbox)
  Consume consume;
  const char* addend;        // reductions: this rank's operand, same layout as dst
  const float* weights;      // weighted reductions: one weight per row of rowBytes bytes
  std::uint64_t rowBytes;
  std::uint64_t rowBase;     // byte offset of dst within those rows (0 for a whole link)
  const char* staging;       // local slots from the peer: [channel][slot][slotBytes]
  const std::uint32_t* head; // local head flags from the peer: [channel]
  std::uint32_t* tail;       // peer's tail flags for this rank: [channel]
  std::uint32_t* ready;      // peer's ready flags for this rank: [channel]
  std::uint32_t* step;       // local steps from the peer: [channel]
  const char* llRegion;      // local LL region for the peer: [channel][2 halves][llHalf]
  std::uint64_t llHalf;
  unsigned long long* profile;  // ProfileCounters::recv of this rank, or nullptr
};

}  // namespace graphep
