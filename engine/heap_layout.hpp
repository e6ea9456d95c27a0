// Layout of the symmetric heap: one arena per rank, identical on every rank, carved by a bump
// allocator in ONE function (carveHeap) that documents each region. Sizing is a dry run of the
// same function, and the heap verifies that carving the allocated arena lands exactly on the
// computed size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace graphep {

// The largest user region a heap takes (HeapConfig::validate).
inline constexpr std::size_t kMaxUserBytes = std::size_t{1} << 40;

struct HeapConfig {
  int numRanks = 0;
  int numSemChannels = 8;   // counting-semaphore channels (one word per channel per source rank)
  int numFlagChannels = 8;  // in-kernel flag channels (one inbox word per channel per peer)
  int numEpochs = 8;        // per-operation-kind epochs
  std::size_t userBytes = 0;       // a symmetric scratch region for callers (tests, movers)
  // Data-mover channels (CTAs) per peer. 32: staged 4 MiB in 22.8 us on 32 against 28.1 on 16
  // (SM zero-copy and LL stop at 16 automatically: kZeroCopyMaxChannels, kLLMaxChannels).
  int moverBlocks = 32;
  int moverSlots = 4;              // staging slots per (peer, channel); a power of two
  // Warps per role (sender, receiver) in a mover CTA, 1..8; hashed so every rank runs the same
  // shape. 8: faster LL (256 KiB: 7.5 vs 9.7 us) and staged transfers, zero-copy within 2%
  // (docs/PERFORMANCE.md).
  int moverWarps = 8;
  std::size_t moverSlotBytes = 0;  // bytes per staging slot (multiple of 16); 0: no staging
  // LL (low-latency) capacity per (peer, channel), a multiple of 16; 0: never LL. Transfers of up
  // to moverLLBytes * moverBlocks bytes go as LL lines over ceil(bytes / moverLLBytes) channels.
  std::size_t moverLLBytes = 16384;
  std::uint32_t counterStart = 0;  // initial flag/step/epoch/total value (tests start near wrap)
  long long timeoutMs = -1;        // device wait bound; -1 reads GRAPHEP_TIMEOUT_MS

  // Throws graphep::Error naming the bad field.
  void validate() const;
  // Hash of every field that must agree across ranks (exchanged at setup).
  std::uint64_t hash() const;
};

struct HeapRegion {
  std::string name;
  std::size_t offset;
  std::size_t bytes;
  std::size_t align;
};

// Offsets of the well-known regions (identical on all ranks).
struct HeapLayout {
  std::size_t semCount = 0, semArrived = 0, semConsumed = 0;
  std::size_t flagInbox = 0, flagStep = 0, epochs = 0;
  std::size_t moverHead = 0, moverTail = 0, moverReady = 0, moverSendStep = 0, moverRecvStep = 0;
  std::size_t moverMailbox = 0;
  std::size_t user = 0;
  std::size_t staging = 0;
  std::size_t ll = 0;
  std::size_t totalBytes = 0;
  std::vector<HeapRegion> regions;  // in carve order
};

class BumpAllocator {
 public:
  explicit BumpAllocator(std::size_t capacity) : capacity_(capacity) {}
  // Returns the offset of `count` x `elemBytes` aligned to `align` (a power of two); throws
  // graphep::Error naming the region when it does not fit.
  std::size_t carve(const char* name, std::size_t count, std::size_t elemBytes, std::size_t align);
  std::size_t used() const { return used_; }
  const std::vector<HeapRegion>& regions() const { return regions_; }

 private:
  std::size_t capacity_;
  std::size_t used_ = 0;
  std::vector<HeapRegion> regions_;
};

// Whether a region holds monotonic 32-bit words that start at HeapConfig.counterStart (flags,
// steps, epochs, semaphore totals) rather than at 0.
bool isMonotonicRegion(const std::string& name);

// The one place regions are carved. With capacity SIZE_MAX it is the sizing dry run.
HeapLayout carveHeap(const HeapConfig& cfg, std::size_t capacity);
inline std::size_t heapBytes(const HeapConfig& cfg) { return carveHeap(cfg, SIZE_MAX).totalBytes; }

}  // namespace graphep
