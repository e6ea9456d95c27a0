#include "engine/transport.hpp"

#include "engine/error.hpp"
#include "engine/nccl_group.hpp"
#include "engine/topology.hpp"

namespace graphep {

ncclComm_t NcclTransport::comm(int peer) const {
  ncclComm_t c = heap_->comm().ncclComm(local_);
  GRAPHEP_REQUIRE(c != nullptr, Status::kNotSupported,
                  "rank %d reaches rank %d only as a remote peer, but its '%s' communicator has "
                  "no NCCL communicator to carry the data",
                  heap_->rank(local_), peer, heap_->comm().kind());
  return c;
}

void NcclTransport::put(cudaStream_t stream, int peer, const void* src, std::size_t bytes) const {
  GRAPHEP_NCCL_CHECK(ncclSend(src, bytes, ncclChar, peer, comm(peer), stream));
}

void NcclTransport::get(cudaStream_t stream, int peer, void* dst, std::size_t bytes) const {
  GRAPHEP_NCCL_CHECK(ncclRecv(dst, bytes, ncclChar, peer, comm(peer), stream));
}

void CopyEngineTransport::put(cudaStream_t stream, void* peerDst, const void* src,
                              std::size_t bytes) {
  if (bytes == 0) return;
  GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(peerDst, src, bytes, cudaMemcpyDefault, stream));
}

Route MeshTransport::route(int peer) const {
  const PeerClass c = heap_->peerClass(local_, peer);
  if (c == PeerClass::kSelf) return Route::kSelf;
  return isLoadStore(c) ? Route::kLoadStore : Route::kNccl;
}

bool MeshTransport::anyRemote() const {
  for (int p = 0; p < heap_->worldSize(); ++p) {
    if (route(p) == Route::kNccl) return true;
  }
  return false;
}

void MeshTransport::warmUp(const SymmetricHeap& heap, const std::vector<const MeshTransport*>& meshes,
                           const std::vector<std::size_t>& sizes) {
  const int R = heap.worldSize();
  for (int l = 0; l < heap.numLocalRanks(); ++l) {  // refused before anything is allocated or grouped
    for (int p = 0; p < R; ++p) {
      if (meshes[static_cast<size_t>(l)]->route(p) == Route::kNccl) meshes[static_cast<size_t>(l)]->nccl().require(p);
    }
  }
  for (std::size_t bytes : sizes) {
    std::vector<char*> bufs;
    std::vector<cudaStream_t> streams;
    for (int l = 0; l < heap.numLocalRanks(); ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(heap.device(l)));
      void* b = nullptr;
      GRAPHEP_CUDA_CHECK(cudaMalloc(&b, 2 * bytes * static_cast<std::size_t>(R)));
      cudaStream_t s;
      GRAPHEP_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      bufs.push_back(static_cast<char*>(b));
      streams.push_back(s);
    }
    NcclGroup group;
    for (int l = 0; l < heap.numLocalRanks(); ++l) {
      const MeshTransport& m = *meshes[static_cast<size_t>(l)];
      char* b = bufs[static_cast<size_t>(l)];
      for (int p = 0; p < R; ++p) {
        if (m.route(p) != Route::kNccl) continue;
        m.nccl().put(streams[static_cast<size_t>(l)], p, b + 2 * bytes * p, bytes);
        m.nccl().get(streams[static_cast<size_t>(l)], p, b + 2 * bytes * p + bytes, bytes);
      }
    }
    group.end();
    for (int l = 0; l < heap.numLocalRanks(); ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(heap.device(l)));
      GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(streams[static_cast<size_t>(l)]));
      GRAPHEP_CUDA_CHECK(cudaStreamDestroy(streams[static_cast<size_t>(l)]));
      GRAPHEP_CUDA_CHECK(cudaFree(bufs[static_cast<size_t>(l)]));
    }
  }
}

}  // namespace graphep
