// Counting semaphores between kernels (docs/DESIGN.md §3), host half: capturable enqueue operations
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
//
// A memop wait cannot time out on the device. The host watchdog covers it: watch() polls the
// stream, and on a stall names the sources whose semaphore words are short of a wait; release()
// then lifts this rank's waits so its streams drain and it can be torn down.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <graphep/moe.hpp>

#include "engine/heap.hpp"
#include "kernels/common/sync_handle.h"

namespace graphep {

// Totals of one semaphore word, read on the host for diagnostics and exact-count checks.
struct SemaphoreCounts {
  std::uint32_t count;     // arrivals not yet consumed
  std::uint32_t arrived;   // monotonic total of signals received
  std::uint32_t consumed;  // monotonic total consumed
};

// One wait() of a rank, as the watchdog remembers it (the largest k per word).
struct SemaphoreWait {
  int channel;
  int src;
  std::uint32_t k;
};

namespace detail {
// "; semaphore channel C: rank S has not signalled (count N of the K waited for; arrived A,
// consumed B)" for each wait whose word holds fewer than k, or a sentence saying none is short.
std::string describeSemaphoreStall(const std::vector<SemaphoreWait>& waits,
                                   const std::vector<SemaphoreCounts>& counts);
}  // namespace detail

class SemaphoreOps {
 public:
  // Setup (not capturable): resolves driver entry points and loads the semaphore kernels.
  SemaphoreOps(const SymmetricHeap& heap, int local);

  // Each call enqueues on `stream` (which must belong to this rank's device) and is capturable.
  void signal(cudaStream_t stream, int channel, std::uint32_t peerMask) const;
  void wait(cudaStream_t stream, int channel, int src, std::uint32_t k) const;
  void consume(cudaStream_t stream, int channel, int src, std::uint32_t k) const;

  // Setup/diagnostics only: one word's counters, copied on the private stream (it does not wait
  // for the rank's other streams: synchronise them first for settled values).
  SemaphoreCounts read(int channel, int src) const;

  // Host watchdog (never synchronises the device): gives the work enqueued on `stream` up to
  // `timeout` to finish. If it does not, reads the word of every wait() enqueued through this
  // rank's ops (a copy on a private stream), names each source short of its wait, and puts the
  // ops in a failed state: signal / wait / consume then throw kRemoteError with that message. A
  // device error recorded for the rank (a consume underflow) is reported too.
  HealthReport watch(cudaStream_t stream, std::chrono::milliseconds timeout);
  // After watch() reported a stall: records the verdict in the rank's error record (kAborted,
  // naming the first short source; the rank's bounded device waits stop), then lifts every short
  // wait by raising its word 2^30 above its count, so stuck streams drain and the rank can be torn
  // down. What runs after a lifted wait reads data that never arrived.
  void release();
  bool failed() const;

 private:
  struct Watch;  // shared by copies of one rank's ops: the waits seen, the failure, the tools

  void checkChannel(int channel) const;
  void checkWord(const char* op, int channel, int src, std::uint32_t k) const;
  void requireHealthy(const char* op) const;
  std::vector<SemaphoreCounts> readAll(const std::vector<SemaphoreWait>& waits) const;

  const SymmetricHeap* heap_;
  int local_;
  bool sharesDevice_ = false;  // another local rank runs on this rank's GPU
  SyncHandle h_;
  std::shared_ptr<Watch> watch_;
};

}  // namespace graphep
