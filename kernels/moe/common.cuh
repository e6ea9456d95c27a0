// Device helpers shared by the MoE kernel families (kernels/moe/*.cu): reading routing entries and
// recording bad input in the status word (MoeDeviceStatus, kernels/moe/moe.h).
#pragma once

#include <cuda_bf16.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cstdint>
#include <cstdio>
#include <type_traits>

#include "kernels/common/hooks.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/moe/moe.h"

namespace graphep {

// Stamps a kernel's (or phase's) span into the timeline when profiling (thread 0 of each CTA):
// the entry time on construction; on destruction (every return path) the exit time, the CTA's
// duration added to the sum and one sample counted.
class MoeStamp {
 public:
  __device__ MoeStamp(const MoeParams& p, MoeKernel k)
      : slot_(p.state.timeline != nullptr && threadIdx.x == 0 ? p.state.timeline + kMoeStampWords * static_cast<int>(k) : nullptr) {
    if (slot_ != nullptr) {
      start_ = ptx::globalTimerNs();
      atomicMin(slot_, static_cast<unsigned long long>(start_));
    }
  }
  __device__ ~MoeStamp() {
    if (slot_ != nullptr) {
      const std::uint64_t end = ptx::globalTimerNs();
      atomicMax(slot_ + 1, static_cast<unsigned long long>(end));
      atomicAdd(slot_ + 2, static_cast<unsigned long long>(end - start_));
      atomicAdd(slot_ + 3, 1ull);
    }
  }
  MoeStamp(const MoeStamp&) = delete;
  MoeStamp& operator=(const MoeStamp&) = delete;

 private:
  unsigned long long* slot_;
  std::uint64_t start_ = 0;
};

// Expert id of flattened (token, k) entry n.
// Event e of latency operation `op` (0 dispatch, 1 combine) at `step` into the step trace
// (MoeTraceEvent, include/graphep/types.hpp), at time ns (0: now), when profiling.
// latest: the latest of the callers' times (an atomic max: the slot's value from kMoeTraceSteps
// operations before is always earlier), for an event that many CTAs reach.
__device__ __forceinline__ void moeTrace(const MoeParams& p, int op, std::uint32_t step, MoeTraceEvent e,
                                         std::uint64_t ns = 0, bool latest = false) {
  if (p.state.timeline == nullptr) return;
  constexpr int kE = static_cast<int>(MoeTraceEvent::kCount);
  unsigned long long* slot = p.state.timeline + kMoeStampWords * static_cast<int>(MoeKernel::kCount) +
                             (op * kMoeTraceSteps + static_cast<int>(step % kMoeTraceSteps)) * kE + static_cast<int>(e);
  const unsigned long long now = ns != 0 ? ns : ptx::globalTimerNs();
  if (latest) {
    atomicMax(slot, now);
  } else {
    *slot = now;
  }
}

__device__ __forceinline__ long long moeReadId(const MoeParams& p, std::uint64_t n) {
  return p.input.int64Ids ? static_cast<const long long*>(p.input.topkIdx)[n]
                    : static_cast<long long>(static_cast<const int*>(p.input.topkIdx)[n]);
}

__device__ __forceinline__ bool moeValidId(const MoeParams& p, long long id) {
  return id >= 0 && id < p.shape.numExperts;
}

// The top-k weight of flattened entry n: 1 when the dispatch has none (the latency path, whose
// combine may bring them: CombineArgs.topkWeights).
__device__ __forceinline__ float moeWeightOf(const MoeParams& p, std::uint64_t n) {
  return p.input.topkWeights != nullptr ? p.input.topkWeights[n] : 1.f;
}

// Rank r takes part in an operation whose mask is `live`.
__device__ __forceinline__ bool isLive(std::uint32_t live, int r) { return ((live >> r) & 1u) != 0; }

// This dispatch's mask: the caller's (Engine::setActiveRanks; bits past the ranks dropped), or no
// rank at all while this rank is outside it (it then sends, receives and waits for nothing).
// Every rank on the mover path. Read by each CTA of each kernel of the dispatch: the word changes
// in stream order between operations, and under shrink on timeout when a wait times out
// (maskAfterTimeout), in practice a timeout after every CTA of the launch read it (DESIGN §5.6).
__device__ __forceinline__ std::uint32_t dispatchMask(const MoeParams& p) {
  const int R = p.shape.numRanks;
  const std::uint32_t m = *p.peers.live & (R >= 32 ? ~0u : (1u << R) - 1u);
  return isLive(m, p.shape.rank) ? m : 0u;
}

// Whether token t's entry of valid expert `id` is routed: always, unless tokenInRank leaves the
// token out of that expert's rank (then the entry is no slot anywhere).
__device__ __forceinline__ bool moeEntryRouted(const MoeParams& p, int t, long long id) {
  return p.input.tokenInRank == nullptr ||
         p.input.tokenInRank[static_cast<std::uint64_t>(t) * p.shape.numRanks + id / p.shape.localExperts] != 0;
}

// An id outside [-1, E): counted, the first one recorded; strict mode traps after counting.
__device__ __noinline__ inline void moeReportInvalidId(const MoeParams& p, long long id, int token, int slot) {
  atomicAdd(&p.state.status->invalidIds, 1ull);
  if (atomicCAS(&p.state.status->firstInvalidSet, 0, 1) == 0) {
    p.state.status->firstInvalidId = id;
    p.state.status->firstInvalidToken = token;
    p.state.status->firstInvalidSlot = slot;
  }
  if (p.state.strict) {
    printf("graphep: rank %d: topk_idx[%d][%d] = %lld is outside [-1, %d) (strict mode)\n", p.shape.rank,
           token, slot, id, p.shape.numExperts);
    __trap();
  }
}

// The live token count of a dispatch, `raw` as read from input.numTokens (a caller that loads it
// early), clamped to [0, maxTokens]. The caller that passes `record` (one thread of the grid)
// publishes it to liveTokens and counts an out-of-range value (strict mode traps); every thread
// may call it for the value.
__device__ inline int moeClampTokens(const MoeParams& p, int raw, bool record) {
  const int T = raw < 0 ? 0 : (raw > p.shape.maxTokens ? p.shape.maxTokens : raw);
  if (record) {
    *p.routing.liveTokens = T;
    if (raw != T) {
      atomicAdd(&p.state.status->clampedCounts, 1ull);
      if (atomicCAS(&p.state.status->firstClampedSet, 0u, 1u) == 0u) p.state.status->firstClampedCount = raw;
      if (p.state.strict) {
        printf("graphep: rank %d: live token count %d is outside [0, %d] (strict mode)\n", p.shape.rank,
               raw, p.shape.maxTokens);
        __trap();
      }
    }
  }
  return T;
}
// moeClampTokens of the count read now.
__device__ inline int moeLiveTokens(const MoeParams& p, bool record) { return moeClampTokens(p, *p.input.numTokens, record); }

// Operation order (one thread of the operation's first kernel). Dispatch -> dispatch and combine
// -> combine are defined: a dispatch replaces the last one's layout, a combine serves the last
// dispatch (again). Only a combine before the engine's first dispatch has nothing to combine: it is
// counted, and strict mode traps; it still runs (over no tokens).
__device__ inline void moeCheckPairing(const MoeParams& p, bool dispatch) {
  if (dispatch || (*p.state.pending & kMoeDispatched) != 0u) return;
  atomicAdd(&p.state.status->unpairedCombines, 1ull);
  if (p.state.strict) {
    printf("graphep: rank %d: combine called before any dispatch (strict mode)\n", p.shape.rank);
    __trap();
  }
}

// A combine input row the layout needs past CombineArgs.expertOutputRows: it adds nothing, counted.
__device__ __noinline__ inline void moeReportMissingRow(const MoeParams& p, long long row) {
  atomicAdd(&p.state.status->missingCombineRows, 1ull);
  if (p.state.strict) {
    printf("graphep: rank %d: combine needs expert output row %lld, past the %lld rows given (strict mode)\n",
           p.shape.rank, row, static_cast<long long>(p.combine.expertOutputRows));
    __trap();
  }
}

// A received row whose place is past the capacity: counted (strict mode traps).
__device__ __noinline__ inline void moeReportDroppedRow(const MoeParams& p, long long pos) {
  atomicAdd(&p.state.status->droppedRows, 1ull);
  if (p.state.strict) {
    if (p.layout.rowsPerExpert > 0) {
      printf("graphep: rank %d: received row %lld is past its expert's block of %lld rows (batched layout, "
             "strict mode)\n",
             p.shape.rank, pos, static_cast<long long>(p.layout.rowsPerExpert));
    } else {
      printf("graphep: rank %d: received row %lld is past the capacity of %lld rows (strict mode)\n", p.shape.rank, pos,
             static_cast<long long>(p.layout.capacity));
    }
    __trap();
  }
}

// --- The receive layout, from the count messages (msg(q): [0] records from source q, [1 + j] its
// rows for local expert j; written by peers or the movers, read through L2) ------------------------
//
// Rows are grouped by local expert, each expert's rows starting at a multiple of the alignment;
// within an expert they come in (source rank, source token, top-k slot) order. A row whose place is
// at or past the capacity is dropped by the expand (moeSlotRow) and counted, so expert j keeps the
// rows [offsets[j], min(offsets[j] + counts[j], capacity)): a prefix of its list. The published
// views describe exactly the kept rows (moePublishLayout).

// Block-shared workspace of the layout for a CTA of kThreads (every local expert: at most
// kMoeMaxLocalExperts, kItems per thread in the scan).
template <int kThreads>
struct MoeLayoutScratch {
  static constexpr int kItems = (kMoeMaxLocalExperts + kThreads - 1) / kThreads;
  using Scan = cub::BlockScan<std::int32_t, kThreads>;
  using Reduce = cub::BlockReduce<std::int32_t, kThreads>;
  union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  };
};

