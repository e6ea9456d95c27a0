// MPI bootstrap: one rank per process over MPI_COMM_WORLD (mpirun -np N), optionally with an
// NCCL communicator created from a unique id broadcast over MPI.
#include <graphep/comm.hpp>
#include <graphep/graphep.hpp>

#include "engine/error.hpp"
#include "engine/log.hpp"
#include "engine/nvtx.hpp"

#if defined(GRAPHEP_HAVE_MPI)
#include <mpi.h>
#endif

namespace graphep {

#if defined(GRAPHEP_HAVE_MPI)
namespace {

void checkMpi(int rc, const char* call, const char* file, int line) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  GRAPHEP_FAIL(Status::kMpiError, "%s failed: %s (%d) at %s:%d", call, msg, rc, file, line);
}
#define GRAPHEP_MPI_CHECK(call) checkMpi((call), #call, __FILE__, __LINE__)

class MpiComm final : public Communicator {
 public:
  MpiComm(int device, bool withNccl) {
    int inited = 0;
    GRAPHEP_MPI_CHECK(MPI_Initialized(&inited));
    GRAPHEP_REQUIRE(inited, Status::kInvalidUsage,
                    "createMpiCommunicator: MPI is not initialised (call MPI_Init first)");
    GRAPHEP_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
    GRAPHEP_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size_));
    GRAPHEP_REQUIRE(size_ <= kMaxRanks, Status::kInvalidArgument,
                    "MPI world has %d ranks; graphep supports at most %d", size_, kMaxRanks);
    if (device < 0) {
      MPI_Comm node;
      GRAPHEP_MPI_CHECK(
          MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node));
      int localRank = 0;
      GRAPHEP_MPI_CHECK(MPI_Comm_rank(node, &localRank));
      MPI_Comm_free(&node);
      const char* reason = nullptr;
      const int count = cudaDeviceCountOrZero(&reason);
      GRAPHEP_REQUIRE(count > 0, Status::kNoDevice, "MPI rank %d: no CUDA device (%s)", rank_,
                      reason);
      device = localRank % count;
    }
    device_ = device;
    GRAPHEP_CUDA_CHECK(cudaSetDevice(device_));
    if (withNccl) {
      ncclUniqueId id{};
      if (rank_ == 0) GRAPHEP_NCCL_CHECK(ncclGetUniqueId(&id));
      GRAPHEP_MPI_CHECK(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD));
      GRAPHEP_NCCL_CHECK(ncclCommInitRank(&nccl_, size_, id, rank_));
    }
    GRAPHEP_LOG_INFO(log::kComm, "MPI rank %d/%d on device %d%s", rank_, size_, device_,
                     withNccl ? " with NCCL" : "");
  }
  ~MpiComm() override {
    if (nccl_ != nullptr) ncclCommDestroy(nccl_);
  }
  int worldSize() const override { return size_; }
  int numLocalRanks() const override { return 1; }
  int globalRank(int) const override { return rank_; }
  int device(int) const override { return device_; }
  ncclComm_t ncclComm(int) const override { return nccl_; }
  const char* kind() const override { return "mpi"; }
  void allgather(const void* send, void* recv, std::size_t bytes) override {
    GRAPHEP_REQUIRE(bytes <= static_cast<std::size_t>(INT32_MAX), Status::kInvalidArgument,
                    "MPI allgather of %zu bytes exceeds INT_MAX", bytes);
    GRAPHEP_MPI_CHECK(MPI_Allgather(send, static_cast<int>(bytes), MPI_BYTE, recv,
                                    static_cast<int>(bytes), MPI_BYTE, MPI_COMM_WORLD));
  }
  void barrier() override { GRAPHEP_MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD)); }

 private:
  int rank_ = 0, size_ = 0, device_ = 0;
  ncclComm_t nccl_ = nullptr;
};

}  // namespace

std::unique_ptr<Communicator> createMpiCommunicator(int device, bool withNccl) {
  GRAPHEP_NVTX_RANGE("graphep::createMpiCommunicator");
  return std::make_unique<MpiComm>(device, withNccl);
}
bool mpiSupported() noexcept { return true; }

#else

std::unique_ptr<Communicator> createMpiCommunicator(int, bool) {
  GRAPHEP_FAIL(Status::kNotSupported,
               "createMpiCommunicator: graphep was built without MPI (GRAPHEP_WITH_MPI=OFF or MPI "
               "not found)");
}
bool mpiSupported() noexcept { return false; }

#endif

}  // namespace graphep
