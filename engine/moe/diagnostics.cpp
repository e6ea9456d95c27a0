// The MoE engine's diagnostics: status counters, the health check and what a stalled latency rank
// waits for (engine/moe/health.hpp), clearing the status, and the profile's timeline and step
// trace (MoeConfig.profile).
#include <graphep/moe.hpp>

#include <algorithm>
#include <string>
#include <vector>

#include "engine/device_pointer.hpp"
#include "engine/error.hpp"
#include "engine/platform.hpp"
#include "engine/moe/health.hpp"
#include "engine/moe/impl.hpp"
#include "engine/watchdog.hpp"
#include "kernels/common/counter.h"
#include "kernels/moe/moe.h"

namespace graphep {

using detail::DeviceGuard;

std::vector<std::uint64_t> Engine::networkBytes() const { return impl_->movers().networkBytes(); }

void Engine::resetNetworkBytes() { impl_->movers().resetNetworkBytes(); }

MoeStatus Engine::status() const {
  const Impl& m = *impl_;
  DeviceGuard guard(m.device);
  GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  MoeDeviceStatus d{};
  GRAPHEP_CUDA_CHECK(cudaMemcpy(&d, m.p.state.status, sizeof(d), cudaMemcpyDeviceToHost));
  MoeStatus s;
  s.invalidExpertIds = d.invalidIds;
  s.droppedRows = d.droppedRows;
  s.clampedTokenCounts = d.clampedCounts;
  s.unpairedDispatches = d.unpairedDispatches;
  s.unpairedCombines = d.unpairedCombines;
  s.missingCombineRows = d.missingCombineRows;
  for (int r = 0; r < kMaxRanks; ++r) s.maskedEntries[static_cast<std::size_t>(r)] = d.maskedEntries[r];
  s.shrunkRanks = d.shrunkRanks;
  if (d.firstInvalidSet != 0) {
    s.firstInvalidId = d.firstInvalidId;
    s.firstInvalidToken = d.firstInvalidToken;
    s.firstInvalidSlot = d.firstInvalidSlot;
  }
  if (d.firstClampedSet != 0) s.firstClampedCount = d.firstClampedCount;
  s.deviceError = m.group->heap->errorMessage(m.local);
  if (!s.deviceError.empty() && m.failure.empty()) m.failure = s.deviceError;
  return s;
}

bool Engine::failed() const { return !impl_->failure.empty(); }

HealthReport Engine::checkHealth(cudaStream_t stream, std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  DeviceGuard guard(m.device);
  HealthReport r = detail::judgeStream(*m.group->heap, m.local, stream, m.watchEvent, timeout, [&]() -> std::string {
    if (m.path != MoePath::kLatency) return "";
    // The counters, copied on the private stream by a copy engine while the kernels spin.
    const int R = m.p.shape.numRanks;
    std::uint32_t* h = m.snapshot;
    const char* user = m.p.peers.userRegions[m.p.shape.rank];
    GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(h, m.p.peers.steps, 2 * 4, cudaMemcpyDeviceToHost, m.watchStream));
    GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(h + 2, m.p.state.pending, 4, cudaMemcpyDeviceToHost, m.watchStream));
    GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(h + 3, user + m.p.peers.countFlagsOff, R * 4, cudaMemcpyDeviceToHost, m.watchStream));
    GRAPHEP_CUDA_CHECK(
        cudaMemcpyAsync(h + 3 + R, user + m.p.latency.partialArrivalsOff, R * 4, cudaMemcpyDeviceToHost, m.watchStream));
    // The masks (the caller's, the last dispatch's) and the combine's expected arrivals.
    GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(h + 3 + 2 * R, m.p.peers.live, 2 * 4, cudaMemcpyDeviceToHost, m.watchStream));
    GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(h + 5 + 2 * R, m.p.latency.expected, R * 4, cudaMemcpyDeviceToHost, m.watchStream));
    // The device barrier's pair counts and the peers' posts of them.
    GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(h + 5 + 3 * R, m.p.peers.barrierPairs, R * 4, cudaMemcpyDeviceToHost, m.watchStream));
    GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(h + 5 + 4 * R, user + m.p.peers.barrierOff, R * 4, cudaMemcpyDeviceToHost, m.watchStream));
    GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(m.watchStream));
    detail::LatencyCounters c;
    c.dispatchStep = h[0];
    c.combineStep = h[1];
    c.pending = h[2];
    c.ctas = static_cast<std::uint32_t>(m.p.grid.budgetCtas);
    c.rank = m.p.shape.rank;
    c.flags.assign(h + 3, h + 3 + R);
    c.combineArrivals.assign(h + 3 + R, h + 3 + 2 * R);
    const std::uint32_t live = h[3 + 2 * R] & allRanksMask(R);
    c.dispatchLive = ((live >> c.rank) & 1u) != 0 ? live : 0u;  // as the dispatch reads it
    c.combineLive = h[4 + 2 * R];
    c.combineExpected.assign(h + 5 + 2 * R, h + 5 + 3 * R);
    c.barrierPairs.assign(h + 5 + 3 * R, h + 5 + 4 * R);
    c.barrierPosts.assign(h + 5 + 4 * R, h + 5 + 5 * R);
    return detail::describeLatencyStall(c);
  });
  if (!r.ok && m.failure.empty()) m.failure = r.message;
  return r;
}

