// MoeConfig and the static memory query. Python spells every field in snake_case (the rule
// errors.cpp applies to messages: MoeConfig.topK -> MoeConfig.top_k).
#include <graphep/moe.hpp>
#include <graphep/status.hpp>

#include <nanobind/stl/string.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "bindings.hpp"

namespace nb = nanobind;

namespace graphep::python {
namespace {

// Each enum's Python names, written once: the bindings and the reprs both read them.
template <typename E>
struct Named {
  const char* name;
  E value;
};
constexpr Named<DType> kDTypes[] = {{"BF16", DType::kBf16}, {"FP8_E4M3", DType::kFp8E4m3}};
constexpr Named<DispatchInput> kDispatchInputs[] = {{"CONFIG", DispatchInput::kConfig}, {"BF16", DispatchInput::kBf16},
                                                    {"FP8_QUANTIZE", DispatchInput::kFp8Quantize},
                                                    {"FP8", DispatchInput::kFp8}};
constexpr Named<Fp8Scales> kFp8Scales[] = {{"FLOAT", Fp8Scales::kFloat}, {"POW2", Fp8Scales::kPow2},
                                           {"UE8M0", Fp8Scales::kUe8m0}};
constexpr Named<MoeHalf> kMoeHalves[] = {{"WHOLE", MoeHalf::kWhole}, {"SEND", MoeHalf::kSend}};
constexpr Named<IndexType> kIndexTypes[] = {{"INT32", IndexType::kInt32}, {"INT64", IndexType::kInt64}};
constexpr Named<MoePath> kPaths[] = {{"AUTO", MoePath::kAuto}, {"LATENCY", MoePath::kLatency},
                                     {"THROUGHPUT", MoePath::kThroughput}};
constexpr Named<ReceiveLayout> kReceiveLayouts[] = {{"EXPERT_MAJOR", ReceiveLayout::kExpertMajor},
                                                    {"BATCHED", ReceiveLayout::kBatched},
                                                    {"RANK_MAJOR", ReceiveLayout::kRankMajor}};

template <typename E, std::size_t N>
const char* nameOf(const Named<E> (&names)[N], E value) {
  for (const Named<E>& n : names) {
    if (n.value == value) return n.name;
  }
  return "?";
}

template <typename E, std::size_t N>
void bindEnum(nb::module_& m, const char* name, const char* doc, const Named<E> (&names)[N]) {
  nb::enum_<E> e(m, name, doc);
  for (const Named<E>& n : names) e.value(n.name, n.value);
}

std::string describe(const MoeConfig& c) {
  return "MoeConfig(max_tokens_per_rank=" + std::to_string(c.maxTokensPerRank) + ", hidden=" + std::to_string(c.hidden) +
         ", num_experts=" + std::to_string(c.numExperts) + ", top_k=" + std::to_string(c.topK) +
         ", dispatch_type=" + nameOf(kDTypes, c.dispatchType) +
         ", recv_capacity=" + std::to_string(c.recvCapacity) + ", expert_alignment=" + std::to_string(c.expertAlignment) +
         ", receive_layout=" + nameOf(kReceiveLayouts, c.receiveLayout) +
         ", rows_per_expert=" + std::to_string(c.rowsPerExpert) +
         ", sm_budget=" + std::to_string(c.smBudget) + ", epilogue_sms=" + std::to_string(c.epilogueSms) +
         ", strict=" + (c.strict ? "True" : "False") +
         ", path=" + nameOf(kPaths, c.path) + ", profile=" + (c.profile ? "True" : "False") +
         ", counter_start=" + std::to_string(c.counterStart) +
         ", shrink_on_timeout=" + (c.shrinkOnTimeout ? "True" : "False") + ")";
}

// A Python int for an int field of MoeConfig: a value past the field's C type is refused naming the
// field, as Engine::validate names the others (nanobind would refuse it as a TypeError naming none).
template <typename T>
T fieldValue(long long v, const char* field) {
  using Limits = std::numeric_limits<T>;
  if (v < static_cast<long long>(Limits::min()) || v > static_cast<long long>(Limits::max())) {
    throw Error(Status::kInvalidArgument, std::string("MoeConfig.") + field + "=" + std::to_string(v) +
                                              " does not fit its " + std::to_string(8 * sizeof(T)) + "-bit field");
  }
  return static_cast<T>(v);
}

// An int field read and written from Python through fieldValue.
template <typename T>
void intField(nb::class_<MoeConfig>& c, const char* python, T MoeConfig::*member, const char* field, const char* doc) {
  c.def_prop_rw(
      python, [member](const MoeConfig& m) { return static_cast<long long>(m.*member); },
      [member, field](MoeConfig& m, long long v) { m.*member = fieldValue<T>(v, field); }, doc);
}

}  // namespace

void bindConfig(nb::module_& m) {
  bindEnum(m, "DType", "What dispatch moves: bf16, or fp8 e4m3 with one fp32 scale per 128 values.", kDTypes);
  bindEnum(m, "DispatchInput", "What a dispatch's x holds and how its rows travel (graphep::DispatchInput).",
           kDispatchInputs);
  bindEnum(m, "Fp8Scales",
           "The fp8 scales of an engine-quantised dispatch, latency path (graphep::Fp8Scales): FLOAT "
           "(amax / 448), POW2 (rounded up to a power of two, DeepEP's round_scale), UE8M0 (those powers "
           "as exponent bytes, four per int32, DeepEP's use_ue8m0).",
           kFp8Scales);
  bindEnum(m, "MoeHalf",
           "Which part of a latency-path operation a call enqueues (graphep::MoeHalf): WHOLE, or SEND "
           "alone with Engine.receive() enqueuing the receive half later (DeepEP's return_recv_hook).",
           kMoeHalves);
  bindEnum(m, "IndexType", "Element type of topk_idx.", kIndexTypes);
  bindEnum(m, "MoePath", "How dispatch and combine move data (DESIGN.md section 5).", kPaths);

  bindEnum(m, "ReceiveLayout", "How dispatch lays out the rows a rank receives (graphep.layouts; DESIGN.md section 5.4).",
           kReceiveLayouts);

  nb::class_<MoeConfig> config(m, "MoeConfig",
                               "graphep::MoeConfig (include/graphep/moe.hpp); every rank passes the same.");
  config.def(
      "__init__",
      [](MoeConfig* c, long long maxTokensPerRank, long long hidden, long long numExperts, long long topK,
         DType dispatchType, long long recvCapacity, long long expertAlignment, long long smBudget, bool strict,
         MoePath path, bool profile, long long counterStart, long long epilogueSms, ReceiveLayout receiveLayout,
         long long rowsPerExpert, bool shrinkOnTimeout) {
        new (c) MoeConfig{};
        c->maxTokensPerRank = fieldValue<int>(maxTokensPerRank, "maxTokensPerRank");
        c->hidden = fieldValue<int>(hidden, "hidden");
        c->numExperts = fieldValue<int>(numExperts, "numExperts");
        c->topK = fieldValue<int>(topK, "topK");
        c->dispatchType = dispatchType;
        c->recvCapacity = recvCapacity;
        c->expertAlignment = fieldValue<int>(expertAlignment, "expertAlignment");
        c->smBudget = fieldValue<int>(smBudget, "smBudget");
        c->epilogueSms = fieldValue<int>(epilogueSms, "epilogueSms");
        c->receiveLayout = receiveLayout;
        c->rowsPerExpert = rowsPerExpert;
        c->strict = strict;
        c->path = path;
        c->profile = profile;
        c->counterStart = fieldValue<std::uint32_t>(counterStart, "counterStart");
        c->shrinkOnTimeout = shrinkOnTimeout;
      },
      nb::kw_only(), nb::arg("max_tokens_per_rank") = 0, nb::arg("hidden") = 0, nb::arg("num_experts") = 0,
      nb::arg("top_k") = 0, nb::arg("dispatch_type") = DType::kBf16, nb::arg("recv_capacity") = 0,
      nb::arg("expert_alignment") = 1, nb::arg("sm_budget") = 0, nb::arg("strict") = false,
      nb::arg("path") = MoePath::kAuto, nb::arg("profile") = false, nb::arg("counter_start") = 0,
      nb::arg("epilogue_sms") = 0, nb::arg("receive_layout") = ReceiveLayout::kExpertMajor,
      nb::arg("rows_per_expert") = 0, nb::arg("shrink_on_timeout") = false);
  intField(config, "max_tokens_per_rank", &MoeConfig::maxTokensPerRank, "maxTokensPerRank",
           "T_max: rows of x per dispatch at most");
  intField(config, "hidden", &MoeConfig::hidden, "hidden", "H: a multiple of 8 (of 128 for fp8), at most 65536");
  intField(config, "num_experts", &MoeConfig::numExperts, "numExperts", "E: a multiple of the world size");
  intField(config, "top_k", &MoeConfig::topK, "topK", "K: 1 .. min(E, 16)");
  intField(config, "expert_alignment", &MoeConfig::expertAlignment, "expertAlignment",
           "each local expert's rows start at a multiple of this");
  intField(config, "sm_budget", &MoeConfig::smBudget, "smBudget",
           "CTAs each engine kernel may use (0: the engine's default)");
  intField(config, "epilogue_sms", &MoeConfig::epilogueSms, "epilogueSms",
           "SMs of the throughput path's epilogues where the direct dispatch applies (0: the SMs sm_budget "
           "leaves free, or every SM)");
  intField(config, "counter_start", &MoeConfig::counterStart, "counterStart",
           "the device counters' first value (tests cross the 32-bit wrap with it)");
  config.def_rw("dispatch_type", &MoeConfig::dispatchType)
      .def_rw("recv_capacity", &MoeConfig::recvCapacity, "rows of recv_x per rank; 0: the worst case")
      .def_rw("receive_layout", &MoeConfig::receiveLayout, "EXPERT_MAJOR (default), BATCHED or RANK_MAJOR")
      .def_rw("rows_per_expert", &MoeConfig::rowsPerExpert,
              "BATCHED: rows per local expert (0: world size x max_tokens_per_rank); rows past it dropped, counted")
      .def_rw("strict", &MoeConfig::strict, "trap on bad input instead of counting it")
      .def_rw("path", &MoeConfig::path)
      .def_rw("profile", &MoeConfig::profile)
      .def_rw("shrink_on_timeout", &MoeConfig::shrinkOnTimeout,
              "latency path: a wait that times out masks its peer instead of failing the engine (DeepEP's shrink mode)")
      .def("__repr__", &describe);

  nb::class_<MoeMemory>(m, "MemoryRequirements", "Device bytes one rank's engine allocates (per rank).")
      .def_ro("path", &MoeMemory::path, "the path the figures are for (never AUTO)")
      .def_ro("symmetric_heap_bytes", &MoeMemory::symmetricHeapBytes)
      .def_ro("private_bytes", &MoeMemory::privateBytes, "recv_x, scales, row metadata, expert outputs, scratch")
      .def_ro("nccl_staging_bytes", &MoeMemory::ncclStagingBytes,
              "added when a peer is reached only through NCCL (throughput path)")
      .def("__repr__", [](const MoeMemory& r) {
        return std::string("MemoryRequirements(path=") + nameOf(kPaths, r.path) +
               ", symmetric_heap_bytes=" + std::to_string(r.symmetricHeapBytes) +
               ", private_bytes=" + std::to_string(r.privateBytes) +
               ", nccl_staging_bytes=" + std::to_string(r.ncclStagingBytes) + ")";
      });

  m.def("memory_requirements", &Engine::memoryRequirements, nb::arg("config"), nb::arg("world_size"),
        "Device bytes per rank of an engine with this config, before anything is allocated (no GPU needed). "
        "Validates the config first. path AUTO: the latency path when the config fits it (every peer "
        "on the same GPU or over NVLink), else throughput; set path=THROUGHPUT for groups with PCIe or "
        "NCCL-only peers.");
  m.def("validate", &Engine::validate, nb::arg("config"), nb::arg("world_size"),
        "Raises graphep.Error naming the first bad field.");
  m.def("worst_case_capacity", &Engine::worstCaseCapacity, nb::arg("config"), nb::arg("world_size"),
        "Rows of recv_x that no routing can overflow.");
}

}  // namespace graphep::python
