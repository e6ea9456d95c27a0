// MoE latency-path kernel family (see kernels/moe.h), launchers below: two kernels per dispatch
// and two per combine, no count round trip before the payload.
//
//   dispatch   every CTA routes all T x K entries in shared memory (T <= 256), then writes its
//              tokens' records straight into each destination's slot [parity][this rank][index];
//              the last CTA to finish writes each destination's count message and posts its flag
//              (step + 1): the count travels with the payload.
//   receive    every CTA waits for every source's flag, derives the layout from the count
//              messages and expands one record; CTA 0 publishes the layout views; the last CTA
//              advances the dispatch step.
//   combine    one CTA per received record writes its partial straight into the source's slot
//              [parity][this rank][index]; the last CTA of each source posts that source's flag.
//   combine    every CTA waits for every destination's flag and sums one token's partials; the
//   receive    last CTA advances the combine step.
//
// Buffers alternate by the step's parity. A rank can only start dispatch s + 2 after its combine
// s + 1 received every destination's partials, which each destination sends after its own
// combine s: so a destination has finished with slot parity s before any source writes it again
// (each dispatch is followed by a combine; the engine enforces it on the host).
#include "kernels/common/flags.cuh"
#include "kernels/common/moe.cuh"

namespace graphep {
namespace {

constexpr int kSendThreads = 256;
constexpr int kRecvThreads = 256;
constexpr int kThreads = 128;

__device__ __forceinline__ std::uint64_t llSlot(const MoeParams& p, int parity, int src, int i,
                                                std::uint64_t bytes) {
  return ((static_cast<std::uint64_t>(parity) * p.numRanks + src) * p.maxTokens + i) * bytes;
}

// Block-wide "am I the last of `arrivals` CTAs to get here": every thread's prior writes (local or
// to peers) are fenced at system scope before the count; returns the same answer in every thread,
// and the last one resets the counter for the next launch.
__device__ bool lastBlock(std::uint32_t* counter, unsigned arrivals = gridDim.x) {
  __shared__ bool last;
  __threadfence_system();  // every thread's own stores, before the barrier hands over to thread 0
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(counter, 1u) == arrivals - 1u;
    if (last) {
      *counter = 0;  // every CTA counted: ready for the next launch
      __threadfence_system();
    }
  }
  __syncthreads();
  return last;
}

__global__ void __launch_bounds__(kSendThreads) moeLatencyDispatchKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kLatencyDispatch);
  __shared__ std::int32_t ids[kMoeLatencyMaxEntries];
  __shared__ std::uint32_t masks[kMoeLatencyMaxTokens];
  __shared__ std::int32_t entryIdx[kMoeMaxTopK];
  __shared__ std::int32_t tokIdx[kMaxRanks];
  __shared__ std::int32_t hist[kMoeMaxLocalExperts];
  const int tid = static_cast<int>(threadIdx.x);
  const int T = moeLiveTokens(p, blockIdx.x == 0 && tid == 0);
  const int K = p.topK, R = p.numRanks, L = p.localExperts;
  const std::uint32_t step = p.llSteps[0];
  const int parity = static_cast<int>(step & 1u);
  // Route every entry in shared memory (invalid ids: -1 here, counted by CTA 0).
  const int n = T * K;
  for (int e = tid; e < n; e += kSendThreads) {
    const long long id = moeReadId(p, static_cast<std::uint64_t>(e));
    const bool valid = moeValidId(p, id);
    if (!valid && id != -1 && blockIdx.x == 0) moeReportInvalidId(p, id, e / K, e % K);
    ids[e] = valid ? static_cast<std::int32_t>(id) : -1;
  }
  __syncthreads();
  for (int t = tid; t < T; t += kSendThreads) {
    std::uint32_t m = 0;
    for (int k = 0; k < K; ++k) {
      const int e = ids[t * K + k];
      if (e >= 0) m |= 1u << (e / L);
    }
    masks[t] = m;
  }
  __syncthreads();
  for (int t = static_cast<int>(blockIdx.x); t < T; t += static_cast<int>(gridDim.x)) {
    // Token t's index in each destination's list (tokens before it going there), and each slot's
    // index among this rank's entries for its expert (entries before it with the same expert).
    if (tid < R) tokIdx[tid] = 0;
    if (tid < K) entryIdx[tid] = 0;
    __syncthreads();
    for (int u = tid; u < t; u += kSendThreads) {
      for (std::uint32_t m = masks[u]; m != 0; m &= m - 1) atomicAdd(&tokIdx[__ffs(m) - 1], 1);
    }
    for (int e = tid; e < (t + 1) * K; e += kSendThreads) {
      const int id = ids[e];
      if (id < 0) continue;
      for (int k = 0; k < K; ++k) {
        if (e < t * K + k && ids[t * K + k] == id) atomicAdd(&entryIdx[k], 1);
      }
    }
    __syncthreads();
    for (int r = 0; r < R; ++r) {
      const bool goes = (masks[t] >> r) & 1u;
      if (tid == 0) p.tokRankIdx[static_cast<std::uint64_t>(t) * R + r] = goes ? tokIdx[r] : -1;
      if (!goes) continue;
      moeWriteRecord(p, p.peerUser[r] + p.llRecOff + llSlot(p, parity, p.rank, tokIdx[r], p.recBytes), t,
                     r, entryIdx, tid, kSendThreads);
    }
    __syncthreads();  // tokIdx / entryIdx are reset for the next token
  }
  if (!lastBlock(&p.llDone[0])) return;
  // The last CTA: count messages (rows and per-expert entries per destination), then the flags.
  for (int r = 0; r < R; ++r) {
    for (int j = tid; j < L; j += kSendThreads) hist[j] = 0;
    if (tid == 0) tokIdx[0] = 0;
    __syncthreads();
    for (int e = tid; e < n; e += kSendThreads) {
      const int id = ids[e];
      if (id >= 0 && id / L == r) atomicAdd(&hist[id % L], 1);
    }
    for (int t = tid; t < T; t += kSendThreads) {
      if ((masks[t] >> r) & 1u) atomicAdd(&tokIdx[0], 1);
    }
    __syncthreads();
    auto* msg = reinterpret_cast<std::uint64_t*>(
        p.peerUser[r] + p.llCntOff + (static_cast<std::uint64_t>(parity) * R + p.rank) * p.cntMsgBytes);
    if (tid == 0) msg[0] = static_cast<std::uint64_t>(tokIdx[0]);
    for (int j = tid; j < L; j += kSendThreads) msg[1 + j] = static_cast<std::uint64_t>(hist[j]);
    __syncthreads();
  }
  // Everything this grid wrote precedes each flag: the other CTAs fenced before counting, this
  // CTA's writes are ordered by the barrier above and each poster's fence + release.
  if (tid < R) {
    flagPost(reinterpret_cast<std::uint32_t*>(p.peerUser[tid] + p.llFlagOff) + p.rank, step + 1u);
  }
}