// A count message copied to shared memory (the latency receive's), read as it is; a plain pointer
// is a message in global memory, written by a peer or another kernel and read through L2.
struct MoeSharedMsg {
  const std::uint64_t* words;
};
// (A plain pointer must address global memory: a copy in shared memory goes as MoeSharedMsg.)
__device__ __forceinline__ std::uint64_t moeMsgWord(const std::uint64_t* msg, int i) { return __ldcg(msg + i); }
__device__ __forceinline__ std::uint64_t moeMsgWord(MoeSharedMsg msg, int i) { return msg.words[i]; }

// The unroll of a loop over ranks that reads count messages of type M (what msg(q) returns): a
// copy in shared memory, rolled (its reads are cheap, and every copy of the body is code that a
// cold SM fetches); a message in global memory, 4 at a time (their loads go out together, as
// the compiler's own unroll had them on the direct path).
template <class M>
inline constexpr int kMoeRankUnroll = std::is_same_v<M, MoeSharedMsg> ? 1 : 4;

// A count message's words hold their count in the low 32 bits (the latency path tags the high 32
// with the step: moeTaggedCount); i = 0 is the source's records, 1 + j its rows for local expert j.
template <class M>
__device__ __forceinline__ std::int32_t moeCountOf(M msg, int i) {
  return static_cast<std::int32_t>(static_cast<std::uint32_t>(moeMsgWord(msg, i)));
}

// The records of source q's message, at most maxTokens (a source sends one per token).
template <class M>
__device__ __forceinline__ std::int32_t moeMsgRecords(const MoeParams& p, M msg) {
  const std::uint32_t rows = static_cast<std::uint32_t>(moeMsgWord(msg, 0));
  return static_cast<std::int32_t>(rows < static_cast<std::uint32_t>(p.shape.maxTokens) ? rows : p.shape.maxTokens);
}

// The tag of step s's count words: s + 1 with the high bit set, so that no step's tag is 0, the
// high half of a word never written (the heap starts zeroed; counters may start at 2^32 - 1, whose
// s + 1 is 0), and the words of step s - 2 (same parity) never carry it.
__host__ __device__ __forceinline__ std::uint32_t moeCountTag(std::uint32_t step) { return (step + 1u) | 0x80000000u; }

// A tagged count word: the count with moeCountTag(step) in the high half, stored whole
// (stRelaxedSys64), so that a reader that sees the tag sees the count (no fence, no flag).
__host__ __device__ __forceinline__ std::uint64_t moeTaggedCount(std::uint32_t step, std::int64_t count) {
  return static_cast<std::uint64_t>(moeCountTag(step)) << 32 | static_cast<std::uint32_t>(count);
}

// Every thread of one CTA of kThreads: counts[j] (rows routed to local expert j from every
// source) and offsets[j] (its first row: the exclusive prefix sum of the aligned counts; offsets[L]
// the end, before any clamping to the capacity), both block-shared. Ends with the CTA synchronised.
// kBatched: whether the layout is batched (p.layout.rowsPerExpert > 0), known to a caller built for
// one layout (1 or 0: the other branch's code is not compiled in), or -1: read from p.
template <int kThreads, class Msg, int kBatched = -1>
__device__ void moeComputeOffsets(const MoeParams& p, Msg msg, std::int32_t* counts, std::int32_t* offsets,
                                  MoeLayoutScratch<kThreads>& scratch) {
  constexpr int kItems = MoeLayoutScratch<kThreads>::kItems;
  const int tid = static_cast<int>(threadIdx.x), L = p.shape.localExperts;
  const bool batched = kBatched < 0 ? p.layout.rowsPerExpert > 0 : kBatched != 0;
  if (batched) {  // batched: expert j's block starts at j x rowsPerExpert, whatever arrives
    for (int j = tid; j <= L; j += kThreads) {
      if (j < L) {
        std::int32_t c = 0;
#pragma unroll kMoeRankUnroll<decltype(msg(0))>
        for (int q = 0; q < p.shape.numRanks; ++q) c += moeCountOf(msg(q), 1 + j);
        counts[j] = c;
      }
      offsets[j] = static_cast<std::int32_t>(static_cast<long long>(j) * p.layout.rowsPerExpert);
    }
  } else {
    std::int32_t aligned[kItems];
#pragma unroll
    for (int i = 0; i < kItems; ++i) {  // blocked: thread t holds experts t * kItems + i
      const int j = tid * kItems + i;
      std::int32_t c = 0;
      if (j < L) {
#pragma unroll kMoeRankUnroll<decltype(msg(0))>
        for (int q = 0; q < p.shape.numRanks; ++q) c += moeCountOf(msg(q), 1 + j);
        counts[j] = c;
      }
      aligned[i] = (c + p.layout.alignment - 1) / p.layout.alignment * p.layout.alignment;
    }
    std::int32_t total = 0;
    typename MoeLayoutScratch<kThreads>::Scan(scratch.scan).ExclusiveSum(aligned, aligned, total);
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int j = tid * kItems + i;
      if (j < L) offsets[j] = aligned[i];
    }
    if (tid == 0) offsets[L] = total;
  }
  __syncthreads();
}

