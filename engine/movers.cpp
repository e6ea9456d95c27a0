#include "engine/movers.hpp"

#include <algorithm>
#include <string>

#include "engine/env.hpp"
#include "engine/error.hpp"
#include "engine/log.hpp"
#include "engine/nccl_group.hpp"
#include "engine/node_map.hpp"
#include "engine/topology.hpp"

namespace graphep {

int moverLinkChannels(int residentCtas, int ranksOnGpu, int linkPeers, int sameDevicePeers, int maxChannels) {
  for (int c = maxChannels; c >= 1; --c) {
    const long long perRank = static_cast<long long>(c) * linkPeers +
                              static_cast<long long>(std::min(c, static_cast<int>(kSameDeviceMaxChannels))) * sameDevicePeers;
    const long long worst = std::max<long long>(perRank, c);  // alltoallv, or one sendRecv
    if (worst * ranksOnGpu <= residentCtas) return c;
  }
  return 0;
}

namespace {
// The emulated nodes, once per process: "node 0: ranks 0 1 | node 1: ranks 2 3".
void logNodes(const SymmetricHeap& heap, const NodeMap& nodes) {
  if (heap.rank(0) != 0) return;
  std::string text;
  for (int n = 0; n < nodes.numNodes; ++n) {
    text.append(n > 0 ? " | node " : "node ").append(std::to_string(n)).append(": ranks");
    for (int r = 0; r < heap.worldSize(); ++r) {
      if (nodes.nodeOf[static_cast<std::size_t>(r)] == n) text.append(" ").append(std::to_string(r));
    }
  }
  const long long mbps = env::kEmulatedNetworkMbps.get();
  const std::string rate = mbps > 0 ? " and send them at " + std::to_string(mbps) + " MB/s a rank" : "";
  GRAPHEP_LOG_INFO(log::kTopo, "emulated network (GRAPHEP_EMULATED_NODES=%d): %s; the movers count the bytes between "
                   "nodes%s", nodes.numNodes, text.c_str(), rate.c_str());
}

// `count` Ts of device memory on `device` (the current device), zeroed unless `zeroed` is false,
// freed with the last owner.
template <class T>
std::shared_ptr<T> deviceArray(int device, std::size_t count, bool zeroed = true) {
  void* p = nullptr;
  GRAPHEP_CUDA_CHECK(cudaMalloc(&p, count * sizeof(T)));
  std::shared_ptr<T> owned(static_cast<T*>(p), [device](T* q) {
    cudaSetDevice(device);
    cudaFree(q);
  });
  if (zeroed) GRAPHEP_CUDA_CHECK(cudaMemset(p, 0, count * sizeof(T)));
  return owned;
}

// Bytes of one peer's remote stage: the largest message, rounded up to 16.
std::size_t remoteCapOf(const MoverOptions& options) { return (options.maxRemoteBytesPerPeer + 15) & ~std::size_t{15}; }

// CTAs of `threads` threads per SM that both mover kernel families can keep resident.
cudaError_t moverCtasPerSm(int threads, int* ctas) {
  int a = 0, b = 0;
  cudaError_t e = sendRecvCtasPerSm(threads, &a);
  if (e == cudaSuccess) e = allToAllvCtasPerSm(threads, &b);
  *ctas = std::min(a, b);
  return e;
}

// Collective: the channels per link every rank can afford (moverLinkChannels over each local
// rank's GPU, then the minimum over all ranks).
int agreedLinkChannels(const SymmetricHeap& heap) {
  const int R = heap.worldSize();
  const HeapConfig& cfg = heap.config();
  std::vector<std::int32_t> mine(static_cast<std::size_t>(heap.numLocalRanks()));
  for (int l = 0; l < heap.numLocalRanks(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(heap.device(l)));
    const int threads = 2 * cfg.moverWarps * 32;
    int perSm = 0, sms = 0;
    GRAPHEP_CUDA_CHECK(moverCtasPerSm(threads, &perSm));
    GRAPHEP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, heap.device(l)));
    int same = 0, link = 0;
    for (int q = 0; q < R; ++q) {
      if (q == heap.rank(l) || !isLoadStore(heap.peerClass(l, q))) continue;
      (heap.peerClass(l, q) == PeerClass::kSameDevice ? same : link) += 1;
    }
    const int c = moverLinkChannels(perSm * sms, 1 + same, link, same, cfg.moverBlocks);
    GRAPHEP_REQUIRE(c >= 1, Status::kNotSupported,
                    "data movers: rank %d shares GPU %d with %d other rank(s) and waits on %d other load/store "
                    "peer(s); their waiting CTAs (%d threads) need more than the %d the GPU holds at once (%d per "
                    "SM)",
                    heap.rank(l), heap.device(l), same, link, threads, perSm * sms, perSm);
    mine[static_cast<std::size_t>(l)] = c;
  }
  std::vector<std::int32_t> all(static_cast<std::size_t>(R), 0);
  heap.comm().allgather(mine.data(), all.data(), sizeof(std::int32_t));
  return *std::min_element(all.begin(), all.end());
}
}  // namespace

