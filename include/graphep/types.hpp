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

// The events of the latency path's step trace (MoeConfig.profile, Engine::stepTrace): the index of
// each in MoeStepTrace::ns.
enum class MoeTraceEvent : int {
  kEnter = 0,  // the send part's first CTA started, before its wait for the stream's last kernel
  kReady,      // that wait returned
  kPosted,     // the last count message (dispatch) or combine weights posted
  kSent,       // dispatch: the last CTA stored its records' lines; combine: the last send CTA
               // announced its partials to every peer
  kLayout,     // the receive's last CTA saw every source's counts (dispatch only)
  kArrived,    // dispatch: the last CTA saw every line it expands; combine: a receive CTA saw
               // every peer's send CTAs arrive (after its sums of the partials' lines, unless
               // shrink on timeout waits for the arrivals first)
  kReceived,   // the last receive CTA finished its share
  kDone,       // the launch's last CTA advanced the step
  // The receive's first CTA (the dispatch's first expanding CTA): the wait for this rank's own
  // send CTAs returned (no longer stamped: the rebuilt dispatch has no such wait; the value is
  // kept so that the others keep theirs), it finished this rank's own records (dispatch: the latest
  // of its warps' first items, when that item is an own record; later items are claimed), it saw
  // every peer arrive (dispatch: every line it expands).
  kOwnArrived0,
  kOwnDone0,
  kArrived0,
  kCount
};

}  // namespace graphep