// The first row of source q's rows for each local expert j, into base[j] (shared or global; all
// threads of the CTA, no synchronisation): offsets[j] plus the rows of the sources before q.
template <int kThreads, class Msg>
__device__ void moeSourceBases(const MoeParams& p, Msg msg, const std::int32_t* offsets, int q, std::int32_t* base) {
  for (int j = static_cast<int>(threadIdx.x); j < p.shape.localExperts; j += kThreads) {
    std::int32_t b = offsets[j];
#pragma unroll kMoeRankUnroll<decltype(msg(0))>
    for (int r = 0; r < q; ++r) b += moeCountOf(msg(r), 1 + j);
    base[j] = b;
  }
}

// srcBase[q * L + j] (shared or global) for every source q, from moeComputeOffsets' offsets. Ends
// with the CTA synchronised.
template <int kThreads, class Msg>
__device__ void moeComputeSourceBases(const MoeParams& p, Msg msg, const std::int32_t* offsets, std::int32_t* srcBase) {
  for (int j = static_cast<int>(threadIdx.x); j < p.shape.localExperts; j += kThreads) {
    std::int32_t base = offsets[j];
#pragma unroll kMoeRankUnroll<decltype(msg(0))>
    for (int q = 0; q < p.shape.numRanks; ++q) {
      srcBase[q * p.shape.localExperts + j] = base;
      base += moeCountOf(msg(q), 1 + j);
    }
  }
  __syncthreads();
}

// moeComputeOffsets, then moeComputeSourceBases. Ends with the CTA synchronised.
template <int kThreads, class Msg>
__device__ void moeComputeLayout(const MoeParams& p, Msg msg, std::int32_t* counts, std::int32_t* offsets,
                                 std::int32_t* srcBase, MoeLayoutScratch<kThreads>& scratch) {
  moeComputeOffsets<kThreads>(p, msg, counts, offsets, scratch);
  moeComputeSourceBases<kThreads>(p, msg, offsets, srcBase);
}

// One CTA of kThreads (all its threads): the layout views a user reads, from moeComputeLayout's
// arrays. They describe only rows that exist: expertOffsets[j] = min(offsets[j], capacity),
// expertCounts[j] = the rows of expert j kept (offsets + counts never pass the capacity),
// expertDropped[j] = the rest, numRecvRows = the rows kept. Also the engine's own views: rows per
// source, per-(source, expert) bases (copied to p.layout.sourceBase unless srcBase is p.layout.sourceBase) and the
// cumulative per-expert totals of rows routed (kept or dropped).
template <int kThreads, class Msg>
__device__ void moePublishLayout(const MoeParams& p, Msg msg, const std::int32_t* counts, const std::int32_t* offsets,
                                 const std::int32_t* srcBase, MoeLayoutScratch<kThreads>& scratch) {
  const int tid = static_cast<int>(threadIdx.x), L = p.shape.localExperts;
  const long long cap = p.layout.capacity;
  std::int32_t keptHere = 0;
  if (p.layout.rankMajor) {
    // Rows are records (at most maxTokens per source: nothing is dropped); the per-expert views
    // count entries, packed: what a grouped GEMM that gathers rows sizes itself by.
    for (int j = tid; j <= L; j += kThreads) {
      p.layout.expertOffsets[j] = offsets[j];
      if (j == L) continue;
      p.layout.expertCounts[j] = counts[j];
      p.layout.expertDropped[j] = 0;
      p.layout.expertTotals[j] += static_cast<unsigned long long>(counts[j]);
      if (p.layout.recvStats != nullptr) p.layout.recvStats[j] += counts[j];
    }
    if (srcBase != p.layout.sourceBase) {
      for (int n = tid; n < p.shape.numRanks * L; n += kThreads) p.layout.sourceBase[n] = srcBase[n];
    }
    if (tid == 0) {
      std::int32_t row = 0;
#pragma unroll kMoeRankUnroll<decltype(msg(0))>
      for (int q = 0; q < p.shape.numRanks; ++q) {
        const std::int32_t n = moeMsgRecords(p, msg(q));
        p.layout.sourceRecords[q] = n;
        p.layout.rankOffsets[q] = row;
        row += n;
      }
      p.layout.rankOffsets[p.shape.numRanks] = row;
      *p.layout.numRecvRows = row;
    }
    return;
  }
  for (int j = tid; j <= L; j += kThreads) {
    const long long first = offsets[j] < cap ? offsets[j] : cap;
    p.layout.expertOffsets[j] = static_cast<std::int32_t>(first);
    if (j == L) continue;
    const long long room = p.layout.rowsPerExpert > 0 ? p.layout.rowsPerExpert : cap - first;  // batched: its block
    const std::int32_t kept = static_cast<std::int32_t>(counts[j] < room ? counts[j] : room);
    p.layout.expertCounts[j] = kept;
    p.layout.expertDropped[j] = counts[j] - kept;
    p.layout.expertTotals[j] += static_cast<unsigned long long>(counts[j]);
    if (p.layout.recvStats != nullptr) p.layout.recvStats[j] += counts[j];
    keptHere += kept;
    if (p.layout.expertSourceRanges != nullptr) {
      // Each source's rows of expert j: from srcBase (the sources' rows follow each other), the
      // kept part only.
#pragma unroll kMoeRankUnroll<decltype(msg(0))>
      for (int q = 0; q < p.shape.numRanks; ++q) {
        const long long begin = srcBase[q * L + j] - offsets[j];
        const long long sent = moeCountOf(msg(q), 1 + j);
        const long long n = begin >= kept ? 0 : (kept - begin < sent ? kept - begin : sent);
        p.layout.expertSourceRanges[static_cast<std::uint64_t>(j) * p.shape.numRanks + q] = (begin << 32) | n;
      }
    }
  }
  if (srcBase != p.layout.sourceBase) {
    for (int n = tid; n < p.shape.numRanks * L; n += kThreads) p.layout.sourceBase[n] = srcBase[n];
  }
  for (int q = tid; q < p.shape.numRanks; q += kThreads) {
    // A source sends at most maxTokens records (one per token); its count is trusted to that bound.
    p.layout.sourceRecords[q] = moeMsgRecords(p, msg(q));
  }
  const std::int32_t kept = typename MoeLayoutScratch<kThreads>::Reduce(scratch.reduce).Sum(keptHere);
  if (tid == 0) *p.layout.numRecvRows = kept;
}

// Rank-major: the first row of source s's records (the rows of the sources before it), from the
// count messages (msg(q)[0]: records from q, at most maxTokens). Every thread may call it.
template <class Msg>
__device__ inline long long moeRankBase(const MoeParams& p, Msg msg, int s) {
  long long base = 0;
#pragma unroll kMoeRankUnroll<decltype(msg(0))>
  for (int q = 0; q < s; ++q) base += moeMsgRecords(p, msg(q));
  return base;
}

