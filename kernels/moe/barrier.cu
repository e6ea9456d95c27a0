// The MoE engine's device barrier (Engine::barrier; see kernels/moe/moe.h), its launcher below.
// One CTA, thread q < R for peer q: among the ranks of the active-rank mask, each pair of ranks
// counts the barriers both took part in (MoePeers::barrierPairs, local [R]); thread q adds one to
// its pair's count, posts it into peer q's slot for this rank (MoePeers::barrierOff, u32 [R] in
// every rank's user region: flagPost's release at system scope) and waits, bounded, until peer
// q's post of the same count is in this rank's slot for q. A rank outside its own mask takes
// part in nothing. Pair counts, not one global count: a rank put back after barriers it was left
// out of finds each pair where both left it. With MoeConfig::shrinkOnTimeout (latency path) a
// peer whose post does not come within the timeout is masked (maskAfterTimeout: the engine's
// mask word, MoeStatus::shrunkRanks) and the barrier completes among the others, as DeepEP's
// low-latency clean barrier does in its shrink mode; otherwise the wait reports the peer and
// the site and the engine fails.
#include "kernels/common/launch.h"
#include "kernels/moe/peer.cuh"

namespace graphep {
namespace {

constexpr int kThreads = kMaxRanks;

__global__ void __launch_bounds__(kThreads) barrierKernel(MoeParams p) {
  __shared__ std::uint32_t masked;  // maskAfterTimeout's word for this operation (nothing reads it)
  if (threadIdx.x == 0) masked = 0;
  __syncthreads();
  const std::uint32_t live = *p.peers.live;
  const int me = p.shape.rank;
  const int q = static_cast<int>(threadIdx.x);
  if (((live >> me) & 1u) == 0 || q >= p.shape.numRanks || q == me || ((live >> q) & 1u) == 0) return;
  const std::uint32_t count = p.peers.barrierPairs[q] + 1u;
  p.peers.barrierPairs[q] = count;
  flagPost(peerCounter(p, q, p.peers.barrierOff) + me, count);
  const bool shrink = p.latency.shrink != nullptr;
  if (!flagWait(p.peers.sync, peerCounter(p, me, p.peers.barrierOff) + q, count, q, WaitSite::kMoeBarrier, nullptr,
                shrink, shrink) &&
      shrink) {
    maskAfterTimeout(p, &masked, q);
  }
}

}  // namespace

cudaError_t launchMoeBarrier(const MoeParams& p, cudaStream_t stream) {
  if (p.shape.numRanks > kMaxRanks) {
    return refuseLaunch("launchMoeBarrier", "numRanks %d (at most %d)", p.shape.numRanks, kMaxRanks);
  }
  barrierKernel<<<1, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t preloadMoeBarrierKernels() { return preloadKernels(barrierKernel); }

}  // namespace graphep
