// The host half of failure detection (DESIGN.md §3): what a device wait cannot bound. A
// stream-memory-op wait has no timeout, and a kernel stuck behind one never reports; the host
// watches the stream instead, without ever synchronising with the device.
#pragma once

#include <cuda_runtime.h>

#include <chrono>

namespace graphep::detail {

// Records `event` on `stream`, then polls it (sleeping between queries, never synchronising)
// until the work enqueued so far completes or `timeout` passes. True when it completed; a CUDA
// error other than "not ready" throws.
bool streamFinishesWithin(cudaStream_t stream, cudaEvent_t event, std::chrono::milliseconds timeout);

}  // namespace graphep::detail
