#include "engine/heap.hpp"

#include <cuda_runtime.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <mutex>
#include <set>
#include <utility>

#include "engine/env.hpp"
#include "engine/error.hpp"
#include "engine/log.hpp"
#include "engine/nvtx.hpp"
#include "engine/platform.hpp"
#include "engine/topology.hpp"

namespace graphep {
namespace {

// What each rank publishes about itself at setup.
struct RankInfo {
  std::uint64_t hostHash;
  std::uint64_t configHash;
  std::uint64_t heapBytes;
  std::uint64_t basePtr;  // meaningful only inside the same process
  std::int32_t pid;
  std::int32_t rank;
  std::int32_t device;
  std::int32_t pad;
  unsigned char uuid[16];
  cudaIpcMemHandle_t ipc;
};

std::uint64_t fnv1a(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

std::uint64_t hostHash() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::string id(host);
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string bootId;
  if (boot >> bootId) id += ":" + bootId;
  return fnv1a(id);
}

void deviceUuid(int device, unsigned char out[16]) {
  cudaDeviceProp prop{};
  GRAPHEP_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::memcpy(out, prop.uuid.bytes, 16);
}

// Ordinal of the visible device with this UUID, or -1.
int ordinalOfUuid(const unsigned char uuid[16]) {
  int n = 0;
  GRAPHEP_CUDA_CHECK(cudaGetDeviceCount(&n));
  for (int d = 0; d < n; ++d) {
    unsigned char u[16];
    deviceUuid(d, u);
    if (std::memcmp(u, uuid, 16) == 0) return d;
  }
  return -1;
}

// Load/store access from the current device's context to device peerOrdinal, asked for once per
// (context, peer) in the process. Asking again answers cudaErrorPeerAccessAlreadyEnabled, a
// handled error that compute-sanitizer still reports (each engine of a process builds a heap);
// the context's unique id keys the record, so a context made anew (a device reset) is asked
// again. Access enabled outside graphep answers "already enabled", taken as done.
void enablePeerAccessOnce(int peerOrdinal) {
  static std::mutex mu;
  static std::set<std::pair<unsigned long long, int>> enabled;
  CUcontext ctx = nullptr;
  GRAPHEP_CU_CHECK(detail::driver().ctxGetCurrent(&ctx));
  GRAPHEP_REQUIRE(ctx != nullptr, Status::kCudaError, "no current CUDA context to enable peer access to device %d from",
                  peerOrdinal);
  unsigned long long id = 0;
  GRAPHEP_CU_CHECK(detail::driver().ctxGetId(ctx, &id));
  const std::lock_guard<std::mutex> lock(mu);
  if (enabled.count({id, peerOrdinal}) != 0) return;
  const cudaError_t e = cudaDeviceEnablePeerAccess(peerOrdinal, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();
  } else {
    GRAPHEP_CUDA_CHECK(e);
  }
  enabled.insert({id, peerOrdinal});
}

}  // namespace

std::unique_ptr<SymmetricHeap> SymmetricHeap::create(Communicator& comm, const HeapConfig& cfg) {
  GRAPHEP_NVTX_RANGE("graphep::SymmetricHeap::create");
  std::unique_ptr<SymmetricHeap> heap(new SymmetricHeap(comm, cfg));
  heap->build();
  return heap;
}

SymmetricHeap::SymmetricHeap(Communicator& comm, const HeapConfig& cfg) : comm_(&comm), cfg_(cfg) {}

SymmetricHeap::~SymmetricHeap() {
  if (pins_->load() > 0) {
    GRAPHEP_LOG_WARN(log::kHeap,
                     "symmetric heap destroyed while %d captured graph(s) still pin it; replaying "
                     "them is now undefined",
                     pins_->load());
  }
  release();
}

const SymmetricHeap::LocalRank& SymmetricHeap::at(int local) const {
  GRAPHEP_REQUIRE(local >= 0 && local < numLocalRanks(), Status::kInvalidArgument,
                  "local rank %d is out of range [0, %d)", local, numLocalRanks());
  return ranks_[static_cast<size_t>(local)];
}

void SymmetricHeap::build() {
  GRAPHEP_REQUIRE(cfg_.numRanks == comm_->worldSize(), Status::kInvalidArgument,
                  "HeapConfig.numRanks=%d but the communicator has %d ranks", cfg_.numRanks,
                  comm_->worldSize());
  layout_ = carveHeap(cfg_, SIZE_MAX);
  const long long timeoutMs = cfg_.timeoutMs >= 0 ? cfg_.timeoutMs : env::kTimeoutMs.get();
  timeoutNs_ = static_cast<std::uint64_t>(timeoutMs) * 1000000ull;
  trapOnTimeout_ = env::kTrapOnTimeout.get();
  const ForceTransport force = forceTransportFromEnv();

  const int nLocal = comm_->numLocalRanks();
  const int world = comm_->worldSize();
  ranks_.assign(static_cast<size_t>(nLocal), LocalRank{});
  std::vector<RankInfo> mine(static_cast<size_t>(nLocal));
  const std::uint64_t myHost = hostHash();

  // Allocate, verify the carve, initialise, and describe each local rank's arena.
  for (int l = 0; l < nLocal; ++l) {
    LocalRank& r = ranks_[static_cast<size_t>(l)];
    r.rank = comm_->globalRank(l);
    r.device = comm_->device(l);
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.device));
    void* p = nullptr;
    GRAPHEP_CUDA_CHECK(cudaMalloc(&p, layout_.totalBytes));
    r.base = static_cast<char*>(p);
    // Carving the real arena must land exactly where the sizing dry run said.
    const HeapLayout check = carveHeap(cfg_, layout_.totalBytes);
    GRAPHEP_REQUIRE(check.totalBytes == layout_.totalBytes, Status::kInternalError,
                    "heap carve mismatch: %zu vs %zu bytes", check.totalBytes, layout_.totalBytes);