std::string detail::describeLatencyStall(const LatencyCounters& c) {
  const std::uint32_t step = c.dispatchStep, cstep = c.combineStep, G = c.ctas;
  const bool inCombine = (c.pending & kMoePendingCombine) != 0;
  std::string missing;
  for (std::size_t peer = 0; peer < c.barrierPairs.size() && peer < c.barrierPosts.size(); ++peer) {
    const bool live = ((c.dispatchLive >> (peer & 31)) & 1u) != 0;
    if (live && static_cast<int>(peer) != c.rank && !counterReached(c.barrierPosts[peer], c.barrierPairs[peer])) {
      missing += format("; rank %zu has not reached barrier %u (its post %u)", peer, c.barrierPairs[peer],
                        c.barrierPosts[peer]);
    }
  }
  if (!missing.empty()) return missing;
  for (std::size_t peer = 0; peer < c.flags.size(); ++peer) {
    const std::uint32_t flag = c.flags[peer], comb = c.combineArrivals[peer];
    const std::uint32_t cbase = c.combineExpected.empty() ? cstep * G : c.combineExpected[peer];
    const bool live = ((c.dispatchLive >> (peer & 31)) & 1u) != 0, clive = ((c.combineLive >> (peer & 31)) & 1u) != 0;
    if (!inCombine && live && !counterReached(flag, step + 1u)) {
      missing += format("; rank %zu's count message for dispatch step %u has not arrived (flag %u)", peer, step, flag);
    } else if (inCombine && clive && static_cast<int>(peer) != c.rank && !counterReached(comb, cbase + G)) {
      missing += format("; %u of rank %zu's %u CTAs have delivered their partials for combine step %u",
                        comb - cbase, peer, G, cstep);
    }
  }
  if (!missing.empty()) return missing;
  const bool outside = c.rank >= 0 && (inCombine ? ((c.combineLive >> (c.rank & 31)) & 1u) == 0 : c.dispatchLive == 0);
  if (outside) return " (this rank is outside the active-rank mask and waits for no peer: its own kernels are behind)";
  // The dispatch's records carry their step in every line and no counter: once every count
  // message is in, a record still missing shows only in the device error of the wait that timed out.
  return inCombine ? " (every peer's counters are complete: this rank's own kernels are behind)"
                   : " (every peer's count message is in: a peer's records not yet landed, or this rank's own kernels "
                     "behind; a wait that timed out names the record's peer in the device error)";
}

void Engine::clearStatus() {
  Impl& m = *impl_;
  DeviceGuard guard(m.device);
  GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  GRAPHEP_CUDA_CHECK(cudaMemset(m.p.state.status, 0, sizeof(MoeDeviceStatus)));
  m.group->heap->clearError(m.local);
  // Landed before the caller's next operation (on a non-blocking stream, not ordered after the
  // legacy stream the memset went to) counts into the status.
  GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
}

