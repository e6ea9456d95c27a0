// The host half of failure detection (docs/DESIGN.md §3): what a device wait cannot bound. A
// stream-memory-op wait has no timeout, and a kernel stuck behind one never reports; the host
// watches the stream instead, without ever synchronising with the device.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <functional>
#include <string>

#include <graphep/moe.hpp>

#include "engine/heap.hpp"

namespace graphep::detail {

// Records `event` on `stream`, then polls it (sleeping between queries, never synchronising)
// until the work enqueued so far completes or `timeout` passes. True when it completed; a CUDA
// error other than "not ready" throws.
bool streamFinishesWithin(cudaStream_t stream, cudaEvent_t event, std::chrono::milliseconds timeout);

// The watchdog's verdict on one local rank's `stream` (Engine::checkHealth, SemaphoreOps::watch):
// healthy when the work enqueued so far finished within `timeout` and the rank's error record is
// empty. Otherwise the message names the rank, then the device error, or the stall followed by
// `diagnose()` (what the rank waits for, read without waiting on the stalled work; called only on
// a stall) and any device error. The verdict is logged.
HealthReport judgeStream(const SymmetricHeap& heap, int local, cudaStream_t stream, cudaEvent_t event,
                         std::chrono::milliseconds timeout, const std::function<std::string()>& diagnose);

}  // namespace graphep::detail