Movers::Movers(const SymmetricHeap& heap, int local, const MoverOptions& options, int linkChannels,
               std::uint32_t networkMask)
    : heap_(&heap),
      local_(local),
      warpsPerRole_(heap.config().moverWarps),
      ceMinBytes_(options.copyEngineMinBytes),
      a2aZeroCopyMinBytes_(options.allToAllvZeroCopyMinBytes),
      linkChannels_(linkChannels),
      mesh_(heap, local),
      networkMask_(networkMask) {
  GRAPHEP_CUDA_CHECK(cudaSetDevice(heap.device(local)));
  const int device = heap.device(local);
  if (mesh_.anyRemote() && options.maxRemoteBytesPerPeer > 0) {
    remoteCap_ = remoteCapOf(options);
    remoteStage_ = deviceArray<char>(device, remoteStageBytes(options, heap.worldSize()), false);
  }
  if (options.profile) profile_ = deviceArray<ProfileCounters>(device, 1);
  if (networkMask_ != 0) {
    networkBytes_ = deviceArray<unsigned long long>(device, static_cast<std::size_t>(heap.worldSize()));
    networkMbps_ = static_cast<std::uint32_t>(env::kEmulatedNetworkMbps.get());
  }
  GRAPHEP_CUDA_CHECK(preloadSendRecvKernels());
  GRAPHEP_CUDA_CHECK(preloadAllToAllvKernels());
}

std::size_t Movers::remoteStageBytes(const MoverOptions& options, int worldSize) {
  return 2 * remoteCapOf(options) * static_cast<std::size_t>(worldSize);  // [2][worldSize][cap]
}

std::vector<Movers> Movers::createAll(const SymmetricHeap& heap, const MoverOptions& options, const NodeMap* known) {
  const int linkChannels = agreedLinkChannels(heap);
  if (linkChannels < heap.config().moverBlocks) {
    GRAPHEP_LOG_INFO(log::kTune, "data movers: at most %d channels per link, so that every waiting CTA of the ranks "
                     "sharing a GPU is resident at once", linkChannels);
  }
  // Emulated nodes (tests): the peers on other nodes, whose bytes the movers count.
  const NodeMap nodes = known != nullptr ? *known : nodeMapOf(heap);  // collective
  const bool emulated = nodes.emulated && nodes.numNodes > 1;
  if (emulated) logNodes(heap, nodes);
  std::vector<Movers> all;
  for (int l = 0; l < heap.numLocalRanks(); ++l) {
    all.push_back(Movers(heap, l, options, linkChannels, emulated ? nodes.networkMask(heap.rank(l)) : 0u));
  }
  // Warm-up, outside any capture: exchanges of 16 B, 1 MiB and the alltoallv stage size with every
  // remote peer, so NCCL sets up its connections (and the channels larger messages use) now rather
  // than inside a captured graph.
  std::vector<const MeshTransport*> meshes;
  bool anyRemote = false;
  for (const Movers& m : all) {
    meshes.push_back(&m.mesh_);
    anyRemote |= m.mesh_.anyRemote();
  }
  if (anyRemote) {
    std::vector<std::size_t> sizes{std::size_t{16}, std::size_t{1} << 20};
    if (all[0].remoteCap_ > 0) sizes.push_back(all[0].remoteCap_);
    if (options.fixedSlotBytes > 0) sizes.push_back(options.fixedSlotBytes);
    MeshTransport::warmUp(heap, meshes, sizes);
  }
  for (int l = 0; l < heap.numLocalRanks(); ++l) {  // the setup's legacy-stream writes landed
    GRAPHEP_CUDA_CHECK(cudaSetDevice(heap.device(l)));
    GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  }
  heap.comm().barrier();
  return all;
}

bool Movers::remote(int peer) const { return mesh_.route(peer) == Route::kNccl; }

int Movers::llChannelsFor(std::size_t bytes, int numChannels) const {
  const HeapConfig& cfg = heap_->config();
  return static_cast<int>(graphep::llChannelsFor(bytes, static_cast<std::uint32_t>(numChannels),
                                                 cfg.moverLLBytes,
                                                 std::min({static_cast<std::uint32_t>(cfg.moverBlocks),
                                                           kLLMaxChannels,
                                                           static_cast<std::uint32_t>(linkChannels_)})));
}

int Movers::channelsFor(std::size_t bytes, bool zeroCopy, int peer) const {
  std::uint32_t cap = static_cast<std::uint32_t>(std::min(heap_->config().moverBlocks, linkChannels_));
  if (zeroCopy) cap = std::min(cap, kZeroCopyMaxChannels);
  if (peer >= 0 && heap_->peerClass(local_, peer) == PeerClass::kSameDevice) {
    cap = std::min(cap, kSameDeviceMaxChannels);  // symmetric: the peer caps alike
  }
  return static_cast<int>(autoChannels(bytes, cap));
}

SendLink Movers::sendLink(int peer) const {
  const HeapConfig& cfg = heap_->config();
  const HeapLayout& L = heap_->layout();
  const std::size_t B = static_cast<std::size_t>(cfg.moverBlocks);
  char* mine = heap_->base(local_);
  char* theirs = heap_->peerBase(local_, peer);
  const std::size_t asSource = static_cast<std::size_t>(heap_->rank(local_)) * B;  // in the peer's tables
  const std::size_t asPeer = static_cast<std::size_t>(peer) * B;                    // in my tables
  auto u32 = [](char* base, std::size_t off) { return reinterpret_cast<std::uint32_t*>(base + off); };
  SendLink l{};
  l.peer = peer;
  l.staging = theirs + L.staging + asSource * cfg.moverSlots * cfg.moverSlotBytes;
  l.head = u32(theirs, L.moverHead) + asSource;
  l.tail = u32(mine, L.moverTail) + asPeer;
  l.ready = u32(mine, L.moverReady) + asPeer;
  l.step = u32(mine, L.moverSendStep) + asPeer;
  l.llHalf = llHalfBytes(cfg.moverLLBytes);
  l.llRegion = theirs + L.ll + static_cast<std::size_t>(heap_->rank(local_)) * B * 2 * l.llHalf;
  l.profile = profile_ ? profile_.get()->send : nullptr;
  return l;
}

