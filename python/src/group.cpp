// Group: a graphep::Communicator (include/graphep/comm.hpp) shared by the engines made over it,
// which keep it alive. Every constructor is setup, collective where the C++ one is, and releases
// the GIL while it waits on other ranks.
#include <graphep/comm.hpp>
#include <graphep/status.hpp>

#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bindings.hpp"
#include "group.hpp"

namespace nb = nanobind;

namespace graphep::python {
namespace {

template <class Make>
std::shared_ptr<Group> makeGroup(Make&& make) {
  std::unique_ptr<Communicator> comm;
  {
    nb::gil_scoped_release release;
    comm = make();
  }
  return std::make_shared<Group>(Group{std::shared_ptr<Communicator>(std::move(comm))});
}

const Communicator& checkedLocal(const Group& g, int local) {
  if (local < 0 || local >= g.comm->numLocalRanks()) {
    throw Error(Status::kInvalidArgument, "local rank " + std::to_string(local) + " is out of range [0, " +
                                              std::to_string(g.comm->numLocalRanks()) + ")");
  }
  return *g.comm;
}

nb::bytes newNcclUniqueId() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) {
    throw Error(Status::kNcclError, std::string("ncclGetUniqueId failed: ") + ncclGetErrorString(r));
  }
  return nb::bytes(id.internal, sizeof(id.internal));
}

ncclUniqueId uniqueIdFrom(nb::bytes bytes) {
  ncclUniqueId id;
  if (bytes.size() != sizeof(id.internal)) {
    throw Error(Status::kInvalidArgument, "nccl unique id has " + std::to_string(bytes.size()) +
                                              " bytes, expected " + std::to_string(sizeof(id.internal)) +
                                              " (pass what Group.nccl_unique_id() returned)");
  }
  std::memcpy(id.internal, bytes.c_str(), sizeof(id.internal));
  return id;
}

}  // namespace

void bindGroup(nb::module_& m) {
  nb::class_<Group>(m, "Group",
                    "The ranks this process drives within a world of ranks (a graphep::Communicator). "
                    "Make one with a static constructor; engines made over it keep it alive.")
      .def_static(
          "local", [](const std::vector<int>& devices) { return makeGroup([&] { return createLocalGroup(devices); }); },
          nb::arg("devices"),
          "Every rank in this process, one per entry of `devices` (CUDA ordinals; repeats emulate several "
          "ranks on one GPU). No NCCL.")
      .def_static(
          "nccl_devices", [](const std::vector<int>& devices) { return makeGroup([&] { return createNcclGroup(devices); }); },
          nb::arg("devices"), "One owned NCCL communicator per device of this process (ncclCommInitAll).")
      .def_static("nccl_unique_id", &newNcclUniqueId,
                  "A fresh ncclUniqueId as bytes: make it on one rank and send it to the others.")
      .def_static(
          "from_nccl_unique_id",
          [](nb::bytes id, int worldSize, int rank, int device) {
            const ncclUniqueId uid = uniqueIdFrom(id);
            return makeGroup([&] { return createNcclComm(uid, worldSize, rank, device); });
          },
          nb::arg("unique_id"), nb::arg("world_size"), nb::arg("rank"), nb::arg("device"),
          "One rank of this process: creates (and owns) its NCCL communicator. Collective over the world.")
      .def_static(
          "adopt_nccl",
          [](const std::vector<std::uintptr_t>& comms) {
            std::vector<ncclComm_t> c;
            for (std::uintptr_t p : comms) c.push_back(reinterpret_cast<ncclComm_t>(p));
            return makeGroup([&] { return adoptNcclComms(c); });
          },
          nb::arg("comms"),
          "The caller's ncclComm_t handles (ints), one per rank this process drives; the caller keeps them "
          "alive and destroys them. They must come from the libnccl this extension calls.")
      .def_static(
          "mpi", [](int device, bool withNccl) { return makeGroup([&] { return createMpiCommunicator(device, withNccl); }); },
          nb::arg("device") = -1, nb::arg("with_nccl") = true,
          "One rank per process over MPI_COMM_WORLD (MPI already initialised, e.g. by mpi4py). device -1: "
          "node-local rank modulo the visible GPUs.")
      .def_static("mpi_supported", &mpiSupported, "Whether this build has the MPI communicator.")
      .def_prop_ro("world_size", [](const Group& g) { return g.comm->worldSize(); })
      .def_prop_ro("num_local_ranks", [](const Group& g) { return g.comm->numLocalRanks(); })
      .def_prop_ro("kind", [](const Group& g) { return std::string(g.comm->kind()); })
      .def("global_rank", [](const Group& g, int local) { return checkedLocal(g, local).globalRank(local); }, nb::arg("local"))
      .def("device", [](const Group& g, int local) { return checkedLocal(g, local).device(local); }, nb::arg("local"))
      .def(
          "barrier",
          [](const Group& g) {
            nb::gil_scoped_release release;
            g.comm->barrier();
          },
          "Setup-time barrier across every process of the group (collective).");
}

}  // namespace graphep::python
