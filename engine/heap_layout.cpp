#include "engine/heap_layout.hpp"

#include <graphep/types.hpp>

#include "engine/error.hpp"
#include "kernels/common/pipe.h"

namespace graphep {

void HeapConfig::validate() const {
  GRAPHEP_REQUIRE(numRanks >= 1 && numRanks <= kMaxRanks, Status::kInvalidArgument,
                  "HeapConfig.numRanks=%d is out of range [1, %d]", numRanks, kMaxRanks);
  GRAPHEP_REQUIRE(numSemChannels >= 1 && numSemChannels <= 64, Status::kInvalidArgument,
                  "HeapConfig.numSemChannels=%d is out of range [1, 64]", numSemChannels);
  GRAPHEP_REQUIRE(numFlagChannels >= 1 && numFlagChannels <= 64, Status::kInvalidArgument,
                  "HeapConfig.numFlagChannels=%d is out of range [1, 64]", numFlagChannels);
  GRAPHEP_REQUIRE(numEpochs >= 1 && numEpochs <= 64, Status::kInvalidArgument,
                  "HeapConfig.numEpochs=%d is out of range [1, 64]", numEpochs);
  GRAPHEP_REQUIRE(userBytes <= kMaxUserBytes, Status::kInvalidArgument,
                  "HeapConfig.userBytes=%zu exceeds 1 TiB", userBytes);
  GRAPHEP_REQUIRE(moverBlocks >= 1 && moverBlocks <= 64, Status::kInvalidArgument,
                  "HeapConfig.moverBlocks=%d is out of range [1, 64]", moverBlocks);
  GRAPHEP_REQUIRE(moverSlots >= 1 && moverSlots <= 64 && (moverSlots & (moverSlots - 1)) == 0,
                  Status::kInvalidArgument,
                  "HeapConfig.moverSlots=%d is not a power of two in [1, 64]", moverSlots);
  GRAPHEP_REQUIRE(moverSlotBytes % 16 == 0 && moverSlotBytes <= (std::size_t{64} << 20),
                  Status::kInvalidArgument,
                  "HeapConfig.moverSlotBytes=%zu is not a multiple of 16 in [0, 64 MiB]",
                  moverSlotBytes);
  GRAPHEP_REQUIRE(moverWarps >= 1 && moverWarps <= kMaxWarpsPerRole, Status::kInvalidArgument,
                  "HeapConfig.moverWarps=%d is out of range [1, %d]", moverWarps, kMaxWarpsPerRole);
  GRAPHEP_REQUIRE(moverLLBytes % 16 == 0 && moverLLBytes <= (std::size_t{1} << 20),
                  Status::kInvalidArgument,
                  "HeapConfig.moverLLBytes=%zu is not a multiple of 16 in [0, 1 MiB]", moverLLBytes);
  GRAPHEP_REQUIRE(timeoutMs == -1 || (timeoutMs >= 1 && timeoutMs <= 3600000),
                  Status::kInvalidArgument,
                  "HeapConfig.timeoutMs=%lld is neither -1 nor in [1, 3600000]", timeoutMs);
}

std::uint64_t HeapConfig::hash() const {
  // FNV-1a over the fields that shape the layout or the protocol.
  std::uint64_t h = 1469598103934665603ull;
  auto mix = [&](std::uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(static_cast<std::uint64_t>(numRanks));
  mix(static_cast<std::uint64_t>(numSemChannels));
  mix(static_cast<std::uint64_t>(numFlagChannels));
  mix(static_cast<std::uint64_t>(numEpochs));
  mix(userBytes);
  mix(counterStart);
  mix(static_cast<std::uint64_t>(moverBlocks));
  mix(static_cast<std::uint64_t>(moverSlots));
  mix(moverSlotBytes);
  mix(moverLLBytes);
  mix(static_cast<std::uint64_t>(moverWarps));
  return h;
}

std::size_t BumpAllocator::carve(const char* name, std::size_t count, std::size_t elemBytes,
                                 std::size_t align) {
  GRAPHEP_REQUIRE(align != 0 && (align & (align - 1)) == 0, Status::kInternalError,
                  "heap region '%s': alignment %zu is not a power of two", name, align);
  GRAPHEP_REQUIRE(elemBytes == 0 || count <= SIZE_MAX / elemBytes, Status::kInvalidArgument,
                  "heap region '%s': %zu x %zu bytes overflows", name, count, elemBytes);
  const std::size_t offset = (used_ + align - 1) & ~(align - 1);
  const std::size_t bytes = count * elemBytes;
  GRAPHEP_REQUIRE(offset <= capacity_ && bytes <= capacity_ - offset, Status::kInternalError,
                  "heap region '%s' (%zu bytes at offset %zu) does not fit the %zu-byte arena",
                  name, bytes, offset, capacity_);
  regions_.push_back({name, offset, bytes, align});
  used_ = offset + bytes;
  return offset;
}

bool isMonotonicRegion(const std::string& name) {
  for (const char* n : {"semArrived", "semConsumed", "flagInbox", "flagStep", "epochs", "moverHead",
                        "moverTail", "moverReady", "moverSendStep", "moverRecvStep"}) {
    if (name == n) return true;
  }
  return false;
}

HeapLayout carveHeap(const HeapConfig& cfg, std::size_t capacity) {
  cfg.validate();
  BumpAllocator a(capacity);
  HeapLayout l;
  const std::size_t R = static_cast<std::size_t>(cfg.numRanks);
  const std::size_t S = static_cast<std::size_t>(cfg.numSemChannels);
  const std::size_t F = static_cast<std::size_t>(cfg.numFlagChannels);
  const std::size_t E = static_cast<std::size_t>(cfg.numEpochs);
  constexpr std::size_t kU32 = sizeof(std::uint32_t);

  // semCount: S channels x R source ranks x u32. Counting semaphores, consumer-owned; producers
  // red.release.sys.add 1, cuStreamWaitValue32 GEQ waits, the consumer subtracts. Own region of
  // 32-bit words (stream memops address it directly). Starts at 0 (a counting semaphore's base).
  l.semCount = a.carve("semCount", S * R, kU32, 256);
  // semArrived: S x R x u32. Monotonic total of signals received per word (producers add).
  l.semArrived = a.carve("semArrived", S * R, kU32, 256);
  // semConsumed: S x R x u32. Monotonic total consumed per word (consumer only).
  l.semConsumed = a.carve("semConsumed", S * R, kU32, 256);
  // flagInbox: F channels x R source ranks x u32. Peers st.release.sys monotonic steps here.
  l.flagInbox = a.carve("flagInbox", F * R, kU32, 256);
  // flagStep: F channels x R peers x u32. Local monotonic step last used with each peer.
  l.flagStep = a.carve("flagStep", F * R, kU32, 256);
  // epochs: E x u32. Local monotonic per-operation epochs: reserved, no kernel advances them yet.
  l.epochs = a.carve("epochs", E, kU32, 256);
  // Data-mover channels (kernels/common/pipe.h), B = moverBlocks channels per peer:
  // moverHead: R source peers x B x u32. The peer's sender posts chunks written (monotonic).
  const std::size_t B = static_cast<std::size_t>(cfg.moverBlocks);
  l.moverHead = a.carve("moverHead", R * B, kU32, 256);
  // moverTail: R destination peers x B x u32. The peer's receiver posts chunks consumed (slots
  // free again), monotonic.
  l.moverTail = a.carve("moverTail", R * B, kU32, 256);
  // moverReady: R destination peers x B x u32. Zero-copy: the peer's receiver posts the step at
  // which its launch starts (its destination may be overwritten), monotonic.
  l.moverReady = a.carve("moverReady", R * B, kU32, 256);
  // moverSendStep / moverRecvStep: R peers x B x u32. Local monotonic chunk counters.
  l.moverSendStep = a.carve("moverSendStep", R * B, kU32, 256);
  l.moverRecvStep = a.carve("moverRecvStep", R * B, kU32, 256);
  // moverMailbox: R source peers x B x {u64 offset, u64 bytes}. A zero-copy receiver that chooses
  // where its bytes land (alltoallv) writes the place into its sender's mailbox before the ready
  // flag's release; the sender reads it after acquiring ready. Plain data, starts at 0.
  l.moverMailbox = a.carve("moverMailbox", R * B * 2, sizeof(std::uint64_t), 256);
  // user: userBytes x u8. Symmetric scratch for callers; 4 KiB aligned for vector access.
  l.user = a.carve("user", cfg.userBytes, 1, 4096);
  // staging: R source peers x B x moverSlots x moverSlotBytes. The peer's sender writes chunks
  // here; this rank's receiver copies them out.
  l.staging = a.carve("staging", R * B * static_cast<std::size_t>(cfg.moverSlots),
                      cfg.moverSlotBytes, 4096);
  // ll: R source peers x B x 2 halves x llHalfBytes(moverLLBytes). The peer's sender writes
  // 16-byte {data, flag, data, flag} lines here in LL mode, each channel in its own pair of halves
  // (so channel counts may differ between launches); zeroed at setup (0 is never a valid flag).
  l.ll = a.carve("ll", R * B * 2, static_cast<std::size_t>(llHalfBytes(cfg.moverLLBytes)), 4096);

  // Round the arena to 4 KiB so the allocation size is a page multiple.
  l.totalBytes = (a.used() + 4095) & ~std::size_t{4095};
  GRAPHEP_REQUIRE(l.totalBytes <= capacity, Status::kInternalError,
                  "heap arena rounds up to %zu bytes, beyond the %zu-byte capacity", l.totalBytes,
                  capacity);
  l.regions = a.regions();
  return l;
}

}  // namespace graphep