RecvLink Movers::recvLink(int peer) const {
  const HeapConfig& cfg = heap_->config();
  const HeapLayout& L = heap_->layout();
  const std::size_t B = static_cast<std::size_t>(cfg.moverBlocks);
  char* mine = heap_->base(local_);
  char* theirs = heap_->peerBase(local_, peer);
  const std::size_t asDest = static_cast<std::size_t>(heap_->rank(local_)) * B;  // in the peer's tables
  const std::size_t asPeer = static_cast<std::size_t>(peer) * B;                  // in my tables
  auto u32 = [](char* base, std::size_t off) { return reinterpret_cast<std::uint32_t*>(base + off); };
  RecvLink l{};
  l.peer = peer;
  l.consume = Consume::kCopy;
  l.staging = mine + L.staging + asPeer * cfg.moverSlots * cfg.moverSlotBytes;
  l.head = u32(mine, L.moverHead) + asPeer;
  l.tail = u32(theirs, L.moverTail) + asDest;
  l.ready = u32(theirs, L.moverReady) + asDest;
  l.step = u32(mine, L.moverRecvStep) + asPeer;
  l.llHalf = llHalfBytes(cfg.moverLLBytes);
  l.llRegion = mine + L.ll + static_cast<std::size_t>(peer) * B * 2 * l.llHalf;
  l.profile = profile_ ? profile_.get()->recv : nullptr;
  return l;
}

PipeShape Movers::shape(int channels) const {
  const HeapConfig& cfg = heap_->config();
  GRAPHEP_REQUIRE(channels >= 1 && channels <= cfg.moverBlocks, Status::kInvalidArgument,
                  "numChannels=%d is out of range [1, %d] (HeapConfig.moverBlocks)", channels,
                  cfg.moverBlocks);
  GRAPHEP_REQUIRE(cfg.moverSlotBytes <= UINT32_MAX, Status::kInvalidArgument,
                  "HeapConfig.moverSlotBytes=%zu exceeds 4 GiB", cfg.moverSlotBytes);
  PipeShape sh{};
  sh.numChannels = static_cast<std::uint32_t>(channels);
  sh.numSlots = static_cast<std::uint32_t>(cfg.moverSlots);
  // With no staging configured only zero-copy and NCCL transfers run; chunks then only count steps.
  sh.slotBytes = cfg.moverSlotBytes > 0 ? static_cast<std::uint32_t>(cfg.moverSlotBytes) : (1u << 30);
  return sh;
}

// Whether a zero-copy direction of `bytes` goes by the copy engine (both ends decide alike).
bool Movers::copyEngine(const SendRecvArgs& a, std::size_t bytes) const {
  switch (a.zeroCopyEngine) {
    case ZeroCopyEngine::kSm:
      return false;
    case ZeroCopyEngine::kCopyEngine:
      return true;
    default:
      return ceMinBytes_ > 0 && bytes >= ceMinBytes_;
  }
}

