// The C ABI (include/graphep/graphep.h) over the C++ API: handles own C++ objects, every entry
// point converts exceptions to a status and this thread's last-error message.
#include <graphep/graphep.h>

#include <graphep/graphep.hpp>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "engine/error.hpp"

struct graphep_comm {
  std::unique_ptr<graphep::Communicator> comm;
};
struct graphep_engine {
  std::unique_ptr<graphep::Engine> engine;
};
struct graphep_graph {
  std::unique_ptr<graphep::MoeGraph> graph;
};

namespace {

thread_local std::string lastError;

// Runs `body`, mapping every exception to a status and the message.
template <class F>
graphep_status_t guarded(F&& body) noexcept {
  try {
    body();
    return GRAPHEP_SUCCESS;
  } catch (const graphep::Error& e) {
    lastError = e.what();
    return static_cast<graphep_status_t>(e.status());
  } catch (const std::bad_alloc&) {
    lastError = "host allocation failed";
    return GRAPHEP_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    lastError = e.what();
    return GRAPHEP_INTERNAL_ERROR;
  } catch (...) {
    lastError = "unknown exception";
    return GRAPHEP_INTERNAL_ERROR;
  }
}

template <class T>
void requireNonNull(const T* p, const char* what) {
  GRAPHEP_REQUIRE(p != nullptr, graphep::Status::kInvalidArgument, "%s is NULL", what);
}

// The size of each versioned struct's first version: a caller's struct_size must cover at least
// that much. A struct grows only at its end (graphep.h), so the fields up to a caller's size are
// the same in every version.
template <class T>
constexpr std::size_t kFirstVersionSize = sizeof(T);  // structs that have not grown since version 1
template <>
constexpr std::size_t kFirstVersionSize<graphep_layout_t> = offsetof(graphep_layout_t, expert_dropped);
static_assert(sizeof(void*) != 8 || kFirstVersionSize<graphep_layout_t> == 120,
              "graphep_layout_t's version-1 fields moved: the struct may only grow at its end");
template <>
constexpr std::size_t kFirstVersionSize<graphep_moe_config_t> = offsetof(graphep_moe_config_t, epilogue_sms);
static_assert(sizeof(void*) != 8 || kFirstVersionSize<graphep_moe_config_t> == 56,
              "graphep_moe_config_t's version-1 fields moved: the struct may only grow at its end");
template <>
constexpr std::size_t kFirstVersionSize<graphep_dispatch_args_t> = offsetof(graphep_dispatch_args_t, top_k);
static_assert(sizeof(void*) != 8 || kFirstVersionSize<graphep_dispatch_args_t> == 48,
              "graphep_dispatch_args_t's version-1 fields moved: the struct may only grow at its end");
template <>
constexpr std::size_t kFirstVersionSize<graphep_combine_args_t> = offsetof(graphep_combine_args_t, expert_output_rows);
static_assert(sizeof(void*) != 8 || kFirstVersionSize<graphep_combine_args_t> == 24,
              "graphep_combine_args_t's version-1 fields moved: the struct may only grow at its end");
template <>
constexpr std::size_t kFirstVersionSize<graphep_moe_status_t> = offsetof(graphep_moe_status_t, missing_combine_rows);
static_assert(sizeof(void*) != 8 || kFirstVersionSize<graphep_moe_status_t> == 72,
              "graphep_moe_status_t's version-1 fields moved: the struct may only grow at its end");
// A version-4 caller passes sizeof its struct, tail padding included: version 5's first field must
// start past that padding, or the caller's padding bytes would be read as it.
static_assert(sizeof(void*) != 8 || offsetof(graphep_dispatch_args_t, scale_format) == 160,
              "graphep_dispatch_args_t's version-5 fields must start at the version-4 size");
static_assert(sizeof(void*) != 8 || offsetof(graphep_combine_args_t, topk_weights) == 56,
              "graphep_combine_args_t's version-5 fields must start at the version-4 size");
static_assert(sizeof(void*) != 8 || offsetof(graphep_layout_t, expert_source_ranges) == 168,
              "graphep_layout_t's version-5 fields must start at the version-4 size");

// The fields of a caller's versioned struct that its struct_size covers (an older caller's struct
// is shorter; a newer caller's extra fields are ignored); fields past it read 0, so a field added
// to an input struct must mean "as before" when 0.
template <class T>
T readVersioned(const T* in, const char* what) {
  requireNonNull(in, what);
  GRAPHEP_REQUIRE(in->struct_size >= kFirstVersionSize<T>, graphep::Status::kInvalidArgument,
                  "%s->struct_size=%zu is smaller than the first version's %zu bytes (initialise it with "
                  "the GRAPHEP_*_INIT macro)",
                  what, in->struct_size, kFirstVersionSize<T>);
  // Every version's size is a sizeof, so a multiple of the struct's alignment: any other size would
  // cut a field in two (read half from the caller, half as 0).
  GRAPHEP_REQUIRE(in->struct_size % alignof(T) == 0, graphep::Status::kInvalidArgument,
                  "%s->struct_size=%zu is not a multiple of %zu, so no version's size (initialise it with "
                  "the GRAPHEP_*_INIT macro)",
                  what, in->struct_size, alignof(T));
  T out{};
  std::memcpy(&out, in, std::min(in->struct_size, sizeof(T)));
  return out;
}

// Writes an output struct into the caller's: only the bytes its struct_size covers (an older
// caller's struct is shorter; a newer caller's extra fields are left as they were), and
// struct_size set to the bytes written. The caller's size was checked by readVersioned.
template <class T>
void writeVersioned(T* dst, T v) {
  const std::size_t n = std::min(dst->struct_size, sizeof(T));
  v.struct_size = n;
  std::memcpy(dst, &v, n);
}

graphep::Engine& engineOf(graphep_engine_t e) {
  GRAPHEP_REQUIRE(e != nullptr && e->engine != nullptr, graphep::Status::kInvalidArgument, "engine is NULL");
  return *e->engine;
}

// A versioned args struct's half field (op: "dispatch" or "combine"), checked.
graphep::MoeHalf halfOf(int half, const char* op) {
  GRAPHEP_REQUIRE(half == GRAPHEP_HALF_WHOLE || half == GRAPHEP_HALF_SEND, graphep::Status::kInvalidArgument,
                  "%s args half=%d is not a graphep_half_t", op, half);
  return static_cast<graphep::MoeHalf>(half);
}

graphep::DispatchArgs dispatchArgs(const graphep_dispatch_args_t* a) {
  const graphep_dispatch_args_t v = readVersioned(a, "dispatch args");
  GRAPHEP_REQUIRE(v.index_type == GRAPHEP_INDEX_INT32 || v.index_type == GRAPHEP_INDEX_INT64,
                  graphep::Status::kInvalidArgument, "dispatch args index_type=%d is not a graphep_index_type_t",
                  v.index_type);
  graphep::DispatchArgs d;
  d.x = v.x;
  d.topkIdx = v.topk_idx;
  d.indexType = v.index_type == GRAPHEP_INDEX_INT64 ? graphep::IndexType::kInt64 : graphep::IndexType::kInt32;
  d.topkWeights = v.topk_weights;
  d.numTokens = v.num_tokens;
  GRAPHEP_REQUIRE(v.input >= GRAPHEP_INPUT_CONFIG && v.input <= GRAPHEP_INPUT_FP8, graphep::Status::kInvalidArgument,
                  "dispatch args input=%d is not a graphep_dispatch_input_t", v.input);
  d.topK = v.top_k;
  d.tokenInRank = reinterpret_cast<const bool*>(v.token_in_rank);
  d.input = static_cast<graphep::DispatchInput>(v.input);
  d.xScales = v.x_scales;
  d.scaleTokenStride = v.scale_token_stride;
  d.scaleHiddenStride = v.scale_hidden_stride;
  d.outputs.recvX = v.out_recv_x;
  d.outputs.recvScales = v.out_recv_scales;
  d.outputs.rowExperts = v.out_row_experts;
  d.outputs.rowExpertWeights = v.out_row_expert_weights;
  d.outputs.rowSrcRank = v.out_row_src_rank;
  d.outputs.rowSrcToken = v.out_row_src_token;
  d.outputs.rankPrefixMatrix = v.out_rank_prefix_matrix;
  d.outputs.rows = v.out_rows;
  GRAPHEP_REQUIRE(v.scale_format >= GRAPHEP_FP8_SCALES_FLOAT && v.scale_format <= GRAPHEP_FP8_SCALES_UE8M0,
                  graphep::Status::kInvalidArgument, "dispatch args scale_format=%d is not a graphep_fp8_scales_t",
                  v.scale_format);
  d.scaleFormat = static_cast<graphep::Fp8Scales>(v.scale_format);
  d.recvStats = v.recv_stats;
  d.half = halfOf(v.half, "dispatch");
  return d;
}

graphep::CombineArgs combineArgs(const graphep_combine_args_t* a) {
  const graphep_combine_args_t v = readVersioned(a, "combine args");
  graphep::CombineArgs c;
  c.expertOutput = v.expert_output;
  c.out = v.out;
  c.expertOutputRows = v.expert_output_rows;
  c.rowValues = v.row_values;
  c.outValues = v.out_values;
  c.numValues = v.num_values;
  c.topkWeights = v.topk_weights;
  c.half = halfOf(v.half, "combine");
  return c;
}

// graphep::MoeConfig from the caller's versioned struct, enums checked by name.
graphep::MoeConfig moeConfig(const graphep_moe_config_t* config) {
  const graphep_moe_config_t c = readVersioned(config, "config");
  GRAPHEP_REQUIRE(c.dispatch_dtype == GRAPHEP_DTYPE_BF16 || c.dispatch_dtype == GRAPHEP_DTYPE_FP8_E4M3,
                  graphep::Status::kInvalidArgument, "config->dispatch_dtype=%d is not a graphep_dtype_t",
                  c.dispatch_dtype);
  GRAPHEP_REQUIRE(c.path >= GRAPHEP_PATH_AUTO && c.path <= GRAPHEP_PATH_THROUGHPUT, graphep::Status::kInvalidArgument,
                  "config->path=%d is not a graphep_path_t", c.path);
  GRAPHEP_REQUIRE(c.receive_layout >= GRAPHEP_LAYOUT_EXPERT_MAJOR && c.receive_layout <= GRAPHEP_LAYOUT_RANK_MAJOR,
                  graphep::Status::kInvalidArgument, "config->receive_layout=%d is not a graphep_receive_layout_t",
                  c.receive_layout);
  graphep::MoeConfig m;
  m.maxTokensPerRank = c.max_tokens_per_rank;
  m.hidden = c.hidden;
  m.numExperts = c.num_experts;
  m.topK = c.top_k;
  m.dispatchType = c.dispatch_dtype == GRAPHEP_DTYPE_FP8_E4M3 ? graphep::DType::kFp8E4m3 : graphep::DType::kBf16;
  m.recvCapacity = c.recv_capacity;
  m.expertAlignment = c.expert_alignment;
  m.smBudget = c.sm_budget;
  m.epilogueSms = c.epilogue_sms;
  m.receiveLayout = static_cast<graphep::ReceiveLayout>(c.receive_layout);
  m.rowsPerExpert = c.rows_per_expert;
  m.shrinkOnTimeout = c.shrink_on_timeout != 0;
  m.strict = c.strict != 0;
  m.path = static_cast<graphep::MoePath>(c.path);
  return m;
}

// A communicator handle from `count` caller items (devices or NCCL communicators).
template <class T, class Create>
graphep_status_t makeComm(const T* items, int count, const char* what, graphep_comm_t* comm, Create create) {
  return guarded([&] {
    requireNonNull(items, what);
    requireNonNull(comm, "comm");
    GRAPHEP_REQUIRE(count >= 1, graphep::Status::kInvalidArgument, "count=%d is not positive", count);
    auto h = std::make_unique<graphep_comm>();
    h->comm = create(std::vector<T>(items, items + count));
    *comm = h.release();
  });
}
}  // namespace