// The count message of source q for this step, in this rank's heap.
__device__ __forceinline__ const std::uint64_t* llMsg(const MoeParams& p, int parity, int q) {
  return reinterpret_cast<const std::uint64_t*>(p.peerUser[p.rank] + p.llCntOff +
                                                (static_cast<std::uint64_t>(parity) * p.numRanks + q) * p.cntMsgBytes);
}

// Waits (threads q < R) until every source q posted `target` into flags[q]; false on a timeout.
__device__ bool waitAll(const MoeParams& p, const std::uint32_t* flags, std::uint32_t target, WaitSite site) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < p.numRanks) {
    if (!flagWait(p.sync, flags + threadIdx.x, target, static_cast<std::int32_t>(threadIdx.x), site)) failed = 1;
  }
  __syncthreads();
  return failed == 0;
}

// Grid: p.llRecvCtas CTAs looping over the (source, record slot) pairs.
__global__ void __launch_bounds__(kRecvThreads) moeLatencyReceiveKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kLatencyReceive);
  __shared__ std::int32_t counts[kMoeMaxLocalExperts];
  __shared__ std::int32_t offsets[kMoeMaxLocalExperts + 1];
  __shared__ std::int32_t base[kMoeMaxLocalExperts];
  const int tid = static_cast<int>(threadIdx.x);
  const std::uint32_t step = p.llSteps[0];
  const int parity = static_cast<int>(step & 1u);
  const auto* flags = reinterpret_cast<const std::uint32_t*>(p.peerUser[p.rank] + p.llFlagOff);
  if (waitAll(p, flags, step + 1u, WaitSite::kMoeDispatch)) {
    auto msg = [&](int q) { return llMsg(p, parity, q); };
    moeExpertOffsets(p, msg, counts, offsets, tid, kRecvThreads);
    if (blockIdx.x == 0) moePublishLayout(p, msg, counts, offsets, tid, kRecvThreads);
    const int slots = p.numRanks * p.maxTokens;
    for (int b = static_cast<int>(blockIdx.x); b < slots; b += static_cast<int>(gridDim.x)) {
      const int s = b / p.maxTokens, i = b % p.maxTokens;
      if (static_cast<std::uint64_t>(i) >= msg(s)[0]) continue;  // block-uniform
      __syncthreads();  // the previous record's readers of `base` are done
      for (int j = tid; j < p.localExperts; j += kRecvThreads) {
        long long acc = offsets[j];
        for (int q = 0; q < s; ++q) acc += static_cast<long long>(msg(q)[1 + j]);
        base[j] = static_cast<std::int32_t>(acc);
      }
      __syncthreads();
      moeExpandRecord(p, s, p.peerUser[p.rank] + p.llRecOff + llSlot(p, parity, s, i, p.recBytes), base,
                      tid, kRecvThreads);
    }
  }
  if (lastBlock(&p.llDone[1]) && tid == 0) p.llSteps[0] = step + 1u;
}

