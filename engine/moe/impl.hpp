// The MoE engine's private state (Engine::Impl) and the group its engines share: what
// engine/moe/engine.cpp, bind.cpp and diagnostics.cpp work on.
#pragma once

#include <cuda_runtime.h>

#include <graphep/moe.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/heap.hpp"
#include "engine/movers.hpp"
#include "kernels/moe/moe.h"

namespace graphep {

// The engines of one createAll share the heap and the movers.
struct EngineGroup {
  std::unique_ptr<SymmetricHeap> heap;
  std::vector<Movers> movers;  // destroyed before the heap they point into
};

// Events one movers-path operation orders its two streams with (engine.cpp, MoversStreams): the
// fork, a chunk's pack (reduce) and its arrival, the layout, the node-aware forwards, the join.
inline constexpr int kMoversEvents = 2 * kMoeMaxChunks + 4;

struct Engine::Impl {
  std::shared_ptr<EngineGroup> group;
  int local = 0;
  int device = 0;
  MoeConfig cfg;
  MoeParams base{};  // every buffer of the engine, as createAll set them: each dispatch starts here
  MoeParams p{};     // the last dispatch's (combine serves it)
  // A latency-path operation enqueued as its send half (MoeHalf::kSend), whose receive half
  // Engine::receive enqueues with these parameters; none between operations.
  enum class Half { kNone, kDispatch, kCombine } half = Half::kNone;
  MoeParams halfParams{};
  DispatchLayout layout{};
  // The movers path's exchanges: the count messages, and the records and partials by chunk.
  AllToAllvArgs cntArgs;
  std::vector<AllToAllvArgs> dispChunks, combChunks;
  MoePath path = MoePath::kThroughput;
  bool direct = false;    // the throughput path's dispatch by direct stores (kernels/moe/direct.cu)
  char* block = nullptr;  // every local buffer, carved from one allocation
  std::size_t blockBytes = 0;
  // The failed state (why; "" when healthy) and the watchdog's tools: a private stream for
  // snapshots, an event, pinned host memory for the counters.
  mutable std::string failure;
  // The failure left this rank's own counters out of step (an operation stopped part-way):
  // Engine::recover cannot repair it.
  bool stoppedPartWay = false;
  // Tests only (GRAPHEP_FAULT_AFTER_LAUNCH, read at setup): the launch after which an operation
  // fails as a refused later launch would; empty: none.
  std::string faultAfterLaunch;
  cudaStream_t watchStream = nullptr;
  cudaEvent_t watchEvent = nullptr;
  // The movers path's stream beside the caller's (engine.cpp, MoversStreams): `commStream` carries
  // the exchanges, chunk by chunk, while the caller's packs, expands and reduces; `events`
  // (kMoversEvents) order the two. One stream, not more: the GPU runs a few hardware queues
  // (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default), and ranks sharing a GPU with three streams each
  // put two ranks' exchanges in one queue, where one's waiting kernel held the other's back. None
  // where the ranks sharing the GPU leave no queue for it (moe_setup::moversStreams): the caller's
  // stream then carries the exchanges too.
  cudaStream_t commStream = nullptr;
  std::vector<cudaEvent_t> events;
  // pinned: peers.steps[2], pending, flags, combine arrivals [R] each, the masks [2], the combine's
  // expected arrivals [R], the barrier's pair counts and posts [R] each
  std::uint32_t* snapshot = nullptr;
  Impl();  // joins the registry of this process's live engines (engine.cpp)
  ~Impl();
  const Movers& movers() const { return group->movers[static_cast<std::size_t>(local)]; }
};

// The rank of another live engine of this process whose buffers hold `ptr`, or -1 (a caller's
// buffer handed to the wrong engine).
int otherEngineHolding(const Engine::Impl& m, const void* ptr);

}  // namespace graphep