// --- Record-level steps shared by the throughput and latency paths ------------------------------
//
// Each step is done by a group of threads of one CTA (MoeGroup: a whole CTA, or a named-barrier
// slice of it so that a CTA works on several records at once). Every thread of the group calls the
// step; rows move as 16-byte vectors, kMoeUnroll loads in flight per thread before any store.

inline constexpr int kMoeUnroll = 8;

struct MoeGroup {
  int tid;       // thread within the group
  int nthreads;  // threads in the group, a multiple of 32
  int barrier;   // named barrier of the group (0 with the whole CTA; unused by a one-warp group)
  __device__ __forceinline__ void sync() const {
    if (nthreads == 32) {
      __syncwarp();  // a one-warp group (always a whole, aligned warp): a CTA has more warps than named barriers
    } else {
      asm volatile("bar.sync %0, %1;" ::"r"(barrier), "r"(nthreads) : "memory");
    }
  }
};

// This thread's group of kMoeGroupThreads in `ctas` CTAs (this one the cta-th) working on items
// (records, tokens) one per group at a time: the group's index in its CTA, its first item and the
// stride over items. A kernel whose CTAs split into parts (kernels/moe/latency.cu) slices each
// part; the others slice the grid. `ctasFirst`: item n goes to group n / ctas of CTA n % ctas, so
// that items fewer than the groups spread over every CTA (SM) before any CTA takes a second (the
// latency kernels: 128 records on 64 CTAs of 4 groups went to the first 32 CTAs); else to CTA
// n / perCta, group n % perCta. `threads`: a group's threads (a multiple of 32 dividing the CTA's).
// Group g's named barrier is 1 + g: a slice of another size than the kernel's barrier groups only
// splits work (its sync() would meet another count at the same barrier; combineReceive's wide
// sums).
struct MoeGroupSlice {
  int group, first, stride;
  MoeGroup g;
};
__device__ __forceinline__ MoeGroupSlice moeGroupSlice(int cta, int ctas, bool ctasFirst = false, int threads = kMoeGroupThreads) {
  const int tid = static_cast<int>(threadIdx.x), group = tid / threads;
  const int perCta = static_cast<int>(blockDim.x) / threads;
  return MoeGroupSlice{group, ctasFirst ? group * ctas + cta : cta * perCta + group, ctas * perCta,
                       MoeGroup{tid % threads, threads, 1 + group}};
}
__device__ __forceinline__ MoeGroupSlice moeGroupSlice() {
  return moeGroupSlice(static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x));
}

// A record's slots resolved to recv_x rows, in slot order (deterministic sums); one per group, in
// shared memory.
struct MoeSlotStage {
  long long row[kMoeMaxTopK];
  float weight[kMoeMaxTopK];
  std::int32_t n;
  std::int32_t token;
};

__device__ __forceinline__ const MoeRecordHeader* moeRecordHeader(const MoeParams& p, const char* rec) {
  return reinterpret_cast<const MoeRecordHeader*>(rec + p.shape.payloadBytes);
}
__device__ __forceinline__ const MoeRecordSlot* moeRecordSlots(const MoeParams& p, const char* rec) {
  return reinterpret_cast<const MoeRecordSlot*>(rec + p.shape.payloadBytes + sizeof(MoeRecordHeader));
}

// One bf16 row of H values quantised to its wire tiles: each aligned eighth of a warp quantises
// one 128-value tile (Fp8TileWide: 16-byte stores), half of kMoeUnroll at a time (the same bytes
// in flight as a 16-lane tile's kMoeUnroll), and writes it to each of the n rows out[d].
__device__ inline void moeQuantizeRow(const MoeParams& p, const char* row, char* const* out, int n, const MoeGroup& g) {
  constexpr int kLanes = Fp8TileWide::kLanes, kUnroll = kMoeUnroll / 2;
  const int tiles = p.shape.hidden / kFp8TileValues, lane = g.tid % kLanes, step = g.nthreads / kLanes;
  const bool pow2 = p.input.scaleFormat != kMoeScaleFloat;
  for (int t0 = g.tid / kLanes; t0 < tiles; t0 += step * kUnroll) {
    uint4 raw[kUnroll][2];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int tile = t0 + u * step;
      if (tile < tiles) {
        const auto* at = reinterpret_cast<const uint4*>(row + static_cast<std::uint64_t>(tile) * kFp8TileSrcBytes + lane * 32);
        raw[u][0] = at[0];
        raw[u][1] = at[1];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int tile = t0 + u * step;
      if (tile >= tiles) break;  // uniform across the tile's 8 lanes (their shuffles stay converged)
      const Fp8TileWide q = Fp8TileWide::quantize(raw[u][0], raw[u][1], pow2);
      for (int d = 0; d < n; ++d) q.emit(out[d] + static_cast<std::uint64_t>(tile) * kFp8TileWireBytes, lane);
    }
  }
}

// The destination "rank" of a hop record (MoeNodeParams): every routed slot, global expert ids.
inline constexpr int kMoeHopRecord = -1;

// The metadata of token t's record in each of the n destinations dst[d] (rank dstRank[d]): the
// header, and one slot per top-k entry whose expert lives on that rank, in slot order (a hop
// record, dstRank kMoeHopRecord: every routed slot, with its global expert id). A whole warp
// calls it, lane k < topK holding slot k's expert id (-1 or out of range: none) and weight.
// entryIndex(k): slot k's index within its expert's rows from this rank.
template <class EntryIndex>
__device__ inline void moeWriteRecordMeta(const MoeParams& p, int t, char* const* dst, const int* dstRank, int n,
                                          EntryIndex entryIndex, long long id, float w, int k) {
  const bool valid = k < p.shape.topK && moeValidId(p, id);
  const std::int32_t index = valid ? entryIndex(k) : 0;
  for (int d = 0; d < n; ++d) {
    const bool hop = dstRank[d] == kMoeHopRecord;
    const bool here = valid && (hop || id / p.shape.localExperts == dstRank[d]);
    const unsigned m = __ballot_sync(0xffffffffu, here);
    if (here) {
      auto* slots = reinterpret_cast<MoeRecordSlot*>(dst[d] + p.shape.payloadBytes + sizeof(MoeRecordHeader));
      const long long expert = hop ? id : id % p.shape.localExperts;
      slots[__popc(m & ((1u << k) - 1u))] = MoeRecordSlot{static_cast<std::int32_t>(expert), index, w, k};
    }
    if (k == 0) *reinterpret_cast<MoeRecordHeader*>(dst[d] + p.shape.payloadBytes) = MoeRecordHeader{t, __popc(m), {0, 0}};
  }
}

// Token t's caller-quantised row (input.xIsFp8): its e4m3 bytes in x, and its scales in xScales,
// tile j's at [j * input.scaleHiddenStride] from the second pointer.
__device__ __forceinline__ const char* moeCallerFp8Row(const MoeParams& p, int t) {
  return static_cast<const char*>(p.input.x) + static_cast<std::uint64_t>(t) * p.shape.hidden;
}
__device__ __forceinline__ const float* moeCallerFp8Scales(const MoeParams& p, int t) {
  return p.input.xScales + static_cast<std::int64_t>(t) * p.input.scaleTokenStride;
}

