// Engine: the host half of MoE dispatch / combine (kernels/moe/moe.h is the device half). Setup sizes
// and allocates everything once (engine/moe/plan, cta_plan, bind); dispatch() and combine() only
// enqueue kernels and the movers' alltoallv, all of whose sizes are the configured maxima, so they
// capture into graphs that replay with any live token count.
#include <graphep/moe.hpp>

#include <algorithm>
#include <array>
#include <cstdio>
#include <exception>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>

#include "engine/device_pointer.hpp"
#include "engine/env.hpp"
#include "engine/error.hpp"
#include "engine/platform.hpp"
#include "engine/heap.hpp"
#include "engine/log.hpp"
#include "engine/moe/bind.hpp"
#include "engine/moe/cta_plan.hpp"
#include "engine/moe/impl.hpp"
#include "engine/moe/plan.hpp"
#include "engine/movers.hpp"
#include "engine/node_map.hpp"
#include "kernels/moe/moe.h"

namespace graphep {

using detail::DeviceGuard;
using detail::requireDevicePointer;
using namespace moe_setup;

namespace {
// Every live engine of this process, to recognise another engine's buffers handed to this one.
std::mutex registryMutex;
std::vector<const Engine::Impl*> registry;
}  // namespace

Engine::Impl::Impl() {
  std::lock_guard<std::mutex> lock(registryMutex);
  registry.push_back(this);
}

Engine::Impl::~Impl() {
  {
    std::lock_guard<std::mutex> lock(registryMutex);
    registry.erase(std::remove(registry.begin(), registry.end(), this), registry.end());
  }
  cudaSetDevice(device);
  if (watchEvent != nullptr) cudaEventDestroy(watchEvent);
  if (watchStream != nullptr) cudaStreamDestroy(watchStream);
  for (cudaEvent_t e : events) cudaEventDestroy(e);
  if (commStream != nullptr) cudaStreamDestroy(commStream);
  if (snapshot != nullptr) cudaFreeHost(snapshot);
  if (block != nullptr) cudaFree(block);
}

int otherEngineHolding(const Engine::Impl& m, const void* ptr) {
  const char* c = static_cast<const char*>(ptr);
  std::lock_guard<std::mutex> lock(registryMutex);
  for (const Engine::Impl* other : registry) {
    if (other != &m && other->block != nullptr && c >= other->block && c < other->block + other->blockBytes) {
      return other->p.shape.rank;
    }
  }
  return -1;
}

namespace {
// Preloads every MoE kernel on the current device (setup: nothing is loaded lazily in a capture).
void preloadMoeKernels() {
  GRAPHEP_CUDA_CHECK(preloadMoeLatencyKernels());
  GRAPHEP_CUDA_CHECK(preloadMoeRouteKernels());
  GRAPHEP_CUDA_CHECK(preloadMoeMoversKernels());
  GRAPHEP_CUDA_CHECK(preloadMoeNodeKernels());
  GRAPHEP_CUDA_CHECK(preloadMoeDirectKernels());
  GRAPHEP_CUDA_CHECK(preloadMoeBarrierKernels());
  GRAPHEP_CUDA_CHECK(preloadMoeTokenLayoutKernels());  // graphep::tokenLayout, beside the engine's
}

// GRAPHEP_SLOW_COMBINE_FINAL ("RANK:US", tests only): the wait, in ns, of `rank`'s direct combine
// final before it reads its peers' partials; 0 for the other ranks and when unset.
std::uint64_t slowCombineFinalNs(int rank) {
  const std::string v = env::kSlowCombineFinal.get();
  if (v.empty()) return 0;
  int r = -1;
  unsigned long long us = 0;
  char tail = 0;
  GRAPHEP_REQUIRE(std::sscanf(v.c_str(), "%d:%llu%c", &r, &us, &tail) == 2 && us <= 10'000'000ull,
                  Status::kInvalidArgument, "GRAPHEP_SLOW_COMBINE_FINAL=%s is not RANK:US (US at most 10,000,000)",
                  v.c_str());
  return r == rank ? us * 1000ull : 0;
}

// Local rank l's engine: its buffers (one allocation, zeroed), its watchdog's tools, its kernel
// parameters, counters, exchanges and layout views.
std::unique_ptr<Engine::Impl> buildEngine(const BindPlan& plan, const std::shared_ptr<EngineGroup>& group, int l,
                                          MoePath path) {
  auto impl = std::make_unique<Engine::Impl>();
  impl->group = group;
  impl->local = l;
  impl->device = group->heap->device(l);
  impl->cfg = plan.cfg;
  impl->path = path;
  impl->direct = plan.direct;
  impl->faultAfterLaunch = env::kFaultAfterLaunch.get();
  DeviceGuard guard(impl->device);
  preloadMoeKernels();
  GRAPHEP_CUDA_CHECK(cudaMalloc(&impl->block, plan.carve.bytes));
  impl->blockBytes = plan.carve.bytes;
  GRAPHEP_CUDA_CHECK(cudaStreamCreateWithFlags(&impl->watchStream, cudaStreamNonBlocking));
  GRAPHEP_CUDA_CHECK(cudaEventCreateWithFlags(&impl->watchEvent, cudaEventDisableTiming));
  if (path == MoePath::kThroughput && !plan.direct) {
    if (plan.tput.streams[static_cast<std::size_t>(l)] == 2) {  // else the caller's stream carries all
      GRAPHEP_CUDA_CHECK(cudaStreamCreateWithFlags(&impl->commStream, cudaStreamNonBlocking));
    }
    for (int i = 0; i < kMoversEvents; ++i) {
      impl->events.push_back(nullptr);
      GRAPHEP_CUDA_CHECK(cudaEventCreateWithFlags(&impl->events.back(), cudaEventDisableTiming));
    }
  }
  GRAPHEP_CUDA_CHECK(
      cudaHostAlloc(&impl->snapshot, (5 + 5 * plan.sizes.R) * sizeof(std::uint32_t), cudaHostAllocDefault));
  GRAPHEP_CUDA_CHECK(cudaMemset(impl->block, 0, plan.carve.bytes));
  char* user = group->heap->user(l);
  impl->p = bindParams(plan, *group->heap, l, impl->block);
  impl->p.direct.slowFinalNs = slowCombineFinalNs(impl->p.shape.rank);
  startCounters(plan, impl->p, user);
  bindExchanges(plan, impl->p, impl->block, user, *impl);
  impl->base = impl->p;
  impl->layout = layoutViews(plan, impl->p, impl->block);
  const MoeConfig& cfg = plan.cfg;
  GRAPHEP_LOG_INFO(log::kInit,
                   "rank %d: MoE engine T_max=%d H=%d E=%d K=%d %s, %s path, capacity %lld rows, %zu B "
                   "local, %zu B symmetric heap",
                   impl->p.shape.rank, cfg.maxTokensPerRank, cfg.hidden, cfg.numExperts, cfg.topK,
                   cfg.dispatchType == DType::kFp8E4m3 ? "fp8" : "bf16",
                   name(path), plan.capacity, plan.carve.bytes,
                   heapBytes(group->heap->config()));
  return impl;
}
}  // namespace

std::vector<std::unique_ptr<Engine>> Engine::createAll(Communicator& comm, const MoeConfig& cfg) {
  const int R = comm.worldSize();
  requireSameConfig(comm, cfg);  // first: a rank whose config alone is invalid must not strand the others
  validate(cfg, R);
  MoeSizes sizes = moeSizes(cfg, R);
  const long long capacity = receiveCapacity(cfg, R);

  // The heap is sized for the latency path when the config fits it; peer classes (known once the
  // heap exists) decide, on every rank alike, whether it stays there or falls back to the
  // throughput path, whose heap replaces it.
  const bool latencyCandidate = preferredPath(cfg, R) == MoePath::kLatency;
  PathHeap ph = pathHeap(latencyCandidate ? MoePath::kLatency : MoePath::kThroughput, sizes, cfg);
  auto group = std::make_shared<EngineGroup>();
  group->heap = SymmetricHeap::create(comm, ph.heap);
  // The latency path writes peers directly, its payload as 128-byte lines that must land whole:
  // every peer on this GPU or over NVLink (a PCIe peer goes to the throughput path).
  const bool linesPeers = everyPeerTakesWholeLines(comm, *group->heap);
  GRAPHEP_REQUIRE(cfg.path != MoePath::kLatency || linesPeers, Status::kNotSupported,
                  "MoeConfig.path=kLatency needs every peer on this GPU or over NVLink (its 128-byte payload "
                  "lines land whole only there); some are reached over PCIe or only through NCCL (use kAuto or "
                  "kThroughput)");
  const MoePath path = latencyCandidate && linesPeers ? MoePath::kLatency : MoePath::kThroughput;
  if (latencyCandidate && path == MoePath::kThroughput) {
    ph = pathHeap(path, sizes, cfg);
    group->heap->reallocate(ph.heap);
  }
  const bool throughput = path == MoePath::kThroughput;
  GRAPHEP_REQUIRE(!throughput || !cfg.shrinkOnTimeout, Status::kNotSupported,
                  "MoeConfig.shrinkOnTimeout needs the latency path; this engine is on the throughput path "
                  "(MoeConfig.path, the sizes, or a peer over PCIe or reached only through NCCL): use recover after a "
                  "timeout");

  // The CTA plan, the movers, and room for every rank's local buffers (before any is allocated).
  const LatencyCtas lctas = throughput ? LatencyCtas{} : latencyCtas(comm, *group->heap, cfg);
  const bool direct = throughput && directDispatch(comm, *group->heap);
  // Ranks on several nodes: the movers path sends a token once per remote node (docs/DESIGN.md
  // §5.10), with room for it in the records and heap regions of its own (a reallocation).
  const NodeMap nodes = nodeMapOf(*group->heap);  // collective
  if (throughput && !direct && nodes.nodeAware()) {
    sizes = moeSizes(cfg, R, true);
    ph = pathHeap(path, sizes, cfg);
    group->heap->reallocate(ph.heap);
  }
  const ThroughputCtas tctas =
      throughput ? throughputCtas(comm, *group->heap, cfg, direct, sizes.R * sizes.T * sizes.recBytes)
                 : ThroughputCtas{};
  group->movers = Movers::createAll(*group->heap, engineMoverOptions(sizes), &nodes);
  const LocalCarve carve = carveLocal(cfg, sizes, static_cast<std::size_t>(capacity), throughput);
  requireLocalBuffersFit(comm, *group->heap, cfg, carve.bytes, capacity);

  const BindPlan plan{cfg, sizes, ph, carve, capacity, throughput, direct, lctas, tctas, nodes};
  std::vector<std::unique_ptr<Engine>> engines;
  for (int l = 0; l < group->heap->numLocalRanks(); ++l) {
    engines.push_back(std::unique_ptr<Engine>(new Engine(buildEngine(plan, group, l, path))));
    engines.back()->resetTimeline();
  }
  // The setup's memsets and copies went to each device's legacy stream, which the caller's
  // (non-blocking) streams and the peers' operations are not ordered after: every one has landed
  // before any rank passes the barrier (a late one would overwrite a peer's first arrival).
  for (int l = 0; l < group->heap->numLocalRanks(); ++l) {
    DeviceGuard guard(group->heap->device(l));
    GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  }
  comm.barrier();
  return engines;
}

std::unique_ptr<Engine> Engine::create(Communicator& comm, const MoeConfig& cfg) {
  GRAPHEP_REQUIRE(comm.numLocalRanks() == 1, Status::kInvalidArgument,
                  "Engine::create: this process drives %d ranks; use Engine::createAll",
                  comm.numLocalRanks());
  auto all = createAll(comm, cfg);
  return std::move(all[0]);
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

int Engine::rank() const { return impl_->p.shape.rank; }
int Engine::device() const { return impl_->device; }
int Engine::worldSize() const { return impl_->p.shape.numRanks; }
MoePath Engine::path() const { return impl_->path; }
const MoeConfig& Engine::config() const { return impl_->cfg; }
std::size_t Engine::symmetricHeapBytes() const { return heapBytes(impl_->group->heap->config()); }
std::size_t Engine::privateBytes() const { return impl_->blockBytes; }
const DispatchLayout& Engine::layout() const { return impl_->layout; }

namespace {
void requireHealthy(const Engine::Impl& m, int rank, const char* op);
}  // namespace

namespace {

// A dispatch argument that needs the rank-major layout on the throughput path (and, with `direct`,
// its direct dispatch: every peer by load/store).
void requireRankMajorThroughput(const Engine::Impl& m, const char* what, bool direct);
// No send half waits for its receive (Engine::receive) when `op` starts.
void requireNoHalf(const Engine::Impl& m, const char* op);
// A capability of the latency path.
void requireLatency(const Engine::Impl& m, const char* what);
// `op`'s MoeHalf: a value of the enum, kSend on the latency path only.
void requireHalf(const Engine::Impl& m, MoeHalf half, const char* op);
// The latency path's launch of operation `op` (dispatch or combine) with `p`: both parts for
// kWhole; the send part for kSend, remembered for Engine::receive; the receive part for nullopt
// (Engine::receive).
void launchLatency(Engine::Impl& m, MoeParams p, Engine::Impl::Half op, std::optional<MoeHalf> half,
                   cudaStream_t stream);

// An operation's launches, named as they are queued: once one is queued, a later one failing (a
// refused launch, a CUDA error) can leave this rank's step counters out of step with its peers' (a
// sender posted, its receiver never advances the step). The engine then enters its failed state,
// naming the operation and what was queued, before the error reaches the caller; its operations
// are refused from then on. Tests make the failure happen with GRAPHEP_FAULT_AFTER_LAUNCH.
class Launches {
 public:
  Launches(Engine::Impl& m, const char* op) : m_(m), op_(op), unwinding_(std::uncaught_exceptions()) {}
  Launches(const Launches&) = delete;
  Launches& operator=(const Launches&) = delete;
  ~Launches() {
    if (last_ == nullptr || std::uncaught_exceptions() <= unwinding_ || !m_.failure.empty()) return;
    m_.stoppedPartWay = true;
    m_.failure = detail::format(
        "rank %d: %s stopped part-way (%s was queued, a later launch failed): its step counters may no longer "
        "match its peers'; destroy the engine and create a new one",
        m_.p.shape.rank, op_, last_);
  }
  // `what` has been queued.
  void queued(const char* what) {
    last_ = what;
    GRAPHEP_REQUIRE(m_.faultAfterLaunch != what, Status::kCudaError,
                    "%s: the launch after %s failed (injected by GRAPHEP_FAULT_AFTER_LAUNCH)", op_, what);
  }

 private:
  Engine::Impl& m_;
  const char* op_;
  int unwinding_;
  const char* last_ = nullptr;
};

// The movers path's comm stream, joined into a capture by a fork, stays in that capture until it
// ends: while it belongs to a capture that `stream` is not in (another capture of this engine still
// open, or an eager call during one), an operation is refused by name, before anything is queued,
// instead of being recorded into the other graph.
void requireCommStreamFree(const Engine::Impl& m, cudaStream_t stream, const char* op) {
  if (m.commStream == nullptr) return;
  cudaStreamCaptureStatus comm = cudaStreamCaptureStatusNone, caller = cudaStreamCaptureStatusNone;
  unsigned long long commId = 0, callerId = 0;
  GRAPHEP_CUDA_CHECK(cudaStreamGetCaptureInfo(m.commStream, &comm, &commId));
  GRAPHEP_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &caller, &callerId));
  GRAPHEP_REQUIRE(comm == cudaStreamCaptureStatusNone || (caller == cudaStreamCaptureStatusActive && commId == callerId),
                  Status::kInvalidArgument,
                  "rank %d: %s: the engine's earlier operations are part of a stream capture (id %llu) that is still "
                  "open; end it first (one open capture of an engine at a time, and no eager call while one is open)",
                  m.p.shape.rank, op, commId);
}

// One movers-path operation's two streams: forks the engine's comm stream (the exchanges) from the
// caller's `stream` and joins it back when the scope ends, also when a launch throws, so a capture
// is never left with an unjoined stream (requireCommStreamFree was called before the operation).
// Between them, order() and mark() / wait() record and wait on the engine's events, each used once
// per operation.
class MoversStreams {
 public:
  MoversStreams(Engine::Impl& m, cudaStream_t stream)
      : m_(m), caller_(stream), comm_(m.commStream != nullptr ? m.commStream : stream) {
    order(comm_, stream);
  }
  MoversStreams(const MoversStreams&) = delete;
  MoversStreams& operator=(const MoversStreams&) = delete;
  ~MoversStreams() {
    const cudaEvent_t join = m_.events.back();
    if (cudaEventRecord(join, comm_) == cudaSuccess) cudaStreamWaitEvent(caller_, join, 0);
  }
  // The exchanges' stream: the engine's comm stream, or the caller's where ranks sharing the GPU
  // leave no hardware queue for one (moe_setup::moversStreams; the events then order one stream).
  cudaStream_t comm() const { return comm_; }
  // What `signaller` has queued so far, as an event to wait() on later.
  cudaEvent_t mark(cudaStream_t signaller) {
    GRAPHEP_REQUIRE(used_ + 1 < m_.events.size(), Status::kInternalError,
                    "rank %d: a movers-path operation ran out of its %zu stream events", m_.p.shape.rank,
                    m_.events.size());
    const cudaEvent_t e = m_.events[used_++];
    GRAPHEP_CUDA_CHECK(cudaEventRecord(e, signaller));
    return e;
  }
  void wait(cudaStream_t waiter, cudaEvent_t e) { GRAPHEP_CUDA_CHECK(cudaStreamWaitEvent(waiter, e, 0)); }
  // `waiter` waits for what `signaller` has queued so far.
  void order(cudaStream_t waiter, cudaStream_t signaller) { wait(waiter, mark(signaller)); }