    // Zero everything (semaphore counts start at 0), then start the monotonic words at
    // counterStart: flags, steps, epochs and the semaphore totals.
    GRAPHEP_CUDA_CHECK(cudaMemset(r.base, 0, layout_.totalBytes));
    // Sizes come from the carved regions themselves (heap_layout.cpp is the one place).
    for (const HeapRegion& region : layout_.regions) {
      if (!isMonotonicRegion(region.name)) continue;
      const std::vector<std::uint32_t> start(region.bytes / sizeof(std::uint32_t), cfg_.counterStart);
      GRAPHEP_CUDA_CHECK(cudaMemcpy(r.base + region.offset, start.data(), region.bytes,
                                    cudaMemcpyHostToDevice));
    }

    void* rec = nullptr;
    GRAPHEP_CUDA_CHECK(
        cudaHostAlloc(&rec, sizeof(DeviceErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(rec, 0, sizeof(DeviceErrorRecord));
    r.error = static_cast<DeviceErrorRecord*>(rec);
    GRAPHEP_CUDA_CHECK(cudaMalloc(&r.errorWords, kDeviceErrorWords * sizeof(std::uint32_t)));
    GRAPHEP_CUDA_CHECK(cudaMemset(r.errorWords, 0, kDeviceErrorWords * sizeof(std::uint32_t)));

    RankInfo& info = mine[static_cast<size_t>(l)];
    std::memset(&info, 0, sizeof(info));
    info.hostHash = myHost;
    info.configHash = cfg_.hash();
    info.heapBytes = layout_.totalBytes;
    info.basePtr = reinterpret_cast<std::uint64_t>(r.base);
    info.pid = static_cast<std::int32_t>(getpid());
    info.rank = r.rank;
    info.device = r.device;
    deviceUuid(r.device, info.uuid);
    GRAPHEP_CUDA_CHECK(cudaIpcGetMemHandle(&info.ipc, r.base));
  }
  for (int l = 0; l < nLocal; ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(ranks_[static_cast<size_t>(l)].device));
    GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  }

  std::vector<RankInfo> all(static_cast<size_t>(world));
  comm_->allgather(mine.data(), all.data(), sizeof(RankInfo));

  for (int p = 0; p < world; ++p) {
    const RankInfo& a = all[static_cast<size_t>(p)];
    GRAPHEP_REQUIRE(a.rank == p, Status::kInternalError,
                    "allgather slot %d holds rank %d's information", p, a.rank);
    GRAPHEP_REQUIRE(a.configHash == all[0].configHash && a.heapBytes == all[0].heapBytes,
                    Status::kInvalidArgument,
                    "heap config differs across ranks: rank 0 has %llu bytes (hash %016llx), "
                    "rank %d has %llu bytes (hash %016llx)",
                    static_cast<unsigned long long>(all[0].heapBytes),
                    static_cast<unsigned long long>(all[0].configHash), p,
                    static_cast<unsigned long long>(a.heapBytes),
                    static_cast<unsigned long long>(a.configHash));
  }

  // Classify and map every peer of every local rank.
  for (int l = 0; l < nLocal; ++l) {
    LocalRank& r = ranks_[static_cast<size_t>(l)];
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.device));
    const RankInfo& me = all[static_cast<size_t>(r.rank)];
    r.peers.assign(static_cast<size_t>(world), nullptr);
    r.classes.assign(static_cast<size_t>(world), PeerClass::kRemote);
    for (int p = 0; p < world; ++p) {
      const RankInfo& peer = all[static_cast<size_t>(p)];
      PeerFacts f;
      f.isSelf = p == r.rank;
      f.sameHost = peer.hostHash == me.hostHash;
      f.sameProcess = f.sameHost && peer.pid == me.pid;
      f.sameDevice = f.sameHost && std::memcmp(peer.uuid, me.uuid, 16) == 0;
      const int peerOrdinal = f.sameHost ? ordinalOfUuid(peer.uuid) : -1;
      f.peerVisible = peerOrdinal >= 0;
      if (f.peerVisible && !f.sameDevice && !f.isSelf) {
        int can = 0, atomics = 0;
        GRAPHEP_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, r.device, peerOrdinal));
        if (can) {
          GRAPHEP_CUDA_CHECK(cudaDeviceGetP2PAttribute(
              &atomics, cudaDevP2PAttrNativeAtomicSupported, r.device, peerOrdinal));
        }
        f.canAccessPeer = can != 0;
        f.nativeAtomics = atomics != 0;
      }
      const PeerClass c = classifyPeer(f, force);
      r.classes[static_cast<size_t>(p)] = c;
      if (c == PeerClass::kSelf) {
        r.peers[static_cast<size_t>(p)] = r.base;
      } else if (c != PeerClass::kRemote) {
        if (f.sameProcess) {
          if (!f.sameDevice) enablePeerAccessOnce(peerOrdinal);
          r.peers[static_cast<size_t>(p)] = reinterpret_cast<char*>(peer.basePtr);
        } else {
          void* mapped = nullptr;
          GRAPHEP_CUDA_CHECK(
              cudaIpcOpenMemHandle(&mapped, peer.ipc, cudaIpcMemLazyEnablePeerAccess));
          r.peers[static_cast<size_t>(p)] = static_cast<char*>(mapped);
          r.ipcOpened.push_back(static_cast<char*>(mapped));
        }
      }
      GRAPHEP_LOG_INFO(log::kTopo, "rank %d -> rank %d: %s%s", r.rank, p, peerClassName(c),
                       f.sameProcess ? " (same process)" : "");
    }
  }
  // Every pair must agree on whether it has load/store access: a rank storing into a peer that
  // expects NCCL (or the reverse) would deadlock. Mismatches come from per-process environments
  // (GRAPHEP_FORCE_TRANSPORT set on some ranks only) or asymmetric P2P support.
  std::vector<std::uint8_t> myRows(static_cast<size_t>(nLocal) * world);
  for (int l = 0; l < nLocal; ++l) {
    for (int p = 0; p < world; ++p) {
      myRows[static_cast<size_t>(l) * world + p] =
          isLoadStore(ranks_[static_cast<size_t>(l)].classes[static_cast<size_t>(p)]) ? 1 : 0;
    }
  }
  std::vector<std::uint8_t> rows(static_cast<size_t>(world) * world);
  comm_->allgather(myRows.data(), rows.data(), static_cast<size_t>(world));
  for (int a = 0; a < world; ++a) {
    for (int b = 0; b < world; ++b) {
      GRAPHEP_REQUIRE(rows[static_cast<size_t>(a) * world + b] == rows[static_cast<size_t>(b) * world + a],
                      Status::kInvalidArgument,
                      "rank %d %s rank %d by load/store but rank %d %s: classification must be "
                      "symmetric (is GRAPHEP_FORCE_TRANSPORT set on some ranks only?)",
                      a, rows[static_cast<size_t>(a) * world + b] ? "reaches" : "does not reach", b,
                      b, rows[static_cast<size_t>(b) * world + a] ? "reaches it" : "does not reach it");
    }
  }

  GRAPHEP_LOG_INFO(log::kHeap, "symmetric heap: %zu bytes per rank, %d local rank(s) of %d",
                   layout_.totalBytes, nLocal, world);
  // No peer may signal into an arena before its owner finished initialising it.
  comm_->barrier();
}

