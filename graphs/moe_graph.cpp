// MoeGraph (include/graphep/graph.hpp): the engine's dispatch and combine captured into graphs
// once, composed with the caller's expert slot, instantiated once.
//
// Expert slot (a) keeps a template graph of three child-graph nodes, dispatch -> experts ->
// combine, so that swapping the experts rebuilds one node and updates (or re-instantiates) the
// executable graph without capturing the engine's operations again. Slot (b) and the one-operation
// graphs are single stream captures.
#include <graphep/graph.hpp>

#include "engine/error.hpp"
#include "engine/log.hpp"
#include "engine/platform.hpp"

namespace graphep {

using detail::DeviceGuard;

namespace {

// Captures what `enqueue(stream)` issues on a private stream of the current device (thread-local
// capture mode, so other threads' work is unaffected) into a new graph.
template <class F>
cudaGraph_t captureGraph(F&& enqueue) {
  cudaStream_t s = nullptr;
  GRAPHEP_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t g = nullptr;
  GRAPHEP_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  try {
    enqueue(s);
  } catch (...) {
    cudaStreamEndCapture(s, &g);  // leave the stream usable, drop the partial graph
    if (g != nullptr) cudaGraphDestroy(g);
    cudaStreamDestroy(s);
    throw;
  }
  const cudaError_t e = cudaStreamEndCapture(s, &g);
  cudaStreamDestroy(s);
  GRAPHEP_CUDA_CHECK(e);
  return g;
}

cudaGraphExec_t instantiate(cudaGraph_t g) {
  cudaGraphExec_t e = nullptr;
  GRAPHEP_CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
  return e;
}

CombineArgs combineArgs(const MoeGraphArgs& a) {
  CombineArgs c;
  c.expertOutput = a.expertOutput;
  c.out = a.out;
  return c;
}

}  // namespace

struct MoeGraph::Impl {
  int device = 0;
  DispatchLayout layout{};
  cudaGraph_t tmpl = nullptr;
  cudaGraphExec_t exec = nullptr;
  // Slot (a): the template's nodes.
  cudaGraphNode_t dispatchNode = nullptr, expertNode = nullptr, combineNode = nullptr;
  int reinstantiations = 0;