 private:
  Engine::Impl& m_;
  cudaStream_t caller_;
  cudaStream_t comm_;
  std::size_t used_ = 0;
};

// Chunk j's list indices (MoeMoverParams).
MoeRange chunkRange(const MoeParams& p, int j) { return moeChunk(p.movers, j, p.shape.maxTokens); }

// The caller's DispatchOutputs over the engine's buffers in `p`: every given pointer checked and
// taken, rows (the caller's) bounding what is written.
void applyOutputs(const Engine::Impl& m, const DispatchArgs& a, MoeParams& p);
}  // namespace

namespace {
// A dispatch's arguments against the engine (every refusal names the value): what it sends.
struct DispatchChoice {
  int topK;  // the dispatch's top-k (0: routing by tokenInRank alone)
  bool fp8;  // its records carry fp8 rows
};
DispatchChoice checkDispatch(const Engine::Impl& m, const DispatchArgs& a) {
  const MoeConfig& c = m.cfg;
  requireDevicePointer(a.x, m.device, "dispatch: x");
  GRAPHEP_REQUIRE(a.tokenInRank != nullptr || a.topkIdx != nullptr, Status::kInvalidArgument,
                  "dispatch: topkIdx is null (pass the top-k ids, or route by tokenInRank)");
  requireNoHalf(m, "dispatch");
  if (a.topkIdx != nullptr) {
    requireDevicePointer(a.topkIdx, m.device, "dispatch: topkIdx");
    // The latency path takes none (weights 1: its combine may bring them, CombineArgs.topkWeights).
    if (m.path != MoePath::kLatency || a.topkWeights != nullptr) {
      requireDevicePointer(a.topkWeights, m.device, "dispatch: topkWeights");
    }
  }
  requireDevicePointer(a.numTokens, m.device, "dispatch: numTokens");
  GRAPHEP_REQUIRE((reinterpret_cast<std::uintptr_t>(a.x) & 15u) == 0, Status::kInvalidArgument,
                  "dispatch: x (%p) is not 16-byte aligned", a.x);
  GRAPHEP_REQUIRE(a.indexType == IndexType::kInt32 || a.indexType == IndexType::kInt64,
                  Status::kInvalidArgument, "dispatch: indexType=%d is not an IndexType",
                  static_cast<int>(a.indexType));
  const int topK = a.topkIdx == nullptr ? 0 : (a.topK == 0 ? c.topK : a.topK);
  GRAPHEP_REQUIRE(a.topkIdx == nullptr || (topK >= 1 && topK <= c.topK), Status::kInvalidArgument,
                  "dispatch: topK=%d is outside [1, MoeConfig.topK=%d]", a.topK, c.topK);
  GRAPHEP_REQUIRE(a.topkIdx != nullptr || a.topK == 0, Status::kInvalidArgument,
                  "dispatch: topK=%d with no topkIdx (routing by tokenInRank alone has no slots)", a.topK);
  if (a.tokenInRank != nullptr) {
    requireDevicePointer(a.tokenInRank, m.device, "dispatch: tokenInRank");
    requireRankMajorThroughput(m, "tokenInRank", false);
  }
  const DispatchInput in = a.input;
  GRAPHEP_REQUIRE(in == DispatchInput::kConfig || in == DispatchInput::kBf16 || in == DispatchInput::kFp8Quantize ||
                      in == DispatchInput::kFp8,
                  Status::kInvalidArgument, "dispatch: input=%d is not a DispatchInput", static_cast<int>(in));
  const bool configFp8 = c.dispatchType == DType::kFp8E4m3;
  const bool fp8 = in == DispatchInput::kConfig ? configFp8 : in != DispatchInput::kBf16;
  GRAPHEP_REQUIRE(fp8 || !configFp8, Status::kInvalidArgument,
                  "dispatch: input=kBf16 on an engine whose MoeConfig.dispatchType is fp8 (its record slots "
                  "hold fp8 rows; create the engine with kBf16 to send both)");
  GRAPHEP_REQUIRE(!fp8 || c.hidden % 128 == 0, Status::kInvalidArgument,
                  "dispatch: an fp8 dispatch needs hidden=%d to be a multiple of 128", c.hidden);
  GRAPHEP_REQUIRE(a.scaleFormat == Fp8Scales::kFloat || a.scaleFormat == Fp8Scales::kPow2 ||
                      a.scaleFormat == Fp8Scales::kUe8m0,
                  Status::kInvalidArgument, "dispatch: scaleFormat=%d is not an Fp8Scales",
                  static_cast<int>(a.scaleFormat));
  if (a.scaleFormat != Fp8Scales::kFloat) {
    GRAPHEP_REQUIRE(fp8 && in != DispatchInput::kFp8, Status::kInvalidArgument,
                    "dispatch: scaleFormat=%d applies to an fp8 dispatch the engine quantises (input=%d)",
                    static_cast<int>(a.scaleFormat), static_cast<int>(in));
    requireLatency(m, "scaleFormat other than kFloat");
  }
  requireHalf(m, a.half, "dispatch");
  if (a.recvStats != nullptr) requireDevicePointer(a.recvStats, m.device, "dispatch: recvStats");
  if (in == DispatchInput::kFp8) {
    requireDevicePointer(a.xScales, m.device, "dispatch: xScales");
    requireRankMajorThroughput(m, "input=kFp8 (caller-quantised x)", true);
    GRAPHEP_REQUIRE((a.scaleTokenStride == 0 && a.scaleHiddenStride == 0) ||
                        (a.scaleTokenStride > 0 && a.scaleHiddenStride > 0),
                    Status::kInvalidArgument,
                    "dispatch: scaleTokenStride=%lld, scaleHiddenStride=%lld (both 0 for row-major, or both "
                    "positive element strides)",
                    a.scaleTokenStride, a.scaleHiddenStride);
  } else {
    GRAPHEP_REQUIRE(a.xScales == nullptr, Status::kInvalidArgument,
                    "dispatch: xScales is set but input=%d is not kFp8 (x would be read as bf16)",
                    static_cast<int>(in));
  }
  return DispatchChoice{topK, fp8};
}
}  // namespace

