// The host-visible device error record (host+device POD). One per rank, in pinned, mapped host
// memory, so the host can read it while a kernel is still stuck. The first error is recorded in
// full (state 0 -> 2, published by a release store); later ones only raise `count`. The record
// takes plain stores only: the atomics that pick the first error and count them act on words in
// device memory (DeviceErrorSink), because a GPU on PCIe without host-native atomics cannot do
// system-scope atomics on host memory (compute-sanitizer memcheck reports them as invalid).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace graphep {

enum class DeviceErrorKind : std::uint32_t {
  kNone = 0,
  kTimeout = 1,             // a bounded spin-wait expired
  kSemaphoreUnderflow = 2,  // a consume found fewer arrivals than it subtracts (protocol bug)
  kOutOfBounds = 3,         // a device-resident count/offset pointed past its buffer: dropped
  kCountMismatch = 4,       // the two ends of a transfer disagree on its byte count: not sent
  kAborted = 5,             // the host watchdog found a stall and lifted the rank's waits
};

// What a wait was waiting for. One code per wait site in the kernels; names in device_error.cpp.
enum class WaitSite : std::uint32_t {
  kNone = 0,
  kFlag = 1,              // generic flag wait (kernels/common/flags.cuh)
  kPingPongPing = 2,      // ping-pong responder waiting for the ping
  kPingPongPong = 3,      // ping-pong initiator waiting for the pong
  kSemaphoreConsume = 4,  // a semaphore consume (underflow check)
  kSemaphoreWait = 5,     // an eager semaphore wait done by a kernel (ranks sharing a GPU)
  kMoverSlotFree = 6,     // sendrecv sender waiting for a free staging slot (tail)
  kMoverData = 7,         // sendrecv receiver waiting for a chunk (head)
  kMoverReady = 8,        // zero-copy sender waiting for the receiver to start (ready)
  kAllToAllvBounds = 9,   // alltoallv count/offset check (expected = capacity, observed = end)
  kZeroCopyExtent = 10,   // zero-copy sender: the receiver's published byte count differs from
                          // the sender's (kCountMismatch: expected = receiver's, observed =
                          // sender's; nothing sent)
  kMoeDispatch = 11,      // MoE dispatch (latency, direct): waiting for a source's records or count message
  kMoeCombine = 12,       // MoE latency combine: waiting for a destination's partials
  kMoeCombineStaged = 13, // MoE direct combine send: waiting for the local reduce's block (peer: the
                          // block's destination)
  kMoeDispatchAck = 14,   // MoE direct dispatch send: waiting for a destination to finish reading this
                          // rank's records of the previous dispatch
  kMoeCombineAck = 15,    // MoE direct combine send: waiting for a source to finish summing this rank's
                          // partials of the previous combine
  kMoeCombineWeights = 16,  // MoE latency combine: waiting for a source's top-k weights (CombineArgs.topkWeights)
  kMoeBarrier = 17,         // MoE device barrier (Engine::barrier): waiting for the peer to reach it
  kMoeNodeReady = 18,       // MoE node-aware dispatch: a landing rank waiting for a rank of its node to be ready for its forwards
  kMoeNodeForwarded = 19,   // MoE node-aware dispatch: waiting for a landing rank of this node to forward the records it received
  kMoeNodeReduced = 20,     // MoE node-aware combine: a landing rank waiting for a rank of its node to reduce its partials
  kMoeNodeSummed = 21,      // MoE node-aware combine: waiting for a landing rank of this node to sum the previous partials
};

struct DeviceErrorRecord {
  std::uint32_t state;  // 0: none (or being written), 2: complete
  std::uint32_t kind;   // DeviceErrorKind
  std::int32_t rank;
  std::int32_t peer;    // -1 when not about a peer
  std::uint32_t site;   // WaitSite
  std::uint32_t expected;
  std::uint32_t observed;
  std::uint32_t count;  // errors seen, the first one included
  std::uint64_t elapsedNs;
  std::uint64_t address;  // device address that was waited on / consumed
};

// Where one rank's kernels report errors.
struct DeviceErrorSink {
  DeviceErrorRecord* record;  // pinned, mapped host memory: the host reads it without a sync
  std::uint32_t* words;       // device memory: [0] claim (the first reporter sets it 0 -> 1),
                              // [1] errors seen (its running value is mirrored into record.count),
                              // [2] stop: set by a timeout or an abort; the rank's other waits
                              // then give up at their next check. Drops (out of bounds, count
                              // mismatch) do not set it: the rank's other transfers go on.
};
inline constexpr int kDeviceErrorWords = 3;

__host__ __device__ inline const char* waitSiteName(std::uint32_t site) {
  switch (static_cast<WaitSite>(site)) {
    case WaitSite::kNone: return "no wait";
    case WaitSite::kFlag: return "flag wait";
    case WaitSite::kPingPongPing: return "ping-pong: responder waiting for ping";
    case WaitSite::kPingPongPong: return "ping-pong: initiator waiting for pong";
    case WaitSite::kSemaphoreConsume: return "semaphore consume";
    case WaitSite::kSemaphoreWait: return "semaphore wait";
    case WaitSite::kMoverSlotFree: return "sendrecv: sender waiting for a free staging slot";
    case WaitSite::kMoverData: return "sendrecv: receiver waiting for data";
    case WaitSite::kMoverReady: return "sendrecv: zero-copy sender waiting for the receiver";
    case WaitSite::kAllToAllvBounds: return "alltoallv: count and offset within the buffer";
    case WaitSite::kZeroCopyExtent: return "zero-copy: receiver's and sender's byte counts agree";
    case WaitSite::kMoeDispatch: return "moe dispatch: waiting for a source's records";
    case WaitSite::kMoeCombine: return "moe combine: waiting for a destination's partials";
    case WaitSite::kMoeCombineStaged: return "moe combine send: waiting for this rank's reduce of a block for the peer";
    case WaitSite::kMoeDispatchAck:
      return "moe dispatch send: waiting for the peer to finish reading this rank's records of the previous dispatch";
    case WaitSite::kMoeCombineAck:
      return "moe combine send: waiting for the peer to finish summing this rank's partials of the previous combine";
    case WaitSite::kMoeCombineWeights: return "moe combine: waiting for a source's top-k weights";
    case WaitSite::kMoeBarrier: return "moe barrier: waiting for the peer to reach the barrier";
    case WaitSite::kMoeNodeReady: return "moe node-aware dispatch: waiting for a rank of this node to be ready for the forwarded records";
    case WaitSite::kMoeNodeForwarded: return "moe node-aware dispatch: waiting for a landing rank of this node to forward its records";
    case WaitSite::kMoeNodeReduced: return "moe node-aware combine: waiting for a rank of this node to reduce its partials";
    case WaitSite::kMoeNodeSummed: return "moe node-aware combine: waiting for a landing rank of this node to sum the last partials";
  }
  return "unknown wait site";
}

}  // namespace graphep