  ~Impl() {
    cudaSetDevice(device);
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    if (tmpl != nullptr) cudaGraphDestroy(tmpl);
  }
};

MoeGraph::MoeGraph(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MoeGraph::~MoeGraph() = default;

std::unique_ptr<MoeGraph> MoeGraph::capture(Engine& engine, const MoeGraphArgs& args, const ExpertEnqueue& experts) {
  GRAPHEP_REQUIRE(static_cast<bool>(experts), Status::kInvalidArgument,
                  "MoeGraph::capture: the expert callback is empty (use withExpertGraph or dispatchOnly)");
  DeviceGuard guard(engine.device());
  auto impl = std::make_unique<Impl>();
  impl->device = engine.device();
  impl->tmpl = captureGraph([&](cudaStream_t s) {
    impl->layout = engine.dispatch(args.dispatch, s);
    experts(impl->layout, s);
    engine.combine(combineArgs(args), s);
  });
  impl->exec = instantiate(impl->tmpl);
  GRAPHEP_LOG_INFO(log::kGraph, "rank %d: MoeGraph captured (expert callback)", engine.rank());
  return std::unique_ptr<MoeGraph>(new MoeGraph(std::move(impl)));
}

std::unique_ptr<MoeGraph> MoeGraph::withExpertGraph(Engine& engine, const MoeGraphArgs& args, cudaGraph_t experts) {
  GRAPHEP_REQUIRE(experts != nullptr, Status::kInvalidArgument, "MoeGraph::withExpertGraph: experts is null");
  DeviceGuard guard(engine.device());
  auto impl = std::make_unique<Impl>();
  impl->device = engine.device();
  DispatchLayout layout{};
  cudaGraph_t d = captureGraph([&](cudaStream_t s) { layout = engine.dispatch(args.dispatch, s); });
  cudaGraph_t c = nullptr;
  try {
    c = captureGraph([&](cudaStream_t s) { engine.combine(combineArgs(args), s); });
  } catch (...) {
    cudaGraphDestroy(d);
    throw;
  }
  impl->layout = layout;
  // Child-graph nodes hold copies: the captures are released below.
  cudaError_t e = cudaGraphCreate(&impl->tmpl, 0);
  if (e == cudaSuccess) e = cudaGraphAddChildGraphNode(&impl->dispatchNode, impl->tmpl, nullptr, 0, d);
  if (e == cudaSuccess) e = cudaGraphAddChildGraphNode(&impl->expertNode, impl->tmpl, &impl->dispatchNode, 1, experts);
  if (e == cudaSuccess) e = cudaGraphAddChildGraphNode(&impl->combineNode, impl->tmpl, &impl->expertNode, 1, c);
  cudaGraphDestroy(d);
  cudaGraphDestroy(c);
  GRAPHEP_CUDA_CHECK(e);
  impl->exec = instantiate(impl->tmpl);
  GRAPHEP_LOG_INFO(log::kGraph, "rank %d: MoeGraph built (expert child graph)", engine.rank());
  return std::unique_ptr<MoeGraph>(new MoeGraph(std::move(impl)));
}

std::unique_ptr<MoeGraph> MoeGraph::dispatchOnly(Engine& engine, const DispatchArgs& args) {
  DeviceGuard guard(engine.device());
  auto impl = std::make_unique<Impl>();
  impl->device = engine.device();
  impl->tmpl = captureGraph([&](cudaStream_t s) { impl->layout = engine.dispatch(args, s); });
  impl->exec = instantiate(impl->tmpl);
  return std::unique_ptr<MoeGraph>(new MoeGraph(std::move(impl)));
}

std::unique_ptr<MoeGraph> MoeGraph::combineOnly(Engine& engine, const CombineArgs& args) {
  DeviceGuard guard(engine.device());
  auto impl = std::make_unique<Impl>();
  impl->device = engine.device();
  impl->layout = engine.layout();
  impl->tmpl = captureGraph([&](cudaStream_t s) { engine.combine(args, s); });
  impl->exec = instantiate(impl->tmpl);
  return std::unique_ptr<MoeGraph>(new MoeGraph(std::move(impl)));
}

void MoeGraph::launch(cudaStream_t stream) { GRAPHEP_CUDA_CHECK(cudaGraphLaunch(impl_->exec, stream)); }

void MoeGraph::setExpertGraph(cudaGraph_t experts) {
  Impl& m = *impl_;
  GRAPHEP_REQUIRE(m.expertNode != nullptr, Status::kInvalidUsage,
                  "MoeGraph::setExpertGraph: this graph has no expert child graph (built by withExpertGraph)");
  GRAPHEP_REQUIRE(experts != nullptr, Status::kInvalidArgument, "MoeGraph::setExpertGraph: experts is null");
  DeviceGuard guard(m.device);
  // The template's expert node is rebuilt around a copy of the new graph, with the same edges.
  cudaGraphNode_t node = nullptr;
  GRAPHEP_CUDA_CHECK(cudaGraphAddChildGraphNode(&node, m.tmpl, &m.dispatchNode, 1, experts));
#if CUDART_VERSION >= 13000
  const cudaError_t edge = cudaGraphAddDependencies(m.tmpl, &node, &m.combineNode, nullptr, 1);
#else
  const cudaError_t edge = cudaGraphAddDependencies(m.tmpl, &node, &m.combineNode, 1);
#endif
  if (edge != cudaSuccess) {
    cudaGraphDestroyNode(node);
    GRAPHEP_CUDA_CHECK(edge);
  }
  GRAPHEP_CUDA_CHECK(cudaGraphDestroyNode(m.expertNode));
  m.expertNode = node;
  // In place when the topology allows it; otherwise a new executable graph from the template.
  cudaGraphExecUpdateResultInfo info{};
  if (cudaGraphExecUpdate(m.exec, m.tmpl, &info) != cudaSuccess) {
    (void)cudaGetLastError();  // the failed update's error is not sticky; clear it
    cudaGraphExec_t fresh = instantiate(m.tmpl);
    GRAPHEP_CUDA_CHECK(cudaGraphExecDestroy(m.exec));
    m.exec = fresh;
    ++m.reinstantiations;
    GRAPHEP_LOG_INFO(log::kGraph, "MoeGraph: expert graph of a new topology, re-instantiated (update result %d)",
                     static_cast<int>(info.result));
  }
}

cudaGraph_t MoeGraph::graph() const { return impl_->tmpl; }
cudaGraphExec_t MoeGraph::exec() const { return impl_->exec; }
const DispatchLayout& MoeGraph::layout() const { return impl_->layout; }
int MoeGraph::device() const { return impl_->device; }
int MoeGraph::reinstantiations() const { return impl_->reinstantiations; }

}  // namespace graphep
