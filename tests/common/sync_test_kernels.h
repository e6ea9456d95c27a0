// Test kernels for the foundation suites (heap exchange, flag ping-pong, bounded waits).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common/sync_handle.h"

namespace graphep::test {

// dst[i] = src[i] for i < n (either side may be a peer's memory).
cudaError_t launchCopyWords(const std::uint32_t* src, std::uint32_t* dst, std::size_t n,
                            cudaStream_t stream);

// Waits (bounded) for one more flag from `peer` on `channel` than the inbox holds now; writes 1
// to *result on success, 0 on timeout.
cudaError_t launchWaitForPeer(const SyncHandle& h, std::uint32_t channel, int peer, int* result,
                              cudaStream_t stream);

}  // namespace graphep::test

namespace graphep::test {

// Byte i of rank `rank`'s data for `seed`: a hash, so any size and alignment can be generated and
// checked on the device.
cudaError_t launchFillPattern(void* dst, std::size_t bytes, std::uint64_t seed, int rank,
                              cudaStream_t stream);
// Loads the test kernels on the current device. Call at setup: under lazy module loading a
// kernel's first launch, queued while another rank's spinning kernel waits for a launch this
// thread has not made yet, stalls until that wait times out (seen with 4 emulated ranks).
cudaError_t preloadTestKernels();

// Adds to *wrong the number of bytes where a and b differ.
cudaError_t launchCountDiffs(const void* a, const void* b, std::size_t bytes,
                             unsigned long long* wrong, cudaStream_t stream);

// Adds to *wrong the number of bytes of p that differ from rank's pattern for seed.
cudaError_t launchCountMismatches(const void* p, std::size_t bytes, std::uint64_t seed, int rank,
                                  unsigned long long* wrong, cudaStream_t stream);

}  // namespace graphep::test

namespace graphep::test {

// Element i of rank's input: small integers (bf16) or multiples of 1/64 (fp32), so sums over up to
// 32 ranks are exact in both types and reductions can be checked bit for bit.
cudaError_t launchFillElems(void* dst, std::size_t count, bool bf16, std::uint64_t seed, int rank,
                            cudaStream_t stream);
// Adds to *wrong the elements of out[0, count) that differ from sum over ranks s < numRanks of
// element (firstIndex + i) of rank s's input.
cudaError_t launchCountSumMismatches(const void* out, std::size_t count, bool bf16,
                                     std::uint64_t seed, int numRanks, std::size_t firstIndex,
                                     unsigned long long* wrong, cudaStream_t stream);

}  // namespace graphep::test