void SymmetricHeap::release() noexcept {
  for (LocalRank& r : ranks_) {
    if (r.device >= 0) cudaSetDevice(r.device);
    for (char* p : r.ipcOpened) cudaIpcCloseMemHandle(p);
    if (r.base != nullptr) cudaFree(r.base);
    if (r.error != nullptr) cudaFreeHost(r.error);
    if (r.errorWords != nullptr) cudaFree(r.errorWords);
  }
  ranks_.clear();
  cudaGetLastError();
}

void SymmetricHeap::reallocate(const HeapConfig& cfg) {
  GRAPHEP_NVTX_RANGE("graphep::SymmetricHeap::reallocate");
  GRAPHEP_REQUIRE(pins_->load() == 0, Status::kGraphInvalidated,
                  "cannot reallocate the symmetric heap: %d captured graph(s) baked its pointers; "
                  "destroy them first",
                  pins_->load());
  cfg.validate();
  for (const LocalRank& r : ranks_) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.device));
    GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  }
  comm_->barrier();  // no peer still touches the old arenas
  release();
  cfg_ = cfg;
  build();
}

char* SymmetricHeap::peerBase(int local, int peer) const {
  const LocalRank& r = at(local);
  GRAPHEP_REQUIRE(peer >= 0 && peer < worldSize(), Status::kInvalidArgument,
                  "peer %d is out of range [0, %d)", peer, worldSize());
  return r.peers[static_cast<size_t>(peer)];
}

