// The symmetric heap (docs/DESIGN.md §2): one device arena per rank, identical layout on every rank,
// allocated once at setup, peers mapped once (CUDA IPC across processes, direct pointers with peer
// access within a process, nothing for remote peers). Captured graphs bake these pointers, so the
// arena is never reallocated while a graph holds a pin.
//
// Every call here is setup: collective where marked, never capturable.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <graphep/comm.hpp>
#include <graphep/types.hpp>

#include "engine/heap_layout.hpp"
#include "kernels/common/sync_handle.h"

namespace graphep {

class SymmetricHeap {
 public:
  // Collective over `comm`: allocates, initialises and exchanges every local rank's arena.
  static std::unique_ptr<SymmetricHeap> create(Communicator& comm, const HeapConfig& cfg);
  ~SymmetricHeap();
  SymmetricHeap(const SymmetricHeap&) = delete;
  SymmetricHeap& operator=(const SymmetricHeap&) = delete;

  Communicator& comm() const { return *comm_; }
  const HeapConfig& config() const { return cfg_; }
  const HeapLayout& layout() const { return layout_; }
  int numLocalRanks() const { return static_cast<int>(ranks_.size()); }
  int worldSize() const { return cfg_.numRanks; }
  int rank(int local) const { return at(local).rank; }
  int device(int local) const { return at(local).device; }
  std::uint64_t timeoutNs() const { return timeoutNs_; }

  // This local rank's arena, and a peer's arena as this rank sees it (nullptr when remote).
  char* base(int local) const { return at(local).base; }
  char* peerBase(int local, int peer) const;
  PeerClass peerClass(int local, int peer) const;
  // The user region of this rank's arena / of a peer's arena (nullptr when remote).
  char* user(int local) const { return base(local) + layout_.user; }
  char* peerUser(int local, int peer) const;

  SyncHandle syncHandle(int local) const;

  // Device error record of a local rank: the host reads it without synchronising.
  DeviceErrorRecord errorRecord(int local) const;
  // The host watchdog's verdict on a stalled rank: claims the rank's error record (its device
  // waits then stop at their next check) and, unless a device error was already being recorded,
  // fills it in (kind kAborted). `side` is a non-blocking stream of the rank's device: nothing
  // here waits for the stalled work.
  void recordHostError(int local, cudaStream_t side, DeviceErrorKind kind, int peer, WaitSite site,
                       std::uint32_t expected, std::uint32_t observed) const;
  // "" when no error was recorded, else one line naming rank, peer, site, expected, observed.
  std::string errorMessage(int local) const;
  void clearError(int local);

  // A pin marks that a captured graph baked this heap's pointers. While any pin lives,
  // reallocate() fails with Status::kGraphInvalidated instead of moving memory under the graph.
  class Pin {
   public:
    Pin() = default;
    explicit Pin(std::shared_ptr<std::atomic<int>> n) : n_(std::move(n)) { ++*n_; }
    Pin(Pin&& o) noexcept = default;
    Pin& operator=(Pin&& o) noexcept {
      reset();
      n_ = std::move(o.n_);
      return *this;
    }
    ~Pin() { reset(); }
    void reset() {
      if (n_) --*n_;
      n_.reset();
    }

   private:
    std::shared_ptr<std::atomic<int>> n_;
  };
  Pin pin() { return Pin(pins_); }
  int numPins() const { return pins_->load(); }

  // Collective: frees and re-creates every arena for a new config. Fails with
  // Status::kGraphInvalidated while any Pin exists.
  void reallocate(const HeapConfig& cfg);

 private:
  struct LocalRank {
    int rank = -1;
    int device = -1;
    char* base = nullptr;
    DeviceErrorRecord* error = nullptr;  // pinned, mapped host memory
    std::uint32_t* errorWords = nullptr;  // device memory: the record's claim, count and stop words
    std::vector<char*> peers;            // by global rank
    std::vector<PeerClass> classes;      // by global rank
    std::vector<char*> ipcOpened;        // peer arenas opened through CUDA IPC
  };

  SymmetricHeap(Communicator& comm, const HeapConfig& cfg);
  const LocalRank& at(int local) const;
  void build();
  void release() noexcept;

  Communicator* comm_;
  HeapConfig cfg_;
  HeapLayout layout_;
  std::uint64_t timeoutNs_ = 0;
  bool trapOnTimeout_ = false;
  std::vector<LocalRank> ranks_;
  std::shared_ptr<std::atomic<int>> pins_ = std::make_shared<std::atomic<int>>(0);
};

// One line describing a device error record ("" when none).
std::string describeDeviceError(const DeviceErrorRecord& rec);

}  // namespace graphep
