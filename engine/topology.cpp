#include "engine/topology.hpp"

#include "engine/env.hpp"
#include "engine/error.hpp"

namespace graphep {

const char* peerClassName(PeerClass c) noexcept {
  switch (c) {
    case PeerClass::kSelf: return "self";
    case PeerClass::kSameDevice: return "same-device";
    case PeerClass::kNvLink: return "nvlink";
    case PeerClass::kPcie: return "pcie";
    case PeerClass::kRemote: return "remote";
  }
  return "?";
}

PeerClass classifyPeer(const PeerFacts& f, ForceTransport force) {
  if (f.isSelf) return PeerClass::kSelf;
  if (force == ForceTransport::kRemote) return PeerClass::kRemote;
  if (!f.sameHost) return PeerClass::kRemote;
  if (f.sameDevice) return PeerClass::kSameDevice;
  if (!f.peerVisible || !f.canAccessPeer) return PeerClass::kRemote;
  return f.nativeAtomics ? PeerClass::kNvLink : PeerClass::kPcie;
}

ForceTransport parseForceTransport(std::string_view text) {
  const std::string v = env::kForceTransport.parse(text);
  return v == "remote" ? ForceTransport::kRemote : ForceTransport::kAuto;
}

ForceTransport forceTransportFromEnv() { return parseForceTransport(env::kForceTransport.raw()); }

}  // namespace graphep