const DispatchLayout& Engine::dispatch(const DispatchArgs& a, cudaStream_t stream) {
  Impl& m = *impl_;
  requireHealthy(m, m.p.shape.rank, "dispatch");
  DeviceGuard guard(m.device);
  const auto [topK, fp8] = checkDispatch(m, a);
  const MoeConfig& c = m.cfg;
  const DispatchInput in = a.input;
  MoeParams p = m.base;
  p.input.x = a.x;
  p.input.topkIdx = a.topkIdx;
  p.input.int64Ids = a.indexType == IndexType::kInt64 ? 1 : 0;
  p.input.topkWeights = a.topkWeights;
  p.input.numTokens = a.numTokens;
  p.shape.topK = topK;
  p.input.tokenInRank = reinterpret_cast<const std::uint8_t*>(a.tokenInRank);
  p.shape.fp8 = fp8 ? 1 : 0;
  p.shape.payloadBytes = moePayloadBytes(c.hidden, fp8);
  p.input.xIsFp8 = in == DispatchInput::kFp8 ? 1 : 0;
  p.input.xScales = a.xScales;
  const bool rowMajorScales = a.scaleTokenStride == 0 && a.scaleHiddenStride == 0;
  p.input.scaleTokenStride = rowMajorScales ? c.hidden / 128 : a.scaleTokenStride;
  p.input.scaleHiddenStride = rowMajorScales ? 1 : a.scaleHiddenStride;
  p.input.scaleFormat = static_cast<std::int32_t>(a.scaleFormat);
  p.layout.recvStats = a.recvStats;
  applyOutputs(m, a, p);
  m.layout.recvScales = fp8 ? m.base.layout.recvScales : nullptr;  // the engine's rows hold this type now
  m.p = p;  // combine reads the routing of the last dispatch
  if (m.path == MoePath::kLatency) {
    launchLatency(m, p, Impl::Half::kDispatch, a.half, stream);
    return m.layout;
  }
  requireCommStreamFree(m, stream, "dispatch");
  Launches launches(m, "dispatch");
  GRAPHEP_CUDA_CHECK(launchMoeRoute(p, stream));
  launches.queued("route");
  if (m.direct) {
    if (p.shape.fp8 && !p.input.xIsFp8) {  // the caller's e4m3 rows are sent as they are read
      GRAPHEP_CUDA_CHECK(launchMoeDirectQuantize(p, stream));
      launches.queued("direct-quantize");
    }
    GRAPHEP_CUDA_CHECK(launchMoeDirectSend(p, stream));
    launches.queued("direct-send");
    GRAPHEP_CUDA_CHECK(launchMoeDirectReceive(p, stream));
    return m.layout;
  }
  // Over the movers (docs/DESIGN.md §5.5): the peers' records packed chunk by chunk on `stream`,
  // each chunk exchanged on the comm stream once packed (the count messages and the layout before
  // the first), this rank's own records packed and expanded meanwhile, then each chunk of the
  // peers' expanded once it arrived.
  // Node-aware (p.node.aware, §5.10): the records exchange carries this node's records and the hop
  // records of the other nodes; once it is done this rank forwards the hop records that landed
  // here to their destinations on its node, and the peers' records are expanded once every landing
  // rank of the node has forwarded.
  const Movers& movers = m.movers();
  if (p.node.aware) {  // this rank's previous operations are done with its forwarded records
    GRAPHEP_CUDA_CHECK(launchMoeNodePost(p, kMoeNodeReady, stream));
    launches.queued("node-ready");
  }
  MoversStreams lanes(m, stream);
  cudaEvent_t layout = nullptr, forwarded = nullptr;
  std::array<cudaEvent_t, kMoeMaxChunks> arrived{};
  for (int j = 0; j < p.movers.chunks; ++j) {
    GRAPHEP_CUDA_CHECK(launchMoePack(p, MoeSources::kPeers, chunkRange(p, j), stream));
    launches.queued("pack");
    lanes.order(lanes.comm(), stream);
    if (j == 0) {
      movers.allToAllv(lanes.comm(), m.cntArgs);
      launches.queued("count-exchange");
      GRAPHEP_CUDA_CHECK(launchMoeOffsets(p, lanes.comm()));
      launches.queued("offsets");
      layout = lanes.mark(lanes.comm());
    }
    movers.allToAllv(lanes.comm(), m.dispChunks[static_cast<std::size_t>(j)]);
    launches.queued("record-exchange");
    arrived[static_cast<std::size_t>(j)] = lanes.mark(lanes.comm());
  }
  if (p.node.aware) {
    GRAPHEP_CUDA_CHECK(launchMoeNodeWait(p, kMoeNodeReady, lanes.comm()));
    launches.queued("node-ready-wait");
    GRAPHEP_CUDA_CHECK(launchMoeForward(p, lanes.comm()));
    launches.queued("forward");
    GRAPHEP_CUDA_CHECK(launchMoeNodePost(p, kMoeNodeForwarded, lanes.comm()));
    launches.queued("node-forwarded");
    forwarded = lanes.mark(lanes.comm());
  }
  const MoeRange all{0, p.shape.maxTokens};
  GRAPHEP_CUDA_CHECK(launchMoePack(p, MoeSources::kOwn, all, stream));
  launches.queued("pack-own");
  lanes.wait(stream, layout);
  GRAPHEP_CUDA_CHECK(launchMoeExpand(p, MoeSources::kOwn, all, stream));
  launches.queued("expand-own");
  if (p.node.aware) {  // this rank's own forwards, then every other landing rank's of this node
    lanes.wait(stream, forwarded);
    GRAPHEP_CUDA_CHECK(launchMoeNodeWait(p, kMoeNodeForwarded, stream));
    launches.queued("node-forwarded-wait");
  }
  for (int j = 0; j < p.movers.chunks; ++j) {
    lanes.wait(stream, arrived[static_cast<std::size_t>(j)]);
    GRAPHEP_CUDA_CHECK(launchMoeExpand(p, MoeSources::kPeers, chunkRange(p, j), stream));
    launches.queued("expand");
  }
  return m.layout;
}