namespace {
const char* kernelName(MoeKernel k) {
  switch (k) {
    case MoeKernel::kRoute: return "route";
    case MoeKernel::kPack: return "pack";
    case MoeKernel::kOffsets: return "offsets";
    case MoeKernel::kExpand: return "expand";
    case MoeKernel::kForward: return "forward";
    case MoeKernel::kNodeSum: return "node sum";
    case MoeKernel::kCombineReduce: return "combine reduce";
    case MoeKernel::kCombineFinal: return "combine final";
    case MoeKernel::kLatencyDispatch: return "latency route";
    case MoeKernel::kLatencyRecords: return "latency records";
    case MoeKernel::kLatencyReceive: return "latency layout";
    case MoeKernel::kLatencyExpand: return "latency expand";
    case MoeKernel::kLatencyCombine: return "latency combine";
    case MoeKernel::kLatencyCombineOwn: return "latency combine own rows";
    case MoeKernel::kLatencyCombineReceive: return "latency combine receive";
    case MoeKernel::kDirectQuantize: return "direct quantise";
    case MoeKernel::kDirectSend: return "direct send";
    case MoeKernel::kDirectReceive: return "direct receive";
    case MoeKernel::kDirectOwn: return "direct own rows";
    case MoeKernel::kDirectPeers: return "direct peers' rows";
    case MoeKernel::kDirectCombineReduce: return "direct combine reduce";
    case MoeKernel::kDirectCombineSend: return "direct combine send";
    case MoeKernel::kDirectCombineFinal: return "direct combine final";
    case MoeKernel::kCount: break;
  }
  return "?";
}
}  // namespace

namespace {
constexpr int kStampKernels = static_cast<int>(MoeKernel::kCount);

// Words [first, first + n) of an engine's profile block (MoeConfig.profile: the stamps, then the
// step trace), once the device has finished (diagnostics: synchronises).
std::vector<unsigned long long> readProfile(const Engine::Impl& m, std::size_t first, std::size_t n) {
  DeviceGuard guard(m.device);
  GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<unsigned long long> words(n);
  GRAPHEP_CUDA_CHECK(cudaMemcpy(words.data(), m.p.state.timeline + first, n * sizeof(unsigned long long),
                                cudaMemcpyDeviceToHost));
  return words;
}
}  // namespace

std::vector<MoeKernelSpan> Engine::timeline() const {
  const Impl& m = *impl_;
  std::vector<MoeKernelSpan> spans;
  if (m.p.state.timeline == nullptr) return spans;
  constexpr int kN = kStampKernels, kW = kMoeStampWords;
  const std::vector<unsigned long long> t = readProfile(m, 0, kW * kN);
  unsigned long long first = ~0ull;
  for (int k = 0; k < kN; ++k) {
    if (t[kW * k + 3] != 0) first = std::min(first, t[kW * k]);
  }
  for (int k = 0; k < kN; ++k) {
    const unsigned long long* w = t.data() + kW * k;
    if (w[3] == 0) continue;  // did not run
    spans.push_back(MoeKernelSpan{kernelName(static_cast<MoeKernel>(k)), static_cast<double>(w[0] - first) / 1e3,
                                  static_cast<double>(w[1] - first) / 1e3,
                                  static_cast<double>(w[2]) / static_cast<double>(w[3]) / 1e3, w[3], w[0], w[1]});
  }
  return spans;
}

void Engine::resetTimeline() {
  const Impl& m = *impl_;
  if (m.p.state.timeline == nullptr) return;
  DeviceGuard guard(m.device);
  GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  // Per kernel: min of entry times (~0), max of exit times, sum of CTA durations, CTAs (0); then
  // the step trace (0: not reached).
  std::vector<unsigned long long> t(kMoeStampWords * kStampKernels + kMoeTraceWords, 0);
  for (int k = 0; k < kStampKernels; ++k) t[static_cast<std::size_t>(kMoeStampWords * k)] = ~0ull;
  GRAPHEP_CUDA_CHECK(cudaMemcpy(m.p.state.timeline, t.data(), t.size() * sizeof(unsigned long long), cudaMemcpyHostToDevice));
  GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());  // landed before the caller's next (non-blocking) stream work
}

