// Data movers, host half (kernels/sendrecv.cu is the device half): validates arguments (errors
// name the value), chooses channel counts, and builds the by-value kernel params from the
// symmetric heap. Every enqueue is capturable; construction is setup.
#pragma once

#include <cuda_runtime.h>

#include <nccl.h>

#include <cstddef>
#include <memory>
#include <vector>

#include "engine/heap.hpp"
#include "engine/transport.hpp"
#include "kernels/alltoallv.h"
#include "kernels/sendrecv.h"

namespace graphep {

struct NodeMap;  // engine/node_map.hpp

// Who moves the bytes of a zero-copy transfer to a load/store peer.
enum class ZeroCopyEngine {
  kAuto,        // the copy engine from MoverOptions.copyEngineMinBytes up, else the SMs
  kSm,          // the kernel's sender warps store into the peer's memory
  kCopyEngine,  // this GPU's copy engine (no SMs; a memcpy between two short flag launches)
};

struct SendRecvArgs {
  int sendPeer = -1;              // -1: receive only
  const void* src = nullptr;
  std::size_t sendBytes = 0;
  // Zero-copy send: >= 0 is the offset in sendPeer's user region where the bytes land (the
  // receiver must pass recvZeroCopy with dst at that same offset of its own user region).
  long long sendToUserOffset = -1;

  int recvPeer = -1;              // -1: send only
  void* dst = nullptr;
  std::size_t recvBytes = 0;
  bool recvZeroCopy = false;      // recvPeer writes into dst directly (dst in the user region)
  // Zero-copy directions only. Both ends of a link pass the same value (and, for kAuto, the same
  // MoverOptions.copyEngineMinBytes), so they agree on the protocol from the byte count.
  ZeroCopyEngine zeroCopyEngine = ZeroCopyEngine::kAuto;
  // The consume hook (kernels/common/pipe.h): reduce on arrival, dst = received + addend, or
  // weighted, dst = addend + weights[row] * received with row = byte offset / rowBytes (fp32 or
  // bf16, computed in fp32). Not zero-copy. With the fp8 wire: kCopy keeps the 144-byte records,
  // kFp8ToBf16 dequantises.
  Consume consume = Consume::kCopy;
  const void* addend = nullptr;
  const float* weights = nullptr;  // device, one per row
  std::size_t rowBytes = 0;        // a multiple of 16

  // Wire format of both directions (both ends pass the same). kFp8E4m3: src holds bf16, sendBytes
  // and recvBytes count bf16 source bytes (multiples of 256), dst gets recvBytes / 256 records of
  // 144 bytes (kCopy) or recvBytes of bf16 (kFp8ToBf16); staged, load/store peers only.
  Wire wire = Wire::kBytes;

  // Also copy localBytes from localSrc to localDst on this rank's GPU, in the same launch (extra
  // CTAs, overlapped with the transfer). Neither may overlap the transfer's buffers.
  const void* localSrc = nullptr;
  void* localDst = nullptr;
  std::size_t localBytes = 0;