SendRecvParams Movers::params(const SendRecvArgs& a) const {
  const HeapConfig& cfg = heap_->config();
  const int R = cfg.numRanks;
  for (auto [role, peer] : {std::pair{"send", a.sendPeer}, std::pair{"receive", a.recvPeer}}) {
    GRAPHEP_REQUIRE(peer >= -1 && peer < R, Status::kInvalidArgument,
                    "sendRecv: %s peer %d is out of range [-1, %d)", role, peer, R);
  }
  const bool sendNvl = a.sendPeer >= 0 && !remote(a.sendPeer);
  const bool recvNvl = a.recvPeer >= 0 && !remote(a.recvPeer);
  const bool sendZeroCopy = a.sendToUserOffset >= 0;
  const bool tiled = a.wire != Wire::kBytes;
  GRAPHEP_REQUIRE(sendRecvSupports(a.wire, a.consume), Status::kInvalidArgument,
                  "sendRecv: consume=%u does not apply to wire format %u (kBytes: kCopy, kAdd*, "
                  "kWeightedAdd*; kFp8E4m3: kCopy, kFp8ToBf16)",
                  static_cast<unsigned>(a.consume), static_cast<unsigned>(a.wire));
  if (tiled) {
    GRAPHEP_REQUIRE(a.sendBytes % kFp8TileSrcBytes == 0 && a.recvBytes % kFp8TileSrcBytes == 0,
                    Status::kInvalidArgument,
                    "sendRecv: the fp8 wire format moves whole tiles of 128 bf16: sendBytes=%zu and "
                    "recvBytes=%zu must be multiples of %llu",
                    a.sendBytes, a.recvBytes, static_cast<unsigned long long>(kFp8TileSrcBytes));
    GRAPHEP_REQUIRE(!sendZeroCopy && !a.recvZeroCopy, Status::kInvalidArgument,
                    "sendRecv: the fp8 wire format runs staged, not zero-copy");
    GRAPHEP_REQUIRE((a.sendPeer < 0 || sendNvl) && (a.recvPeer < 0 || recvNvl), Status::kNotSupported,
                    "sendRecv: the fp8 wire format needs load/store peers (send %d, receive %d)",
                    a.sendPeer, a.recvPeer);
    GRAPHEP_REQUIRE(cfg.moverSlotBytes >= kFp8TileWireBytes, Status::kInvalidArgument,
                    "sendRecv: HeapConfig.moverSlotBytes=%zu is smaller than one %llu-byte fp8 record",
                    cfg.moverSlotBytes, static_cast<unsigned long long>(kFp8TileWireBytes));
    GRAPHEP_REQUIRE(a.sendBytes == 0 || (reinterpret_cast<std::uintptr_t>(a.src) & 15u) == 0,
                    Status::kInvalidArgument, "sendRecv: fp8 src %p is not 16-byte aligned", a.src);
    GRAPHEP_REQUIRE(a.recvBytes == 0 || (reinterpret_cast<std::uintptr_t>(a.dst) & 15u) == 0,
                    Status::kInvalidArgument, "sendRecv: fp8 dst %p is not 16-byte aligned", a.dst);
  }
  // LL mode for small transfers: both ends decide from the byte count and channel count alone
  // (and the zero-copy flag and wire format, which both ends pass alike), so they always agree.
  GRAPHEP_REQUIRE(a.numChannels >= 0 && a.numChannels <= cfg.moverBlocks, Status::kInvalidArgument,
                  "sendRecv: numChannels=%d is out of range [0, %d] (HeapConfig.moverBlocks)", a.numChannels,
                  cfg.moverBlocks);
  // A caller's channel count is capped like the automatic one (every rank caps alike).
  const int numChannels = std::min(a.numChannels, linkChannels_);
  const int sendLLChannels =
      sendNvl && !sendZeroCopy && !tiled ? llChannelsFor(a.sendBytes, numChannels) : 0;
  const int recvLLChannels =
      recvNvl && !a.recvZeroCopy && !tiled ? llChannelsFor(a.recvBytes, numChannels) : 0;
  const bool sendLL = sendLLChannels > 0;
  const bool recvLL = recvLLChannels > 0;
  GRAPHEP_REQUIRE(a.zeroCopyEngine == ZeroCopyEngine::kAuto || a.zeroCopyEngine == ZeroCopyEngine::kSm ||
                      a.zeroCopyEngine == ZeroCopyEngine::kCopyEngine,
                  Status::kInvalidArgument, "sendRecv: zeroCopyEngine=%d is not a ZeroCopyEngine",
                  static_cast<int>(a.zeroCopyEngine));
  const bool sendCe = sendNvl && sendZeroCopy && copyEngine(a, a.sendBytes);
  const bool recvCe = recvNvl && a.recvZeroCopy && copyEngine(a, a.recvBytes);
  const bool needStaging = (sendNvl && !sendZeroCopy && !sendLL && a.sendBytes > 0) ||
                           (recvNvl && !a.recvZeroCopy && !recvLL && a.recvBytes > 0);
  GRAPHEP_REQUIRE(!needStaging || cfg.moverSlotBytes > 0, Status::kInvalidArgument,
                  "sendRecv: staged transfers need HeapConfig.moverSlotBytes > 0 (it is 0)");
  GRAPHEP_REQUIRE(a.recvPeer < 0 || recvNvl || a.consume == Consume::kCopy, Status::kNotSupported,
                  "sendRecv: a reducing receive from remote rank %d is not supported (NCCL delivers "
                  "plain bytes)",
                  a.recvPeer);

  SendRecvParams p{};
  p.sync = heap_->syncHandle(local_);
  // Each direction's channel count comes from its own bytes, which both ends of that link know.
  // A copy-engine direction runs its flags on one channel whatever numChannels says.
  p.sendShape = shape(sendLL ? sendLLChannels
                      : sendCe ? 1
                               : (numChannels > 0 ? numChannels : channelsFor(a.sendBytes, sendZeroCopy, a.sendPeer)));
  p.recvShape = shape(recvLL ? recvLLChannels
                      : recvCe ? 1
                               : (numChannels > 0 ? numChannels : channelsFor(a.recvBytes, a.recvZeroCopy, a.recvPeer)));
  p.warpsPerRole = static_cast<std::uint32_t>(warpsPerRole_);
  p.wire = a.wire;
  // Remote roles are served by NCCL (sendRecv); the kernel sees them as disabled.
  p.send.peer = -1;
  p.recv.peer = -1;
  if (sendNvl) {
    GRAPHEP_REQUIRE(a.sendBytes == 0 || a.src != nullptr, Status::kInvalidArgument,
                    "sendRecv: src is null with sendBytes=%zu", a.sendBytes);
    p.send = sendLink(a.sendPeer);
    p.send.src = static_cast<const char*>(a.src);
    p.send.bytes = a.sendBytes;
    p.send.ll = sendLL ? 1 : 0;
    if (sendZeroCopy) {
      GRAPHEP_REQUIRE(static_cast<std::size_t>(a.sendToUserOffset) + a.sendBytes <= cfg.userBytes,
                      Status::kInvalidArgument,
                      "sendRecv: zero-copy send of %zu bytes at user offset %lld exceeds the "
                      "%zu-byte user region",
                      a.sendBytes, a.sendToUserOffset, cfg.userBytes);
      p.send.direct = heap_->peerUser(local_, a.sendPeer) + a.sendToUserOffset;
      if (sendCe) p.send.ce = CePhase::kBefore;
    }
  }
  if (recvNvl) {
    GRAPHEP_REQUIRE(a.recvBytes == 0 || a.dst != nullptr, Status::kInvalidArgument,
                    "sendRecv: dst is null with recvBytes=%zu", a.recvBytes);
    p.recv = recvLink(a.recvPeer);
    p.recv.dst = static_cast<char*>(a.dst);
    p.recv.bytes = a.recvBytes;
    p.recv.ll = recvLL ? 1 : 0;
    if (a.recvZeroCopy) {
      const char* user = heap_->user(local_);
      const char* d = static_cast<const char*>(a.dst);
      GRAPHEP_REQUIRE(a.recvBytes == 0 || (d >= user && d + a.recvBytes <= user + cfg.userBytes),
                      Status::kInvalidArgument,
                      "sendRecv: zero-copy dst [%p, +%zu) is not inside this rank's user region",
                      a.dst, a.recvBytes);
      p.recv.direct = 1;
      if (recvCe) p.recv.ce = CePhase::kBefore;
    }
    p.recv.consume = a.consume;
    if (a.consume != Consume::kCopy && !tiled) {
      GRAPHEP_REQUIRE(!a.recvZeroCopy, Status::kInvalidArgument,
                      "sendRecv: a reducing receive cannot be zero-copy");
      const std::uint32_t elem = consumeElemBytes(a.consume);
      GRAPHEP_REQUIRE(a.recvBytes % elem == 0, Status::kInvalidArgument,
                      "sendRecv: recvBytes=%zu is not a multiple of the %u-byte element",
                      a.recvBytes, elem);
      GRAPHEP_REQUIRE(a.recvBytes == 0 || a.addend != nullptr, Status::kInvalidArgument,
                      "sendRecv: a reducing receive of %zu bytes needs an addend", a.recvBytes);
      p.recv.addend = static_cast<const char*>(a.addend);
      if (a.consume == Consume::kWeightedAddF32 || a.consume == Consume::kWeightedAddBf16) {
        GRAPHEP_REQUIRE(a.rowBytes > 0 && a.rowBytes % 16 == 0, Status::kInvalidArgument,
                        "sendRecv: weighted accumulation needs rowBytes as a positive multiple of "
                        "16 (it is %zu)",
                        a.rowBytes);
        GRAPHEP_REQUIRE(a.recvBytes == 0 || a.weights != nullptr, Status::kInvalidArgument,
                        "sendRecv: weighted accumulation of %zu bytes needs weights (one per "
                        "%zu-byte row)",
                        a.recvBytes, a.rowBytes);
        p.recv.weights = a.weights;
        p.recv.rowBytes = a.rowBytes;
      }
    }
  }
  if (a.localBytes > 0) {
    GRAPHEP_REQUIRE(a.localSrc != nullptr && a.localDst != nullptr, Status::kInvalidArgument,
                    "sendRecv: a local copy of %zu bytes needs localSrc and localDst", a.localBytes);
    p.localSrc = static_cast<const char*>(a.localSrc);
    p.localDst = static_cast<char*>(a.localDst);
    p.localBytes = a.localBytes;
    p.localChannels = static_cast<std::uint32_t>(channelsFor(a.localBytes));
  }
  return p;
}