char* SymmetricHeap::peerUser(int local, int peer) const {
  char* b = peerBase(local, peer);
  return b != nullptr ? b + layout_.user : nullptr;
}

PeerClass SymmetricHeap::peerClass(int local, int peer) const {
  const LocalRank& r = at(local);
  GRAPHEP_REQUIRE(peer >= 0 && peer < worldSize(), Status::kInvalidArgument,
                  "peer %d is out of range [0, %d)", peer, worldSize());
  return r.classes[static_cast<size_t>(peer)];
}

SyncHandle SymmetricHeap::syncHandle(int local) const {
  const LocalRank& r = at(local);
  SyncHandle h{};
  h.rank = r.rank;
  h.numRanks = cfg_.numRanks;
  h.numSemChannels = static_cast<std::uint32_t>(cfg_.numSemChannels);
  h.numFlagChannels = static_cast<std::uint32_t>(cfg_.numFlagChannels);
  h.numEpochs = static_cast<std::uint32_t>(cfg_.numEpochs);
  h.trapOnTimeout = trapOnTimeout_ ? 1u : 0u;
  h.timeoutNs = timeoutNs_;
  auto u32 = [](char* base, std::size_t off) {
    return base != nullptr ? reinterpret_cast<std::uint32_t*>(base + off) : nullptr;
  };
  h.semCount = u32(r.base, layout_.semCount);
  h.semArrived = u32(r.base, layout_.semArrived);
  h.semConsumed = u32(r.base, layout_.semConsumed);
  h.flagInbox = u32(r.base, layout_.flagInbox);
  h.flagStep = u32(r.base, layout_.flagStep);
  h.epochs = u32(r.base, layout_.epochs);
  for (int p = 0; p < cfg_.numRanks; ++p) {
    char* pb = r.peers[static_cast<size_t>(p)];
    h.peerSemCount[p] = u32(pb, layout_.semCount);
    h.peerSemArrived[p] = u32(pb, layout_.semArrived);
    h.peerFlagInbox[p] = u32(pb, layout_.flagInbox);
  }
  h.error.record = r.error;  // mapped pinned memory: the same address is valid on the device (UVA)
  h.error.words = r.errorWords;
  return h;
}

DeviceErrorRecord SymmetricHeap::errorRecord(int local) const {
  const volatile DeviceErrorRecord* rec = at(local).error;
  DeviceErrorRecord out{};
  out.state = rec->state;
  if (out.state != 2) {
    out.count = rec->count;
    return out;
  }
  __atomic_thread_fence(__ATOMIC_ACQUIRE);  // pairs with the device's st.release.sys of state
  out.kind = rec->kind;
  out.rank = rec->rank;
  out.peer = rec->peer;
  out.site = rec->site;
  out.expected = rec->expected;
  out.observed = rec->observed;
  out.count = rec->count;
  out.elapsedNs = rec->elapsedNs;
  out.address = rec->address;
  return out;
}

