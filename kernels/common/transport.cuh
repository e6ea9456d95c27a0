// The transport seam (docs/DESIGN.md §4): how a role moves bytes and signals one peer.
//   put     copy bytes into memory the peer reads (its staging slot or its destination)
//   signal  publish a monotonic value into the peer's flag (fence, then release store)
//   wait    bounded wait until a local flag reaches a value
// NvlTransport serves peers with load/store access (NVLink, PCIe P2P, the same GPU). Peers without
// it are served by NcclTransport (NCCL send/recv issued into the same stream, so inside the graph),
// and MeshTransport routes each peer to one or the other by its topology class: both are the host
// half of the seam, engine/transport.hpp.
#pragma once

#include <cstdint>

#include "kernels/common/copy.cuh"
#include "kernels/common/flags.cuh"

namespace graphep {

struct NvlTransport {
  template <LoadKind kLoad = LoadKind::kDefault>
  __device__ __forceinline__ static void put(void* dst, const void* src, std::uint64_t bytes,
                                             int tid, int nthreads) {
    copyBytes<kLoad>(dst, src, bytes, tid, nthreads);
  }
  __device__ __forceinline__ static void signal(std::uint32_t* peerFlag, std::uint32_t value) {
    flagPost(peerFlag, value);
  }
  __device__ __forceinline__ static bool wait(const SyncHandle& h, const std::uint32_t* flag,
                                              std::uint32_t target, std::int32_t peer,
                                              WaitSite site) {
    return flagWait(h, flag, target, peer, site);
  }
};

}  // namespace graphep
