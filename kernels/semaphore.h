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

// Waits (bounded, reporting on timeout) until this rank's (channel, src) semaphore holds >= k.
// The eager stand-in for cuStreamWaitValue32 where several ranks share one GPU: see
// SemaphoreOps::wait.
cudaError_t launchSemaphoreWait(const SyncHandle& h, std::uint32_t channel, std::int32_t src,
                                std::uint32_t k, cudaStream_t stream);

// Loads the kernels on the current device. Setup only: with lazy module loading (the CUDA 12+
// default) a kernel's first launch loads it, which waits for the context, so a first launch queued
// behind a stream-memop wait that needs another stream's kernel deadlocks (seen with 4 emulated
// ranks on one GPU). Loading at setup keeps the run path free of it.
cudaError_t preloadSemaphoreKernels();

}  // namespace graphep
