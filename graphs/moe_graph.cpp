// MoeGraph (include/graphep/graph.hpp): the engine's dispatch and combine captured into graphs
// once, composed with the caller's expert slot, instantiated once.
//
// Expert slot (a) keeps a template graph of three child-graph nodes, dispatch -> experts ->
// combine, so that swapping the experts rebuilds one node and updates (or re-instantiates) the
// executable graph without capturing the engine's operations again. Slot (b) and the one-operation
// graphs are single stream captures.
#include <graphep/graph.hpp>

#include <vector>

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

// Whether cudaGraphExecUpdate can take `a`'s executable graph to `b`, as far as the host can
// tell cheaply: the same node types in creation order, child graphs included. A pair that passes
// may still be refused (the update then reports why); a pair that fails is re-instantiated without
// asking, so no failing call is made (compute-sanitizer reports every CUDA error, handled or not).
bool sameShape(cudaGraph_t a, cudaGraph_t b) {
  std::size_t na = 0, nb = 0;
  GRAPHEP_CUDA_CHECK(cudaGraphGetNodes(a, nullptr, &na));
  GRAPHEP_CUDA_CHECK(cudaGraphGetNodes(b, nullptr, &nb));
  if (na != nb) return false;
  std::vector<cudaGraphNode_t> xa(na), xb(nb);
  if (na != 0) {
    GRAPHEP_CUDA_CHECK(cudaGraphGetNodes(a, xa.data(), &na));
    GRAPHEP_CUDA_CHECK(cudaGraphGetNodes(b, xb.data(), &nb));
  }
  for (std::size_t i = 0; i < na; ++i) {
    cudaGraphNodeType ta, tb;
    GRAPHEP_CUDA_CHECK(cudaGraphNodeGetType(xa[i], &ta));
    GRAPHEP_CUDA_CHECK(cudaGraphNodeGetType(xb[i], &tb));
    if (ta != tb) return false;
    if (ta == cudaGraphNodeTypeGraph) {
      cudaGraph_t ca = nullptr, cb = nullptr;
      GRAPHEP_CUDA_CHECK(cudaGraphChildGraphNodeGetGraph(xa[i], &ca));
      GRAPHEP_CUDA_CHECK(cudaGraphChildGraphNodeGetGraph(xb[i], &cb));
      if (!sameShape(ca, cb)) return false;
    }
  }
  return true;
}

cudaGraphExec_t instantiate(cudaGraph_t g) {
  cudaGraphExec_t e = nullptr;
  GRAPHEP_CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
  return e;
}

// Slot (a)'s template: three child-graph nodes holding copies of the given graphs, dispatch ->
// experts -> combine, always created in that order (cudaGraphExecUpdate pairs nodes by it).
struct Template {
  cudaGraph_t graph = nullptr;
  cudaGraphNode_t dispatch = nullptr, experts = nullptr, combine = nullptr;
};
Template buildTemplate(cudaGraph_t d, cudaGraph_t x, cudaGraph_t c) {
  Template t;
  cudaError_t e = cudaGraphCreate(&t.graph, 0);
  if (e == cudaSuccess) e = cudaGraphAddChildGraphNode(&t.dispatch, t.graph, nullptr, 0, d);
  if (e == cudaSuccess) e = cudaGraphAddChildGraphNode(&t.experts, t.graph, &t.dispatch, 1, x);
  if (e == cudaSuccess) e = cudaGraphAddChildGraphNode(&t.combine, t.graph, &t.experts, 1, c);
  if (e != cudaSuccess && t.graph != nullptr) cudaGraphDestroy(t.graph);
  GRAPHEP_CUDA_CHECK(e);
  return t;
}

CombineArgs combineArgs(const MoeGraphArgs& a) {
  CombineArgs c;
  c.expertOutput = a.expertOutput;
  c.out = a.out;
  return c;
}

}  // namespace

struct MoeGraph::Impl {
  std::shared_ptr<void> engine;  // the engine's buffers outlive the Engine object while this graph exists
  int device = 0;
  DispatchLayout layout{};
  cudaGraph_t tmpl = nullptr;
  cudaGraphExec_t exec = nullptr;
  // Slot (a): the captured dispatch and combine graphs (kept: a new template is built from them
  // when the experts change; graphs owned by child-graph nodes cannot be copied into another
  // graph) and the template's nodes.
  cudaGraph_t dispatchGraph = nullptr, combineGraph = nullptr;
  cudaGraphNode_t dispatchNode = nullptr, expertNode = nullptr, combineNode = nullptr;
  int reinstantiations = 0;

  ~Impl() {
    cudaSetDevice(device);
    if (exec != nullptr) cudaGraphExecDestroy(exec);  // before the engine's buffers it points into
    if (tmpl != nullptr) cudaGraphDestroy(tmpl);
    if (dispatchGraph != nullptr) cudaGraphDestroy(dispatchGraph);
    if (combineGraph != nullptr) cudaGraphDestroy(combineGraph);
  }

  // Every factory's frame: on the engine's device, a graph holding the engine's state, whose
  // template (and what goes with it) `fill` builds, instantiated last; `built` (or nullptr) is
  // logged there, still on the engine's device (the log names the current device).
  template <typename Fill>
  static std::unique_ptr<MoeGraph> build(Engine& engine, const char* built, Fill&& fill) {
    DeviceGuard guard(engine.device());
    auto impl = std::make_unique<Impl>();
    impl->device = engine.device();
    impl->engine = engine.impl_;
    fill(*impl);
    impl->exec = instantiate(impl->tmpl);
    if (built != nullptr) GRAPHEP_LOG_INFO(log::kGraph, "rank %d: %s", engine.rank(), built);
    return std::unique_ptr<MoeGraph>(new MoeGraph(std::move(impl)));
  }
};

