// Counting semaphores between kernels (docs/DESIGN.md §3), device half.
//
//   producer kernel:  ... payload ... -> semaphoreSignal(): release-add 1 on the consumer's word
//   consumer stream:  cuStreamWaitValue32(word, k, GEQ)          (engine/semaphore.cpp)
//   consumer kernel:  semaphoreConsume(k): atomic subtract k
//
// Arrivals accumulate and are consumed, so no signal is lost and nothing is reset, however far
// ranks drift apart between replays. Captured memop values are constants, which is exactly what
// a counting semaphore needs: every replay waits for "k more" and subtracts k.
#pragma once

#include <cstdint>

#include "kernels/common/device_error.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/common/sync_handle.h"

namespace graphep {

// Call from ONE thread after every write the consumer may read is complete (for a multi-CTA
// producer: after a grid-wide completion point). The fence publishes those writes at system scope.
__device__ __forceinline__ void semaphoreSignal(const SyncHandle& h, std::uint32_t channel,
                                                std::int32_t peer) {
  const std::uint32_t idx = h.semIndex(channel, h.rank);
  ptx::fenceAcqRelSys();
  ptx::redRelaxedSysAdd(h.peerSemArrived[peer] + idx, 1u);
  ptx::redReleaseSysAdd(h.peerSemCount[peer] + idx, 1u);
}

// Call from ONE thread, before any read of what the producer published. Returns the count before
// the subtraction. A count below k means the stream wait was missing: recorded as an error.
__device__ __forceinline__ std::uint32_t semaphoreConsume(const SyncHandle& h,
                                                          std::uint32_t channel, std::int32_t src,
                                                          std::uint32_t k) {
  const std::uint32_t idx = h.semIndex(channel, src);
  const std::uint32_t old = ptx::atomAcqRelSysAdd(h.semCount + idx, 0u - k);
  // Only the consumer of (channel, src) writes semConsumed[idx]: a plain update, published with
  // release so a host watchdog reading it sees a consistent total.
  ptx::stReleaseSys(h.semConsumed + idx, ptx::ldRelaxedSys(h.semConsumed + idx) + k);
  if (old < k) {
    reportDeviceError(h.error, DeviceErrorKind::kSemaphoreUnderflow, h.rank, src,
                      WaitSite::kSemaphoreConsume, k, old, 0, h.semCount + idx);
  }
  return old;
}

}  // namespace graphep
