// 128-byte tagged lines: how the latency path's dispatch payload (kernels/moe/latency.cu) and its
// combine partials cross to a peer with no fence and no flag.
//
// A line is 8 pieces of 16 bytes, stored by 8 lanes of one warp instruction (st.volatile.v4) and
// loaded the same way, its last 8 bytes the step's tag (twice 4 bytes): a reader that sees a line's
// tag word takes the whole line as the writer's (NCCL's LL128 premise; docs/DESIGN.md, "128-byte
// lines": true on one GPU and over NVLink, which is why the latency path takes no PCIe peer).
//
// A chunk is what a warp holds: kRounds rounds of 32 lanes x 16 bytes (lane L's round-r share as
// piece 32 r + L, four lines a warp store, no shuffle), the last lane of each line (L % 8 == 7)
// storing only its share's first 8 bytes beside the tag; then a spill line (pieces 32 kRounds +
// 0..7, lanes 0-7): its piece k holds the cut halves of lanes 16 (k % 2) + 7 and 16 (k % 2) + 15 of
// round k / 2, and with kScales its piece 2 the four fp32 scales of lanes 0, 8, 16 and 24. Every
// piece is stored (zeros past a chunk's data): the reader checks every line's tag.
#pragma once

#include <cstdint>

#include "kernels/common/device_error.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/common/sync_handle.h"
#include "kernels/moe/moe.h"

