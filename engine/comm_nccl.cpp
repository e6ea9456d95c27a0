// NCCL communicators: adopted from the caller (the embedding path) or created by graphep.
#include <cuda_runtime.h>

#include <cstring>

#include <graphep/comm.hpp>
#include <graphep/types.hpp>

#include "engine/error.hpp"
#include "engine/log.hpp"
#include "engine/nccl_group.hpp"
#include "engine/nvtx.hpp"

namespace graphep {
namespace {

class NcclComm final : public Communicator {
 public:
  NcclComm(std::vector<ncclComm_t> comms, bool owned) : comms_(std::move(comms)), owned_(owned) {
    GRAPHEP_REQUIRE(!comms_.empty(), Status::kInvalidArgument, "no NCCL communicator given");
    for (size_t i = 0; i < comms_.size(); ++i) {
      GRAPHEP_REQUIRE(comms_[i] != nullptr, Status::kInvalidArgument,
                      "NCCL communicator %zu is null", i);
      int n = 0, r = 0, d = 0;
      GRAPHEP_NCCL_CHECK(ncclCommCount(comms_[i], &n));
      GRAPHEP_NCCL_CHECK(ncclCommUserRank(comms_[i], &r));
      GRAPHEP_NCCL_CHECK(ncclCommCuDevice(comms_[i], &d));
      GRAPHEP_REQUIRE(n >= 1 && r >= 0 && r < n, Status::kInvalidArgument,
                      "NCCL communicator %zu reports rank %d of %d ranks: not initialised (an NCCL group left open "
                      "on this thread queues ncclCommInitAll unrun)",
                      i, r, n);
      if (i == 0) world_ = n;
      GRAPHEP_REQUIRE(n == world_, Status::kInvalidArgument,
                      "NCCL communicator %zu has %d ranks, communicator 0 has %d", i, n, world_);
      ranks_.push_back(r);
      devices_.push_back(d);
    }
    GRAPHEP_REQUIRE(world_ <= kMaxRanks, Status::kInvalidArgument,
                    "NCCL communicator has %d ranks; graphep supports at most %d", world_,
                    kMaxRanks);
  }
  ~NcclComm() override {
    if (!owned_) return;
    for (ncclComm_t c : comms_) ncclCommDestroy(c);
  }
  int worldSize() const override { return world_; }
  int numLocalRanks() const override { return static_cast<int>(comms_.size()); }
  int globalRank(int local) const override { return ranks_.at(static_cast<size_t>(local)); }
  int device(int local) const override { return devices_.at(static_cast<size_t>(local)); }
  ncclComm_t ncclComm(int local) const override { return comms_.at(static_cast<size_t>(local)); }
  const char* kind() const override { return "nccl"; }

  void allgather(const void* send, void* recv, std::size_t bytes) override {
    if (bytes == 0) return;
    const size_t n = comms_.size();
    std::vector<void*> dsend(n), drecv(n);
    std::vector<cudaStream_t> streams(n);
    for (size_t i = 0; i < n; ++i) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(devices_[i]));
      GRAPHEP_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking));
      GRAPHEP_CUDA_CHECK(cudaMalloc(&dsend[i], bytes));
      GRAPHEP_CUDA_CHECK(cudaMalloc(&drecv[i], bytes * static_cast<size_t>(world_)));
      GRAPHEP_CUDA_CHECK(cudaMemcpy(dsend[i], static_cast<const char*>(send) + i * bytes, bytes,
                                    cudaMemcpyHostToDevice));
    }
    NcclGroup group;
    for (size_t i = 0; i < n; ++i) {
      GRAPHEP_NCCL_CHECK(
          ncclAllGather(dsend[i], drecv[i], bytes, ncclChar, comms_[i], streams[i]));
    }
    group.end();
    for (size_t i = 0; i < n; ++i) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(devices_[i]));
      GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(streams[i]));
    }
    GRAPHEP_CUDA_CHECK(cudaSetDevice(devices_[0]));
    GRAPHEP_CUDA_CHECK(cudaMemcpy(recv, drecv[0], bytes * static_cast<size_t>(world_),
                                  cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; ++i) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(devices_[i]));
      GRAPHEP_CUDA_CHECK(cudaFree(dsend[i]));
      GRAPHEP_CUDA_CHECK(cudaFree(drecv[i]));
      GRAPHEP_CUDA_CHECK(cudaStreamDestroy(streams[i]));
    }
  }

  void barrier() override {
    std::vector<char> s(comms_.size(), 1), r(static_cast<size_t>(world_));
    allgather(s.data(), r.data(), 1);
  }

 private:
  std::vector<ncclComm_t> comms_;
  bool owned_;
  int world_ = 0;
  std::vector<int> ranks_, devices_;
};

}  // namespace

std::unique_ptr<Communicator> adoptNcclComms(const std::vector<ncclComm_t>& comms) {
  return std::make_unique<NcclComm>(comms, /*owned=*/false);
}

std::unique_ptr<Communicator> createNcclComm(const ncclUniqueId& id, int nranks, int rank,
                                             int device) {
  GRAPHEP_REQUIRE(nranks >= 1 && nranks <= kMaxRanks, Status::kInvalidArgument,
                  "createNcclComm: nranks=%d is out of range [1, %d]", nranks, kMaxRanks);
  GRAPHEP_REQUIRE(rank >= 0 && rank < nranks, Status::kInvalidArgument,
                  "createNcclComm: rank=%d is out of range [0, %d)", rank, nranks);
  GRAPHEP_CUDA_CHECK(cudaSetDevice(device));
  ncclComm_t c = nullptr;
  GRAPHEP_NCCL_CHECK(ncclCommInitRank(&c, nranks, id, rank));
  GRAPHEP_LOG_INFO(log::kComm, "created NCCL communicator rank %d/%d on device %d", rank, nranks,
                   device);
  return std::make_unique<NcclComm>(std::vector<ncclComm_t>{c}, /*owned=*/true);
}

std::unique_ptr<Communicator> createNcclGroup(const std::vector<int>& devices) {
  GRAPHEP_NVTX_RANGE("graphep::createNcclGroup");
  GRAPHEP_REQUIRE(!devices.empty() && devices.size() <= static_cast<size_t>(kMaxRanks),
                  Status::kInvalidArgument, "createNcclGroup: %zu devices is out of range [1, %d]",
                  devices.size(), kMaxRanks);
  std::vector<ncclComm_t> comms(devices.size());
  GRAPHEP_NCCL_CHECK(
      ncclCommInitAll(comms.data(), static_cast<int>(devices.size()), devices.data()));
  return std::make_unique<NcclComm>(std::move(comms), /*owned=*/true);
}

}  // namespace graphep