// That row read as its wire tiles (per tile of 128 values: its 128 bytes in 8 pieces, then a
// piece of its scale and 12 zero bytes): piece n of 16 bytes.
__device__ __forceinline__ uint4 moeCallerFp8Piece(const MoeParams& p, int t, int n) {
  const int tile = n / 9, part = n % 9;
  if (part < 8) {
    return *(reinterpret_cast<const uint4*>(moeCallerFp8Row(p, t) + static_cast<std::uint64_t>(tile) * kFp8TileValues) +
             part);
  }
  const float s = moeCallerFp8Scales(p, t)[static_cast<std::int64_t>(tile) * p.input.scaleHiddenStride];
  return make_uint4(__float_as_uint(s), 0, 0, 0);
}
static_assert(kFp8TileWireBytes == 9 * 16, "a wire tile is 8 pieces of e4m3 bytes and one of its scale");

// Writes token t's record to each of the n destinations dst[d] (rank dstRank[d]; local or peers'
// memory): the row is read once (bf16 copied, quantised once to fp8 tiles by the produce hook, or
// the caller's e4m3 bytes and scales read as wire tiles) and stored to every destination, with the
// metadata of the slots whose experts live on that rank. Only the first nPayload destinations get
// the row (the others, the metadata alone). `wire`: the row already in its record form
// (payloadBytes, e.g. quantised beforehand), copied as it is. entryIndex(k): slot k's index within
// its expert's rows from this rank.
template <class EntryIndex>
__device__ inline void moeWriteRecords(const MoeParams& p, int t, char* const* dst, const int* dstRank,
                                       int n, EntryIndex entryIndex, const MoeGroup& g, int nPayload,
                                       const char* wire = nullptr) {
  const std::uint64_t H = static_cast<std::uint64_t>(p.shape.hidden);
  const char* row = static_cast<const char*>(p.input.x) + static_cast<std::uint64_t>(t) * H * 2;
  // The first warp's lanes k < topK read slot k's id and weight before the row's loads are issued.
  const int k = g.tid;
  const std::uint64_t e = static_cast<std::uint64_t>(t) * p.shape.topK + (k < p.shape.topK ? k : 0);
  const long long id = k < p.shape.topK ? moeReadId(p, e) : -1;
  const float w = k < p.shape.topK ? moeWeightOf(p, e) : 0.f;
  const bool callerFp8 = p.input.xIsFp8 && wire == nullptr;  // read as wire tiles (moeCallerFp8Piece)
  if (nPayload > 0 && p.shape.fp8 && wire == nullptr && !p.input.xIsFp8) {
    moeQuantizeRow(p, row, dst, nPayload, g);
  } else if (nPayload > 0) {
    const auto* src = reinterpret_cast<const uint4*>(wire != nullptr ? wire : row);
    const int vecs = static_cast<int>((wire != nullptr || callerFp8 ? p.shape.payloadBytes : H * 2) / 16);
    for (int c0 = g.tid; c0 < vecs; c0 += g.nthreads * kMoeUnroll) {
      uint4 v[kMoeUnroll];
#pragma unroll
      for (int u = 0; u < kMoeUnroll; ++u) {
        const int c = c0 + u * g.nthreads;
        if (c < vecs) v[u] = callerFp8 ? moeCallerFp8Piece(p, t, c) : src[c];
      }
      for (int d = 0; d < nPayload; ++d) {
        auto* out = reinterpret_cast<uint4*>(dst[d]);
#pragma unroll
        for (int u = 0; u < kMoeUnroll; ++u) {
          if (c0 + u * g.nthreads < vecs) out[c0 + u * g.nthreads] = v[u];
        }
      }
    }
  }
  if (g.tid < 32) moeWriteRecordMeta(p, t, dst, dstRank, n, entryIndex, id, w, k);
}

// The recv_x row of a record's slot: srcBase[local expert] + its index, or -1 past the capacity
// (batched: past its expert's block; or for a slot graphep did not write).
__device__ __forceinline__ long long moeSlotRow(const MoeParams& p, const std::int32_t* srcBase,
                                                const MoeRecordSlot& slot) {
  if (slot.localExpert < 0 || slot.localExpert >= p.shape.localExperts) return -1;
  const long long pos = static_cast<long long>(srcBase[slot.localExpert]) + slot.index;
  const long long end = p.layout.rowsPerExpert > 0 ? (slot.localExpert + 1ll) * p.layout.rowsPerExpert : p.layout.capacity;
  return pos >= 0 && pos < end ? pos : -1;
}

// Rank-major: whether row `rankRow` exists for this operation: a dispatch writes rows below
// layout.outputRows (the caller's outputs or the capacity; a row past it is dropped and counted), a combine
// reads rows below combine.expertOutputRows (the rows of its input; a row past it adds nothing, counted). Lane 0
// counts.
__device__ __forceinline__ bool moeRankRowExists(const MoeParams& p, long long rankRow, bool expand, int lane) {
  const bool ok = rankRow < (expand ? p.layout.outputRows : p.combine.expertOutputRows);
  if (!ok && lane == 0) {
    if (expand) {
      moeReportDroppedRow(p, rankRow);
    } else {
      moeReportMissingRow(p, rankRow);
    }
  }
  return ok;
}

// Rank-major: top-k slot k of row `row`, its local expert (-1: not on this rank) and weight (0 then).
__device__ __forceinline__ void moeStoreRowSlot(const MoeParams& p, long long row, int k, int expert, float weight) {
  const std::uint64_t n = static_cast<std::uint64_t>(row) * p.shape.topK + k;
  if (p.layout.rowExperts64) {
    static_cast<long long*>(p.layout.rowExperts)[n] = expert;
  } else {
    static_cast<std::int32_t*>(p.layout.rowExperts)[n] = expert;
  }
  p.layout.rowExpertWeights[n] = weight;
}

// Rank-major (rankRow >= 0): a record's one row. `stage` gets it with weight 1 (the payload goes
// there; combine's partial is y there, the experts having summed the row's slots), or nothing when
// the row does not exist (moeRankRowExists, checked by the caller); with `expand` the row's
// metadata: source, token, rowTopkSlot -1, rowWeight 0 (lane 0). The first warp calls it.
__device__ inline void moeStageRankRow(const MoeParams& p, long long rankRow, bool exists, int s, int t, bool expand,
                                       MoeSlotStage& stage, int lane) {
  if (lane != 0) return;
  stage.token = t;
  if (!exists) {
    stage.n = 0;
    return;
  }
  if (expand) {
    p.layout.rowSrcRank[rankRow] = s;
    p.layout.rowSrcToken[rankRow] = t;
    p.layout.rowTopkSlot[rankRow] = -1;
    p.layout.rowWeight[rankRow] = 0.f;
  }
  stage.n = 1;
  stage.row[0] = rankRow;
  stage.weight[0] = 1.f;
}