MoeGraph::MoeGraph(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MoeGraph::~MoeGraph() = default;

std::unique_ptr<MoeGraph> MoeGraph::capture(Engine& engine, const MoeGraphArgs& args, const ExpertEnqueue& experts) {
  GRAPHEP_REQUIRE(static_cast<bool>(experts), Status::kInvalidArgument,
                  "MoeGraph::capture: the expert callback is empty (use withExpertGraph or dispatchOnly)");
  return Impl::build(engine, "MoeGraph captured (expert callback)", [&](Impl& m) {
    m.tmpl = captureGraph([&](cudaStream_t s) {
      m.layout = engine.dispatch(args.dispatch, s);
      experts(m.layout, s);
      engine.combine(combineArgs(args), s);
    });
  });
}

std::unique_ptr<MoeGraph> MoeGraph::withExpertGraph(Engine& engine, const MoeGraphArgs& args, cudaGraph_t experts) {
  GRAPHEP_REQUIRE(experts != nullptr, Status::kInvalidArgument, "MoeGraph::withExpertGraph: experts is null");
  return Impl::build(engine, "MoeGraph built (expert child graph)", [&](Impl& m) {
    m.dispatchGraph = captureGraph([&](cudaStream_t s) { m.layout = engine.dispatch(args.dispatch, s); });
    m.combineGraph = captureGraph([&](cudaStream_t s) { engine.combine(combineArgs(args), s); });
    const Template t = buildTemplate(m.dispatchGraph, experts, m.combineGraph);
    m.tmpl = t.graph;
    m.dispatchNode = t.dispatch;
    m.expertNode = t.experts;
    m.combineNode = t.combine;
  });
}

std::unique_ptr<MoeGraph> MoeGraph::dispatchOnly(Engine& engine, const DispatchArgs& args) {
  return Impl::build(engine, nullptr, [&](Impl& m) {
    m.tmpl = captureGraph([&](cudaStream_t s) { m.layout = engine.dispatch(args, s); });
  });
}

std::unique_ptr<MoeGraph> MoeGraph::combineOnly(Engine& engine, const CombineArgs& args) {
  return Impl::build(engine, nullptr, [&](Impl& m) {
    m.layout = engine.layout();
    m.tmpl = captureGraph([&](cudaStream_t s) { engine.combine(args, s); });
  });
}

void MoeGraph::launch(cudaStream_t stream) { GRAPHEP_CUDA_CHECK(cudaGraphLaunch(impl_->exec, stream)); }

void MoeGraph::setExpertGraph(cudaGraph_t experts) {
  Impl& m = *impl_;
  GRAPHEP_REQUIRE(m.expertNode != nullptr, Status::kInvalidUsage,
                  "MoeGraph::setExpertGraph: this graph has no expert child graph (built by withExpertGraph)");
  GRAPHEP_REQUIRE(experts != nullptr, Status::kInvalidArgument, "MoeGraph::setExpertGraph: experts is null");
  DeviceGuard guard(m.device);
  // A new template from the current one's dispatch and combine graphs and the new experts, in the
  // same creation order; the executable graph is updated from it in place when the topology allows.
  const Template t = buildTemplate(m.dispatchGraph, experts, m.combineGraph);
  cudaGraph_t current = nullptr;
  GRAPHEP_CUDA_CHECK(cudaGraphChildGraphNodeGetGraph(m.expertNode, &current));
  cudaGraphExecUpdateResultInfo info{};
  info.result = cudaGraphExecUpdateErrorTopologyChanged;
  if (!sameShape(current, experts) || cudaGraphExecUpdate(m.exec, t.graph, &info) != cudaSuccess) {
    (void)cudaGetLastError();  // a failed update leaves the executable graph as it was
    cudaGraphExec_t fresh = nullptr;
    const cudaError_t e = cudaGraphInstantiate(&fresh, t.graph, 0);
    if (e != cudaSuccess) {
      cudaGraphDestroy(t.graph);
      GRAPHEP_CUDA_CHECK(e);
    }
    GRAPHEP_CUDA_CHECK(cudaGraphExecDestroy(m.exec));
    m.exec = fresh;
    ++m.reinstantiations;
    GRAPHEP_LOG_INFO(log::kGraph, "MoeGraph: expert graph of a new topology, re-instantiated (update result %d)",
                     static_cast<int>(info.result));
  }
  GRAPHEP_CUDA_CHECK(cudaGraphDestroy(m.tmpl));
  m.tmpl = t.graph;
  m.dispatchNode = t.dispatch;
  m.expertNode = t.experts;
  m.combineNode = t.combine;
}

cudaGraph_t MoeGraph::graph() const { return impl_->tmpl; }
cudaGraphExec_t MoeGraph::exec() const { return impl_->exec; }
const DispatchLayout& MoeGraph::layout() const { return impl_->layout; }
int MoeGraph::device() const { return impl_->device; }
int MoeGraph::reinstantiations() const { return impl_->reinstantiations; }

}  // namespace graphep