  // Channels (CTAs) per direction. 0: each direction chooses from its own byte count (fewer,
  // larger steps when small). A value > 0 applies to both directions, and the peer must pass the
  // same value for the same link.
  int numChannels = 0;
};

// alltoallv arguments: counts and offsets (bytes) live in device memory, one entry per rank, and
// are read when the kernel runs, so they may change between graph replays. Both ends of each pair
// must agree (sendCounts[p] on rank r == recvCounts[r] on rank p), as a count exchange provides.
struct AllToAllvArgs {
  const void* src = nullptr;
  std::size_t srcBytes = 0;  // capacity of src: a count/offset beyond it is dropped and reported
  void* dst = nullptr;
  std::size_t dstBytes = 0;  // capacity of dst, likewise
  const std::uint64_t* sendCounts = nullptr;
  const std::uint64_t* sendOffsets = nullptr;
  const std::uint64_t* recvCounts = nullptr;
  const std::uint64_t* recvOffsets = nullptr;
  // Channel counts. Both ends of a link derive its active channels from them, so they must be
  // equal on every rank (as the buffers' capacities are, in an engine built from one config).
  // maxBytesPerPeer sizes the channel counts (0: the larger capacity) and is also each remote
  // peer's NCCL message where it is below MoverOptions.maxRemoteBytesPerPeer: a remote segment
  // beyond it is dropped and reported, as one beyond a capacity is.
  std::size_t maxBytesPerPeer = 0;
  int channelsPerPeer = 0;          // 0: from maxBytesPerPeer and each peer's topology class
  // dst lies in this rank's user region: load/store peers write straight into it (each receiving
  // channel tells its sender where, with its ready flag), no staging, for segments of at least
  // MoverOptions.allToAllvZeroCopyMinBytes. Every rank passes the same.
  bool zeroCopy = false;
  // Fixed slots: peer q's segment is at q * maxBytesPerPeer in src and in dst (sendOffsets and
  // recvOffsets say so; counts at most maxBytesPerPeer), so a remote peer's NCCL message goes
  // straight from src's slot into dst's (the whole slot, bytes past the count included), with no
  // stage and no copy, and needs no MoverOptions.maxRemoteBytesPerPeer. A table that breaks the
  // promise is reported (the alltoallv bounds check). Every rank passes the same.
  bool fixedSlots = false;
  // With fixed slots: peer q's segment starts at q * slotStride in src and dst (0: maxBytesPerPeer),
  // so one call can move a window of maxBytesPerPeer bytes inside larger slots (the MoE engine's
  // chunks: src and dst point at the window's start in slot 0). Every rank passes the same.
  std::size_t slotStride = 0;
  // The rank's own block is not copied (its consumer reads it from src): no channels for it.
  bool skipOwnBlock = false;
  // The peers this call sends to and receives from (bit q; every peer by default). A peer left out
  // of a direction gets no link, channel or NCCL message that way, whatever its count (which must
  // be 0); both ends of each pair must leave it out alike, as a rule both derive from the same
  // facts (the node-aware records exchange: the node's ranks and the landing ranks).
  std::uint32_t sendPeers = ~0u;
  std::uint32_t recvPeers = ~0u;
};

struct MoverOptions {
  // alltoallv to remote peers moves fixed-capacity messages (its counts live on the device, NCCL
  // needs sizes on the host): this many bytes per peer, staged in buffers allocated at setup.
  // 0: alltoallv refuses remote peers.
  std::size_t maxRemoteBytesPerPeer = 0;
  // The largest fixed-slot alltoallv message (AllToAllvArgs::fixedSlots) a remote peer will get:
  // NCCL sets up the connections and channels of that size at setup (no stage is allocated for
  // it), so a captured exchange never does. 0: none beyond the stage size and the small ones.
  std::size_t fixedSlotBytes = 0;
  // Count where staged transfers spend their time (ProfileCounters in kernels/common/pipe.h):
  // thread 0 of each role reads the global timer at phase boundaries. For benchmarks and tuning.
  bool profile = false;
  // Zero-copy transfers of at least this many bytes to load/store peers go by the copy engine
  // (ZeroCopyEngine::kAuto): 389 GB/s per direction on NV18 with no SMs, against a fixed cost of
  // about 20 us for the two launches around the copy (SM zero-copy: 350 GB/s, 16 CTAs; the
  // crossover is near 32 MiB, docs/PERFORMANCE.md). 0: never automatically. Every rank passes the
  // same.
  std::size_t copyEngineMinBytes = std::size_t{64} << 20;
  // A zero-copy alltoallv (AllToAllvArgs.zeroCopy) moves a peer's segment zero-copy when it holds
  // at least this many bytes, else staged (faster for small segments): both ends read the same
  // count when the kernel runs, so they agree. Every rank passes the same.
  std::size_t allToAllvZeroCopyMinBytes = std::size_t{4} << 20;
};

// Mover CTAs wait for their peers' CTAs, so every waiting CTA of every rank on a GPU must be
// resident at once, or a rank's CTAs can spin while the CTAs they wait for (a neighbour's on the
// same GPU, or ones that another GPU's waiting CTAs depend on) cannot be scheduled. Per rank, a
// transfer's waiting CTAs are its load/store channels: sendRecv's send or receive channels (the
// larger), alltoallv's channels to every load/store peer (own-block copies and NCCL unpacks do not
// wait). The channels per link are capped so that the GPU holds all `ranksOnGpu` ranks' waiting
// CTAs: the largest c <= maxChannels with
// ranksOnGpu * (c * linkPeers + min(c, kSameDeviceMaxChannels) * sameDevicePeers) <= residentCtas
// and ranksOnGpu * c <= residentCtas; 0 when not even one channel fits. A pure function (setup
// takes the minimum over every rank, so both ends of a link agree).
int moverLinkChannels(int residentCtas, int ranksOnGpu, int linkPeers, int sameDevicePeers, int maxChannels);

// Peers are routed by MeshTransport (engine/transport.hpp): those classified remote (no load/store)
// are reached through NcclTransport (NCCL send/recv) on the same stream, after the sendRecv kernel
// that serves the load/store roles (alltoallv: between its gather kernel and the kernel that
// unpacks the stages): the communicator must carry NCCL comms. A
// thread that drives several local ranks wraps its per-rank calls in ncclGroupStart/ncclGroupEnd
// (NCCL's rule for several GPUs per thread); each call's own group nests inside it.
class Movers {
 public:
  // Setup, collective over the heap's communicator: loads the kernels on every local rank's GPU,
  // allocates the remote staging of alltoallv, and warms up the NCCL connection to every remote
  // peer at every message size the run path uses (so capture never sets one up).
  // `nodes`: the ranks' nodes where the caller has them (nodeMapOf), else gathered here.
  static std::vector<Movers> createAll(const SymmetricHeap& heap, const MoverOptions& options = {},
                                       const NodeMap* nodes = nullptr);
  // Device bytes of the remote staging a rank allocates when some peer is remote (else none).
  static std::size_t remoteStageBytes(const MoverOptions& options, int worldSize);

