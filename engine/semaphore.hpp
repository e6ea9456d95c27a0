// Counting semaphores between kernels (DESIGN.md §3), host half: capturable enqueue operations
// for one local rank. Device half: kernels/common/semaphore.cuh.
//
//   rank A stream:  [producer kernel] -> signal(ch, peerMask)           (release-add 1 on B's word)
//   rank B stream:  wait(ch, src=A, k)  -> consume(ch, src=A, k) -> [consumer kernel]
//
// wait() is a cuStreamWaitValue32 GEQ memop: it occupies no SM, but its ordering is invisible to
// the CUDA scheduler, so work it orders must also be ordered by stream/graph edges.
//
// Exception, measured on H100 and H200 (driver 580, CUDA 13.0): an EAGER memop wait that blocks
// stalls the other streams of the same GPU, so ranks sharing one GPU (emulated ranks) deadlock
// when one waits for another (even 100 rounds of ping-pong never finish). Captured memop nodes do
// not (10,000 graph-replayed rounds pass in about 1 s). So, when the stream is not capturing and
// this rank's GPU hosts other local ranks, wait() launches a one-thread bounded spin kernel
// instead; captured waits are always memops.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "engine/heap.hpp"
#include "kernels/common/sync_handle.h"

namespace graphep {

// Totals of one semaphore word, read on the host for diagnostics and exact-count checks.
struct SemaphoreCounts {
  std::uint32_t count;     // arrivals not yet consumed
  std::uint32_t arrived;   // monotonic total of signals received
  std::uint32_t consumed;  // monotonic total consumed
};

class SemaphoreOps {
 public:
  // Setup (not capturable): resolves driver entry points and loads the semaphore kernels.
  SemaphoreOps(const SymmetricHeap& heap, int local);

  // Each call enqueues on `stream` (which must belong to this rank's device) and is capturable.
  void signal(cudaStream_t stream, int channel, std::uint32_t peerMask) const;
  void wait(cudaStream_t stream, int channel, int src, std::uint32_t k) const;
  void consume(cudaStream_t stream, int channel, int src, std::uint32_t k) const;

  // Setup/diagnostics only: synchronous read of one word's counters.
  SemaphoreCounts read(int channel, int src) const;

 private:
  void checkChannel(int channel) const;
  void checkWord(const char* op, int channel, int src, std::uint32_t k) const;

  const SymmetricHeap* heap_;
  int local_;
  bool sharesDevice_ = false;  // another local rank runs on this rank's GPU
  SyncHandle h_;
};

}  // namespace graphep
