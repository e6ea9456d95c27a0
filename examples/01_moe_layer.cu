// 01_moe_layer: the main job. Decode steps of a Mixture-of-Experts layer at Qwen3-30B-A3B's shape
// (H = 2048, 128 experts, top-8, SwiGLU experts of FFN 768, bf16), its experts sharded over the
// ranks with graphep and run on tensor cores (cuBLAS batched GEMMs), captured as one CUDA graph per
// rank and replayed with no host work between steps:
//
//   router: this step's tokens (from a device step counter), scores, top-8, softmax weights
//   -> graphep dispatch: recv_x grouped by local expert, counts and offsets on the device
//   -> gather to [local experts, M rows, H] -> gate/up GEMM -> SwiGLU -> down GEMM -> scatter back
//   -> graphep combine: out[t] = sum_k w_k y_k
//
// It prints the step time's percentiles, where rank 0's step time goes (events recorded by a
// profiled copy of its graph), the expert GEMMs' achieved TFLOP/s, and the same layer on one GPU,
// unsharded, for comparison. Every --check-every steps both are checked against a CUDA-core
// reference (common/moe_reference.cu derives its tolerance). One rank per GPU, or two emulated
// ranks on one GPU (--one-gpu). Exit code 0: PASS; 1: FAIL or an error; 2: bad flags; 77: no GPU.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <vector>

#include <graphep/graphep.hpp>

#include "common/batched_experts.cuh"
#include "common/cuda_raii.hpp"
#include "common/layer_inputs.cuh"
#include "common/layer_options.hpp"
#include "common/layout_bridge.cuh"
#include "common/moe_reference.cuh"
#include "common/single_gpu_layer.cuh"
#include "common/step_timing.hpp"

