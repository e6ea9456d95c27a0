// Host half of the transport seam (docs/DESIGN.md §4); the device half, NvlTransport (put / signal /
// wait over peer mappings), is kernels/common/transport.cuh.
//
//   MeshTransport  routes every peer by its topology class: load/store peers (self, same device,
//                  NVLink, PCIe) to the movers' kernels and NvlTransport, remote peers to
//                  NcclTransport, so one collective mixes both.
//   NcclTransport  put (ncclSend) and get (ncclRecv) of whole messages to and from a remote peer on
//                  a stream; capturable, so the messages run inside the graph. A message's signal
//                  and wait are its completion in stream order. Sizes are fixed at capture (device
//                  counts travel as fixed-capacity messages). Setup warms up every size the run
//                  path uses, so capture never sets up a connection.
//   CopyEngineTransport  put of a whole zero-copy transfer into a load/store peer's memory by this
//                  GPU's copy engine (a memcpy node under capture; no SMs); its signal and wait are
//                  the movers' kernel flags launched just before and after it (CePhase,
//                  kernels/common/pipe.h).
#pragma once

#include <cuda_runtime.h>

#include <nccl.h>

#include <cstddef>
#include <vector>

#include "engine/heap.hpp"

namespace graphep {

enum class Route { kSelf, kLoadStore, kNccl };

class NcclTransport {
 public:
  NcclTransport(const SymmetricHeap& heap, int local) : heap_(&heap), local_(local) {}
  // Capturable. Callers pair them inside one NcclGroup (engine/nccl_group.hpp) as NCCL requires,
  // after require(): so nothing in the group throws for want of a communicator.
  void put(cudaStream_t stream, int peer, const void* src, std::size_t bytes) const;
  void get(cudaStream_t stream, int peer, void* dst, std::size_t bytes) const;
  // Throws, naming the ranks, when this rank's communicator has no NCCL communicator to reach `peer`.
  void require(int peer) const { (void)comm(peer); }

 private:
  ncclComm_t comm(int peer) const;  // errors name the rank when the communicator has no NCCL
  const SymmetricHeap* heap_;
  int local_;
};

class CopyEngineTransport {
 public:
  // Capturable; the current device must be the one that owns `stream`.
  static void put(cudaStream_t stream, void* peerDst, const void* src, std::size_t bytes);
};

class MeshTransport {
 public:
  MeshTransport(const SymmetricHeap& heap, int local) : heap_(&heap), local_(local), nccl_(heap, local) {}
  Route route(int peer) const;
  bool anyRemote() const;  // any peer routed through NCCL
  const NcclTransport& nccl() const { return nccl_; }

  // Setup, collective over the heap's communicator: for each size, one exchange with every remote
  // peer of every local rank (meshes[l] is local rank l's), all in one NCCL group, synchronised.
  static void warmUp(const SymmetricHeap& heap, const std::vector<const MeshTransport*>& meshes,
                     const std::vector<std::size_t>& sizes);

 private:
  const SymmetricHeap* heap_;
  int local_;
  NcclTransport nccl_;
};

}  // namespace graphep
