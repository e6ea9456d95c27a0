// Peer classification (docs/DESIGN.md §2, Topology). classifyPeer is a pure function of facts gathered
// at setup, so its rules are unit-tested on the CPU with synthetic inputs.
#pragma once

#include <graphep/types.hpp>

#include <string_view>

namespace graphep {

struct PeerFacts {
  bool isSelf = false;         // same global rank
  bool sameHost = false;       // same host (hostname hash)
  bool sameProcess = false;    // same host and pid
  bool sameDevice = false;     // same GPU (UUID)
  bool peerVisible = false;    // the peer's GPU is visible to this process (needed for P2P)
  bool canAccessPeer = false;  // cudaDeviceCanAccessPeer(mine, peer's)
  bool nativeAtomics = false;  // cudaDevP2PAttrNativeAtomicSupported(mine, peer's)
};

PeerClass classifyPeer(const PeerFacts& facts, ForceTransport force);

// Parses GRAPHEP_FORCE_TRANSPORT's value ("auto" or "remote"); throws naming the bad value.
ForceTransport parseForceTransport(std::string_view text);
// Reads GRAPHEP_FORCE_TRANSPORT.
ForceTransport forceTransportFromEnv();

// True when the class allows plain load/store (and thus direct pointers).
inline bool isLoadStore(PeerClass c) { return c != PeerClass::kRemote; }
// True when a warp's 128-byte store to the peer lands whole for a 128-byte load (NCCL's LL128
// premise: this GPU or an NVLink peer, not PCIe): the latency path's payload lines need it.
inline bool takesWholeLines(PeerClass c) { return c == PeerClass::kSelf || c == PeerClass::kSameDevice || c == PeerClass::kNvLink; }

}  // namespace graphep