// The top-k weights a reduce takes instead of the dispatch's (none: `at` null): fp32 [topK] (the
// caller's, as they are), or the latency combine's tagged words [topK] (`tagged`: each weight's
// bits in the low half of a u64 whose high half is the step's tag, moeTaggedCount), read with a
// strong load once a wait saw every tag (the words hold no other step's weights until this one's
// partials have arrived).
struct MoeSlotWeights {
  const void* at = nullptr;
  bool tagged = false;
  __device__ MoeSlotWeights(const float* weights = nullptr) : at(weights) {}  // a plain fp32 pointer converts
  __device__ static MoeSlotWeights taggedWords(const std::uint64_t* words) {
    MoeSlotWeights w;
    w.at = words;
    w.tagged = true;
    return w;
  }
  __device__ bool given() const { return at != nullptr; }
  __device__ float load(int k) const {
    return tagged ? __uint_as_float(static_cast<std::uint32_t>(ptx::ldRelaxedSys64(static_cast<const std::uint64_t*>(at) + k)))
                  : __ldcg(static_cast<const float*>(at) + k);
  }
};

// A received record's header `h` and lane `lane`'s slot ({-1, ...} past the record's slots), read
// through L2 (another CTA or GPU wrote it), with lane k's top-k weight from `weights` (when given)
// into `laneWeight`: the loads go out together. Lanes below topK load a slot.
__device__ __forceinline__ MoeRecordSlot moeLoadLaneSlot(const MoeParams& p, const char* rec, int lane, int4& h,
                                                         MoeSlotWeights weights = {}, float* laneWeight = nullptr) {
  h = __ldcg(reinterpret_cast<const int4*>(moeRecordHeader(p, rec)));
  int4 v = make_int4(-1, 0, 0, 0);
  if (lane < p.shape.topK) {
    v = __ldcg(reinterpret_cast<const int4*>(moeRecordSlots(p, rec)) + lane);
    if (weights.given()) *laneWeight = weights.load(lane);
  }
  MoeRecordSlot slot{-1, 0, 0.f, 0};
  if (lane < (h.y < p.shape.topK ? h.y : p.shape.topK)) slot = MoeRecordSlot{v.x, v.y, __int_as_float(v.z), v.w};
  return slot;
}

// Resolves a received record's slots into `stage` (rows past the capacity left out). With
// `expand`, also writes each row's metadata and counts the dropped rows. Rank-major (rankRow >= 0):
// the record's one row, and with `expand` each top-k slot's local expert (-1: not here) and weight
// in rowExperts / rowExpertWeights. The record was written by another CTA or GPU: read through L2.
// Synchronises the group before and after.
__device__ inline void moeResolveSlots(const MoeParams& p, int s, const char* rec, const std::int32_t* srcBase,
                                       MoeSlotStage& stage, bool expand, const MoeGroup& g, long long rankRow = -1,
                                       MoeSlotWeights slotWeights = {}) {
  g.sync();  // the previous user of `stage` is done
  if (g.tid < 32) {  // topK <= 16: the group's first warp, one lane per slot
    // The header, every slot and every top-k weight at once (a record has room for topK slots;
    // lane k loads weight k, and each slot takes its own from lane slot.k: no round trip after the
    // slots').
    int4 h;
    float laneWeight = 0.f;
    const MoeRecordSlot slot = moeLoadLaneSlot(p, rec, g.tid, h, slotWeights, &laneWeight);
    const int nslots = h.y < p.shape.topK ? h.y : p.shape.topK;
    const bool knownK = slot.k >= 0 && slot.k < p.shape.topK;
    const float slotWeight = __shfl_sync(0xffffffffu, laneWeight, knownK ? slot.k : 0);  // every lane of the warp
    if (rankRow >= 0) {
      const bool exists = moeRankRowExists(p, rankRow, expand, g.tid);
      if (expand && exists) {  // every slot -1, then the record's (compacted) slots at their top-k positions
        if (g.tid < p.shape.topK) moeStoreRowSlot(p, rankRow, g.tid, -1, 0.f);
        __syncwarp();
        if (g.tid < nslots && slot.k >= 0 && slot.k < p.shape.topK && slot.localExpert >= 0 &&
            slot.localExpert < p.shape.localExperts) {
          moeStoreRowSlot(p, rankRow, slot.k, slot.localExpert, slot.weight);
        }
      }
      moeStageRankRow(p, rankRow, exists, s, h.x, expand, stage, g.tid);
      __syncwarp();
    } else {
    long long pos = g.tid < nslots ? moeSlotRow(p, srcBase, slot) : -1;
    if (!expand && pos >= p.combine.expertOutputRows) {  // combine: the caller's expert outputs end before this row
      moeReportMissingRow(p, pos);
      pos = -1;
    }
    const unsigned kept = __ballot_sync(0xffffffffu, pos >= 0);
    if (pos >= 0) {
      const int at = __popc(kept & ((1u << g.tid) - 1u));
      stage.row[at] = pos;
      stage.weight[at] = !slotWeights.given() ? slot.weight : knownK ? slotWeight : 0.f;
      if (expand) {
        p.layout.rowSrcRank[pos] = s;
        p.layout.rowSrcToken[pos] = h.x;
        p.layout.rowTopkSlot[pos] = slot.k;
        p.layout.rowWeight[pos] = slot.weight;
      }
    } else if (expand && g.tid < nslots && slot.localExpert >= 0 && slot.localExpert < p.shape.localExperts) {
      moeReportDroppedRow(p, static_cast<long long>(srcBase[slot.localExpert]) + slot.index);
    }
    if (g.tid == 0) {
      stage.n = __popc(kept);
      stage.token = h.x;
    }
    }
  }
  g.sync();
}

// This rank's own token t (its record index i in its own list), resolved from the routing instead
// of a received record: `stage` gets its slots' recv_x rows (rows past the capacity dropped and
// counted), each row's metadata is written, and the record's metadata (header and slots, as
// moeWriteRecords writes them) goes to `rec` for the combine. Synchronises the group before and
// after.
__device__ inline void moeResolveOwnSlots(const MoeParams& p, int t, char* rec, const std::int32_t* srcBase,
                                          MoeSlotStage& stage, const MoeGroup& g, long long rankRow = -1) {
  g.sync();  // the previous user of `stage` is done
  if (g.tid < 32) {  // topK <= 16: the group's first warp, one lane per slot
    const int k = g.tid, L = p.shape.localExperts;
    const std::uint64_t e = static_cast<std::uint64_t>(t) * p.shape.topK + (k < p.shape.topK ? k : 0);
    const long long id = k < p.shape.topK ? moeReadId(p, e) : -1;
    const bool here = k < p.shape.topK && moeValidId(p, id) && id / L == p.shape.rank;  // invalid ids: counted by route
    const MoeRecordSlot slot{here ? static_cast<std::int32_t>(id % L) : -1, here ? p.routing.entryIndex[e] : 0,
                             here ? moeWeightOf(p, e) : 0.f, k};
    const unsigned m = __ballot_sync(0xffffffffu, here);
    if (here) {
      reinterpret_cast<MoeRecordSlot*>(rec + p.shape.payloadBytes + sizeof(MoeRecordHeader))[__popc(m & ((1u << k) - 1u))] = slot;
    }
    if (k == 0) *reinterpret_cast<MoeRecordHeader*>(rec + p.shape.payloadBytes) = MoeRecordHeader{t, __popc(m), {0, 0}};
    if (rankRow >= 0) {  // rank-major: the token's one row, each slot's local expert (-1: not here)
      const bool exists = moeRankRowExists(p, rankRow, true, k);
      if (exists && k < p.shape.topK) moeStoreRowSlot(p, rankRow, k, slot.localExpert, slot.weight);
      moeStageRankRow(p, rankRow, exists, p.shape.rank, t, true, stage, k);
    } else {
    const long long pos = here ? moeSlotRow(p, srcBase, slot) : -1;
    const unsigned kept = __ballot_sync(0xffffffffu, pos >= 0);
    if (pos >= 0) {
      const int at = __popc(kept & ((1u << k) - 1u));
      stage.row[at] = pos;
      stage.weight[at] = slot.weight;
      p.layout.rowSrcRank[pos] = p.shape.rank;
      p.layout.rowSrcToken[pos] = t;
      p.layout.rowTopkSlot[pos] = k;
      p.layout.rowWeight[pos] = slot.weight;
    } else if (here) {
      moeReportDroppedRow(p, static_cast<long long>(srcBase[slot.localExpert]) + slot.index);
    }
    if (k == 0) {
      stage.n = __popc(kept);
      stage.token = t;
    }
    }
  }
  g.sync();
}