namespace {
// The node-aware combine's first steps (docs/DESIGN.md §5.10), on `stream` before the partials
// exchange: the peers' records reduced (other nodes' sources' into this rank's nodePartial slots,
// once its node peers have summed the last ones), the node peers told; once they have all reduced,
// this rank sums the node's partials of the hop records it forwarded into partialStage.
void reduceAndSumNode(const MoeParams& p, cudaStream_t stream, Launches& launches) {
  GRAPHEP_CUDA_CHECK(launchMoeNodeWait(p, kMoeNodeSummed, stream));
  launches.queued("node-summed-wait");
  GRAPHEP_CUDA_CHECK(launchMoeCombineReduce(p, MoeSources::kPeers, MoeRange{0, p.shape.maxTokens}, stream));
  launches.queued("combine-reduce");
  GRAPHEP_CUDA_CHECK(launchMoeNodePost(p, kMoeNodeReduced, stream));
  launches.queued("node-reduced");
  GRAPHEP_CUDA_CHECK(launchMoeNodeWait(p, kMoeNodeReduced, stream));
  launches.queued("node-reduced-wait");
  GRAPHEP_CUDA_CHECK(launchMoeNodeSum(p, stream));
  launches.queued("node-sum");
  GRAPHEP_CUDA_CHECK(launchMoeNodePost(p, kMoeNodeSummed, stream));
  launches.queued("node-summed");
}
}  // namespace