namespace {

namespace ex = graphep::example;
using ex::bf16;
using ex::StepPoint;

constexpr int kProfiledReplays = 20;

// One rank of the sharded layer: its engine, router buffers, experts and layer graphs.
struct RankLayer {
  RankLayer(const ex::LayerShape& s, int r, std::unique_ptr<graphep::Engine> e, int rowsPerExpert)
      : rank(r),
        device(e->device()),
        engine(std::move(e)),
        stream(ex::makeStream(device)),
        routerWeights(device, static_cast<std::size_t>(s.hidden) * s.numExperts),
        x(device, static_cast<std::size_t>(s.tokensPerRank) * s.hidden),
        out(device, x.size()),
        topkIds(device, static_cast<std::size_t>(s.tokensPerRank) * s.topK),
        numTokens(device, 1),
        topkWeights(device, topkIds.size()),
        step(device, 1),
        overflow(device, 1),
        experts(device, s, r * (s.numExperts / s.numRanks), s.numExperts / s.numRanks, rowsPerExpert) {
    const ex::DeviceGuard guard(device);
    ex::fillWeights(routerWeights.get(), routerWeights.size(), ex::Tensor::kRouter, 0, routerWeights.size(), s.hidden,
                    stream.get());
    GRAPHEP_EXAMPLE_CUDA_CHECK(
        cudaMemcpyAsync(numTokens.get(), &s.tokensPerRank, sizeof(int), cudaMemcpyHostToDevice, stream.get()));
    GRAPHEP_EXAMPLE_CUDA_CHECK(cudaMemsetAsync(step.get(), 0, step.bytes(), stream.get()));
    GRAPHEP_EXAMPLE_CUDA_CHECK(cudaMemsetAsync(overflow.get(), 0, overflow.bytes(), stream.get()));
    GRAPHEP_EXAMPLE_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
  }
  int rank, device;
  std::unique_ptr<graphep::Engine> engine;
  ex::Stream stream;
  ex::DeviceBuffer<bf16> routerWeights, x, out;
  ex::DeviceBuffer<int> topkIds, numTokens;
  ex::DeviceBuffer<float> topkWeights;
  ex::DeviceBuffer<std::uint32_t> step;
  ex::DeviceBuffer<unsigned long long> overflow;  // rows past M, never computed
  ex::BatchedExperts experts;
  std::vector<std::unique_ptr<graphep::MoeGraph>> moeGraphs;
  ex::GraphExec layer, profiled;  // the decode loop's graph; rank 0: the same, recording the probe
};

// One rank's layer graph: [router -> step + 1] -> [MoeGraph: dispatch -> expert slot -> combine].
// The MoeGraph's template is embedded as a child graph, so a step is one cudaGraphLaunch. With a
// probe, the graph records its events at the points of the step.
ex::GraphExec buildLayerGraph(RankLayer& k, const ex::LayerShape& shape, const ex::StepProbe* probe) {
  auto mark = [probe](StepPoint point, cudaStream_t s) {
    if (probe != nullptr) probe->mark(point, s);
  };
  graphep::MoeGraphArgs args;
  args.dispatch = {k.x.get(), k.topkIds.get(), graphep::IndexType::kInt32, k.topkWeights.get(), k.numTokens.get()};
  args.out = k.out.get();
  // The expert slot: from graphep's layout (counts and offsets read on the device) to its expertOutput.
  auto expertSlot = [&](const graphep::DispatchLayout& layout, cudaStream_t s) {
    mark(StepPoint::kDispatched, s);
    ex::gatherFromLayout(layout, k.experts, k.overflow.get(), s);
    mark(StepPoint::kGathered, s);
    k.experts.enqueue(s);
    mark(StepPoint::kComputed, s);
    ex::scatterToLayout(k.experts, layout, s);
    mark(StepPoint::kScattered, s);
  };
  k.moeGraphs.push_back(graphep::MoeGraph::capture(*k.engine, args, expertSlot));
  const ex::Graph router = ex::capture(k.device, k.stream.get(), [&](cudaStream_t s) {
    mark(StepPoint::kStart, s);
    ex::routeTokens({.routerWeights = k.routerWeights.get(),
                     .step = k.step.get(),
                     .x = k.x.get(),
                     .topkIds = k.topkIds.get(),
                     .topkWeights = k.topkWeights.get(),
                     .numTokens = shape.tokensPerRank,
                     .firstRank = k.rank,
                     .shape = shape},
                    s);
    ex::advanceStep(k.step.get(), s);
    mark(StepPoint::kRouted, s);
  });
  const ex::Graph layer = ex::makeGraph(k.device);
  cudaGraphNode_t routerNode = nullptr, moeNode = nullptr, endNode = nullptr;
  GRAPHEP_EXAMPLE_CUDA_CHECK(cudaGraphAddChildGraphNode(&routerNode, layer.get(), nullptr, 0, router.get()));
  GRAPHEP_EXAMPLE_CUDA_CHECK(
      cudaGraphAddChildGraphNode(&moeNode, layer.get(), &routerNode, 1, k.moeGraphs.back()->graph()));
  if (probe != nullptr) {
    GRAPHEP_EXAMPLE_CUDA_CHECK(
        cudaGraphAddEventRecordNode(&endNode, layer.get(), &moeNode, 1, probe->event(StepPoint::kCombined)));
  }
  return ex::instantiate(layer);
}

int run(const ex::LayerOptions& o, int gpus) {
  ex::LayerShape shape = o.shape;
  const int R = o.ranks > 0 ? o.ranks : (gpus >= 2 && !o.oneGpu ? gpus : 2);
  shape.numRanks = R;
  const int T = shape.tokensPerRank, M = o.rowsPerExpert > 0 ? o.rowsPerExpert : R * T;
  if (shape.numExperts % R != 0) {
    std::fprintf(stderr, "01_moe_layer: experts=%d is not divisible by %d ranks\n", shape.numExperts, R);
    return 2;
  }
  std::vector<int> devices;
  for (int r = 0; r < R; ++r) devices.push_back(o.oneGpu ? 0 : r % gpus);
  std::printf(
      "01_moe_layer: H=%d, %d experts, top-%d, expert FFN %d (SwiGLU, bf16); %d ranks on %d GPU(s), "
      "%d tokens per rank, %d rows per expert; %d steps\n",
      shape.hidden, shape.numExperts, shape.topK, shape.ffn, R, o.oneGpu ? 1 : std::min(gpus, R), T, M, o.steps);

  // Setup: engines (collective), each rank's experts and graphs, the unsharded layer, the reference.
  auto comm = graphep::createLocalGroup(devices);
  graphep::MoeConfig cfg;
  cfg.maxTokensPerRank = T;
  cfg.hidden = shape.hidden;
  cfg.numExperts = shape.numExperts;
  cfg.topK = shape.topK;
  auto engines = graphep::Engine::createAll(*comm, cfg);
  std::vector<std::unique_ptr<RankLayer>> ranks;
  for (int r = 0; r < R; ++r) ranks.push_back(std::make_unique<RankLayer>(shape, r, std::move(engines[r]), M));
  ex::StepProbe probe(devices[0]);
  for (auto& k : ranks) k->layer = buildLayerGraph(*k, shape, nullptr);
  ranks[0]->profiled = buildLayerGraph(*ranks[0], shape, &probe);
  ex::SingleGpuLayer single(devices[0], shape, M);
  ex::Reference reference(devices[0], shape, single.routerWeights(), single.experts().gateUpWeights(),
                          single.experts().downWeights());

  // The decode loop: one graph launch per rank per step, nothing else.
  auto launchRanks = [&](bool profiledRank0) {
    for (auto& k : ranks) {
      const ex::DeviceGuard guard(k->device);
      GRAPHEP_EXAMPLE_CUDA_CHECK(
          cudaGraphLaunch((profiledRank0 && k->rank == 0 ? k->profiled : k->layer).get(), k->stream.get()));
    }
  };
  auto syncRanks = [&] {
    for (auto& k : ranks) {
      const ex::DeviceGuard guard(k->device);
      GRAPHEP_EXAMPLE_CUDA_CHECK(cudaStreamSynchronize(k->stream.get()));
    }
  };
  ex::CheckStats shardedCheck, singleCheck;
  auto checkSharded = [&](std::uint32_t step) {
    syncRanks();
    reference.compute(step);
    for (auto& k : ranks) reference.compare(k->out.get(), k->device, k->rank * T, T, "sharded", shardedCheck);
  };
  const std::vector<double> shardedUs = ex::timeDecodeSteps(
      o.steps, o.checkEvery, devices[0], ranks[0]->stream.get(), [&] { launchRanks(false); }, checkSharded);
  ex::printStepTimes("sharded layer, rank 0's stream", shardedUs);

  // Where a step goes: profiled replays of rank 0's graph, medians.
  std::vector<double> realRows;
  for (int i = 0; i < kProfiledReplays; ++i) {
    launchRanks(true);
    syncRanks();
    probe.collect();
    realRows.push_back(ex::readDeviceValue(ranks[0]->engine->layout().numRecvRows, devices[0]));
  }
  std::printf("  breakdown (rank 0, median of %d profiled replays, us):", probe.replays());
  probe.printBreakdown();
  ex::printExpertRates(ranks[0]->experts, ex::median(realRows), probe.medianUs(StepPoint::kGathered));

  // The same layer on one GPU, unsharded: its own graph, the same tokens step by step.
  const ex::Stream singleStream = ex::makeStream(devices[0]);
  auto checkSingle = [&](std::uint32_t step) {
    GRAPHEP_EXAMPLE_CUDA_CHECK(cudaStreamSynchronize(singleStream.get()));
    reference.compute(step);
    reference.compare(single.out(), devices[0], 0, R * T, "one GPU", singleCheck);
  };
  const std::vector<double> singleUs = ex::timeDecodeSteps(
      o.steps, o.checkEvery, devices[0], singleStream.get(), [&] { single.launch(singleStream.get()); }, checkSingle);
  ex::printStepTimes("one GPU, unsharded (all experts, every rank's tokens)", singleUs);
  std::printf("  one-GPU p50 / sharded p50: %.2fx\n", ex::percentile(singleUs, 0.5) / ex::percentile(shardedUs, 0.5));

  bool ok = shardedCheck.wrong == 0 && singleCheck.wrong == 0;
  for (const ex::CheckStats* c : {&shardedCheck, &singleCheck}) {
    std::printf(
        "checked the %s layer against the CUDA-core reference: %lld values, %lld wrong, worst error %.3f "
        "of the tolerance\n",
        c == &shardedCheck ? "sharded" : "one-GPU", c->checked, c->wrong, c->worstRatio);
  }
  for (auto& k : ranks) {
    const graphep::MoeStatus st = k->engine->status();
    const unsigned long long dropped = ex::readDeviceValue(k->overflow.get(), k->device);
    if (!st.ok() || dropped != 0) {
      std::fprintf(stderr, "rank %d: %s; %llu rows past %d per expert dropped\n", k->rank, st.describe().c_str(),
                   dropped, M);
      ok = false;
    }
  }
  if (const unsigned long long dropped = single.overflowRows(); dropped != 0) {
    std::fprintf(stderr, "one GPU: %llu rows past %d per expert dropped\n", dropped, M);
    ok = false;
  }
  std::printf("%s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const ex::LayerOptions o = ex::parseLayerOptions(argc, argv);
  const char* why = nullptr;
  const int gpus = graphep::cudaDeviceCountOrZero(&why);
  if (gpus == 0) {
    std::printf("01_moe_layer: no GPU (%s): nothing to run\n", why != nullptr ? why : "none found");
    return 77;
  }
  try {
    return run(o, gpus);
  } catch (const graphep::Error& e) {
    std::fprintf(stderr, "01_moe_layer: %s: %s\n", graphep::statusName(e.status()), e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "01_moe_layer: %s\n", e.what());
  }
  return 1;
}
