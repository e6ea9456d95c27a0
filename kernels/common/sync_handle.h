// Device handle for the synchronisation state of one rank (host+device POD, passed by value).
// All pointers are carved from the symmetric heap (engine/heap_layout.cpp documents the regions);
// peer pointers are nullptr for peers without load/store access.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include <graphep/types.hpp>

#include "kernels/common/device_error.h"

namespace graphep {

struct SyncHandle {
  std::int32_t rank;
  std::int32_t numRanks;
  std::uint32_t numSemChannels;
  std::uint32_t numFlagChannels;
  std::uint32_t numEpochs;
  std::uint32_t trapOnTimeout;
  std::uint64_t timeoutNs;

  // Counting semaphores, [channel][source rank] words: consumer-owned, producers add 1.
  std::uint32_t* semCount;
  // Monotonic totals beside each semaphore word (diagnostics and exact-count checks):
  // semArrived is added to by producers together with semCount; semConsumed by the consumer.
  std::uint32_t* semArrived;
  std::uint32_t* semConsumed;
  // Peers' semCount / semArrived bases (this rank signals into them).
  std::uint32_t* peerSemCount[kMaxRanks];
  std::uint32_t* peerSemArrived[kMaxRanks];

  // Flag inbox, [channel][source rank]: peers store monotonic step values into it.
  std::uint32_t* flagInbox;
  std::uint32_t* peerFlagInbox[kMaxRanks];
  // Local monotonic step counters, [channel][peer]: the step this rank last used with that peer.
  std::uint32_t* flagStep;
  // Local monotonic epochs, one per operation kind: reserved, no kernel advances them yet.
  std::uint32_t* epochs;

  DeviceErrorSink error;  // this rank's error record (host-mapped) and its device words

  __host__ __device__ std::uint32_t semIndex(std::uint32_t channel, std::int32_t src) const {
    return channel * static_cast<std::uint32_t>(numRanks) + static_cast<std::uint32_t>(src);
  }
  __host__ __device__ std::uint32_t flagIndex(std::uint32_t channel, std::int32_t peer) const {
    return channel * static_cast<std::uint32_t>(numRanks) + static_cast<std::uint32_t>(peer);
  }
};

}  // namespace graphep