void Engine::combine(const CombineArgs& a, cudaStream_t stream) {
  Impl& m = *impl_;
  requireHealthy(m, m.p.shape.rank, "combine");
  requireNoHalf(m, "combine");
  DeviceGuard guard(m.device);
  MoeParams p = m.p;
  requireHalf(m, a.half, "combine");
  if (a.topkWeights != nullptr) {
    requireLatency(m, "combine topkWeights");
    GRAPHEP_REQUIRE(m.cfg.receiveLayout != ReceiveLayout::kRankMajor, Status::kNotSupported,
                    "combine: topkWeights with the rank-major layout (its experts apply the weights)");
    requireDevicePointer(a.topkWeights, m.device, "combine: topkWeights");
    p.combine.topkWeights = a.topkWeights;
  }
  GRAPHEP_REQUIRE(a.expertOutputRows >= 0, Status::kInvalidArgument, "combine: expertOutputRows=%lld is negative",
                  a.expertOutputRows);
  GRAPHEP_REQUIRE(a.expertOutput != nullptr || a.expertOutputRows <= m.layout.capacity, Status::kInvalidArgument,
                  "combine: expertOutputRows=%lld exceeds the engine's expertOutput of %lld rows",
                  a.expertOutputRows, m.layout.capacity);
  p.combine.expertOutput = m.base.combine.expertOutput;
  p.combine.expertOutputRows = a.expertOutputRows > 0 ? a.expertOutputRows : m.layout.capacity;
  GRAPHEP_REQUIRE((a.rowValues == nullptr) == (a.outValues == nullptr), Status::kInvalidArgument,
                  "combine: rowValues (%p) and outValues (%p) come together", static_cast<const void*>(a.rowValues),
                  static_cast<void*>(a.outValues));
  p.combine.rowValues = nullptr;
  p.combine.outValues = nullptr;
  p.combine.numValues = 0;
  if (a.rowValues != nullptr) {
    requireRankMajorThroughput(m, "rowValues", true);
    requireDevicePointer(a.rowValues, m.device, "combine: rowValues");
    requireDevicePointer(a.outValues, m.device, "combine: outValues");
    GRAPHEP_REQUIRE(a.numValues >= 1 && a.numValues <= kMoeMaxValues, Status::kInvalidArgument,
                    "combine: numValues=%d is outside [1, %d]", a.numValues, kMoeMaxValues);
    p.combine.rowValues = a.rowValues;
    p.combine.outValues = a.outValues;
    p.combine.numValues = a.numValues;
  } else {
    GRAPHEP_REQUIRE(a.numValues == 0, Status::kInvalidArgument, "combine: numValues=%d with no rowValues",
                    a.numValues);
  }
  if (a.expertOutput != nullptr) {
    requireDevicePointer(a.expertOutput, m.device, "combine: expertOutput");
    GRAPHEP_REQUIRE((reinterpret_cast<std::uintptr_t>(a.expertOutput) & 15u) == 0,
                    Status::kInvalidArgument, "combine: expertOutput (%p) is not 16-byte aligned",
                    a.expertOutput);
    p.combine.expertOutput = static_cast<const char*>(a.expertOutput);
    const int other = otherEngineHolding(m, a.expertOutput);
    GRAPHEP_REQUIRE(other < 0, Status::kInvalidArgument,
                    "combine: expertOutput (%p) lies in the buffers of another engine (rank %d); pass this "
                    "engine's layout().expertOutput, or a buffer of your own",
                    a.expertOutput, other);
  }
  requireDevicePointer(a.out, m.device, "combine: out");
  GRAPHEP_REQUIRE((reinterpret_cast<std::uintptr_t>(a.out) & 15u) == 0, Status::kInvalidArgument,
                  "combine: out (%p) is not 16-byte aligned", a.out);
  p.combine.out = static_cast<char*>(a.out);
  if (m.path == MoePath::kLatency) {
    launchLatency(m, p, Impl::Half::kCombine, a.half, stream);
    return;
  }
  requireCommStreamFree(m, stream, "combine");
  Launches launches(m, "combine");
  if (m.direct) {
    GRAPHEP_CUDA_CHECK(launchMoeDirectCombineReduce(p, stream));
    launches.queued("direct-combine-reduce");
    GRAPHEP_CUDA_CHECK(launchMoeDirectCombineSend(p, stream));
    launches.queued("direct-combine-send");
    GRAPHEP_CUDA_CHECK(launchMoeDirectCombineFinal(p, stream));
    return;
  }
  // Over the movers: the peers' partials reduced chunk by chunk on `stream`, each chunk exchanged on
  // the comm stream once reduced, this rank's own reduced meanwhile, then the tokens of chunk j
  // summed once it arrived: token t's partials sit at list indices <= t. Node-aware, every peer
  // partial is reduced and the node's sums made first (the exchange forks after them).
  if (p.node.aware) reduceAndSumNode(p, stream, launches);
  MoversStreams lanes(m, stream);
  std::array<cudaEvent_t, kMoeMaxChunks> arrived{};
  for (int j = 0; j < p.movers.chunks; ++j) {
    if (!p.node.aware) {
      GRAPHEP_CUDA_CHECK(launchMoeCombineReduce(p, MoeSources::kPeers, chunkRange(p, j), stream));
      launches.queued("combine-reduce");
      lanes.order(lanes.comm(), stream);
    }
    m.movers().allToAllv(lanes.comm(), m.combChunks[static_cast<std::size_t>(j)]);
    launches.queued("partial-exchange");
    arrived[static_cast<std::size_t>(j)] = lanes.mark(lanes.comm());
  }
  GRAPHEP_CUDA_CHECK(launchMoeCombineReduce(p, MoeSources::kOwn, MoeRange{0, p.shape.maxTokens}, stream));
  launches.queued("combine-reduce-own");
  for (int j = 0; j < p.movers.chunks; ++j) {
    lanes.wait(stream, arrived[static_cast<std::size_t>(j)]);
    GRAPHEP_CUDA_CHECK(launchMoeCombineFinal(p, chunkRange(p, j), stream));
    launches.queued("combine-final");
  }
}