void Movers::allGatherRing(cudaStream_t stream, const void* in, void* out,
                           std::size_t chunkBytes, bool zeroCopy) const {
  const int R = heap_->worldSize();
  const int me = heap_->rank(local_);
  char* o = static_cast<char*>(out);
  GRAPHEP_REQUIRE(chunkBytes == 0 || (in != nullptr && out != nullptr), Status::kInvalidArgument,
                  "allGatherRing: null buffer with chunkBytes=%zu", chunkBytes);
  long long outOffset = -1;
  if (zeroCopy) {
    const char* user = heap_->user(local_);
    GRAPHEP_REQUIRE(o >= user && o + chunkBytes * R <= user + heap_->config().userBytes,
                    Status::kInvalidArgument,
                    "allGatherRing: zero-copy out [%p, +%zu) is not inside the user region", out,
                    chunkBytes * R);
    outOffset = o - user;
  }
  char* mine = o + chunkBytes * static_cast<std::size_t>(me);
  const bool copyMine = in != mine && chunkBytes > 0;
  if (R == 1) {
    if (copyMine) GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(mine, in, chunkBytes, cudaMemcpyDeviceToDevice, stream));
    return;
  }
  const int next = (me + 1) % R, prev = (me + R - 1) % R;
  for (int k = 0; k < R - 1; ++k) {
    const std::size_t js = static_cast<std::size_t>((me - k + R) % R);
    const std::size_t jr = static_cast<std::size_t>((me - k - 1 + 2 * R) % R);
    SendRecvArgs a;
    a.sendPeer = next;
    // Step 0 sends this rank's chunk straight from `in` and copies it into `out` in the same
    // launch; later steps forward chunks received into `out`.
    a.src = k == 0 ? in : o + js * chunkBytes;
    a.sendBytes = chunkBytes;
    if (k == 0 && copyMine) {
      a.localSrc = in;
      a.localDst = mine;
      a.localBytes = chunkBytes;
    }
    a.recvPeer = prev;
    a.dst = o + jr * chunkBytes;
    a.recvBytes = chunkBytes;
    if (zeroCopy) {
      a.sendToUserOffset = outOffset + static_cast<long long>(js * chunkBytes);
      a.recvZeroCopy = true;
      // Step 0's own-chunk copy would hold a copy-engine transfer back until it ends (stream
      // order); the SMs overlap the two. Every rank decides alike (k only).
      if (k == 0) a.zeroCopyEngine = ZeroCopyEngine::kSm;
    }
    sendRecv(stream, a);  // stream order: step k+1 forwards what step k received
  }
}