namespace graphep {
namespace moe_lines {

constexpr unsigned kFullMask = 0xffffffffu;

// 16-byte pieces of a chunk of kRounds rounds: its rounds' and its spill line's.
template <int kRounds>
constexpr int kPieces = moeLinePieces(kRounds);
// Warp loads of a chunk: its rounds and its spill line.
template <int kRounds>
constexpr int kLoads = kRounds + 1;

__device__ __forceinline__ bool lineEnd(int lane) { return (lane & 7) == 7; }

// The spill line's piece `lane & 7` from the warp's shares v[kRounds] (every lane shuffles; the
// pieces past the cut halves and scales are zero).
template <int kRounds, bool kScales>
__device__ __forceinline__ uint4 spillPiece(const uint4 (&v)[kRounds], float scale, int lane) {
  static_assert(kRounds >= 1 && kRounds <= 2 && (!kScales || kRounds == 1), "a spill line holds 2 rounds' halves, or 1 round's and the scales");
  const int k = lane & 7, a = 16 * (k & 1) + 7;
  uint4 out = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
  for (int r = 0; r < kRounds; ++r) {
    const uint4 h = make_uint4(__shfl_sync(kFullMask, v[r].z, a), __shfl_sync(kFullMask, v[r].w, a),
                               __shfl_sync(kFullMask, v[r].z, a + 8), __shfl_sync(kFullMask, v[r].w, a + 8));
    if ((k >> 1) == r) out = h;
  }
  if (kScales) {
    const uint4 sc = make_uint4(__float_as_uint(__shfl_sync(kFullMask, scale, 0)), __float_as_uint(__shfl_sync(kFullMask, scale, 8)),
                                __float_as_uint(__shfl_sync(kFullMask, scale, 16)), __float_as_uint(__shfl_sync(kFullMask, scale, 24)));
    if (k == 2) out = sc;
  }
  return out;
}

// The warp's shares v as a chunk's lines at `cl`, carrying `tag` (every lane), with its spill
// piece made already (spillPiece: a share sent to several ranks shuffles once).
template <int kRounds>
__device__ __forceinline__ void storeLines(uint4* cl, int lane, const uint4 (&v)[kRounds], uint4 spill, std::uint32_t tag) {
#pragma unroll
  for (int r = 0; r < kRounds; ++r) {
    ptx::stVolatileV4(cl + 32 * r + lane, lineEnd(lane) ? make_uint4(v[r].x, v[r].y, tag, tag) : v[r]);
  }
  if (lane < 8) ptx::stVolatileV4(cl + 32 * kRounds + lane, lineEnd(lane) ? make_uint4(spill.x, spill.y, tag, tag) : spill);
}
// The same, the spill piece made here (and with kScales the scales in it).
template <int kRounds, bool kScales>
__device__ __forceinline__ void storeLines(uint4* cl, int lane, const uint4 (&v)[kRounds], float scale, std::uint32_t tag) {
  storeLines<kRounds>(cl, lane, v, spillPiece<kRounds, kScales>(v, scale, lane), tag);
}

// A chunk's pieces as a warp loads them: load r, piece 32 r + lane (the spill line's on lanes 0-7).
template <int kRounds>
__device__ __forceinline__ void loadLines(const uint4* cl, int lane, uint4 (&v)[kLoads<kRounds>]) {
#pragma unroll
  for (int r = 0; r < kLoads<kRounds>; ++r) {
    v[r] = r < kRounds || lane < 8 ? ptx::ldVolatileV4(cl + 32 * r + lane) : make_uint4(0u, 0u, 0u, 0u);
  }
}

// Whether every line of a chunk (as loaded) carries `tag`: the warp's answer.
template <int kRounds>
__device__ __forceinline__ bool linesLanded(const uint4 (&v)[kLoads<kRounds>], int lane, std::uint32_t tag) {
  bool ok = true;
#pragma unroll
  for (int r = 0; r < kLoads<kRounds>; ++r) {
    if ((r < kRounds || lane < 8) && lineEnd(lane)) ok = ok && v[r].z == tag && v[r].w == tag;
  }
  return __all_sync(kFullMask, ok);
}

// The high half of the first missing line's tag word (the warp's answer; `tag` when none is).
template <int kRounds>
__device__ __forceinline__ std::uint32_t missingTag(const uint4 (&v)[kLoads<kRounds>], int lane, std::uint32_t tag) {
  std::uint32_t seen = tag;
  bool found = false;
#pragma unroll
  for (int r = 0; r < kLoads<kRounds>; ++r) {  // no early return: v stays in registers
    const bool missing = (r < kRounds || lane < 8) && lineEnd(lane) && !(v[r].z == tag && v[r].w == tag);
    const unsigned m = __ballot_sync(kFullMask, missing);
    const std::uint32_t w = __shfl_sync(kFullMask, v[r].w, m != 0u ? __ffs(m) - 1 : 0);
    if (!found && m != 0u) seen = w;
    found = found || m != 0u;
  }
  return seen;
}

// Reloads a chunk's lines until every one carries `tag` (the warp together), bounded as
// boundedPoll: lane 0 keeps the time and reports the first missing line's tag word as observed, with `site`
// and the peer `src`. Out of line (its pieces in its own registers; the caller loads them again
// once all are there: they do not change before the slot's next step): called only for a chunk
// not all there at its first load. False: a line never came (recorded), or another wait of this
// rank failed.
template <int kRounds>
__device__ __noinline__ bool waitLines(const SyncHandle& h, const uint4* cl, int lane, std::uint32_t tag, int src, WaitSite site) {
  const std::uint64_t start = ptx::globalTimerNs();
  uint4 v[kLoads<kRounds>];
  for (std::uint32_t iter = 1;; ++iter) {
    loadLines<kRounds>(cl, lane, v);
    if (linesLanded<kRounds>(v, lane, tag)) return true;
    if ((iter & 255u) != 0u) continue;
    const std::uint32_t seen = missingTag<kRounds>(v, lane, tag);
    int verdict = 0;  // lane 0's: 1 timed out (reported), 2 another wait of this rank failed
    if (lane == 0) {
      const std::uint64_t elapsed = ptx::globalTimerNs() - start;
      if (elapsed > h.timeoutNs) {
        reportDeviceError(h.error, DeviceErrorKind::kTimeout, h.rank, src, site, tag, seen, elapsed, cl);
        if (h.trapOnTimeout) __trap();
        verdict = 1;
      } else if (deviceErrorRaised(h.error)) {
        verdict = 2;
      }
    }
    if (__shfl_sync(kFullMask, verdict, 0) != 0) return false;
  }
}

// Each lane's shares (and, kScales, its tile's scale: lane / 8) back from a chunk's landed pieces:
// a line's last lane takes its cut half from the spill line.
template <int kRounds, bool kScales>
__device__ __forceinline__ void takeLines(const uint4 (&v)[kLoads<kRounds>], int lane, uint4 (&out)[kRounds], float& scale) {
  const uint4& spill = v[kRounds];        // on lanes 0-7
  const bool high = (lane >> 3) & 1;      // which half of its spill piece a line's last lane takes
#pragma unroll
  for (int r = 0; r < kRounds; ++r) {
    const int k = 2 * r + (lane >> 4);
    const std::uint32_t x = __shfl_sync(kFullMask, spill.x, k), y = __shfl_sync(kFullMask, spill.y, k);
    const std::uint32_t z = __shfl_sync(kFullMask, spill.z, k), w = __shfl_sync(kFullMask, spill.w, k);
    out[r] = lineEnd(lane) ? make_uint4(v[r].x, v[r].y, high ? z : x, high ? w : y) : v[r];
  }
  if (kScales) {
    const std::uint32_t x = __shfl_sync(kFullMask, spill.x, 2), y = __shfl_sync(kFullMask, spill.y, 2);
    const std::uint32_t z = __shfl_sync(kFullMask, spill.z, 2), w = __shfl_sync(kFullMask, spill.w, 2);
    const int tile = lane >> 3;
    scale = __uint_as_float(tile == 0 ? x : tile == 1 ? y : tile == 2 ? z : w);
  }
}

// The warp's shares from a chunk's lines once every one carries `tag`: every piece loaded before
// any is checked (one round trip once they have landed), the chunk waited for whole if a line is
// missing. False: a line never came (recorded).
template <int kRounds, bool kScales>
__device__ __forceinline__ bool readLines(const SyncHandle& h, const uint4* cl, int lane, std::uint32_t tag, int src, WaitSite site,
                                          uint4 (&out)[kRounds], float& scale) {
  uint4 v[kLoads<kRounds>];
  loadLines<kRounds>(cl, lane, v);
  if (!linesLanded<kRounds>(v, lane, tag)) {
    if (!waitLines<kRounds>(h, cl, lane, tag, src, site)) return false;
    loadLines<kRounds>(cl, lane, v);
  }
  takeLines<kRounds, kScales>(v, lane, out, scale);
  return true;
}

}  // namespace moe_lines
}  // namespace graphep