namespace {
// The engine's operations honour an active-rank mask: the latency path, and the throughput path's
// direct variant (every peer by load/store). The movers' exchanges take every
// rank: a captured NCCL call is bound to its peer, and the load/store movers' per-link counters
// (GRAPHEP_MOE_KERNELS=movers) assume every peer in every exchange.
bool takesMask(const Engine::Impl& m) { return m.path == MoePath::kLatency || m.direct; }

// A mask `who` (setActiveRanks, recover) may write: some rank, and none past the world.
void requireMaskFits(const Engine::Impl& m, std::uint32_t mask, const char* who) {
  const int R = m.p.shape.numRanks;
  GRAPHEP_REQUIRE((mask & ~allRanksMask(R)) == 0, Status::kInvalidArgument,
                  "%s: mask 0x%x names ranks past the last (world size %d)", who, mask, R);
  GRAPHEP_REQUIRE(mask != 0, Status::kInvalidArgument, "%s: mask 0 leaves no rank", who);
}
}  // namespace

void Engine::setActiveRanks(std::uint32_t mask, cudaStream_t stream) {
  Impl& m = *impl_;
  const int R = m.p.shape.numRanks;
  requireMaskFits(m, mask, "setActiveRanks");
  GRAPHEP_REQUIRE(takesMask(m) || mask == allRanksMask(R), Status::kNotSupported,
                  "setActiveRanks: mask 0x%x on the throughput path over the movers (peers reached through NCCL, "
                  "or GRAPHEP_MOE_KERNELS=movers), which takes every rank (the latency path and the direct "
                  "throughput path take a mask)",
                  mask);
  GRAPHEP_REQUIRE(m.half == Impl::Half::kNone, Status::kInvalidArgument,
                  "setActiveRanks: rank %d has a send half waiting for its receive", m.p.shape.rank);
  if (!takesMask(m)) return;  // every rank: nothing to write
  DeviceGuard guard(m.device);
  GRAPHEP_CU_CHECK(detail::driver().streamWriteValue32(reinterpret_cast<CUstream>(stream),
                                                        reinterpret_cast<CUdeviceptr>(m.p.peers.live), mask,
                                                        CU_STREAM_WRITE_VALUE_DEFAULT));
}