void Movers::reduceScatterRing(cudaStream_t stream, const void* in, void* out, void* scratch,
                               std::size_t count, Consume addKind) const {
  GRAPHEP_REQUIRE(addKind == Consume::kAddF32 || addKind == Consume::kAddBf16,
                  Status::kInvalidArgument,
                  "reduceScatterRing: consume=%u is not a reduction (kAddF32 or kAddBf16)",
                  static_cast<unsigned>(addKind));
  const int R = heap_->worldSize();
  const int me = heap_->rank(local_);
  const std::size_t chunk = count * consumeElemBytes(addKind);
  const char* input = static_cast<const char*>(in);
  GRAPHEP_REQUIRE(count == 0 || (in != nullptr && out != nullptr && (R == 1 || scratch != nullptr)),
                  Status::kInvalidArgument, "reduceScatterRing: null buffer with count=%zu", count);
  GRAPHEP_REQUIRE(scratch != out && scratch != in, Status::kInvalidArgument,
                  "reduceScatterRing: scratch must not alias in or out");
  if (R == 1) {
    if (chunk > 0 && in != out) {
      GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(out, in, chunk, cudaMemcpyDeviceToDevice, stream));
    }
    return;
  }
  const int next = (me + 1) % R, prev = (me + R - 1) % R;
  // Step k receives chunk jr = me-2-k, adds this rank's input of jr, and stores the partial in
  // B_k; step k+1 sends B_k on. B alternates so the last step (k = R-2, jr = me) lands in out.
  auto partial = [&](int k) { return ((R - 2 - k) % 2 == 0) ? static_cast<char*>(out) : static_cast<char*>(scratch); };
  for (int k = 0; k < R - 1; ++k) {
    const std::size_t js = static_cast<std::size_t>(((me - 1 - k) % R + R) % R);
    const std::size_t jr = static_cast<std::size_t>(((me - 2 - k) % R + R) % R);
    SendRecvArgs a;
    a.sendPeer = next;
    a.src = k == 0 ? input + js * chunk : partial(k - 1);
    a.sendBytes = chunk;
    a.recvPeer = prev;
    a.dst = partial(k);
    a.recvBytes = chunk;
    a.consume = addKind;
    a.addend = input + jr * chunk;
    sendRecv(stream, a);
  }
}

