// Device flags with monotonic values (docs/DESIGN.md §3).
//
// Producer:  payload stores -> (block barrier, by the caller) -> flagPost():
//            fence.acq_rel.sys, then st.release.sys of the new step into the peer's inbox.
// Consumer:  flagWait(): ld.acquire.sys polling until counterReached(observed, step), bounded by
//            SyncHandle::timeoutNs. Values only grow (mod 2^32); flags are never reset, so the
//            same captured graph can replay forever.
#pragma once

#include <cstdint>

#include "kernels/common/device_error.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/common/sync_handle.h"

namespace graphep {

// A flagged line (NCCL's LL protocol): 16 bytes {a, tag, b, tag}, stored and loaded whole
// (ptx::stVolatileV4 / ldVolatileV4), each 8-byte half single-copy atomic, so a reader that sees
// `tag` in both halves holds a and b of the same store, with no fence and no flag word.
__device__ __forceinline__ uint4 flaggedLine(std::uint32_t a, std::uint32_t b, std::uint32_t tag) {
  return make_uint4(a, tag, b, tag);
}
__device__ __forceinline__ bool flaggedLineReady(const uint4& v, std::uint32_t tag) { return v.y == tag && v.w == tag; }

__device__ __forceinline__ void flagPost(std::uint32_t* slot, std::uint32_t value) {
  ptx::fenceAcqRelSys();  // everything this thread wrote before is visible before the flag
  ptx::stReleaseSys(slot, value);
}

// Polls until poll(&observed) returns true, bounded by SyncHandle::timeoutNs. Returns true on
// success; on timeout records the error (rank, peer, site, expected = target, observed, address)
// and returns false (or traps when asked to). Also returns false promptly once another wait of
// this rank has failed, unless `ownTimeout` (then only its own timeout ends it: a caller that
// must tell a late peer from one that never came). `quiet`: the timeout is the caller's to handle
// (a peer masked after it: MoeConfig::shrinkOnTimeout), neither recorded nor trapped; only its own
// timeout ends the wait.
template <class Poll>
__device__ inline bool boundedPoll(const SyncHandle& h, Poll poll, std::uint32_t target,
                                   std::int32_t peer, WaitSite site, const void* address,
                                   bool ownTimeout = false, bool quiet = false) {
  std::uint32_t v = 0;
  if (poll(&v)) return true;
  const std::uint64_t start = ptx::globalTimerNs();
  for (std::uint32_t iter = 1;; ++iter) {
    if (poll(&v)) return true;
    if ((iter & 255u) == 0u) {
      const std::uint64_t elapsed = ptx::globalTimerNs() - start;
      if (elapsed > h.timeoutNs) {
        if (quiet) return false;
        reportDeviceError(h.error, DeviceErrorKind::kTimeout, h.rank, peer, site, target, v,
                          elapsed, address);
        if (h.trapOnTimeout) __trap();
        return false;
      }
      if (!ownTimeout && !quiet && deviceErrorRaised(h.error)) return false;
    }
  }
}

// Spins until reached(*slot) holds (acquire loads); `observed` gets the last value read.
template <class Reached>
__device__ inline bool boundedWait(const SyncHandle& h, const std::uint32_t* slot,
                                   std::uint32_t target, Reached reached, std::int32_t peer,
                                   WaitSite site, std::uint32_t* observed, bool ownTimeout = false,
                                   bool quiet = false) {
  std::uint32_t last = 0;
  const bool ok = boundedPoll(
      h,
      [&](std::uint32_t* v) {
        *v = ptx::ldAcquireSys(slot);
        last = *v;
        return reached(*v);
      },
      target, peer, site, slot, ownTimeout, quiet);
  if (observed) *observed = last;
  return ok;
}

// Waits until the monotonic flag *slot reaches `target` (wrap-safe); `ownTimeout` and `quiet` as
// boundedPoll.
__device__ inline bool flagWait(const SyncHandle& h, const std::uint32_t* slot,
                                std::uint32_t target, std::int32_t peer, WaitSite site,
                                std::uint32_t* observed = nullptr, bool ownTimeout = false, bool quiet = false) {
  return boundedWait(
      h, slot, target, [target](std::uint32_t v) { return ptx::counterReached(v, target); }, peer,
      site, observed, ownTimeout, quiet);
}

}  // namespace graphep