// Grid: R * maxTokens CTAs, one per (source, received record slot).
__global__ void __launch_bounds__(kThreads) moeLatencyCombineKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kLatencyCombine);
  const int tid = static_cast<int>(threadIdx.x);
  const int s = static_cast<int>(blockIdx.x / static_cast<unsigned>(p.maxTokens));
  const int i = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.maxTokens));
  const std::uint32_t cstep = p.llSteps[1];
  // The records of the last dispatch (whose receive advanced the dispatch step past them).
  const int dparity = static_cast<int>((p.llSteps[0] - 1u) & 1u);
  const int cparity = static_cast<int>(cstep & 1u);
  const std::uint64_t rowBytes = static_cast<std::uint64_t>(p.hidden) * 2;
  if (i < p.recvRows[s]) {
    moeReduceRecord(p, p.peerUser[p.rank] + p.llRecOff + llSlot(p, dparity, s, i, p.recBytes),
                    p.srcBase + s * p.localExperts,
                    p.peerUser[s] + p.llCombOff + llSlot(p, cparity, p.rank, i, rowBytes), tid, kThreads);
  }
  // The last of source s's maxTokens CTAs posts its flag (also when it received nothing).
  if (lastBlock(&p.llDone[3 + s], static_cast<unsigned>(p.maxTokens)) && tid == 0) {
    flagPost(reinterpret_cast<std::uint32_t*>(p.peerUser[s] + p.llCombFlagOff) + p.rank, cstep + 1u);
  }
}

// Grid: p.llCombRecvCtas CTAs looping over the tokens.
__global__ void __launch_bounds__(kThreads) moeLatencyCombineReceiveKernel(const __grid_constant__ MoeParams p) {
  const MoeStamp stamp(p, MoeKernel::kLatencyCombineReceive);
  const int tid = static_cast<int>(threadIdx.x);
  const std::uint32_t cstep = p.llSteps[1];
  const int cparity = static_cast<int>(cstep & 1u);
  const std::uint64_t rowBytes = static_cast<std::uint64_t>(p.hidden) * 2;
  const auto* flags = reinterpret_cast<const std::uint32_t*>(p.peerUser[p.rank] + p.llCombFlagOff);
  if (waitAll(p, flags, cstep + 1u, WaitSite::kMoeCombine)) {
    const int T = *p.liveTokens;
    for (int t = static_cast<int>(blockIdx.x); t < T; t += static_cast<int>(gridDim.x)) {
      moeFinalToken(
          p, t,
          [&](int r) -> const char* {
            const int i = p.tokRankIdx[static_cast<std::uint64_t>(t) * p.numRanks + r];
            return i < 0 ? nullptr : p.peerUser[p.rank] + p.llCombOff + llSlot(p, cparity, r, i, rowBytes);
          },
          tid, kThreads);
    }
  }
  if (lastBlock(&p.llDone[2]) && tid == 0) p.llSteps[1] = cstep + 1u;
}

}  // namespace

cudaError_t launchMoeLatencyDispatch(const MoeParams& p, cudaStream_t stream) {
  if (p.maxTokens > kMoeLatencyMaxTokens || p.maxTokens * p.topK > kMoeLatencyMaxEntries ||
      p.localExperts > kMoeMaxLocalExperts || p.numRanks > 32) {
    return cudaErrorInvalidValue;
  }
  moeLatencyDispatchKernel<<<static_cast<unsigned>(p.maxTokens), kSendThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launchMoeLatencyReceive(const MoeParams& p, cudaStream_t stream) {
  if (p.llRecvCtas < 1) return cudaErrorInvalidValue;
  moeLatencyReceiveKernel<<<static_cast<unsigned>(p.llRecvCtas), kRecvThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launchMoeLatencyCombine(const MoeParams& p, cudaStream_t stream) {
  moeLatencyCombineKernel<<<static_cast<unsigned>(p.numRanks * p.maxTokens), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launchMoeLatencyCombineReceive(const MoeParams& p, cudaStream_t stream) {
  if (p.llCombRecvCtas < 1) return cudaErrorInvalidValue;
  moeLatencyCombineReceiveKernel<<<static_cast<unsigned>(p.llCombRecvCtas), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t preloadMoeLatencyKernels() {
  cudaFuncAttributes a{};
  for (const void* f : {reinterpret_cast<const void*>(moeLatencyDispatchKernel),
                        reinterpret_cast<const void*>(moeLatencyReceiveKernel),
                        reinterpret_cast<const void*>(moeLatencyCombineKernel),
                        reinterpret_cast<const void*>(moeLatencyCombineReceiveKernel)}) {
    const cudaError_t e = cudaFuncGetAttributes(&a, f);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace graphep
