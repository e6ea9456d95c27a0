// Launchers of the standalone semaphore kernels (kernels/semaphore.cu). Capturable: each is one
// kernel launch on `stream`. Operations that produce data fuse semaphoreSignal()/Consume() into
// their own kernels instead; these serve coarse phases and tests.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/sync_handle.h"

namespace graphep {

// Signals (channel, h.rank) on every peer whose bit is set in peerMask (bit p = rank p).
cudaError_t launchSemaphoreSignal(const SyncHandle& h, std::uint32_t channel,
                                  std::uint32_t peerMask, cudaStream_t stream);

// Subtracts k from this rank's (channel, src) semaphore word.
cudaError_t launchSemaphoreConsume(const SyncHandle& h, std::uint32_t channel, std::int32_t src,
                                   std::uint32_t k, cudaStream_t stream);

}  // namespace graphep