AllToAllvParams Movers::allToAllvParams(const AllToAllvArgs& a) const {
  const HeapConfig& cfg = heap_->config();
  const int R = cfg.numRanks;
  const int me = heap_->rank(local_);
  GRAPHEP_REQUIRE(a.sendCounts && a.sendOffsets && a.recvCounts && a.recvOffsets,
                  Status::kInvalidArgument,
                  "allToAllv: counts and offsets must be device arrays of %d entries (one is null)", R);
  GRAPHEP_REQUIRE((a.srcBytes == 0 || a.src) && (a.dstBytes == 0 || a.dst), Status::kInvalidArgument,
                  "allToAllv: null src or dst with capacities %zu / %zu bytes", a.srcBytes,
                  a.dstBytes);
  GRAPHEP_REQUIRE(cfg.moverSlotBytes > 0, Status::kInvalidArgument,
                  "allToAllv: needs HeapConfig.moverSlotBytes > 0 (it is 0)");
  GRAPHEP_REQUIRE(a.channelsPerPeer >= 0 && a.channelsPerPeer <= cfg.moverBlocks,
                  Status::kInvalidArgument,
                  "allToAllv: channelsPerPeer=%d is out of range [0, %d] (HeapConfig.moverBlocks)",
                  a.channelsPerPeer, cfg.moverBlocks);
  GRAPHEP_REQUIRE(a.slotStride == 0 || (a.fixedSlots && a.slotStride >= a.maxBytesPerPeer), Status::kInvalidArgument,
                  "allToAllv: slotStride=%zu needs fixedSlots and at least maxBytesPerPeer=%zu", a.slotStride,
                  a.maxBytesPerPeer);
  const std::size_t stride = a.slotStride > 0 ? a.slotStride : a.maxBytesPerPeer;
  if (a.fixedSlots) {
    const std::size_t need = stride * static_cast<std::size_t>(R - 1) + a.maxBytesPerPeer;
    GRAPHEP_REQUIRE(a.maxBytesPerPeer > 0 && a.srcBytes >= need && a.dstBytes >= need, Status::kInvalidArgument,
                    "allToAllv: fixedSlots needs maxBytesPerPeer > 0 and src and dst of %d slots of it %zu bytes apart "
                    "(%zu bytes); maxBytesPerPeer=%zu, srcBytes=%zu, dstBytes=%zu",
                    R, stride, need, a.maxBytesPerPeer, a.srcBytes, a.dstBytes);
  }
  AllToAllvParams p{};
  p.sync = heap_->syncHandle(local_);
  const PipeShape sh = shape(1);
  p.numSlots = sh.numSlots;
  p.slotBytes = sh.slotBytes;
  p.warpsPerRole = static_cast<std::uint32_t>(warpsPerRole_);
  p.minBytesPerChannel = kBytesPerChannel;
  p.src = static_cast<const char*>(a.src);
  p.dst = static_cast<char*>(a.dst);
  p.srcBytes = a.srcBytes;
  p.dstBytes = a.dstBytes;
  p.sendCounts = a.sendCounts;
  p.sendOffsets = a.sendOffsets;
  p.recvCounts = a.recvCounts;
  p.recvOffsets = a.recvOffsets;
  if (a.zeroCopy) {
    const char* user = heap_->user(local_);
    const char* d = static_cast<const char*>(a.dst);
    GRAPHEP_REQUIRE(a.dstBytes == 0 || (d >= user && d + a.dstBytes <= user + cfg.userBytes),
                    Status::kInvalidArgument,
                    "allToAllv: zero-copy dst [%p, +%zu) is not inside this rank's %zu-byte user region",
                    a.dst, a.dstBytes, cfg.userBytes);
    p.zeroCopy = 1;
    p.zeroCopyMinBytes = a2aZeroCopyMinBytes_;
    p.dstUserOffset = a.dstBytes == 0 ? 0 : static_cast<std::uint64_t>(d - user);
  }
  const std::size_t maxBytes = a.maxBytesPerPeer > 0 ? a.maxBytesPerPeer : std::max(a.srcBytes, a.dstBytes);
  const int full = std::min(a.channelsPerPeer > 0 ? a.channelsPerPeer : channelsFor(maxBytes), linkChannels_);
  int next = 0;
  // Each remote peer's NCCL message (every rank passes the same arguments, so both ends of a
  // message agree on its size): with fixed slots the slot itself, moved in place; else the stage
  // capacity, or maxBytesPerPeer where smaller (a count exchange of a few hundred bytes then moves
  // that, not the stage's megabytes), rounded up to 16 bytes as the capacity is, so every peer's
  // stage slot stays aligned for the copies.
  if (a.fixedSlots) {
    p.remoteInPlace = 1;
    p.remoteCap = a.maxBytesPerPeer;
    p.remoteStride = stride;
  } else {
    p.remoteCap = a.maxBytesPerPeer > 0 ? std::min(remoteCap_, (a.maxBytesPerPeer + 15) & ~std::size_t{15}) : remoteCap_;
    if (remoteStage_) {
      p.remoteSend = remoteStage_.get();
      p.remoteRecv = remoteStage_.get() + remoteCap_ * static_cast<std::size_t>(R);
    }
    p.remoteStride = p.remoteCap;
  }
  for (int q = 0; q < R; ++q) {
    const PeerClass c = heap_->peerClass(local_, q);
    const Route route = mesh_.route(q);
    GRAPHEP_REQUIRE(route != Route::kNccl || remoteCap_ > 0 || a.fixedSlots, Status::kNotSupported,
                    "allToAllv: rank %d reaches rank %d only as %s, and "
                    "MoverOptions.maxRemoteBytesPerPeer is 0 (set it to stage NCCL messages)",
                    me, q, peerClassName(c));
    // Per-class channel counts: peers sharing this GPU need few CTAs; NVLink / PCIe peers, the
    // rank's own block (a local copy, as large as any) and remote peers (the gather into and the
    // unpack out of their NCCL stages: local copies of a whole message, which CTAs that wait on
    // nothing make) get the full count.
    int ch = full;
    if (c == PeerClass::kSameDevice && route != Route::kNccl) {
      ch = std::min(full, static_cast<int>(kSameDeviceMaxChannels));
    }
    if (route == Route::kNccl && a.fixedSlots) ch = 1;  // NCCL moves it in place: one CTA checks the tables
    if (q == me && a.skipOwnBlock) ch = 0;
    const bool sends = ((a.sendPeers >> q) & 1u) != 0, receives = ((a.recvPeers >> q) & 1u) != 0;
    if (!sends && !receives) ch = 0;  // no link with q in this call
    p.firstChannel[q] = static_cast<std::uint16_t>(next);
    next += ch;
    p.send[q].peer = -1;
    p.recv[q].peer = -1;
    if (route == Route::kNccl) {
      if (sends || receives) p.remoteMask |= 1u << q;
    } else if (route == Route::kLoadStore && (sends || receives)) {
      if (sends) p.send[q] = sendLink(q);
      if (receives) p.recv[q] = recvLink(q);
      if (a.zeroCopy) {
        const std::size_t B = static_cast<std::size_t>(cfg.moverBlocks);
        auto mailbox = [&](char* base, int slot) {
          return reinterpret_cast<std::uint64_t*>(base + heap_->layout().moverMailbox) +
                 static_cast<std::size_t>(slot) * B * 2;
        };
        if (sends) {
          p.send[q].direct = heap_->peerUser(local_, q);
          p.send[q].mailbox = mailbox(heap_->base(local_), q);              // q writes it
        }
        if (receives) {
          p.recv[q].direct = 1;
          p.recv[q].mailbox = mailbox(heap_->peerBase(local_, q), me);      // in q's heap
        }
      }
    }
  }
  p.firstChannel[R] = static_cast<std::uint16_t>(next);
  return p;
}

