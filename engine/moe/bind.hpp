// The MoE engine's kernel parameters (setup only): one local rank's MoeParams bound to its carved
// buffers, its heap and the CTA plan; the device counters started at MoeConfig.counterStart; the
// throughput path's alltoallv exchanges; and the DispatchLayout views a user reads.
#pragma once

#include <graphep/moe.hpp>

#include "engine/heap.hpp"
#include "engine/node_map.hpp"
#include "engine/moe/cta_plan.hpp"
#include "engine/moe/impl.hpp"
#include "engine/moe/plan.hpp"
#include "kernels/moe/moe.h"

namespace graphep::moe_setup {

// What one local rank's parameters are bound from.
struct BindPlan {
  const MoeConfig& cfg;
  const MoeSizes& sizes;
  const PathHeap& ph;
  const LocalCarve& carve;
  long long capacity;
  bool throughput, direct;
  const LatencyCtas& latency;
  const ThroughputCtas& tput;
  const NodeMap& nodes;  // the node-aware dispatch where sizes.nodeAware
};

// Local rank l's kernel parameters over its buffers `block` (carved as plan.carve) and its heap.
// Also writes the exchange tables' constant halves (throughput path) into the block.
MoeParams bindParams(const BindPlan& plan, SymmetricHeap& heap, int l, char* block);

// Starts the latency and direct paths' device counters (steps, flags, block flags, arrivals,
// acknowledgements) at MoeConfig.counterStart (setup only, before any kernel).
void startCounters(const BindPlan& plan, const MoeParams& p, char* user);

// The throughput path's three alltoallv exchanges (count messages, records, partials) of `impl`.
void bindExchanges(const BindPlan& plan, const MoeParams& p, char* block, char* user, Engine::Impl& impl);

// The layout views of an engine whose parameters are `p`.
DispatchLayout layoutViews(const BindPlan& plan, const MoeParams& p, char* block);

}  // namespace graphep::moe_setup
