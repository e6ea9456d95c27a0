// alltoallv: every rank sends sendCounts[p] bytes from src + sendOffsets[p] to each rank p and
// receives recvCounts[p] bytes into dst + recvOffsets[p], with counts and offsets read from
// device memory when the kernel runs (graph-capturable; they may change between replays).
//
// Grid: for each peer p, channels firstChannel[p] .. firstChannel[p+1]-1 (the count per peer is
// chosen on the host from the peer's topology class). A peer's transfer of B bytes uses only
// ceil(B / minBytesPerChannel) of its channels (at most all): the rest are masked at run time.
// Both ends derive the same number from the same count. The rank's own block is a local copy.
// Zero-copy (dst in the user region): each receiving channel publishes where its bytes land in its
// sender's mailbox with its ready flag, and the sender writes them there directly.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include <graphep/types.hpp>

#include "kernels/common/pipe.h"
#include "kernels/common/sync_handle.h"

namespace graphep {

struct AllToAllvParams {
  SyncHandle sync;
  std::uint32_t numSlots, slotBytes, warpsPerRole;
  std::uint64_t minBytesPerChannel;
  std::uint16_t firstChannel[kMaxRanks + 1];  // CTA ranges per peer

  const char* src;
  char* dst;
  std::uint64_t srcBytes, dstBytes;  // capacities: a count past them is dropped and reported
  const std::uint64_t* sendCounts;   // device, [numRanks] bytes
  const std::uint64_t* sendOffsets;
  const std::uint64_t* recvCounts;
  const std::uint64_t* recvOffsets;

  // Zero-copy: load/store peers write straight into dst, which lies dstUserOffset bytes into this
  // rank's user region (send[p].direct is p's user region, send[p].mailbox where p publishes the
  // place of each channel's bytes); no staging.
  // A segment of fewer than zeroCopyMinBytes goes staged (both ends read the same count).
  std::uint32_t zeroCopy;
  std::uint64_t zeroCopyMinBytes;
  std::uint64_t dstUserOffset;

  SendLink send[kMaxRanks];  // channel tables per peer (src/bytes filled in by the kernel)
  RecvLink recv[kMaxRanks];

  // Remote peers (bit p of remoteMask): fixed-size NCCL messages of remoteCap bytes per peer
  // (this call's size, at most the stages' capacity). The gather kernel packs src segments into
  // remoteSend + p * remoteCap over peer p's channels (firstChannel); the alltoallv kernel
  // unpacks remoteRecv + p * remoteCap into dst over the same channels.
  // remoteInPlace (AllToAllvArgs::fixedSlots): NCCL moved remoteCap bytes of each remote peer's
  // slot straight from src + p * remoteStride into dst + p * remoteStride (remoteStride: the
  // slots' spacing, AllToAllvArgs::slotStride; remoteCap when staged); the kernel only checks the
  // tables' promise.
  std::uint32_t remoteMask;
  std::uint32_t remoteInPlace;
  std::uint64_t remoteCap;
  std::uint64_t remoteStride;
  char* remoteSend;
  const char* remoteRecv;
};

cudaError_t launchAllToAllv(const AllToAllvParams& p, cudaStream_t stream);
// Packs each remote peer's segment into its send stage (runs before the NCCL exchange).
cudaError_t launchAllToAllvGather(const AllToAllvParams& p, cudaStream_t stream);
// The emulated network's meter and pace, queued before the exchange: adds the bytes this call
// sends each peer in networkMask to bytes[peer] (device, [numRanks]); with mbps > 0 it then holds
// the stream until those bytes would have left at mbps MB/s (the emulated network's rate cap).
cudaError_t launchAllToAllvNetworkBytes(const AllToAllvParams& p, std::uint32_t networkMask, unsigned long long* bytes,
                                        std::uint32_t mbps, cudaStream_t stream);
cudaError_t preloadAllToAllvKernels();
// CTAs of `threads` threads of the alltoallv kernel resident per SM.
cudaError_t allToAllvCtasPerSm(int threads, int* ctas);

}  // namespace graphep
