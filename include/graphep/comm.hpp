// Communicators: who the ranks are and how setup-time data is exchanged.
//
// A Communicator describes the ranks that THIS process drives ("local ranks") within a world of
// worldSize() ranks. One process may drive one rank (MPI, NCCL from a unique id) or several
// (a local group on one or more GPUs, or NCCL comms made by ncclCommInitAll). Collective setup
// calls (allgather, barrier, and every graphep setup call that takes a Communicator) are called
// ONCE per process and cover all of its local ranks.
//
// Nothing here may be called during stream capture; none of it is on the run path.
#pragma once

#include <nccl.h>

#include <cstddef>
#include <memory>
#include <vector>

namespace graphep {

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int worldSize() const = 0;
  virtual int numLocalRanks() const = 0;
  // Global rank of local rank `local` (0 <= local < numLocalRanks()).
  virtual int globalRank(int local) const = 0;
  // CUDA device ordinal (in this process's numbering) of local rank `local`.
  virtual int device(int local) const = 0;
  // NCCL communicator of local rank `local`, or nullptr when this communicator has none.
  virtual ncclComm_t ncclComm(int local) const { return nullptr; }
  // "local-group", "nccl" or "mpi".
  virtual const char* kind() const = 0;

  // Setup-time allgather. `send` holds numLocalRanks() blocks of `bytes` (local-rank order);
  // `recv` receives worldSize() blocks of `bytes` in global-rank order. Blocking, collective.
  virtual void allgather(const void* send, void* recv, std::size_t bytes) = 0;
  // Setup-time barrier across all processes. Blocking, collective.
  virtual void barrier() = 0;
};

// N ranks driven by one host thread in this process, no NCCL. `devices[i]` is the GPU of rank i;
// devices may repeat (several ranks on one GPU: the emulation mode).
std::unique_ptr<Communicator> createLocalGroup(const std::vector<int>& devices);

// Adopts NCCL communicators created by the caller, one per rank this process drives (one element
// for one process per GPU, several for ncclCommInitAll). The caller keeps ownership: graphep never
// destroys them and they must outlive the Communicator.
std::unique_ptr<Communicator> adoptNcclComms(const std::vector<ncclComm_t>& comms);

// Creates (and owns) one NCCL communicator for `rank` of `nranks` from a unique id that the caller
// distributed, on CUDA device `device`.
std::unique_ptr<Communicator> createNcclComm(const ncclUniqueId& id, int nranks, int rank,
                                             int device);

// Creates (and owns) NCCL communicators for all `devices` of this process (ncclCommInitAll).
std::unique_ptr<Communicator> createNcclGroup(const std::vector<int>& devices);

// MPI bootstrap over MPI_COMM_WORLD: one rank per process. The caller must have initialised MPI.
// device < 0 picks (node-local rank) % (visible devices). With withNccl, an NCCL communicator is
// also created (unique id broadcast over MPI) for transports that need one.
// Throws Status::kNotSupported when graphep was built without MPI.
std::unique_ptr<Communicator> createMpiCommunicator(int device = -1, bool withNccl = true);

// Whether this build has the MPI communicator.
bool mpiSupported() noexcept;

}  // namespace graphep
