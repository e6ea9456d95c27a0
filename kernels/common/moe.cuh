// Device helpers shared by the MoE kernel families (kernels/moe_*.cu): reading routing entries and
// recording bad input in the status word (MoeDeviceStatus, kernels/moe.h).
#pragma once

#include <cstdint>
#include <cstdio>

#include "kernels/moe.h"

namespace graphep {

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

// A received row whose place is past the capacity: counted (strict mode traps).
__device__ inline void moeReportDroppedRow(const MoeParams& p, long long pos) {
  atomicAdd(&p.status->droppedRows, 1ull);
  if (p.strict) {
    printf("graphep: rank %d: received row %lld is past the capacity of %lld rows (strict mode)\n",
           p.rank, pos, static_cast<long long>(p.capacity));
    __trap();
  }
}

}  // namespace graphep
