// Local group: N ranks driven by one host thread in this process, no NCCL (NCCL refuses two ranks
// on one GPU). Devices may repeat: several ranks on one GPU is the emulation mode.
#include <cstring>

#include <graphep/comm.hpp>
#include <graphep/graphep.hpp>

#include "engine/error.hpp"
#include "engine/log.hpp"
#include "engine/nvtx.hpp"

namespace graphep {
namespace {

class LocalGroupComm final : public Communicator {
 public:
  explicit LocalGroupComm(std::vector<int> devices) : devices_(std::move(devices)) {}
  int worldSize() const override { return static_cast<int>(devices_.size()); }
  int numLocalRanks() const override { return static_cast<int>(devices_.size()); }
  int globalRank(int local) const override { return local; }
  int device(int local) const override { return devices_.at(static_cast<size_t>(local)); }
  const char* kind() const override { return "local-group"; }
  void allgather(const void* send, void* recv, std::size_t bytes) override {
    // Local ranks are the whole world, in order: the gather is a copy.
    if (bytes != 0) std::memcpy(recv, send, bytes * devices_.size());
  }
  void barrier() override {}  // one host thread drives every rank

 private:
  std::vector<int> devices_;
};

}  // namespace

std::unique_ptr<Communicator> createLocalGroup(const std::vector<int>& devices) {
  GRAPHEP_NVTX_RANGE("graphep::createLocalGroup");
  GRAPHEP_REQUIRE(!devices.empty() && devices.size() <= static_cast<size_t>(kMaxRanks),
                  Status::kInvalidArgument, "createLocalGroup: %zu ranks is out of range [1, %d]",
                  devices.size(), kMaxRanks);
  const char* reason = nullptr;
  const int count = cudaDeviceCountOrZero(&reason);
  GRAPHEP_REQUIRE(count > 0, Status::kNoDevice, "createLocalGroup: no CUDA device (%s)", reason);
  for (size_t i = 0; i < devices.size(); ++i) {
    GRAPHEP_REQUIRE(devices[i] >= 0 && devices[i] < count, Status::kInvalidArgument,
                    "createLocalGroup: rank %zu has device %d, but %d device(s) are visible", i,
                    devices[i], count);
  }
  GRAPHEP_LOG_INFO(log::kComm, "local group of %zu ranks", devices.size());
  return std::make_unique<LocalGroupComm>(devices);
}

}  // namespace graphep
