// Data-mover test bodies shared by every configuration (emulated ranks on one GPU, 2 GPUs in one
// process, one process per GPU). Each rank sends to rank+1 and receives from rank-1 (a ring step;
// with 2 ranks, a bidirectional exchange), or only rank 0 -> rank 1 (unidirectional). Data is
// generated and checked on the device; destinations are poisoned first; every byte is compared.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <graphep/comm.hpp>

#include "engine/movers.hpp"

namespace graphep::test {

struct SendRecvCase {
  std::size_t bytes;
  bool zeroCopy = false;
  bool unidirectional = false;
  int numChannels = 0;  // 0: adaptive
  // Rank r sends bytes + sizeStep * r (so a rank's two directions differ in size, mode and
  // channel count).
  std::size_t sizeStep = 0;
  ZeroCopyEngine engine = ZeroCopyEngine::kAuto;  // zero-copy cases: SM or copy engine
};

// Runs every case once (eagerly), counting wrong bytes per rank; EXPECTs zero.
void runSendRecvCases(Communicator& comm, const std::vector<SendRecvCase>& cases,
                      std::size_t slotBytes = std::size_t{64} << 10);

// Captures one sendRecv of `bytes` per rank and replays it `replays` times, refilling the source
// with a new seed and poisoning the destination before each replay (outside the graph), and
// counting wrong bytes after each replay on the device. EXPECTs zero over all replays.
void runSendRecvReplays(Communicator& comm, std::size_t bytes, int replays, bool zeroCopy,
                        ZeroCopyEngine engine = ZeroCopyEngine::kAuto);

// Ring all-gather of `chunkBytes` per rank (staged or zero-copy into the user region). With
// replays > 1 the R-1 steps are captured once per rank and replayed with fresh data each time;
// every chunk on every rank is checked after every run.
void runAllGatherRing(Communicator& comm, std::size_t chunkBytes, bool zeroCopy, int replays);

// Ring reduce-scatter (sum) of `count` elements per rank, fp32 or bf16, checked bit for bit
// (inputs are chosen so every partial sum is exact). replays as above.
void runReduceScatterRing(Communicator& comm, std::size_t count, bool bf16, int replays);

enum class CountPattern { kEqual, kRandom, kSomePairsZero, kEmpty };

// alltoallv with counts drawn per run from `pattern` (up to maxPerPeer bytes per pair, packed
// offsets, so segments are unaligned). With replays > 1 one captured graph per rank is replayed
// with new counts (written into the device count arrays) and new data every time.
// zeroCopy: dst is the user region and load/store peers write straight into it.
// fixedSlots (AllToAllvArgs::fixedSlots): offsets q * maxPerPeer, remote peers' slots moved by
// NCCL in place.
void runAllToAllv(Communicator& comm, CountPattern pattern, std::size_t maxPerPeer, int replays,
                  bool zeroCopy = false, bool fixedSlots = false);

// A count that overflows both the sender's and the receiver's buffer is dropped on both sides
// (nothing written, no hang) and reported with kOutOfBounds naming the peer.
void runAllToAllvOutOfBounds(Communicator& comm, bool zeroCopy = false);

// Zero-copy alltoallv where rank 1 expects one byte less from rank 0 than rank 0 sends: rank 0
// reports kCountMismatch naming rank 1 and both channel counts, sends nothing on the channel that
// disagrees (the others arrive intact), and nobody hangs.
void runAllToAllvZeroCopyMismatch(Communicator& comm);

// Fixed slots misused: refused by name on the host (maxBytesPerPeer 0; buffers smaller than the
// slots), and, with remote peers (GRAPHEP_FORCE_TRANSPORT=remote), a device table whose offset to
// peer 1 is off its slot is reported (kOutOfBounds naming the peer, expected the slot's offset),
// the run captured so no eager NCCL group blocks the one thread.
void runAllToAllvFixedSlotsMisuse(Communicator& comm);

// The emulated network (GRAPHEP_EMULATED_NODES=nodes, set here): two alltoallv runs with random
// counts; each rank's Movers::networkBytes() equals, per peer, the bytes it sent that peer where
// the peer is on another node (R / nodes consecutive ranks each) and 0 on its own; zero after
// resetNetworkBytes().
void runAllToAllvNetworkBytes(Communicator& comm, int nodes);

// The emulated network's rate cap (GRAPHEP_EMULATED_NETWORK_MBPS=mbps, set here): one alltoallv
// of 1 MiB to every peer; each rank's call, timed on its stream, takes at least its bytes to the
// other nodes at `mbps`, and the meter counts exactly those bytes.
void runAllToAllvNetworkPace(Communicator& comm, int nodes, int mbps);

}  // namespace graphep::test

namespace graphep::test {

// The produce / consume hooks through a ring sendRecv (each rank sends to rank+1), checked on the
// host against an independent reference on fresh random data every run, byte for byte:
//   kFp8Records    bf16 -> fp8 e4m3 + per-128 scales (produce), records kept (consume kCopy)
//   kFp8Dequant    the same produce, dequantised to bf16 on arrival (consume kFp8ToBf16)
//   kWeightedBf16  dst = bf16(addend + weight[row] * received), one fp32 fma (rows of 14336 B)
//   kWeightedF32   the same in fp32 (rows of 16384 B)
// `units` is tiles of 128 values (fp8) or rows (weighted). replays > 1: captured once per rank and
// replayed with new data (and weights) each time.
enum class HookCase { kFp8Records, kFp8Dequant, kWeightedBf16, kWeightedF32 };
void runHookCase(Communicator& comm, HookCase kind, std::size_t units, int replays);
// Every hook case at 1, 37 and 4,101 tiles / 1, 3 and 70 rows eagerly, and 30 graph replays.
void runHookSuite(Communicator& comm);

// Each mover against NCCL on the same fresh data, byte for byte (destinations poisoned with
// different bytes first, so a byte either side leaves unwritten shows): ring sendrecv (staged,
// zero-copy by the SMs and by the copy engine) vs grouped ncclSend/ncclRecv, ring all-gather (staged and zero-copy) vs ncclAllGather, ring reduce-scatter
// (fp32, bf16; inputs whose sums are exact) vs ncclReduceScatter, alltoallv with random counts vs
// grouped send/recv (staged and zero-copy). Sizes 1, 3, 4095 bytes, 64 KiB, 1 MiB and maxBytes per rank. The
// communicator must carry NCCL comms.
void runAgainstNccl(Communicator& comm, std::size_t maxBytes);

}  // namespace graphep::test
