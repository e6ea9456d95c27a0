// sendrecv: move bytes to one peer and from one peer (they may differ: rings compose from it), over
// per-(peer, channel) staging slots with monotonic head/tail flags, zero-copy straight into the
// peer's symmetric destination (by the sender's warps, or by the copy engine between two launches
// that run only the flags: CePhase), or (small transfers) as LL lines that carry their own flags
// (kernels/common/pipe.cuh has the protocol). One launch is
// capturable and replayable forever: the chunk steps live in device memory and only grow.
//
// CTA layout: warps [0, W) run the sender role, warps [W, 2W) the receiver role; each role
// synchronises only its own warps with its own named barrier (ids 1 and 2).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/pipe.h"
#include "kernels/common/sync_handle.h"

namespace graphep {

struct SendRecvParams {
  SyncHandle sync;             // rank, wait bound, error record
  // Each direction has its own channel count, derived from its own byte count so that both ends
  // of a link agree; the grid is the larger of the two. Slots and slot size come from the heap.
  PipeShape sendShape;
  PipeShape recvShape;
  std::uint32_t warpsPerRole;  // 1..kMaxWarpsPerRole
  Wire wire;                   // both directions; kFp8E4m3 runs staged (no LL, no zero-copy)
  SendLink send;               // send.peer < 0: no send role
  RecvLink recv;               // recv.peer < 0: no receive role
  // A local copy run by localChannels extra CTAs of the same launch, overlapped with the
  // transfer (a ring all-gather's own chunk); localChannels == 0: none.
  const char* localSrc;
  char* localDst;
  std::uint64_t localBytes;
  std::uint32_t localChannels;
};

// Launches one CTA of 2 * warpsPerRole warps per channel (of the direction with more channels),
// plus localChannels CTAs for the local copy. The caller (engine/movers.cpp) has
// validated every field; this returns cudaErrorInvalidValue for a configuration it cannot run.
cudaError_t launchSendRecv(const SendRecvParams& p, cudaStream_t stream);

// Whether the family has a kernel for this wire format and consume hook.
bool sendRecvSupports(Wire wire, Consume consume);

// Loads the kernels on the current device (setup only; see preloadSemaphoreKernels).
cudaError_t preloadSendRecvKernels();
// CTAs of `threads` threads that every kernel of the family keeps resident per SM (the least).
cudaError_t sendRecvCtasPerSm(int threads, int* ctas);

}  // namespace graphep