extern "C" {

const char* graphep_version(void) { return graphep::versionString(); }

int graphep_api_version(void) { return GRAPHEP_C_API_VERSION; }

const char* graphep_status_name(graphep_status_t status) {
  return graphep::statusName(static_cast<graphep::Status>(status));
}

const char* graphep_last_error(void) { return lastError.c_str(); }


graphep_status_t graphep_comm_create_local_group(const int* devices, int count, graphep_comm_t* comm) {
  return makeComm(devices, count, "devices", comm, [](const std::vector<int>& d) { return graphep::createLocalGroup(d); });
}

graphep_status_t graphep_comm_adopt_nccl(const ncclComm_t* comms, int count, graphep_comm_t* comm) {
  return makeComm(comms, count, "comms", comm,
                  [](const std::vector<ncclComm_t>& c) { return graphep::adoptNcclComms(c); });
}

graphep_status_t graphep_comm_world_size(graphep_comm_t comm, int* worldSize) {
  return guarded([&] {
    requireNonNull(comm, "comm");
    requireNonNull(worldSize, "world_size");
    *worldSize = comm->comm->worldSize();
  });
}

graphep_status_t graphep_comm_local_ranks(graphep_comm_t comm, int* localRanks) {
  return guarded([&] {
    requireNonNull(comm, "comm");
    requireNonNull(localRanks, "local_ranks");
    *localRanks = comm->comm->numLocalRanks();
  });
}

graphep_status_t graphep_comm_destroy(graphep_comm_t comm) {
  return guarded([&] { delete comm; });
}

graphep_status_t graphep_engine_create_all(graphep_comm_t comm, const graphep_moe_config_t* config,
                                           graphep_engine_t* engines, int count) {
  return guarded([&] {
    requireNonNull(comm, "comm");
    requireNonNull(engines, "engines");
    const graphep::MoeConfig m = moeConfig(config);
    GRAPHEP_REQUIRE(count == comm->comm->numLocalRanks(), graphep::Status::kInvalidArgument,
                    "count=%d differs from the communicator's %d local ranks", count, comm->comm->numLocalRanks());
    auto all = graphep::Engine::createAll(*comm->comm, m);
    std::vector<std::unique_ptr<graphep_engine>> hs;
    for (auto& e : all) {
      hs.push_back(std::make_unique<graphep_engine>());
      hs.back()->engine = std::move(e);
    }
    for (int i = 0; i < count; ++i) engines[i] = hs[static_cast<std::size_t>(i)].release();
  });
}

graphep_status_t graphep_memory_requirements(const graphep_moe_config_t* config, int world_size,
                                             graphep_moe_memory_t* memory) {
  return guarded([&] {
    const graphep::MoeConfig m = moeConfig(config);
    (void)readVersioned(memory, "memory");
    const graphep::MoeMemory r = graphep::Engine::memoryRequirements(m, world_size);
    graphep_moe_memory_t o{};
    o.path = static_cast<int>(r.path);
    o.symmetric_heap_bytes = r.symmetricHeapBytes;
    o.private_bytes = r.privateBytes;
    o.nccl_staging_bytes = r.ncclStagingBytes;
    writeVersioned(memory, o);
  });
}

graphep_status_t graphep_engine_destroy(graphep_engine_t engine) {
  return guarded([&] { delete engine; });
}

graphep_status_t graphep_engine_layout(graphep_engine_t engine, graphep_layout_t* layout) {
  return guarded([&] {
    const graphep::DispatchLayout& v = engineOf(engine).layout();
    (void)readVersioned(layout, "layout");
    graphep_layout_t o{};
    o.recv_x = v.recvX;
    o.recv_scales = v.recvScales;
    o.expert_offsets = v.expertOffsets;
    o.expert_counts = v.expertCounts;
    o.row_src_rank = v.rowSrcRank;
    o.row_src_token = v.rowSrcToken;
    o.row_topk_slot = v.rowTopkSlot;
    o.row_weight = v.rowWeight;
    o.num_recv_rows = v.numRecvRows;
    o.expert_totals = v.expertTotals;
    o.expert_output = v.expertOutput;
    o.capacity = v.capacity;
    o.hidden = v.hidden;
    o.num_local_experts = v.numLocalExperts;
    o.first_local_expert = v.firstLocalExpert;
    o.expert_dropped = v.expertDropped;
    o.receive_layout = static_cast<int>(v.receiveLayout);
    o.rows_per_expert = v.rowsPerExpert;
    o.rank_offsets = v.rankOffsets;
    o.row_experts = v.rowExperts;
    o.row_expert_weights = v.rowExpertWeights;
    o.expert_source_ranges = v.expertSourceRanges;
    o.scales_buffer = v.scalesBuffer;
    writeVersioned(layout, o);
  });
}

graphep_status_t graphep_engine_path(graphep_engine_t engine, int* path) {
  return guarded([&] {
    requireNonNull(path, "path");
    *path = static_cast<int>(engineOf(engine).path());
  });
}

graphep_status_t graphep_dispatch(graphep_engine_t engine, const graphep_dispatch_args_t* args, cudaStream_t stream) {
  return guarded([&] { engineOf(engine).dispatch(dispatchArgs(args), stream); });
}

graphep_status_t graphep_combine(graphep_engine_t engine, const graphep_combine_args_t* args, cudaStream_t stream) {
  return guarded([&] { engineOf(engine).combine(combineArgs(args), stream); });
}

graphep_status_t graphep_receive(graphep_engine_t engine, cudaStream_t stream) {
  return guarded([&] { engineOf(engine).receive(stream); });
}

graphep_status_t graphep_set_active_ranks(graphep_engine_t engine, unsigned int mask, cudaStream_t stream) {
  return guarded([&] { engineOf(engine).setActiveRanks(mask, stream); });
}

graphep_status_t graphep_engine_recover(graphep_engine_t engine, unsigned int mask, cudaStream_t stream) {
  return guarded([&] { engineOf(engine).recover(mask, stream); });
}

graphep_status_t graphep_engine_barrier(graphep_engine_t engine, cudaStream_t stream) {
  return guarded([&] { engineOf(engine).barrier(stream); });
}

static_assert(GRAPHEP_MAX_RANKS == graphep::kMaxRanks, "graphep.h's GRAPHEP_MAX_RANKS is graphep::kMaxRanks");

graphep_status_t graphep_engine_status(graphep_engine_t engine, graphep_moe_status_t* status) {
  return guarded([&] {
    (void)readVersioned(status, "status");
    const graphep::MoeStatus s = engineOf(engine).status();
    graphep_moe_status_t o{};
    o.invalid_expert_ids = s.invalidExpertIds;
    o.dropped_rows = s.droppedRows;
    o.clamped_token_counts = s.clampedTokenCounts;
    o.first_invalid_id = s.firstInvalidId;
    o.first_invalid_token = s.firstInvalidToken;
    o.first_invalid_slot = s.firstInvalidSlot;
    o.first_clamped_count = s.firstClampedCount;
    o.device_error = s.deviceError.empty() ? 0 : 1;
    o.unpaired_dispatches = s.unpairedDispatches;
    o.unpaired_combines = s.unpairedCombines;
    o.missing_combine_rows = s.missingCombineRows;
    for (int r = 0; r < GRAPHEP_MAX_RANKS; ++r) o.masked_entries[r] = s.maskedEntries[static_cast<std::size_t>(r)];
    o.shrunk_ranks = s.shrunkRanks;
    if (!s.deviceError.empty()) lastError = s.deviceError;
    writeVersioned(status, o);
  });
}

graphep_status_t graphep_token_layout(const void* topk_idx, int index_type, int num_tokens, int top_k,
                                      int num_experts, int num_ranks, int* tokens_per_rank,
                                      int* tokens_per_expert, unsigned char* token_in_rank, cudaStream_t stream) {
  return guarded([&] {
    GRAPHEP_REQUIRE(index_type == GRAPHEP_INDEX_INT32 || index_type == GRAPHEP_INDEX_INT64,
                    graphep::Status::kInvalidArgument, "index_type=%d is not a graphep_index_type_t", index_type);
    graphep::TokenLayoutArgs a;
    a.topkIdx = topk_idx;
    a.indexType = index_type == GRAPHEP_INDEX_INT64 ? graphep::IndexType::kInt64 : graphep::IndexType::kInt32;
    a.numTokens = num_tokens;
    a.topK = top_k;
    a.numExperts = num_experts;
    a.numRanks = num_ranks;
    a.tokensPerRank = tokens_per_rank;
    a.tokensPerExpert = tokens_per_expert;
    a.tokenInRank = reinterpret_cast<bool*>(token_in_rank);
    graphep::tokenLayout(a, stream);
  });
}

graphep_status_t graphep_graph_create(graphep_engine_t engine, const graphep_dispatch_args_t* dispatch,
                                      const graphep_combine_args_t* combine, cudaGraph_t experts,
                                      graphep_graph_t* graph) {
  return guarded([&] {
    requireNonNull(graph, "graph");
    graphep::MoeGraphArgs a;
    a.dispatch = dispatchArgs(dispatch);
    const graphep::CombineArgs c = combineArgs(combine);
    // A MoeGraph runs whole operations and its combine takes only expert_output and out: refuse what
    // it would otherwise drop (capture graphep_dispatch / graphep_receive / graphep_combine instead),
    // before the engine is looked at.
    GRAPHEP_REQUIRE(a.dispatch.half == graphep::MoeHalf::kWhole && c.half == graphep::MoeHalf::kWhole,
                    graphep::Status::kInvalidArgument,
                    "graphep_graph_create: dispatch half=%d, combine half=%d: a MoeGraph runs whole operations",
                    static_cast<int>(a.dispatch.half), static_cast<int>(c.half));
    GRAPHEP_REQUIRE(c.topkWeights == nullptr, graphep::Status::kInvalidArgument,
                    "graphep_graph_create: combine topk_weights=%p: a MoeGraph's combine takes the dispatch's weights",
                    static_cast<const void*>(c.topkWeights));
    GRAPHEP_REQUIRE(c.expertOutputRows == 0, graphep::Status::kInvalidArgument,
                    "graphep_graph_create: combine expert_output_rows=%lld: a MoeGraph's combine reads the whole "
                    "receive capacity of expert_output (0)", c.expertOutputRows);
    GRAPHEP_REQUIRE(c.rowValues == nullptr && c.outValues == nullptr && c.numValues == 0,
                    graphep::Status::kInvalidArgument,
                    "graphep_graph_create: combine row_values=%p, out_values=%p, num_values=%d: a MoeGraph's combine "
                    "carries no per-row values",
                    static_cast<const void*>(c.rowValues), static_cast<const void*>(c.outValues), c.numValues);
    a.expertOutput = c.expertOutput;
    a.out = c.out;
    auto h = std::make_unique<graphep_graph>();
    h->graph = graphep::MoeGraph::withExpertGraph(engineOf(engine), a, experts);
    *graph = h.release();
  });
}

graphep_status_t graphep_graph_set_experts(graphep_graph_t graph, cudaGraph_t experts) {
  return guarded([&] {
    requireNonNull(graph, "graph");
    graph->graph->setExpertGraph(experts);
  });
}

graphep_status_t graphep_graph_launch(graphep_graph_t graph, cudaStream_t stream) {
  return guarded([&] {
    requireNonNull(graph, "graph");
    graph->graph->launch(stream);
  });
}

graphep_status_t graphep_graph_destroy(graphep_graph_t graph) {
  return guarded([&] { delete graph; });
}

}  // extern "C"