void Engine::recover(std::uint32_t mask, cudaStream_t stream) {
  Impl& m = *impl_;
  GRAPHEP_REQUIRE(takesMask(m), Status::kNotSupported,
                  "recover: rank %d's engine is on the throughput path over the movers (peers reached through NCCL, or "
                  "GRAPHEP_MOE_KERNELS=movers), which has no active-rank mask; destroy the engine and create a new one",
                  m.p.shape.rank);
  GRAPHEP_REQUIRE(!m.stoppedPartWay, Status::kRemoteError, "recover: %s", m.failure.c_str());
  // Validated before anything is cleared: a refused mask leaves the engine as it was.
  requireMaskFits(m, mask, "recover");
  GRAPHEP_REQUIRE((mask >> m.p.shape.rank) & 1u, Status::kInvalidArgument,
                  "recover: mask 0x%x leaves out rank %d itself", mask, m.p.shape.rank);
  GRAPHEP_REQUIRE(m.half == Impl::Half::kNone, Status::kRemoteError,
                  "recover: rank %d failed between a send half and its receive (its counters are part-way); "
                  "destroy the engine and create a new one",
                  m.p.shape.rank);
  clearStatus();  // synchronises: the failed operation's kernels have returned (every wait is bounded)
  m.failure.clear();
  setActiveRanks(mask, stream);
  // A combine of the failed step's dispatch, if one still comes, leaves the dead rank out too
  // (and brings back no rank that dispatch left out).
  std::uint32_t last = 0;
  GRAPHEP_CUDA_CHECK(cudaMemcpy(&last, m.p.peers.dispatchLive, 4, cudaMemcpyDeviceToHost));
  GRAPHEP_CU_CHECK(detail::driver().streamWriteValue32(reinterpret_cast<CUstream>(stream),
                                                        reinterpret_cast<CUdeviceptr>(m.p.peers.dispatchLive), mask & last,
                                                        CU_STREAM_WRITE_VALUE_DEFAULT));
}

void Engine::barrier(cudaStream_t stream) {
  Impl& m = *impl_;
  requireHealthy(m, m.p.shape.rank, "barrier");
  GRAPHEP_REQUIRE(takesMask(m), Status::kNotSupported,
                  "barrier: rank %d's engine is on the throughput path over the movers (peers reached through NCCL, "
                  "or GRAPHEP_MOE_KERNELS=movers), which has no load/store barrier; the latency path and the direct "
                  "throughput path have one",
                  m.p.shape.rank);
  requireNoHalf(m, "barrier");
  DeviceGuard guard(m.device);
  GRAPHEP_CUDA_CHECK(launchMoeBarrier(m.p, stream));
}

std::uint32_t* Engine::activeRanksDevice() const {
  const Impl& m = *impl_;
  return takesMask(m) ? const_cast<std::uint32_t*>(m.p.peers.live) : nullptr;
}

void Engine::receive(cudaStream_t stream) {
  Impl& m = *impl_;
  requireHealthy(m, m.p.shape.rank, "receive");
  GRAPHEP_REQUIRE(m.half != Impl::Half::kNone, Status::kInvalidArgument,
                  "receive: rank %d has no send half waiting for its receive (dispatch or combine with "
                  "half=kSend comes first)",
                  m.p.shape.rank);
  DeviceGuard guard(m.device);
  const Impl::Half op = m.half;
  m.half = Impl::Half::kNone;
  // The send half is queued already: its receive half failing leaves the counters part-way.
  Launches launches(m, op == Impl::Half::kDispatch ? "dispatch" : "combine");
  launches.queued("send-half");
  launchLatency(m, m.halfParams, op, std::nullopt, stream);
}