void SymmetricHeap::recordHostError(int local, cudaStream_t side, DeviceErrorKind kind, int peer,
                                    WaitSite site, std::uint32_t expected, std::uint32_t observed) const {
  const LocalRank& r = at(local);
  static const std::uint32_t kSet = 1;
  GRAPHEP_CUDA_CHECK(cudaSetDevice(r.device));
  GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(r.errorWords, &kSet, sizeof(kSet), cudaMemcpyHostToDevice, side));  // claim
  GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(r.errorWords + 2, &kSet, sizeof(kSet), cudaMemcpyHostToDevice, side));  // stop
  GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(side));
  // A device reporter raises the count before it claims; one that claimed first is left to
  // finish its record. (One racing in the copy's last microseconds may mix fields: accepted, the
  // rank is failed either way.)
  volatile DeviceErrorRecord* rec = r.error;
  if (rec->count != 0 || rec->state != 0) return;
  rec->kind = static_cast<std::uint32_t>(kind);
  rec->rank = r.rank;
  rec->peer = peer;
  rec->site = static_cast<std::uint32_t>(site);
  rec->expected = expected;
  rec->observed = observed;
  rec->elapsedNs = 0;
  rec->address = 0;
  rec->count = 1;
  __atomic_thread_fence(__ATOMIC_RELEASE);
  rec->state = 2;
}

std::string SymmetricHeap::errorMessage(int local) const {
  return describeDeviceError(errorRecord(local));
}

void SymmetricHeap::clearError(int local) {
  const LocalRank& r = at(local);
  GRAPHEP_CUDA_CHECK(cudaSetDevice(r.device));
  GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  std::memset(r.error, 0, sizeof(DeviceErrorRecord));
  GRAPHEP_CUDA_CHECK(cudaMemset(r.errorWords, 0, kDeviceErrorWords * sizeof(std::uint32_t)));
  GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
}

std::string describeDeviceError(const DeviceErrorRecord& rec) {
  if (rec.state != 2) return rec.count != 0 ? "device error being recorded" : "";
  switch (static_cast<DeviceErrorKind>(rec.kind)) {
    case DeviceErrorKind::kTimeout:
      return detail::format(
          "rank %d timed out after %llu ms waiting for peer %d in %s: expected >= %u, observed %u "
          "(%u error(s) in total)",
          rec.rank, static_cast<unsigned long long>(rec.elapsedNs / 1000000ull), rec.peer,
          waitSiteName(rec.site), rec.expected, rec.observed, rec.count);
    case DeviceErrorKind::kSemaphoreUnderflow:
      return detail::format(
          "rank %d consumed %u from its semaphore for peer %d, which held only %u: a consume ran "
          "without its stream wait (%u error(s) in total)",
          rec.rank, rec.expected, rec.peer, rec.observed, rec.count);
    case DeviceErrorKind::kOutOfBounds:
      return detail::format(
          "rank %d: the transfer for peer %d ends at byte %u but the buffer holds %u; it was "
          "dropped, nothing was written (%u error(s) in total)",
          rec.rank, rec.peer, rec.observed, rec.expected, rec.count);
    case DeviceErrorKind::kCountMismatch:
      return detail::format(
          "rank %d has %u bytes for peer %d, which expects %u (%s): both ends must pass the same "
          "count; nothing was sent (%u error(s) in total)",
          rec.rank, rec.observed, rec.peer, rec.expected, waitSiteName(rec.site), rec.count);
    case DeviceErrorKind::kAborted:
      return detail::format(
          "rank %d was aborted by its host watchdog: it waited for peer %d (%s: expected >= %u, "
          "observed %u); its waits were lifted, so what ran after them is invalid",
          rec.rank, rec.peer, waitSiteName(rec.site), rec.expected, rec.observed);
    case DeviceErrorKind::kNone:
      break;
  }
  return detail::format("rank %d: device error kind %u (peer %d, %s)", rec.rank, rec.kind, rec.peer,
                        waitSiteName(rec.site));
}

}  // namespace graphep
