// EngineCore: one rank's graphep::Engine (include/graphep/moe.hpp) with its group kept alive. The
// run path takes raw device pointers and a cudaStream_t as ints: graphep/engine.py checks the
// arrays they come from once, in one place, for every framework. Engine-owned buffers leave as
// DLPack views whose owner is the EngineCore, so a view (or a tensor made from one) keeps the
// engine alive.
#include <graphep/moe.hpp>

#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "bindings.hpp"
#include "group.hpp"

namespace nb = nanobind;

namespace graphep::python {
namespace {

struct EngineCore {
  std::shared_ptr<Communicator> comm;  // outlives the engine (the heap holds a pointer to it)
  std::unique_ptr<Engine> engine;
};

cudaStream_t streamOf(std::uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }
template <class T>
T* pointerOf(std::uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

std::vector<EngineCore> createEngines(const Group& group, const MoeConfig& cfg) {
  std::vector<std::unique_ptr<Engine>> engines;
  {
    nb::gil_scoped_release release;  // collective: other processes' ranks are waited for
    engines = Engine::createAll(*group.comm, cfg);
  }
  std::vector<EngineCore> out;
  for (auto& e : engines) out.push_back(EngineCore{group.comm, std::move(e)});
  return out;
}

// A view of engine-owned elements (rows x cols, or a vector when cols is 0) kept alive by the
// Python object `owner`. nb::array_api makes it a nanobind.nb_ndarray, which has __dlpack__ and
// __dlpack_device__ and exports a fresh capsule per call; without a framework tag nanobind
// returns a bare one-shot "dltensor" capsule, which DeviceArray and from_dlpack cannot use.
nb::object view(nb::handle owner, const void* data, std::size_t rows, std::size_t cols, nb::dlpack::dtype dtype,
                int device, int deviceType = nb::device::cuda::value) {
  const std::size_t shape[2] = {rows, cols};
  nb::ndarray<nb::array_api> a(const_cast<void*>(data), cols == 0 ? 1 : 2, shape, owner, nullptr, dtype, deviceType,
                               device);
  return nb::cast(a);
}

// Every buffer of the dispatch layout (DispatchLayout), fixed for the engine's life. Keys whose
// buffer the engine does not have are None.
nb::dict views(EngineCore& core) {
  nb::object owner = nb::find(&core);
  const Engine& e = *core.engine;
  const DispatchLayout& v = e.layout();
  const bool fp8 = e.config().dispatchType == DType::kFp8E4m3;
  const std::size_t cap = static_cast<std::size_t>(v.capacity), H = static_cast<std::size_t>(v.hidden);
  const std::size_t L = static_cast<std::size_t>(v.numLocalExperts);
  const std::size_t R = static_cast<std::size_t>(e.worldSize());
  const int dev = e.device();
  const nb::dlpack::dtype bf16{static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
  const auto u8 = nb::dtype<std::uint8_t>();
  nb::dict d;
  // fp8 rows leave as uint8 (e4m3fn bytes): every DLPack consumer reads uint8.
  d["recv_x"] = fp8 ? view(owner, v.recvX, cap, H, u8, dev) : view(owner, v.recvX, cap, H, bf16, dev);
  // The scales exist wherever an fp8 dispatch can land: fp8 engines, and bf16 engines with hidden a
  // multiple of 128 (an engine-quantised latency dispatch writes its e4m3 rows into recv_x's first
  // cap x H bytes, row stride H bytes). UE8M0 scales reuse the first cap x H / 128 bytes of the
  // same buffer: the caller re-views it.
  const bool scales = v.scalesBuffer != nullptr;
  d["recv_scales"] = scales ? view(owner, v.scalesBuffer, cap, H / 128, nb::dtype<float>(), dev) : nb::none();
  d["recv_x_fp8"] = scales ? view(owner, v.recvX, cap, H, u8, dev) : nb::none();
  // [E_local][R] begin << 32 | count (expert-major and batched layouts; None for rank-major).
  d["expert_source_ranges"] = v.expertSourceRanges != nullptr
                                  ? view(owner, v.expertSourceRanges, L, R, nb::dtype<std::int64_t>(), dev)
                                  : nb::none();
  d["expert_offsets"] = view(owner, v.expertOffsets, L + 1, 0, nb::dtype<std::int32_t>(), dev);
  d["expert_counts"] = view(owner, v.expertCounts, L, 0, nb::dtype<std::int32_t>(), dev);
  d["expert_dropped"] = view(owner, v.expertDropped, L, 0, nb::dtype<std::int32_t>(), dev);
  d["row_src_rank"] = view(owner, v.rowSrcRank, cap, 0, nb::dtype<std::int32_t>(), dev);
  d["row_src_token"] = view(owner, v.rowSrcToken, cap, 0, nb::dtype<std::int32_t>(), dev);
  d["row_topk_slot"] = view(owner, v.rowTopkSlot, cap, 0, nb::dtype<std::int32_t>(), dev);
  d["row_weight"] = view(owner, v.rowWeight, cap, 0, nb::dtype<float>(), dev);
  d["num_recv_rows"] = view(owner, v.numRecvRows, 1, 0, nb::dtype<std::int32_t>(), dev);
  d["expert_totals"] = view(owner, v.expertTotals, L, 0, nb::dtype<std::int64_t>(), dev);  // counts < 2^63
  d["expert_output"] = view(owner, v.expertOutput, cap, H, bf16, dev);
  return d;
}

// The rank-major layout's own views (an empty dict for the other layouts).
nb::dict rankMajorViews(EngineCore& core) {
  nb::object owner = nb::find(&core);
  const Engine& e = *core.engine;
  const DispatchLayout& v = e.layout();
  nb::dict d;
  if (v.rankOffsets == nullptr) return d;
  const std::size_t cap = static_cast<std::size_t>(v.capacity), K = static_cast<std::size_t>(e.config().topK);
  const int dev = e.device();
  d["rank_offsets"] = view(owner, v.rankOffsets, static_cast<std::size_t>(e.worldSize()) + 1, 0,
                           nb::dtype<std::int32_t>(), dev);
  d["row_experts"] = view(owner, v.rowExperts, cap, K, nb::dtype<std::int32_t>(), dev);
  d["row_expert_weights"] = view(owner, v.rowExpertWeights, cap, K, nb::dtype<float>(), dev);
  return d;
}

}  // namespace

void bindEngine(nb::module_& m) {
  nb::class_<MoeStatus>(m, "MoeStatus", "Bad input the device counted (Engine.status()).")
      .def_ro("invalid_expert_ids", &MoeStatus::invalidExpertIds)
      .def_ro("dropped_rows", &MoeStatus::droppedRows)
      .def_ro("clamped_token_counts", &MoeStatus::clampedTokenCounts)
      .def_ro("first_invalid_id", &MoeStatus::firstInvalidId)
      .def_ro("first_invalid_token", &MoeStatus::firstInvalidToken)
      .def_ro("first_invalid_slot", &MoeStatus::firstInvalidSlot)
      .def_ro("first_clamped_count", &MoeStatus::firstClampedCount)
      .def_ro("unpaired_dispatches", &MoeStatus::unpairedDispatches)
      .def_ro("unpaired_combines", &MoeStatus::unpairedCombines)
      .def_ro("missing_combine_rows", &MoeStatus::missingCombineRows)
      .def_prop_ro(
          "masked_entries",
          [](const MoeStatus& s) { return std::vector<unsigned long long>(s.maskedEntries.begin(), s.maskedEntries.end()); },
          "Per destination rank: entries not sent because the rank was outside the active-rank mask.")
      .def_ro("shrunk_ranks", &MoeStatus::shrunkRanks,
              "Bit r: rank r masked after a wait on it timed out (MoeConfig.shrink_on_timeout): not an error.")
      .def_ro("device_error", &MoeStatus::deviceError)
      .def_prop_ro("ok", &MoeStatus::ok)
      .def("describe", &MoeStatus::describe)
      .def("__repr__", [](const MoeStatus& s) { return "MoeStatus(" + s.describe() + ")"; });

  nb::class_<HealthReport>(m, "HealthReport", "What Engine.check_health found.")
      .def_ro("ok", &HealthReport::ok)
      .def_ro("message", &HealthReport::message)
      .def("__bool__", [](const HealthReport& h) { return h.ok; })
      .def("__repr__", [](const HealthReport& h) { return h.ok ? std::string("HealthReport(ok)") : "HealthReport(" + h.message + ")"; });

  nb::class_<EngineCore>(m, "EngineCore", "One rank's engine; use graphep.Engine (graphep/engine.py).")
      .def_prop_ro("rank", [](const EngineCore& c) { return c.engine->rank(); })
      .def_prop_ro("world_size", [](const EngineCore& c) { return c.engine->worldSize(); })
      .def_prop_ro("device", [](const EngineCore& c) { return c.engine->device(); })
      .def_prop_ro("path", [](const EngineCore& c) { return c.engine->path(); })
      .def_prop_ro("config", [](const EngineCore& c) { return c.engine->config(); })
      .def_prop_ro("symmetric_heap_bytes", [](const EngineCore& c) { return c.engine->symmetricHeapBytes(); })
      .def_prop_ro("private_bytes", [](const EngineCore& c) { return c.engine->privateBytes(); })
      .def_prop_ro("capacity", [](const EngineCore& c) { return c.engine->layout().capacity; })
      .def_prop_ro("rows_per_expert", [](const EngineCore& c) { return c.engine->layout().rowsPerExpert; })
      .def_prop_ro("num_local_experts", [](const EngineCore& c) { return c.engine->layout().numLocalExperts; })
      .def_prop_ro("first_local_expert", [](const EngineCore& c) { return c.engine->layout().firstLocalExpert; })
      .def("views", &views)
      .def(
          "active_ranks_view",
          [](nb::handle self) -> nb::object {
            const Engine& e = *nb::cast<EngineCore&>(self).engine;
            if (e.activeRanksDevice() == nullptr) return nb::none();
            return view(self, e.activeRanksDevice(), 1, 0, nb::dtype<std::int32_t>(), e.device());
          },
          "The active-rank mask's device word as an int32 [1] view (bit r: rank r takes part), or None on "
          "the throughput path over the movers.")
      .def("rank_major_views", &rankMajorViews)
      .def(
          "dispatch",
          [](EngineCore& c, std::uintptr_t x, std::uintptr_t topkIdx, IndexType indexType, std::uintptr_t topkWeights,
             std::uintptr_t numTokens, std::uintptr_t stream, int topK, std::uintptr_t tokenInRank, DispatchInput input,
             std::uintptr_t xScales, long long scaleTokenStride, long long scaleHiddenStride, std::uintptr_t outRecvX,
             std::uintptr_t outRecvScales, std::uintptr_t outRowExperts, std::uintptr_t outRowExpertWeights,
             std::uintptr_t outRowSrcRank, std::uintptr_t outRowSrcToken, std::uintptr_t outRankPrefixMatrix,
             long long outRows, Fp8Scales scaleFormat, std::uintptr_t recvStats, MoeHalf half) {
            DispatchArgs a;
            a.x = pointerOf<const void>(x);
            a.topkIdx = pointerOf<const void>(topkIdx);
            a.indexType = indexType;
            a.topkWeights = pointerOf<const float>(topkWeights);
            a.numTokens = pointerOf<const int>(numTokens);
            a.topK = topK;
            a.tokenInRank = pointerOf<const bool>(tokenInRank);
            a.input = input;
            a.xScales = pointerOf<const float>(xScales);
            a.scaleTokenStride = scaleTokenStride;
            a.scaleHiddenStride = scaleHiddenStride;
            a.scaleFormat = scaleFormat;
            a.recvStats = pointerOf<int>(recvStats);
            a.half = half;
            a.outputs.recvX = pointerOf<void>(outRecvX);
            a.outputs.recvScales = pointerOf<float>(outRecvScales);
            a.outputs.rowExperts = pointerOf<void>(outRowExperts);
            a.outputs.rowExpertWeights = pointerOf<float>(outRowExpertWeights);
            a.outputs.rowSrcRank = pointerOf<int>(outRowSrcRank);
            a.outputs.rowSrcToken = pointerOf<int>(outRowSrcToken);
            a.outputs.rankPrefixMatrix = pointerOf<int>(outRankPrefixMatrix);
            a.outputs.rows = outRows;
            c.engine->dispatch(a, streamOf(stream));
          },
          nb::arg("x"), nb::arg("topk_idx"), nb::arg("index_type"), nb::arg("topk_weights"), nb::arg("num_tokens"),
          nb::arg("stream"), nb::kw_only(), nb::arg("top_k") = 0, nb::arg("token_in_rank") = 0,
          nb::arg("input") = DispatchInput::kConfig, nb::arg("x_scales") = 0, nb::arg("scale_token_stride") = 0,
          nb::arg("scale_hidden_stride") = 0, nb::arg("out_recv_x") = 0, nb::arg("out_recv_scales") = 0,
          nb::arg("out_row_experts") = 0, nb::arg("out_row_expert_weights") = 0, nb::arg("out_row_src_rank") = 0,
          nb::arg("out_row_src_token") = 0, nb::arg("out_rank_prefix_matrix") = 0, nb::arg("out_rows") = 0,
          nb::arg("scale_format") = Fp8Scales::kFloat, nb::arg("recv_stats") = 0, nb::arg("half") = MoeHalf::kWhole,
          "Capturable. Device pointers as ints (0: none; graphep::DispatchArgs); graphep.Engine.dispatch checks the "
          "arrays.")
      .def(
          "combine",
          [](EngineCore& c, std::uintptr_t expertOutput, std::uintptr_t out, std::uintptr_t stream,
             long long expertOutputRows, std::uintptr_t rowValues, std::uintptr_t outValues, int numValues,
             std::uintptr_t topkWeights, MoeHalf half) {
            CombineArgs a;
            a.expertOutput = pointerOf<const void>(expertOutput);
            a.out = pointerOf<void>(out);
            a.expertOutputRows = expertOutputRows;
            a.rowValues = pointerOf<const float>(rowValues);
            a.outValues = pointerOf<float>(outValues);
            a.numValues = numValues;
            a.topkWeights = pointerOf<const float>(topkWeights);
            a.half = half;
            c.engine->combine(a, streamOf(stream));
          },
          nb::arg("expert_output"), nb::arg("out"), nb::arg("stream"), nb::kw_only(), nb::arg("expert_output_rows") = 0,
          nb::arg("row_values") = 0, nb::arg("out_values") = 0, nb::arg("num_values") = 0, nb::arg("topk_weights") = 0,
          nb::arg("half") = MoeHalf::kWhole,
          "Capturable. expert_output 0: the engine's own buffer (graphep::CombineArgs).")
      .def(
          "receive", [](EngineCore& c, std::uintptr_t stream) { c.engine->receive(streamOf(stream)); },
          nb::arg("stream"),
          "Capturable, collective. The receive half of the last dispatch or combine enqueued with half=SEND "
          "(graphep::Engine::receive).")
      .def(
          "set_active_ranks",
          [](EngineCore& c, std::uint32_t mask, std::uintptr_t stream) { c.engine->setActiveRanks(mask, streamOf(stream)); },
          nb::arg("mask"), nb::arg("stream"),
          "Capturable. The active-rank mask, bit r for rank r, written in stream order; the latency path "
          "and the direct throughput path (graphep::Engine::setActiveRanks).")
      .def(
          "recover",
          [](EngineCore& c, std::uint32_t mask, std::uintptr_t stream) {
            nb::gil_scoped_release release;
            c.engine->recover(mask, streamOf(stream));
          },
          nb::arg("mask"), nb::arg("stream"),
          "Back to service among the survivors after a wait named a dead peer; synchronises "
          "(graphep::Engine::recover).")
      .def(
          "barrier", [](EngineCore& c, std::uintptr_t stream) { c.engine->barrier(streamOf(stream)); },
          nb::arg("stream"),
          "Capturable, collective. A device barrier among the ranks of the active-rank mask; with "
          "shrink_on_timeout a rank that does not come is masked (graphep::Engine::barrier).")
      .def_prop_ro(
          "active_ranks_device",
          [](const EngineCore& c) { return reinterpret_cast<std::uintptr_t>(c.engine->activeRanksDevice()); },
          "The mask's device word (uint32), 0 on the throughput path over the movers.")
      .def(
          "status",
          [](const EngineCore& c) {
            nb::gil_scoped_release release;
            return c.engine->status();
          },
          "Diagnostics, synchronises the device.")
      .def(
          "check_health",
          [](EngineCore& c, std::uintptr_t stream, long long timeoutMs) {
            nb::gil_scoped_release release;
            return c.engine->checkHealth(streamOf(stream), std::chrono::milliseconds(timeoutMs));
          },
          nb::arg("stream"), nb::arg("timeout_ms"), "Host watchdog; never synchronises the device.")
      .def_prop_ro("failed", [](const EngineCore& c) { return c.engine->failed(); })
      .def("clear_status", [](EngineCore& c) {
        nb::gil_scoped_release release;
        c.engine->clearStatus();
      });

  // Tests only (CPU): the views' export path over host memory that `owner` stands for.
  m.def(
      "_view_probe",
      [](nb::handle owner) {
        static std::int32_t values[4] = {3, 1, 4, 1};
        return view(owner, values, 4, 0, nb::dtype<std::int32_t>(), 0, nb::device::cpu::value);
      },
      nb::arg("owner"), "Tests only: a view of 4 host int32 values [3, 1, 4, 1] made as the engine's views are.");
  m.def(
      "token_layout",
      [](std::uintptr_t topkIdx, IndexType indexType, int numTokens, int topK, int numExperts, int numRanks,
         std::uintptr_t tokensPerRank, std::uintptr_t tokensPerExpert, std::uintptr_t tokenInRank, std::uintptr_t stream) {
        TokenLayoutArgs a;
        a.topkIdx = pointerOf<const void>(topkIdx);
        a.indexType = indexType;
        a.numTokens = numTokens;
        a.topK = topK;
        a.numExperts = numExperts;
        a.numRanks = numRanks;
        a.tokensPerRank = pointerOf<int>(tokensPerRank);
        a.tokensPerExpert = pointerOf<int>(tokensPerExpert);
        a.tokenInRank = pointerOf<bool>(tokenInRank);
        tokenLayout(a, streamOf(stream));
      },
      nb::arg("topk_idx"), nb::arg("index_type"), nb::arg("num_tokens"), nb::arg("top_k"), nb::arg("num_experts"),
      nb::arg("num_ranks"), nb::arg("tokens_per_rank"), nb::arg("tokens_per_expert"), nb::arg("token_in_rank"),
      nb::arg("stream"),
      "Capturable, not collective (graphep::tokenLayout, DeepEP's get_dispatch_layout): int32 [num_ranks] tokens "
      "per rank, int32 [num_experts] entries per expert, bool [num_tokens, num_ranks]; device pointers as ints.");
  m.def("create_engines", &createEngines, nb::arg("group"), nb::arg("config"),
        "Collective over the group: one EngineCore per rank this process drives (local-rank order).");
}

}  // namespace graphep::python
