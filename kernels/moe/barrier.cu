// The MoE engine's device barrier (Engine::barrier; see kernels/moe/moe.h), its launcher below.
// One CTA, thread q < R for peer q: among the ranks of the active-rank mask, each pair of ranks
// counts the barriers both took part in (MoePeers::barrierPairs, local [R]); thread q adds one to
// its pair's count, posts it into peer q's slot for this rank (MoePeers::barrierOff, u32 [R] in
// every rank's user region: flagPost's release at system scope) and waits, bounded, until peer
// q's post of the same count is in this rank's slot for q. A rank outside its own mask takes
// part in nothing. Pair counts, not one global count: a rank put back after barriers it was left
// out of finds each pair where both left it. With MoeConfig::shrinkOnTimeout (latency path) a
// peer whose post does not come within the timeout is masked (maskAfterTimeout: the engine's
// mask word, MoeStatus::shrunkRanks; and the last dispatch's mask, for its combine) and the
// barrier completes among the others, as DeepEP's low-latency clean barrier does in its shrink
// mode; otherwise the wait reports the peer and the site and the engine fails. A peer masked
// after a timeout has not counted that barrier while the others have: like any rank masked after
// a timeout, it is not put back (a late peer is not detected).
#include "kernels/common/launch.h"
#include "kernels/moe/peer.cuh"

namespace graphep {
namespace {

constexpr int kThreads = kMaxRanks;

__global__ void __launch_bounds__(kThreads) barrierKernel(const __grid_constant__ MoeParams p) {
  __shared__ std::uint32_t masked;  // maskAfterTimeout's word for this operation (nothing reads it)
  if (threadIdx.x == 0) masked = 0;
  __syncthreads();
  const std::uint32_t live = dispatchMask(p);  // no rank while this rank is outside its own mask
  const int me = p.shape.rank;
  const int q = static_cast<int>(threadIdx.x);
  if (q == me || !isLive(live, q)) return;
  const std::uint32_t count = p.peers.barrierPairs[q] + 1u;
  p.peers.barrierPairs[q] = count;
  flagPost(peerCounter(p, q, p.peers.barrierOff) + me, count);
  const bool shrink = p.latency.shrink != nullptr;
  if (!flagWait(p.peers.sync, peerCounter(p, me, p.peers.barrierOff) + q, count, q, WaitSite::kMoeBarrier, nullptr,
                false, shrink) &&
      shrink) {
    maskAfterTimeout(p, &masked, q);
    // A barrier between a dispatch and its combine: the combine leaves q out too.
    atomicAnd(p.peers.dispatchLive, ~(1u << q));
  }
}

}  // namespace

cudaError_t launchMoeBarrier(const MoeParams& p, cudaStream_t stream) {
  GRAPHEP_LAUNCH_REQUIRE(p.shape.numRanks <= kMaxRanks, "numRanks %d (at most %d)", p.shape.numRanks, kMaxRanks);
  barrierKernel<<<1, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t preloadMoeBarrierKernels() { return preloadKernels(barrierKernel); }

}  // namespace graphep
