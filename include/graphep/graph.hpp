// MoeGraph: dispatch -> expert slot -> combine, captured once, instantiated once, replayed any
// number of times (docs/DESIGN.md §6). Between replays the caller only rewrites its inputs in place (x,
// topk ids and weights, the live token count in device memory); a replay is one cudaGraphLaunch.
//
// Every piece of state a replay needs lives on the device (the engine's monotonic counters and
// buffers), so any number of graphs over one engine (one per batch-size bucket, dispatch-only and
// combine-only pairs) may be replayed in any interleaving: on each engine, a combine serves the
// last dispatch (dispatch -> dispatch and combine -> combine are defined). Building a graph is setup work
// (captures, instantiation); replaying it is not.
#pragma once

#include <cuda_runtime.h>

#include <functional>
#include <memory>

#include <graphep/moe.hpp>

namespace graphep {

// Expert slot (b): enqueues the caller's expert kernels on `stream` while the graph is being
// captured. They find their rows through the layout's device pointers (expertOffsets,
// expertCounts, numRecvRows: read when the kernels run) and write their outputs where the combine
// reads them (the layout's expertOutput unless MoeGraphArgs.expertOutput says otherwise).
using ExpertEnqueue = std::function<void(const DispatchLayout& layout, cudaStream_t stream)>;

struct MoeGraphArgs {
  DispatchArgs dispatch;                // device pointers the caller rewrites between replays
  const void* expertOutput = nullptr;   // [capacity, H] bf16 read by combine; nullptr: the layout's
  void* out = nullptr;                  // [T_max, H] bf16 combine output
};

class MoeGraph {
 public:
  // dispatch -> experts enqueued by `experts` during the capture -> combine.
  static std::unique_ptr<MoeGraph> capture(Engine& engine, const MoeGraphArgs& args, const ExpertEnqueue& experts);
  // dispatch -> a child graph holding a copy of `experts` -> combine. setExpertGraph swaps it.
  static std::unique_ptr<MoeGraph> withExpertGraph(Engine& engine, const MoeGraphArgs& args, cudaGraph_t experts);
  // For stacks that run their experts themselves: each graph is one operation; replay them
  // alternately (dispatch, then combine) on each engine.
  static std::unique_ptr<MoeGraph> dispatchOnly(Engine& engine, const DispatchArgs& args);
  static std::unique_ptr<MoeGraph> combineOnly(Engine& engine, const CombineArgs& args);

  ~MoeGraph();
  MoeGraph(const MoeGraph&) = delete;
  MoeGraph& operator=(const MoeGraph&) = delete;

  // One replay on `stream` (on the engine's device): a single cudaGraphLaunch.
  void launch(cudaStream_t stream);
  // Replaces the expert child graph (withExpertGraph only; setup work, not a run path): updated in
  // place when the new graph has the old one's topology, otherwise the graph is re-instantiated
  // from its kept template. Dispatch and combine are never recaptured. Replays already launched
  // keep the old experts.
  void setExpertGraph(cudaGraph_t experts);
  // The template (owned by the MoeGraph): embed it in the caller's own graph as a child graph node.
  cudaGraph_t graph() const;
  cudaGraphExec_t exec() const;
  const DispatchLayout& layout() const;
  int device() const;
  // How many times setExpertGraph re-instantiated instead of updating in place.
  int reinstantiations() const;

  struct Impl;

 private:
  explicit MoeGraph(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace graphep