std::vector<MoeStepTrace> Engine::stepTrace() const {
  const Impl& m = *impl_;
  std::vector<MoeStepTrace> steps;
  if (m.p.state.timeline == nullptr) return steps;
  constexpr int kE = static_cast<int>(MoeTraceEvent::kCount);
  const std::vector<unsigned long long> t = readProfile(m, kMoeStampWords * kStampKernels, kMoeTraceWords);
  for (int op = 0; op < 2; ++op) {
    for (int s = 0; s < kMoeTraceSteps; ++s) {
      const unsigned long long* w = t.data() + (op * kMoeTraceSteps + s) * kE;
      MoeStepTrace st;
      st.combine = op == 1;
      std::copy(w, w + kE, st.ns);
      if (st.at(MoeTraceEvent::kDone) != 0) steps.push_back(st);  // an operation of this slot completed
    }
  }
  std::sort(steps.begin(), steps.end(), [](const MoeStepTrace& a, const MoeStepTrace& b) {
    return a.at(MoeTraceEvent::kDone) < b.at(MoeTraceEvent::kDone);
  });
  return steps;
}

std::string MoeStatus::describe() const {
  std::string s;
  auto line = [&](const std::string& l) { s += (s.empty() ? "" : "\n") + l; };
  if (shrunkRanks != 0) {  // not a problem, but a change the caller should see
    std::string ranks;
    for (int r = 0; r < kMaxRanks; ++r) {
      if (((shrunkRanks >> r) & 1u) != 0) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    }
    line("masked after a timeout (MoeConfig::shrinkOnTimeout): rank(s) " + ranks);
  }
  if (ok()) return s.empty() ? "ok" : s;
  if (invalidExpertIds > 0) {
    line(detail::format("%llu expert id(s) outside [-1, E) skipped; the first: topk_idx[%d][%d] = %lld",
                        invalidExpertIds, firstInvalidToken, firstInvalidSlot, firstInvalidId));
  }
  if (droppedRows > 0) {
    line(detail::format("%llu received row(s) past the receive capacity (batched: past their expert's block) dropped",
                        droppedRows));
  }
  if (clampedTokenCounts > 0) {
    line(detail::format("%llu dispatch(es) had a live token count outside [0, maxTokensPerRank]; "
                        "the first was %d (clamped)",
                        clampedTokenCounts, firstClampedCount));
  }
  if (unpairedDispatches > 0) {
    line(detail::format("%llu dispatch(es) counted as unpaired", unpairedDispatches));
  }
  if (unpairedCombines > 0) {
    line(detail::format("%llu combine(s) ran before any dispatch (nothing to combine)", unpairedCombines));
  }
  if (missingCombineRows > 0) {
    line(detail::format("%llu expert output row(s) a combine needed lay past CombineArgs.expertOutputRows (they "
                        "added nothing)",
                        missingCombineRows));
  }
  if (!deviceError.empty()) line(deviceError);
  return s;
}

DirectBlockFlags Engine::directBlockFlags() const {
  const Impl& m = *impl_;
  DirectBlockFlags f;
  if (!m.direct) return f;
  DeviceGuard guard(m.device);
  GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  const int W = static_cast<int>(moeRouteWords(m.p.shape.maxTokens));
  const std::size_t n = static_cast<std::size_t>(m.p.shape.numRanks) * static_cast<std::size_t>(W);
  const char* mine = m.p.peers.userRegions[m.p.shape.rank];
  f.blocksPerRank = W;
  f.records.resize(n);
  f.partials.resize(n);
  GRAPHEP_CUDA_CHECK(cudaMemcpy(f.records.data(), mine + m.p.direct.recordFlagsOff, n * 4, cudaMemcpyDeviceToHost));
  GRAPHEP_CUDA_CHECK(cudaMemcpy(f.partials.data(), mine + m.p.direct.partialFlagsOff, n * 4, cudaMemcpyDeviceToHost));
  f.partialsReady.resize(n);
  GRAPHEP_CUDA_CHECK(cudaMemcpy(f.partialsReady.data(), m.p.direct.partialReady, n * 4, cudaMemcpyDeviceToHost));
  f.pairSteps.resize(2 * static_cast<std::size_t>(m.p.shape.numRanks));
  GRAPHEP_CUDA_CHECK(cudaMemcpy(f.pairSteps.data(), m.p.direct.shared, f.pairSteps.size() * 4, cudaMemcpyDeviceToHost));
  std::uint32_t steps[2] = {0, 0};
  GRAPHEP_CUDA_CHECK(cudaMemcpy(steps, m.p.peers.steps, sizeof steps, cudaMemcpyDeviceToHost));
  f.dispatchStep = steps[0];
  f.combineStep = steps[1];
  return f;
}

}  // namespace graphep