// Scale n of recv_scales: fp32, or with kMoeScaleUe8m0 the power of two's biased exponent in byte n
// (DeepEP's packed UE8M0: four per int32 word, value 4w + i in byte i).
__device__ __forceinline__ void moeStoreScale(const MoeParams& p, std::uint64_t n, float scale) {
  if (p.input.scaleFormat == kMoeScaleUe8m0) {
    reinterpret_cast<std::uint8_t*>(p.layout.recvScales)[n] = static_cast<std::uint8_t>(__float_as_uint(scale) >> 23);
  } else {
    p.layout.recvScales[n] = scale;
  }
}

// Copies one row into recv_x at each row of `stage`, which resolve() fills (called once, after
// the first loads are issued: they do not depend on it). The row is a record's payload (bf16, or
// fp8 wire tiles: e4m3 bytes into recv_x, the scale into recv_scales), or with `fromX` a row of x:
// bf16 (quantised here by the produce hook for fp8), or with `xScales` the caller's e4m3 bytes
// (input.xIsFp8) and xScales[tile * input.scaleHiddenStride] their scales.
template <class Resolve>
__device__ inline void moeExpandRow(const MoeParams& p, const char* row, bool fromX, Resolve resolve,
                                    const MoeSlotStage& stage, const MoeGroup& g,
                                    const float* xScales = nullptr) {
  const std::uint64_t H = static_cast<std::uint64_t>(p.shape.hidden);
  // Each pass loads kMoeUnroll pieces per thread, then stores them to every row.
  if (p.shape.fp8) {
    // A tile per aligned eighth of a warp (Fp8TileWide: 16-byte loads and stores), half of
    // kMoeUnroll tiles at a time: the same bytes in flight as the bf16 rows' pass below.
    constexpr int kLanes = Fp8TileWide::kLanes, kUnroll = kMoeUnroll / 2;
    const int tiles = static_cast<int>(H / kFp8TileValues), lane = g.tid % kLanes, step = g.nthreads / kLanes;
    Fp8TileWide w[kUnroll];
    auto load = [&](int t0) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int tile = t0 + u * step;
        if (tile >= tiles) break;  // uniform across the tile's 8 lanes (the quantiser's shuffles)
        if (fromX && xScales != nullptr) {
          w[u].q = *reinterpret_cast<const uint4*>(row + static_cast<std::uint64_t>(tile) * kFp8TileValues + lane * 16);
          w[u].scale = xScales[static_cast<std::int64_t>(tile) * p.input.scaleHiddenStride];
        } else if (fromX) {
          const auto* at = reinterpret_cast<const uint4*>(row + static_cast<std::uint64_t>(tile) * kFp8TileSrcBytes + lane * 32);
          w[u] = Fp8TileWide::quantize(at[0], at[1], p.input.scaleFormat != kMoeScaleFloat);
        } else {
          w[u] = Fp8TileWide::load(row + static_cast<std::uint64_t>(tile) * kFp8TileWireBytes, lane);
        }
      }
    };
    int t0 = g.tid / kLanes;
    load(t0);
    resolve();
    const int n = stage.n;
    while (t0 < tiles) {
      for (int d = 0; d < n; ++d) {
        const std::uint64_t r = static_cast<std::uint64_t>(stage.row[d]);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int tile = t0 + u * step;
          if (tile >= tiles) break;
          *reinterpret_cast<uint4*>(p.layout.recvX + r * H + static_cast<std::uint64_t>(tile) * kFp8TileValues + lane * 16) = w[u].q;
          if (lane == 0) moeStoreScale(p, r * (H / kFp8TileValues) + tile, w[u].scale);
        }
      }
      t0 += step * kUnroll;
      if (t0 < tiles) load(t0);
    }
  } else {
    const auto* src = reinterpret_cast<const uint4*>(row);
    const int vecs = static_cast<int>(H / 8);
    uint4 v[kMoeUnroll];
    auto load = [&](int c0) {
#pragma unroll
      for (int u = 0; u < kMoeUnroll; ++u) {
        if (c0 + u * g.nthreads < vecs) v[u] = __ldcg(src + c0 + u * g.nthreads);
      }
    };
    int c0 = g.tid;
    load(c0);
    resolve();
    const int n = stage.n;
    while (c0 < vecs) {
      for (int d = 0; d < n; ++d) {
        auto* out = reinterpret_cast<uint4*>(p.layout.recvX) + static_cast<std::uint64_t>(stage.row[d]) * vecs;
#pragma unroll
        for (int u = 0; u < kMoeUnroll; ++u) {
          if (c0 + u * g.nthreads < vecs) out[c0 + u * g.nthreads] = v[u];
        }
      }
      c0 += g.nthreads * kMoeUnroll;
      if (c0 < vecs) load(c0);
    }
  }
}

// Copies a received record from source s into recv_x at each of its slots' rows (rows past the
// capacity are dropped and counted) with the per-row metadata. srcBase: [E_local] of source s.
// Rank-major (rankRow >= 0): its one row at rankRow.
__device__ inline void moeExpandRecord(const MoeParams& p, int s, const char* rec, const std::int32_t* srcBase,
                                       MoeSlotStage& stage, const MoeGroup& g, long long rankRow = -1) {
  moeExpandRow(
      p, rec, false,
      [&] { moeResolveSlots(p, s, rec, srcBase, stage, true, g, rankRow); }, stage, g);
}

