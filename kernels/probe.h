// Link probes (kernels/probe.cu): flag ping-pong between every pair of ranks, used by the tests to
// prove lossless, wrap-safe signalling and by graphep-bench to measure flag round-trip latency;
// and a push of bytes into a peer's memory, whose rate at setup sizes the communication kernels
// (engine/sm_model.hpp).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common/sync_handle.h"

namespace graphep {

// `rounds` rounds of flag ping-pong with every peer on `channel`, inside one kernel: thread p
// handles peer p; the lower rank pings, the higher responds. Steps come from the device-resident
// counters (flagStep), so the same launch can be captured and replayed forever. Every wait must
// observe exactly the expected step: anything else (an extra or lost signal) or a timeout adds 1
// to *errors. Capturable. Needs every peer's matching launch to be resident at the same time.
cudaError_t launchFlagPingPong(const SyncHandle& h, std::uint32_t channel, std::uint32_t rounds,
                               unsigned long long* errors, cudaStream_t stream);

// `ctas` CTAs copy `bytes` (a multiple of 16, 16-byte aligned) from src to dst (local or a
// load/store peer's memory) with 16-byte stores, CTA c taking an equal contiguous share.
cudaError_t launchPushProbe(char* dst, const char* src, std::size_t bytes, int ctas, cudaStream_t stream);

// Loads the probe kernels on the current device (setup only; see preloadSemaphoreKernels).
cudaError_t preloadProbeKernels();

}  // namespace graphep
