// Device helpers shared by the MoE kernel families (kernels/moe_*.cu): reading routing entries and
// recording bad input in the status word (MoeDeviceStatus, kernels/moe.h).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cstdio>

#include "kernels/common/copy.cuh"
#include "kernels/common/hooks.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/moe.h"

namespace graphep {

// Stamps a kernel's span into the timeline when profiling (one per CTA, thread 0): the entry time
// on construction, the exit time on destruction (every return path).
class MoeStamp {
 public:
  __device__ MoeStamp(const MoeParams& p, MoeKernel k)
      : slot_(p.timeline != nullptr && threadIdx.x == 0 ? p.timeline + 2 * static_cast<int>(k) : nullptr) {
    if (slot_ != nullptr) atomicMin(slot_, static_cast<unsigned long long>(ptx::globalTimerNs()));
  }
  __device__ ~MoeStamp() {
    if (slot_ != nullptr) atomicMax(slot_ + 1, static_cast<unsigned long long>(ptx::globalTimerNs()));
  }
  MoeStamp(const MoeStamp&) = delete;
  MoeStamp& operator=(const MoeStamp&) = delete;

 private:
  unsigned long long* slot_;
};

// Expert id of flattened (token, k) entry n.
__device__ __forceinline__ long long moeReadId(const MoeParams& p, std::uint64_t n) {
  return p.int64Ids ? static_cast<const long long*>(p.topkIdx)[n]
                    : static_cast<long long>(static_cast<const int*>(p.topkIdx)[n]);
}

__device__ __forceinline__ bool moeValidId(const MoeParams& p, long long id) {
  return id >= 0 && id < p.numExperts;
}

// An id outside [-1, E): counted, the first one recorded; strict mode traps after counting.
__device__ inline void moeReportInvalidId(const MoeParams& p, long long id, int token, int slot) {
  atomicAdd(&p.status->invalidIds, 1ull);
  if (atomicCAS(&p.status->firstInvalidSet, 0, 1) == 0) {
    p.status->firstInvalidId = id;
    p.status->firstInvalidToken = token;
    p.status->firstInvalidSlot = slot;
  }
  if (p.strict) {
    printf("graphep: rank %d: topk_idx[%d][%d] = %lld is outside [-1, %d) (strict mode)\n", p.rank,
           token, slot, id, p.numExperts);
    __trap();
  }
}

// The live token count of a dispatch, clamped to [0, maxTokens]. The caller that passes `record`
// (one thread of the grid) publishes it to liveTokens and counts an out-of-range value (strict mode
// traps); every thread may call it for the value.
__device__ inline int moeLiveTokens(const MoeParams& p, bool record) {
  const int raw = *p.numTokens;
  const int T = raw < 0 ? 0 : (raw > p.maxTokens ? p.maxTokens : raw);
  if (record) {
    *p.liveTokens = T;
    if (raw != T) {
      atomicAdd(&p.status->clampedCounts, 1ull);
      if (atomicCAS(&p.status->firstClampedSet, 0u, 1u) == 0u) p.status->firstClampedCount = raw;
      if (p.strict) {
        printf("graphep: rank %d: live token count %d is outside [0, %d] (strict mode)\n", p.rank,
               raw, p.maxTokens);
        __trap();
      }
    }
  }
  return T;
}

// A received row whose place is past the capacity: counted (strict mode traps).
__device__ inline void moeReportDroppedRow(const MoeParams& p, long long pos) {
  atomicAdd(&p.status->droppedRows, 1ull);
  if (p.strict) {
    printf("graphep: rank %d: received row %lld is past the capacity of %lld rows (strict mode)\n",
           p.rank, pos, static_cast<long long>(p.capacity));
    __trap();
  }
}

// --- The receive layout, from the count messages (msg(q): [0] rows from source q, [1 + j] its
// rows for local expert j) ----------------------------------------------------------------------

// Expert counts and aligned offsets into block-shared arrays counts[E_local], offsets[E_local + 1];
// every thread of the block calls it (it synchronises the block).
template <class Msg>
__device__ inline void moeExpertOffsets(const MoeParams& p, Msg msg, std::int32_t* counts,
                                        std::int32_t* offsets, int tid, int nthreads) {
  for (int j = tid; j < p.localExperts; j += nthreads) {
    std::uint64_t total = 0;
    for (int q = 0; q < p.numRanks; ++q) total += msg(q)[1 + j];
    counts[j] = static_cast<std::int32_t>(total);
  }
  __syncthreads();
  if (tid == 0) {
    long long off = 0;
    for (int j = 0; j < p.localExperts; ++j) {
      offsets[j] = static_cast<std::int32_t>(off);
      off += (static_cast<long long>(counts[j]) + p.alignment - 1) / p.alignment * p.alignment;
    }
    offsets[p.localExperts] = static_cast<std::int32_t>(off);
  }
  __syncthreads();
}

// Writes the layout views (expert counts and offsets, received rows, cumulative totals, rows per
// source, per-(source, expert) bases) from the block-shared arrays of moeExpertOffsets; one block.
template <class Msg>
__device__ inline void moePublishLayout(const MoeParams& p, Msg msg, const std::int32_t* counts,
                                        const std::int32_t* offsets, int tid, int nthreads) {
  const int L = p.localExperts;
  for (int j = tid; j <= L; j += nthreads) {
    p.expertOffsets[j] = offsets[j];
    if (j == L) continue;
    p.expertCounts[j] = counts[j];
    p.expertTotals[j] += static_cast<unsigned long long>(counts[j]);
    long long base = offsets[j];
    for (int q = 0; q < p.numRanks; ++q) {
      p.srcBase[q * L + j] = static_cast<std::int32_t>(base);
      base += static_cast<long long>(msg(q)[1 + j]);
    }
  }
  for (int q = tid; q < p.numRanks; q += nthreads) {
    // A source sends at most maxTokens records (one per token); its count is trusted to that bound.
    const std::uint64_t rows = msg(q)[0];
    p.recvRows[q] = static_cast<std::int32_t>(rows < static_cast<std::uint64_t>(p.maxTokens) ? rows : p.maxTokens);
  }
  if (tid == 0) {
    long long rows = 0;
    for (int j = 0; j < L; ++j) rows += counts[j];
    *p.numRecvRows = static_cast<std::int32_t>(rows);
  }
}

// --- Record-level steps shared by the throughput and latency paths ------------------------------

__device__ __forceinline__ const MoeRecordHeader* moeRecordHeader(const MoeParams& p, const char* rec) {
  return reinterpret_cast<const MoeRecordHeader*>(rec + p.payloadBytes);
}
__device__ __forceinline__ const MoeRecordSlot* moeRecordSlots(const MoeParams& p, const char* rec) {
  return reinterpret_cast<const MoeRecordSlot*>(rec + p.payloadBytes + sizeof(MoeRecordHeader));
}

// Writes token t's record for destination rank r at `rec` (local or a peer's memory): the row
// (bf16, or fp8 tiles by the produce hook) and the metadata of the slots whose experts live on r.
// entryIdx[k]: slot k's index within its expert's rows from this rank. Every thread of the CTA
// (nthreads, a multiple of 16) takes part.
__device__ inline void moeWriteRecord(const MoeParams& p, char* rec, int t, int r,
                                      const std::int32_t* entryIdx, int tid, int nthreads) {
  const std::uint64_t rowBytes = static_cast<std::uint64_t>(p.hidden) * 2;
  const char* row = static_cast<const char*>(p.x) + static_cast<std::uint64_t>(t) * rowBytes;
  if (p.fp8) {
    // The produce hook: each aligned half-warp quantises one 128-value tile at a time.
    constexpr int kLanes = ProduceFp8E4m3::kThreads;
    const int tiles = p.hidden / static_cast<int>(kFp8TileValues);
    HookCtx ctx{r, blockIdx.x, 0, 0, tid % kLanes, row, nullptr};
    for (int tile = tid / kLanes; tile < tiles; tile += nthreads / kLanes) {
      ctx.tile = static_cast<std::uint64_t>(tile);
      ProduceFp8E4m3::emit(rec + static_cast<std::uint64_t>(tile) * kFp8TileWireBytes, ctx.lane,
                           ProduceFp8E4m3::produce(ctx));
    }
  } else {
    copyBytes<LoadKind::kDefault>(rec, row, rowBytes, tid, nthreads);
  }
  if (tid == 0) {
    auto* hdr = reinterpret_cast<MoeRecordHeader*>(rec + p.payloadBytes);
    auto* slots = reinterpret_cast<MoeRecordSlot*>(rec + p.payloadBytes + sizeof(MoeRecordHeader));
    int n = 0;
    for (int k = 0; k < p.topK; ++k) {
      const std::uint64_t e = static_cast<std::uint64_t>(t) * p.topK + k;
      const long long id = moeReadId(p, e);
      if (!moeValidId(p, id) || id / p.localExperts != r) continue;
      slots[n++] = MoeRecordSlot{static_cast<std::int32_t>(id % p.localExperts), entryIdx[k],
                                 p.topkWeights[e], k};
    }
    *hdr = MoeRecordHeader{t, n, {0, 0}};
  }
}

// The recv_x row of a record's slot: srcBase[local expert] + its index, or -1 past the capacity
// (or for a slot graphep did not write).
__device__ __forceinline__ long long moeSlotRow(const MoeParams& p, const std::int32_t* srcBase,
                                                const MoeRecordSlot& slot) {
  if (slot.localExpert < 0 || slot.localExpert >= p.localExperts) return -1;
  const long long pos = static_cast<long long>(srcBase[slot.localExpert]) + slot.index;
  return pos >= 0 && pos < p.capacity ? pos : -1;
}

// Copies a received record from source s into recv_x at each of its slots' rows (rows past the
// capacity are dropped and counted) with the per-row metadata. srcBase: [E_local] of source s.
__device__ inline void moeExpandRecord(const MoeParams& p, int s, const char* rec,
                                       const std::int32_t* srcBase, int tid, int nthreads) {
  const MoeRecordHeader* hdr = moeRecordHeader(p, rec);
  const MoeRecordSlot* slots = moeRecordSlots(p, rec);
  const int nslots = hdr->nslots < p.topK ? hdr->nslots : p.topK;
  const std::uint64_t H = static_cast<std::uint64_t>(p.hidden);
  for (int sl = 0; sl < nslots; ++sl) {
    const MoeRecordSlot slot = slots[sl];
    const long long pos = moeSlotRow(p, srcBase, slot);
    if (pos < 0) {
      if (tid == 0 && slot.localExpert >= 0 && slot.localExpert < p.localExperts) {
        moeReportDroppedRow(p, static_cast<long long>(srcBase[slot.localExpert]) + slot.index);
      }
      continue;
    }
    const std::uint64_t row = static_cast<std::uint64_t>(pos);
    if (p.fp8) {
      // Unpack the wire tiles: 128 e4m3 bytes into recv_x, the scale into recv_scales.
      constexpr int kLanes = ProduceFp8E4m3::kThreads;
      const int tiles = p.hidden / static_cast<int>(kFp8TileValues);
      const int lane = tid % kLanes;
      for (int tile = tid / kLanes; tile < tiles; tile += nthreads / kLanes) {
        const Fp8WireRegs w = loadFp8Wire(rec + static_cast<std::uint64_t>(tile) * kFp8TileWireBytes, lane);
        *reinterpret_cast<uint2*>(p.recvX + row * H + static_cast<std::uint64_t>(tile) * kFp8TileValues +
                                  lane * 8) = w.q;
        if (lane == 0) p.recvScales[row * (H / kFp8TileValues) + tile] = w.scale;
      }
    } else {
      copyBytes<LoadKind::kCacheGlobal>(p.recvX + row * H * 2, rec, H * 2, tid, nthreads);
    }
    if (tid == 0) {
      p.rowSrcRank[row] = s;
      p.rowSrcToken[row] = hdr->token;
      p.rowTopkSlot[row] = slot.k;
      p.rowWeight[row] = slot.weight;
    }
  }
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

// The combine partial of a received record from source s: sum over its slots of weight * y[row]
// in fp32, written as bf16 to `out` (H values; local or the source's memory). Dropped rows add 0.
__device__ inline void moeReduceRecord(const MoeParams& p, const char* rec, const std::int32_t* srcBase,
                                       char* out, int tid, int nthreads) {
  const MoeRecordHeader* hdr = moeRecordHeader(p, rec);
  const MoeRecordSlot* slots = moeRecordSlots(p, rec);
  const int nslots = hdr->nslots < p.topK ? hdr->nslots : p.topK;
  const std::uint64_t vecs = static_cast<std::uint64_t>(p.hidden) / 8;  // 16-byte vectors per row
  for (std::uint64_t c = static_cast<std::uint64_t>(tid); c < vecs; c += static_cast<std::uint64_t>(nthreads)) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int sl = 0; sl < nslots; ++sl) {
      const MoeRecordSlot slot = slots[sl];
      const long long pos = moeSlotRow(p, srcBase, slot);
      if (pos < 0) continue;  // dropped at dispatch (counted there)
      moeAddBf16x8(acc, reinterpret_cast<const uint4*>(p.y)[static_cast<std::uint64_t>(pos) * vecs + c], slot.weight);
    }
    reinterpret_cast<uint4*>(out)[c] = moeToBf16x8(acc);
  }
}

// out[t] = sum over destination ranks r of the partial partial(r) (nullptr: none), fp32, bf16 out.
template <class Partial>
__device__ inline void moeFinalToken(const MoeParams& p, int t, Partial partial, int tid, int nthreads) {
  const std::uint64_t vecs = static_cast<std::uint64_t>(p.hidden) / 8;
  auto* out = reinterpret_cast<uint4*>(p.out) + static_cast<std::uint64_t>(t) * vecs;
  for (std::uint64_t c = static_cast<std::uint64_t>(tid); c < vecs; c += static_cast<std::uint64_t>(nthreads)) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int r = 0; r < p.numRanks; ++r) {
      const char* part = partial(r);
      if (part == nullptr) continue;
      moeAddBf16x8(acc, __ldcg(reinterpret_cast<const uint4*>(part) + c), 1.0f);
    }
    out[c] = moeToBf16x8(acc);
  }
}

}  // namespace graphep