// This rank's own token t (index i in its own list) into recv_x straight from x (bf16, or the
// caller's e4m3 bytes and scales with input.xIsFp8), or from `wire` (its row already quantised to
// fp8 wire tiles), with no record: moeResolveOwnSlots writes the record's metadata to `rec` for
// the combine.
__device__ inline void moeExpandOwnToken(const MoeParams& p, int t, char* rec, const std::int32_t* srcBase,
                                         MoeSlotStage& stage, const MoeGroup& g, const char* wire = nullptr,
                                         long long rankRow = -1) {
  const bool callerFp8 = wire == nullptr && p.input.xIsFp8;
  const char* row = wire != nullptr ? wire
                    : callerFp8     ? moeCallerFp8Row(p, t)
                                    : static_cast<const char*>(p.input.x) + static_cast<std::uint64_t>(t) * p.shape.hidden * 2;
  const float* scales = callerFp8 ? moeCallerFp8Scales(p, t) : nullptr;
  moeExpandRow(p, row, wire == nullptr, [&] { moeResolveOwnSlots(p, t, rec, srcBase, stage, g, rankRow); }, stage, g,
               scales);
}

__device__ __forceinline__ void moeAddBf16x8(float (&acc)[8], uint4 v, float w) {
  const auto* h = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
  for (int k = 0; k < 8; ++k) acc[k] = __fmaf_rn(w, __bfloat162float(h[k]), acc[k]);
}

__device__ __forceinline__ uint4 moeToBf16x8(const float (&acc)[8]) {
  uint4 v;
  auto* h = reinterpret_cast<__nv_bfloat16*>(&v);
#pragma unroll
  for (int k = 0; k < 8; ++k) h[k] = __float2bfloat16_rn(acc[k]);
  return v;
}

// Adds kS sources' kU vectors (weights w) into acc: every load issued before the first add.
// Past the row a lane's sum is not stored; kZeroPast: it sums zeros there (for whole-warp
// stores; as ptxas allocates, this keeps the latency combine off the stack and costs the
// movers' final kernel registers, so each path picks its form).
template <int kS, int kU, bool kZeroPast, class Src, class Weight>
__device__ __forceinline__ void moeAccumulate(float (&acc)[kU][8], int i, int c0, int stride, int vecs, Src src,
                                              Weight weight) {
  uint4 v[kS][kU];
#pragma unroll
  for (int j = 0; j < kS; ++j) {
    const uint4* a = src(i + j);
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if (kZeroPast) {
        v[j][u] = c0 + u * stride < vecs ? __ldcg(a + c0 + u * stride) : make_uint4(0u, 0u, 0u, 0u);
      } else if (c0 + u * stride < vecs) {
        v[j][u] = __ldcg(a + c0 + u * stride);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kS; ++j) {
    const float w = weight(i + j);
#pragma unroll
    for (int u = 0; u < kU; ++u) moeAddBf16x8(acc[u], v[j][u], w);
  }
}

// The sum over i < n of weight(i) * src(i) (rows of H bf16 values), fp32 in source order, as
// bf16: store(c, v, valid) for vector c (8 values) of the row, called by every lane of a warp whose
// 32 vectors hold one of the row (`valid`: c is in the row), so that a store may work by whole
// warps (the latency combine's 128-byte lines, kernels/moe/lines.cuh). Two sources' kU vectors in
// flight per thread (four spill registers at 512 threads per CTA, measured slower). kWholeWarps:
// the store works by whole warps (moeAccumulate's kZeroPast).
template <bool kWholeWarps = false, class Src, class Weight, class Store>
__device__ inline void moeWeightedSumTo(const MoeParams& p, int n, Src src, Weight weight, const MoeGroup& g, Store store) {
  constexpr int kU = kMoeUnroll / 2;
  const int vecs = p.shape.hidden / 8, lane = g.tid % 32;  // a group is whole warps
  for (int c0 = g.tid; c0 - lane < vecs; c0 += g.nthreads * kU) {
    float acc[kU][8];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[u][k] = 0.f;
    }
    int i = 0;
    for (; i + 1 < n; i += 2) moeAccumulate<2, kU, kWholeWarps>(acc, i, c0, g.nthreads, vecs, src, weight);
    if (i < n) moeAccumulate<1, kU, kWholeWarps>(acc, i, c0, g.nthreads, vecs, src, weight);
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int c = c0 + u * g.nthreads;
      if (c - lane < vecs) store(c, moeToBf16x8(acc[u]), c < vecs);
    }
  }
}
// out = the weighted sum above, vector by vector.
template <class Src, class Weight>
__device__ inline void moeWeightedSum(const MoeParams& p, int n, Src src, Weight weight, uint4* out,
                                      const MoeGroup& g) {
  moeWeightedSumTo(p, n, src, weight, g, [&](int c, uint4 v, bool valid) {
    if (valid) out[c] = v;
  });
}

// The combine partial of a received record from source s: sum over its slots of weight * y[row]
// in fp32, as bf16 through store (moeWeightedSumTo). Dropped rows add 0. Rank-major (rankRow >= 0):
// the partial is y[rankRow] as it is (the experts summed the row's slots).
template <bool kWholeWarps = false, class Store>
__device__ inline void moeReduceRecordTo(const MoeParams& p, const char* rec, const std::int32_t* srcBase, MoeSlotStage& stage,
                                         const MoeGroup& g, long long rankRow, MoeSlotWeights slotWeights, Store store) {
  moeResolveSlots(p, -1, rec, srcBase, stage, false, g, rankRow, slotWeights);
  const std::uint64_t vecs = static_cast<std::uint64_t>(p.shape.hidden) / 8;
  const auto* y = reinterpret_cast<const uint4*>(p.combine.expertOutput);
  moeWeightedSumTo<kWholeWarps>(
      p, stage.n, [&](int i) { return y + static_cast<std::uint64_t>(stage.row[i]) * vecs; },
      [&](int i) { return stage.weight[i]; }, g, store);
}
// The partial written as bf16 to `out` (H values; local or the source's memory).
__device__ inline void moeReduceRecord(const MoeParams& p, const char* rec, const std::int32_t* srcBase,
                                       char* out, MoeSlotStage& stage, const MoeGroup& g, long long rankRow = -1,
                                       MoeSlotWeights slotWeights = {}) {
  auto* o = reinterpret_cast<uint4*>(out);
  moeReduceRecordTo(p, rec, srcBase, stage, g, rankRow, slotWeights, [&](int c, uint4 v, bool valid) {
    if (valid) o[c] = v;
  });
}

// out[t] = sum over destination ranks r of the partial partial(r) (nullptr: none), fp32 in rank
// order, bf16 out. `parts`: the group's shared scratch of kMaxRanks pointers.
template <class Partial>
__device__ inline void moeFinalToken(const MoeParams& p, int t, Partial partial, const uint4** parts,
                                     const MoeGroup& g) {
  g.sync();  // the previous token's readers of `parts` are done
  if (g.tid == 0) {
    int n = 0;
    for (int r = 0; r < p.shape.numRanks; ++r) {
      const char* part = partial(r);
      if (part != nullptr) parts[n++] = reinterpret_cast<const uint4*>(part);
    }
    for (int r = n; r < p.shape.numRanks; ++r) parts[r] = nullptr;
  }
  g.sync();
  int n = 0;
  while (n < p.shape.numRanks && parts[n] != nullptr) ++n;
  const std::uint64_t vecs = static_cast<std::uint64_t>(p.shape.hidden) / 8;
  moeWeightedSum(
      p, n, [&](int i) { return parts[i]; }, [](int) { return 1.0f; },
      reinterpret_cast<uint4*>(p.combine.out) + static_cast<std::uint64_t>(t) * vecs, g);
}

}  // namespace graphep