namespace {
void requireHealthy(const Engine::Impl& m, int rank, const char* op) {
  GRAPHEP_REQUIRE(m.failure.empty(), Status::kRemoteError,
                  "%s: the engine of rank %d is in its failed state (%s); destroy it and create a new one",
                  op, rank, m.failure.c_str());
}

void requireNoHalf(const Engine::Impl& m, const char* op) {
  GRAPHEP_REQUIRE(m.half == Engine::Impl::Half::kNone, Status::kInvalidArgument,
                  "%s: rank %d's last %s was enqueued as its send half; enqueue its receive half first "
                  "(Engine::receive)",
                  op, m.p.shape.rank, m.half == Engine::Impl::Half::kDispatch ? "dispatch" : "combine");
}

void requireLatency(const Engine::Impl& m, const char* what) {
  GRAPHEP_REQUIRE(m.path == MoePath::kLatency, Status::kNotSupported,
                  "%s applies to the latency path; this engine is on the throughput path (MoeConfig.path, "
                  "maxTokensPerRank <= %d and every peer on this GPU or over NVLink choose the latency path)",
                  what, kMoeLatencyMaxTokens);
}

void requireHalf(const Engine::Impl& m, MoeHalf half, const char* op) {
  GRAPHEP_REQUIRE(half == MoeHalf::kWhole || half == MoeHalf::kSend, Status::kInvalidArgument,
                  "%s: half=%d is not a MoeHalf", op, static_cast<int>(half));
  if (half == MoeHalf::kSend) requireLatency(m, (std::string(op) + " half=kSend").c_str());
}

void launchLatency(Engine::Impl& m, MoeParams p, Engine::Impl::Half op, std::optional<MoeHalf> half,
                   cudaStream_t stream) {
  p.latency.phase = !half ? kMoeLatencyReceive
              : *half == MoeHalf::kSend ? kMoeLatencySend
                                        : kMoeLatencySend | kMoeLatencyReceive;
  // The programmatic early start only where the kernels run back to back: in a captured graph.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  GRAPHEP_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  p.grid.programmatic = capture == cudaStreamCaptureStatusActive ? 1 : 0;
  GRAPHEP_CUDA_CHECK(op == Engine::Impl::Half::kDispatch ? launchMoeLatencyDispatch(p, stream)
                                                           : launchMoeLatencyCombine(p, stream));
  if (half == MoeHalf::kSend) {
    m.half = op;
    m.halfParams = p;
  }
}

void requireRankMajorThroughput(const Engine::Impl& m, const char* what, bool direct) {
  GRAPHEP_REQUIRE(m.cfg.receiveLayout == ReceiveLayout::kRankMajor && m.path == MoePath::kThroughput,
                  Status::kNotSupported,
                  "%s applies to the rank-major receive layout on the throughput path; this engine has the %s "
                  "layout on the %s path (MoeConfig.receiveLayout, MoeConfig.path)",
                  what, name(m.cfg.receiveLayout), name(m.path));
  GRAPHEP_REQUIRE(!direct || m.direct, Status::kNotSupported,
                  "%s needs the direct dispatch (every peer by load/store); this "
                  "engine's peers go through the movers",
                  what);
}

void applyOutputs(const Engine::Impl& m, const DispatchArgs& a, MoeParams& p) {
  const DispatchOutputs& o = a.outputs;
  const bool rowBuffers = o.recvX != nullptr || o.recvScales != nullptr || o.rowExperts != nullptr ||
                          o.rowExpertWeights != nullptr || o.rowSrcRank != nullptr || o.rowSrcToken != nullptr;
  GRAPHEP_REQUIRE(o.rows >= 0, Status::kInvalidArgument, "dispatch: outputs.rows=%lld is negative", o.rows);
  if (!rowBuffers && o.rankPrefixMatrix == nullptr) {
    GRAPHEP_REQUIRE(o.rows == 0, Status::kInvalidArgument, "dispatch: outputs.rows=%lld with no output buffer",
                    o.rows);
    return;
  }
  requireRankMajorThroughput(m, "DispatchOutputs", o.rankPrefixMatrix != nullptr);
  GRAPHEP_REQUIRE(!rowBuffers || o.rows > 0, Status::kInvalidArgument,
                  "dispatch: outputs.rows=0: give the rows your output buffers hold");
  if (o.rows > 0) p.layout.outputRows = o.rows;
  // Each buffer given is checked and replaces the engine's for this dispatch.
  auto take = [&](auto* given, const char* what, auto*& into) {
    if (given == nullptr) return;
    requireDevicePointer(given, m.device, what);
    into = static_cast<std::remove_reference_t<decltype(into)>>(given);
  };
  if (o.recvX != nullptr) {
    GRAPHEP_REQUIRE((reinterpret_cast<std::uintptr_t>(o.recvX) & 15u) == 0, Status::kInvalidArgument,
                    "dispatch: outputs.recvX (%p) is not 16-byte aligned", o.recvX);
  }
  GRAPHEP_REQUIRE(o.recvScales == nullptr || p.shape.fp8 != 0, Status::kInvalidArgument,
                  "dispatch: outputs.recvScales is set for a bf16 dispatch");
  take(o.recvX, "dispatch: outputs.recvX", p.layout.recvX);
  take(o.recvScales, "dispatch: outputs.recvScales", p.layout.recvScales);
  take(o.rowExperts, "dispatch: outputs.rowExperts", p.layout.rowExperts);
  if (o.rowExperts != nullptr) p.layout.rowExperts64 = a.indexType == IndexType::kInt64 ? 1 : 0;
  take(o.rowExpertWeights, "dispatch: outputs.rowExpertWeights", p.layout.rowExpertWeights);
  take(o.rowSrcRank, "dispatch: outputs.rowSrcRank", p.layout.rowSrcRank);
  take(o.rowSrcToken, "dispatch: outputs.rowSrcToken", p.layout.rowSrcToken);
  take(o.rankPrefixMatrix, "dispatch: outputs.rankPrefixMatrix", p.layout.rankPrefix);
  // A row buffer the caller did not give is the engine's: its rows hold layout.outputRows (the capacity holds
  // every rank-major row).
}
}  // namespace

}  // namespace graphep