  // Capturable. Both ends of each transfer must pass the same byte count, channel count and mode
  // (directions are independent: sendBytes and recvBytes may differ).
  void sendRecv(cudaStream_t stream, const SendRecvArgs& args) const;

  // The channel count used for `bytes` when the caller passes 0: one channel per kBytesPerChannel
  // (16 KiB), capped by the heap's moverBlocks, by kZeroCopyMaxChannels for SM zero-copy, and by
  // kSameDeviceMaxChannels when `peer` shares this rank's GPU.
  int channelsFor(std::size_t bytes, bool zeroCopy = false, int peer = -1) const;
  // Channels of an LL transfer of `bytes` (numChannels: the caller's count, 0 for automatic), or 0
  // when the transfer is too large for LL mode.
  int llChannelsFor(std::size_t bytes, int numChannels) const;

  // Ring all-gather over every rank (send to rank+1, receive from rank-1; R-1 sendRecv steps):
  // out holds R chunks of chunkBytes and ends with chunk q = rank q's `in`. `in` may alias
  // out + rank * chunkBytes. zeroCopy: out lies at the same offset of every rank's user region
  // and chunks are written straight into the next rank's out. Capturable; collective.
  void allGatherRing(cudaStream_t stream, const void* in, void* out, std::size_t chunkBytes,
                     bool zeroCopy = false) const;

  // Ring reduce-scatter (sum) over every rank: `in` holds R chunks of `count` elements; out gets
  // chunk `rank` summed over all ranks (fp32 accumulation per step). scratch: `count` elements,
  // distinct from in and out. Capturable; collective.
  void reduceScatterRing(cudaStream_t stream, const void* in, void* out, void* scratch,
                         std::size_t count, Consume addKind) const;

  // Capturable. Peers without load/store access exchange a fixed-size NCCL message whatever the
  // count: the slot with fixed slots, else MoverOptions.maxRemoteBytesPerPeer or maxBytesPerPeer
  // where smaller, rounded up to 16 (a count beyond it is dropped and reported).
  void allToAllv(cudaStream_t stream, const AllToAllvArgs& args) const;

  // The staged-transfer phase profile accumulated since setup or the last resetProfile()
  // (MoverOptions.profile; all zero otherwise). Diagnostics, not a run path: synchronises the
  // device.
  ProfileCounters profile() const;
  void resetProfile() const;

  // The emulated network (GRAPHEP_EMULATED_NODES, engine/node_map.hpp): the bytes this rank's
  // allToAllv calls sent each peer on another node since setup or the last resetNetworkBytes(),
  // counted on the device after each call ([worldSize]; all zero for peers of this node, and
  // without emulated nodes). Diagnostics, not a run path: synchronises the device.
  std::vector<std::uint64_t> networkBytes() const;
  void resetNetworkBytes() const;

 private:
  Movers(const SymmetricHeap& heap, int local, const MoverOptions& options, int linkChannels,
         std::uint32_t networkMask);
  // Validate the arguments (errors name the values) and build the kernels' by-value params.
  SendRecvParams params(const SendRecvArgs& args) const;
  bool copyEngine(const SendRecvArgs& args, std::size_t bytes) const;
  AllToAllvParams allToAllvParams(const AllToAllvArgs& args) const;
  bool remote(int peer) const;
  SendLink sendLink(int peer) const;  // channel tables of this rank -> peer
  RecvLink recvLink(int peer) const;  // channel tables of peer -> this rank
  PipeShape shape(int channels) const;

  const SymmetricHeap* heap_;
  int local_;
  int warpsPerRole_;  // the heap's moverWarps
  std::size_t ceMinBytes_;  // MoverOptions.copyEngineMinBytes
  std::size_t a2aZeroCopyMinBytes_;  // MoverOptions.allToAllvZeroCopyMinBytes
  // Channels per load/store link at most (moverLinkChannels, the same on every rank): every
  // channel count below is capped by it.
  int linkChannels_;
  MeshTransport mesh_;  // per-peer routes: the kernels for load/store peers, NCCL for remote ones
  std::size_t remoteCap_ = 0;
  std::shared_ptr<char> remoteStage_;  // [2][worldSize][remoteCap_]: send stages, receive stages
  std::shared_ptr<ProfileCounters> profile_;  // device, MoverOptions.profile only
  // The emulated network: the peers on other nodes (GRAPHEP_EMULATED_NODES only, else 0), their
  // byte counters (device, [worldSize]) and the rate each call's bytes to them leave at.
  std::uint32_t networkMask_ = 0;
  std::shared_ptr<unsigned long long> networkBytes_;
  std::uint32_t networkMbps_ = 0;  // its rate cap (GRAPHEP_EMULATED_NETWORK_MBPS; 0: none)
};

}  // namespace graphep
