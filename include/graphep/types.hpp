// Plain public types shared by the graphep API.
#pragma once

#include <cstdint>

namespace graphep {

// Largest number of ranks one engine spans. Device handles hold one peer pointer per rank.
inline constexpr int kMaxRanks = 32;

// How a rank reaches a peer, decided once at setup (engine/topology.hpp).
enum class PeerClass : std::uint8_t {
  kSelf = 0,        // the rank itself
  kSameDevice = 1,  // another rank on the same GPU (emulated ranks): plain load/store
  kNvLink = 2,      // P2P load/store with native atomics (NVLink/NVSwitch)
  kPcie = 3,        // P2P load/store without native atomics
  kRemote = 4,      // no load/store access: data moves through NCCL
};

const char* peerClassName(PeerClass c) noexcept;

// GRAPHEP_FORCE_TRANSPORT: "auto" classifies from hardware facts; "remote" treats every peer other
// than the rank itself as remote, so the NCCL path is testable on one node.
enum class ForceTransport : std::uint8_t { kAuto = 0, kRemote = 1 };

}  // namespace graphep