void Movers::allToAllv(cudaStream_t stream, const AllToAllvArgs& args) const {
  const AllToAllvParams p = allToAllvParams(args);
  if ((networkMask_ & args.sendPeers) != 0) {
    GRAPHEP_CUDA_CHECK(
        launchAllToAllvNetworkBytes(p, networkMask_ & args.sendPeers, networkBytes_.get(), networkMbps_, stream));
  }
  if (p.remoteMask != 0) {
    // Remote peers: fixed-size NCCL messages, straight between the slots of src and dst (fixed
    // slots), or else gathered into stages, exchanged, and scattered by the alltoallv kernel by
    // their device counts.
    if (!p.remoteInPlace) GRAPHEP_CUDA_CHECK(launchAllToAllvGather(p, stream));
    const char* from = p.remoteInPlace ? p.src : p.remoteSend;
    char* to = p.remoteInPlace ? p.dst : const_cast<char*>(p.remoteRecv);
    for (int q = 0; q < heap_->worldSize(); ++q) {
      if ((p.remoteMask & (1u << q)) != 0) mesh_.nccl().require(q);
    }
    NcclGroup group;
    for (int q = 0; q < heap_->worldSize(); ++q) {
      if ((p.remoteMask & (1u << q)) == 0) continue;
      if ((args.sendPeers >> q) & 1u) mesh_.nccl().put(stream, q, from + p.remoteStride * q, p.remoteCap);
      if ((args.recvPeers >> q) & 1u) mesh_.nccl().get(stream, q, to + p.remoteStride * q, p.remoteCap);
    }
    group.end();
  }
  // No channels (one rank whose own block is skipped, every other peer in place): nothing to launch.
  if (p.firstChannel[heap_->worldSize()] == 0) return;
  GRAPHEP_CUDA_CHECK(launchAllToAllv(p, stream));
}

void Movers::sendRecv(cudaStream_t stream, const SendRecvArgs& args) const {
  const SendRecvParams p = params(args);
  if (p.send.peer >= 0 || p.recv.peer >= 0 || p.localChannels > 0) {
    GRAPHEP_CUDA_CHECK(launchSendRecv(p, stream));
  }
  const bool sendCe = p.send.peer >= 0 && p.send.ce != CePhase::kNone;
  const bool recvCe = p.recv.peer >= 0 && p.recv.ce != CePhase::kNone;
  if (sendCe || recvCe) {
    // Copy-engine zero-copy: the launch above ran every SM role and the flags before the copy
    // (ready); the copy runs in stream order after it, and a one-CTA launch publishes it (head) and
    // waits for the peer's copy into this rank (CePhase in kernels/common/pipe.h). Nothing in the
    // first launch waits on a second launch, so the two ranks' sequences cannot deadlock.
    if (sendCe) CopyEngineTransport::put(stream, p.send.direct, p.send.src, p.send.bytes);
    SendRecvParams after = p;
    after.localBytes = 0;
    after.localChannels = 0;
    if (sendCe) {
      after.send.ce = CePhase::kAfter;
    } else {
      after.send.peer = -1;
    }
    if (recvCe) {
      after.recv.ce = CePhase::kAfter;
    } else {
      after.recv.peer = -1;
    }
    after.sendShape = shape(1);
    after.recvShape = shape(1);
    GRAPHEP_CUDA_CHECK(launchSendRecv(after, stream));
  }
  const bool ncclSendRole = args.sendPeer >= 0 && remote(args.sendPeer) && args.sendBytes > 0;
  const bool ncclRecvRole = args.recvPeer >= 0 && remote(args.recvPeer) && args.recvBytes > 0;
  if (!ncclSendRole && !ncclRecvRole) return;
  // After the kernel on the same stream; grouped so a send and a receive cannot block each other.
  if (ncclSendRole) mesh_.nccl().require(args.sendPeer);
  if (ncclRecvRole) mesh_.nccl().require(args.recvPeer);
  NcclGroup group;
  if (ncclSendRole) mesh_.nccl().put(stream, args.sendPeer, args.src, args.sendBytes);
  if (ncclRecvRole) mesh_.nccl().get(stream, args.recvPeer, args.dst, args.recvBytes);
  group.end();
}

std::vector<std::uint64_t> Movers::networkBytes() const {
  std::vector<std::uint64_t> bytes(static_cast<std::size_t>(heap_->worldSize()), 0);
  if (!networkBytes_) return bytes;
  GRAPHEP_CUDA_CHECK(cudaSetDevice(heap_->device(local_)));
  GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  static_assert(sizeof(unsigned long long) == sizeof(std::uint64_t), "the counters are 64-bit");
  GRAPHEP_CUDA_CHECK(cudaMemcpy(bytes.data(), networkBytes_.get(), bytes.size() * sizeof(std::uint64_t),
                                cudaMemcpyDeviceToHost));
  return bytes;
}

void Movers::resetNetworkBytes() const {
  if (!networkBytes_) return;
  GRAPHEP_CUDA_CHECK(cudaSetDevice(heap_->device(local_)));
  GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  GRAPHEP_CUDA_CHECK(cudaMemset(networkBytes_.get(), 0,
                                static_cast<std::size_t>(heap_->worldSize()) * sizeof(unsigned long long)));
  GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());  // landed before the caller's next (non-blocking) stream work
}

ProfileCounters Movers::profile() const {
  ProfileCounters c{};
  if (!profile_) return c;
  GRAPHEP_CUDA_CHECK(cudaSetDevice(heap_->device(local_)));
  GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  GRAPHEP_CUDA_CHECK(cudaMemcpy(&c, profile_.get(), sizeof(c), cudaMemcpyDeviceToHost));
  return c;
}

void Movers::resetProfile() const {
  if (!profile_) return;
  GRAPHEP_CUDA_CHECK(cudaSetDevice(heap_->device(local_)));
  GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  GRAPHEP_CUDA_CHECK(cudaMemset(profile_.get(), 0, sizeof(ProfileCounters)));
  GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());  // landed before the caller's next (non-blocking) stream work
}

}  // namespace graphep
