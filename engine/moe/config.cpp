// The MoE config's checks (engine/moe/plan.hpp): Engine::validate, the same config on every rank,
// and the local buffers fitting every rank's device, all before anything is allocated.
#include <graphep/moe.hpp>

#include <iterator>
#include <vector>

#include "engine/device_pointer.hpp"
#include "engine/error.hpp"
#include "engine/moe/plan.hpp"
#include "engine/platform.hpp"
#include "kernels/moe/moe.h"

namespace graphep {

const char* name(MoePath path) {
  static constexpr const char* kNames[] = {"auto", "latency", "throughput"};
  const auto i = static_cast<std::size_t>(path);
  return i < std::size(kNames) ? kNames[i] : "?";
}

const char* name(ReceiveLayout layout) {
  static constexpr const char* kNames[] = {"expert-major", "batched", "rank-major"};
  const auto i = static_cast<std::size_t>(layout);
  return i < std::size(kNames) ? kNames[i] : "?";
}

namespace moe_setup {

using detail::DeviceGuard;

void requireSameConfig(Communicator& comm, const MoeConfig& cfg) {
  // Every field of MoeConfig, and the world size: the binding stops compiling when a field is
  // added to MoeConfig or removed, until it is compared here too.
  const auto& [maxTokensPerRank, hidden, numExperts, topK, dispatchType, recvCapacity, expertAlignment, receiveLayout,
               rowsPerExpert, smBudget, epilogueSms, strict, path, profile, counterStart, shrinkOnTimeout] = cfg;
  constexpr int kFields = 17;
  struct Fields {
    long long v[kFields];
  };
  const Fields mine{{maxTokensPerRank, hidden, numExperts, topK, static_cast<long long>(dispatchType), recvCapacity,
                     expertAlignment, static_cast<long long>(receiveLayout), rowsPerExpert, smBudget, epilogueSms,
                     strict ? 1 : 0, static_cast<long long>(path), profile ? 1 : 0,
                     static_cast<long long>(counterStart), shrinkOnTimeout ? 1 : 0, comm.worldSize()}};
  static constexpr const char* names[] = {"maxTokensPerRank", "hidden", "numExperts", "topK", "dispatchType",
                                          "recvCapacity", "expertAlignment", "receiveLayout", "rowsPerExpert",
                                          "smBudget", "epilogueSms", "strict", "path", "profile", "counterStart",
                                          "shrinkOnTimeout", "world size"};
  static_assert(std::size(names) == kFields, "a name for every compared field");
  std::vector<Fields> local(static_cast<std::size_t>(comm.numLocalRanks()), mine);
  std::vector<Fields> all(static_cast<std::size_t>(comm.worldSize()));
  comm.allgather(local.data(), all.data(), sizeof(Fields));
  for (std::size_t q = 0; q < all.size(); ++q) {
    for (int k = 0; k < kFields; ++k) {
      GRAPHEP_REQUIRE(all[q].v[k] == mine.v[k], Status::kInvalidArgument,
                      "MoeConfig differs across ranks: %s is %lld on rank %d but %lld on rank %zu (every rank "
                      "must pass the same config)",
                      names[k], mine.v[k], comm.globalRank(0), all[q].v[k], q);
    }
  }
}

void requireLocalBuffersFit(Communicator& comm, const SymmetricHeap& heap, const MoeConfig& cfg, std::size_t bytes,
                            long long capacity) {
  struct Room {
    unsigned long long free;  // the device's free bytes shared out over this process's ranks on it
    int device;
  };
  std::vector<Room> mine;
  for (int l = 0; l < heap.numLocalRanks(); ++l) {
    DeviceGuard guard(heap.device(l));
    std::size_t free = 0, total = 0;
    GRAPHEP_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    int sharing = 0;  // emulated ranks of this process on the same GPU allocate one after another
    for (int k = 0; k < heap.numLocalRanks(); ++k) sharing += heap.device(k) == heap.device(l) ? 1 : 0;
    mine.push_back(Room{free / static_cast<unsigned long long>(sharing), heap.device(l)});
  }
  std::vector<Room> all(static_cast<std::size_t>(comm.worldSize()));
  comm.allgather(mine.data(), all.data(), sizeof(Room));
  for (std::size_t q = 0; q < all.size(); ++q) {
    GRAPHEP_REQUIRE(bytes <= all[q].free, Status::kOutOfMemory,
                    "MoeConfig: rank %zu needs %zu B of engine buffers (recv_x and expert outputs: %lld rows "
                    "of H=%d%s), more than its share (%llu B) of the memory free on its device %d; lower %s",
                    q, bytes, capacity, cfg.hidden,
                    cfg.receiveLayout == ReceiveLayout::kBatched ? ", the batched layout's E_local x rowsPerExpert" : "",
                    all[q].free, all[q].device,
                    cfg.receiveLayout == ReceiveLayout::kBatched ? "rowsPerExpert" : "recvCapacity or maxTokensPerRank");
  }
}

namespace {
// The batched and rank-major layouts size themselves (`capacity`): recvCapacity stays 0 and
// expertAlignment 1.
void requireLayoutSizesItself(const MoeConfig& c, const char* layout, const char* capacity) {
  GRAPHEP_REQUIRE(c.recvCapacity == 0, Status::kInvalidArgument,
                  "MoeConfig.recvCapacity=%lld: the %s layout's capacity is %s (leave recvCapacity 0)",
                  c.recvCapacity, layout, capacity);
  GRAPHEP_REQUIRE(c.expertAlignment == 1, Status::kInvalidArgument,
                  "MoeConfig.expertAlignment=%d does not apply to the %s layout (leave it 1)", c.expertAlignment,
                  layout);
}
}  // namespace

}  // namespace moe_setup

using namespace moe_setup;

void Engine::validate(const MoeConfig& c, int R) {
  GRAPHEP_REQUIRE(R >= 1 && R <= kMaxRanks, Status::kInvalidArgument,
                  "MoeConfig: world size %d is out of range [1, %d]", R, kMaxRanks);
  GRAPHEP_REQUIRE(c.maxTokensPerRank >= 1 && c.maxTokensPerRank <= (1 << 20),
                  Status::kInvalidArgument,
                  "MoeConfig.maxTokensPerRank=%d is out of range [1, 1048576]", c.maxTokensPerRank);
  GRAPHEP_REQUIRE(c.hidden > 0 && c.hidden % 8 == 0, Status::kInvalidArgument,
                  "MoeConfig.hidden=%d is not a positive multiple of 8", c.hidden);
  GRAPHEP_REQUIRE(c.hidden <= kMoeMaxHidden, Status::kInvalidArgument,
                  "MoeConfig.hidden=%d exceeds the supported %d", c.hidden, kMoeMaxHidden);
  GRAPHEP_REQUIRE(c.dispatchType == DType::kBf16 || c.dispatchType == DType::kFp8E4m3,
                  Status::kInvalidArgument, "MoeConfig.dispatchType=%d is not a DType",
                  static_cast<int>(c.dispatchType));
  GRAPHEP_REQUIRE(c.dispatchType != DType::kFp8E4m3 || c.hidden % 128 == 0,
                  Status::kInvalidArgument,
                  "MoeConfig.hidden=%d is not a multiple of 128 (fp8 dispatch has one scale per 128 "
                  "values)",
                  c.hidden);
  GRAPHEP_REQUIRE(c.numExperts >= 1, Status::kInvalidArgument,
                  "MoeConfig.numExperts=%d is not positive", c.numExperts);
  GRAPHEP_REQUIRE(c.numExperts % R == 0, Status::kInvalidArgument,
                  "MoeConfig.numExperts=%d is not divisible by the %d ranks", c.numExperts, R);
  GRAPHEP_REQUIRE(c.topK >= 1, Status::kInvalidArgument, "MoeConfig.topK=%d is not positive", c.topK);
  GRAPHEP_REQUIRE(c.topK <= c.numExperts, Status::kInvalidArgument,
                  "MoeConfig.topK=%d exceeds numExperts=%d", c.topK, c.numExperts);
  GRAPHEP_REQUIRE(c.topK <= kMoeMaxTopK, Status::kInvalidArgument,
                  "MoeConfig.topK=%d exceeds the supported %d", c.topK, kMoeMaxTopK);
  GRAPHEP_REQUIRE(c.expertAlignment >= 1 && c.expertAlignment <= 4096, Status::kInvalidArgument,
                  "MoeConfig.expertAlignment=%d is out of range [1, 4096]", c.expertAlignment);
  GRAPHEP_REQUIRE(c.smBudget >= 0 && c.smBudget <= 64, Status::kInvalidArgument,
                  "MoeConfig.smBudget=%d is out of range [0, 64]", c.smBudget);
  GRAPHEP_REQUIRE(c.epilogueSms >= 0 && c.epilogueSms <= 1024, Status::kInvalidArgument,
                  "MoeConfig.epilogueSms=%d is out of range [0, 1024]", c.epilogueSms);
  GRAPHEP_REQUIRE(c.numExperts / R <= kMoeMaxLocalExperts, Status::kInvalidArgument,
                  "MoeConfig: %d experts per rank (numExperts=%d over %d ranks) exceed the supported %d",
                  c.numExperts / R, c.numExperts, R, kMoeMaxLocalExperts);
  GRAPHEP_REQUIRE(c.path == MoePath::kAuto || c.path == MoePath::kLatency || c.path == MoePath::kThroughput,
                  Status::kInvalidArgument, "MoeConfig.path=%d is not a MoePath", static_cast<int>(c.path));
  GRAPHEP_REQUIRE(c.path != MoePath::kLatency || latencyFits(c, R), Status::kInvalidArgument,
                  "MoeConfig.path=kLatency needs maxTokensPerRank <= %d, maxTokensPerRank * topK <= %d and "
                  "its routing in %u B of shared memory (maxTokensPerRank=%d, topK=%d, numExperts=%d)",
                  kMoeLatencyMaxTokens, kMoeLatencyMaxEntries, kMoeLatencyMaxSmem, c.maxTokensPerRank, c.topK,
                  c.numExperts);
  GRAPHEP_REQUIRE(!c.shrinkOnTimeout || preferredPath(c, R) == MoePath::kLatency, Status::kInvalidArgument,
                  "MoeConfig.shrinkOnTimeout needs the latency path; this config takes the throughput path "
                  "(path=%d, maxTokensPerRank=%d)",
                  static_cast<int>(c.path), c.maxTokensPerRank);
  GRAPHEP_REQUIRE(c.recvCapacity >= 0, Status::kInvalidArgument,
                  "MoeConfig.recvCapacity=%lld is negative", c.recvCapacity);
  GRAPHEP_REQUIRE(c.receiveLayout == ReceiveLayout::kExpertMajor || c.receiveLayout == ReceiveLayout::kBatched ||
                      c.receiveLayout == ReceiveLayout::kRankMajor,
                  Status::kInvalidArgument, "MoeConfig.receiveLayout=%d is not a ReceiveLayout",
                  static_cast<int>(c.receiveLayout));
  if (c.receiveLayout == ReceiveLayout::kRankMajor) {
    requireLayoutSizesItself(c, "rank-major", "worldSize x maxTokensPerRank (one row per source token)");
  }
  GRAPHEP_REQUIRE(c.rowsPerExpert >= 0, Status::kInvalidArgument, "MoeConfig.rowsPerExpert=%lld is negative",
                  c.rowsPerExpert);
  if (c.receiveLayout == ReceiveLayout::kBatched) {
    requireLayoutSizesItself(c, "batched", "E_local x rowsPerExpert");
  } else {
    GRAPHEP_REQUIRE(c.rowsPerExpert == 0, Status::kInvalidArgument,
                    "MoeConfig.rowsPerExpert=%lld applies to the batched layout only", c.rowsPerExpert);
  }
  const long long cap = receiveCapacity(c, R);
  if (c.receiveLayout == ReceiveLayout::kBatched) {  // the capacity's own field named
    GRAPHEP_REQUIRE(cap < (1ll << 31), Status::kInvalidArgument,
                    "MoeConfig.rowsPerExpert=%lld: %d local experts x %lld rows exceed 2^31 - 1 rows (lower "
                    "rowsPerExpert)",
                    c.rowsPerExpert, c.numExperts / R, batchedRowsPerExpert(c, R));
  } else {
    GRAPHEP_REQUIRE(cap < (1ll << 31), Status::kInvalidArgument,
                    "MoeConfig: a receive capacity of %lld rows exceeds 2^31 - 1 (lower recvCapacity)", cap);
  }
  GRAPHEP_REQUIRE(static_cast<long long>(R) * c.maxTokensPerRank < (1ll << 31),
                  Status::kInvalidArgument,
                  "MoeConfig: %d ranks x maxTokensPerRank=%d records exceed 2^31 - 1", R,
                  c.maxTokensPerRank);
}

}  // namespace graphep
