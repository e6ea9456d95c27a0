// Produce / consume hooks of the data movers (docs/DESIGN.md §4). A transfer in a *tiled* wire format
// moves tiles: the sender's produce hook reads one tile of the source and returns registers that
// the pipe writes to the wire (a staging slot); the receiver's consume hook takes the registers
// the pipe read from the wire and writes the destination. Both get one HookCtx. A tile is handled
// by kThreads consecutive threads of a role (lane = thread index within the tile's group).
//
// The byte format (Wire::kBytes: plain copies, element-wise reductions, weighted accumulation) is
// the degenerate case and runs on the vectorised byte paths of pipe.cuh; its consume hooks are
// selected by Consume (consumeChunk in pipe.cuh, reduceElems in copy.cuh). Wire::kFp8E4m3 is the tiled format shipped here:
//   produce  ProduceFp8E4m3: 128 bf16 -> 128 e4m3 bytes + one fp32 scale (amax / 448)
//   consume  ConsumeWire (keep the record), ConsumeFp8ToBf16 (dequantise to 128 bf16)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>

#include "kernels/common/pipe.h"

namespace graphep {

struct HookCtx {
  std::int32_t peer;      // the other end of the link
  std::uint32_t channel;  // the CTA's channel (block) on the link
  std::uint32_t step;     // the chunk's monotonic step
  std::uint64_t tile;     // tile index within the link's transfer
  int lane;               // thread within the tile's group, [0, kThreads)
  const char* src;        // produce: the link's source (tile t at src + t * source tile bytes)
  char* dst;              // consume: the link's destination (tile t at dst + t * its tile bytes)
};

// bf16 -> fp8 e4m3 with one fp32 scale per 128 values. Wire record per tile (kFp8Tile* in pipe.h):
// 128 e4m3 bytes, then the scale, then 12 zero bytes. scale = max(amax, kFp8MinAmax) / 448 (1 when
// the tile is all zeros); q = e4m3(x * (1 / scale)) rounded to nearest even, saturating. The floor
// keeps 1 / scale finite: without it a tile whose amax is below 448 x 2^-126 (bf16 subnormals)
// would get an infinite inverse, and its zeros would become NaN (0 x inf).
struct ProduceFp8E4m3 {
  static constexpr int kThreads = 16;  // 8 values per thread
  struct Regs {
    uint2 q;      // this lane's 8 e4m3 values
    float scale;  // the tile's scale (every lane holds it)
  };
  __device__ __forceinline__ static Regs produce(const HookCtx& ctx) {
    return quantize(*reinterpret_cast<const uint4*>(ctx.src + ctx.tile * kFp8TileSrcBytes +
                                                    static_cast<std::uint64_t>(ctx.lane) * 16));
  }
  // The lane's 8 bf16 values of a tile (16 bytes, already loaded) -> e4m3 + the tile's scale.
  // pow2: the scale rounded up to a power of two (DeepEP's round_scale; q stays within e4m3's range).
  __device__ __forceinline__ static Regs quantize(const uint4 raw, bool pow2 = false) {
    const uint4 pieces[1] = {raw};
    float v[8];
    Regs r;
    r.scale = laneScale<kThreads, 8>(pieces, v, pow2);
    const float inv = 1.0f / r.scale;
    r.q = make_uint2(pack4(v, inv), pack4(v + 4, inv));
    return r;
  }
  // One lane's share of a tile handled by kLanes lanes (an aligned kLanes-th of the warp, every
  // lane taking part): its N bf16 values (raw: N / 8 pieces of 16 bytes) as floats into v, and
  // the tile's scale from the amax over the tile's lanes (pow2: rounded up to a power of two).
  template <int kLanes, int N>
  __device__ __forceinline__ static float laneScale(const uint4 (&raw)[N / 8], float (&v)[N], bool pow2) {
    static_assert(kLanes * N == kFp8TileValues && kLanes < 32, "a tile's lanes hold its 128 values");
    const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(raw);
    float amax = 0.f;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      v[k] = __bfloat162float(h[k]);
      amax = fmaxf(amax, fabsf(v[k]));
    }
    const unsigned mask = ((1u << kLanes) - 1u) << (threadIdx.x & (32u - kLanes));
#pragma unroll
    for (int o = kLanes / 2; o >= 1; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(mask, amax, o, kLanes));
    return pow2 ? fp8ScalePow2(fp8Scale(amax)) : fp8Scale(amax);
  }
  // v[0, 4) x inv as e4m3 bytes, the first in the low byte.
  __device__ __forceinline__ static unsigned pack4(const float* v, float inv) {
    return fp8E4m3(v[0] * inv) | (fp8E4m3(v[1] * inv) << 8) | (fp8E4m3(v[2] * inv) << 16) |
           (static_cast<unsigned>(fp8E4m3(v[3] * inv)) << 24);
  }
  // Writes the lane's part of the record (the wire tile).
  __device__ __forceinline__ static void emit(char* wire, int lane, const Regs& r) {
    *reinterpret_cast<uint2*>(wire + lane * 8) = r.q;
    if (lane == 0) {
      *reinterpret_cast<uint4*>(wire + kFp8TileValues) = make_uint4(__float_as_uint(r.scale), 0, 0, 0);
    }
  }
  static constexpr float kFp8MinAmax = 0x1.cp-118f;  // 448 x 2^-126: scale >= 2^-126, 1 / scale <= 2^126
  __host__ __device__ static float fp8Scale(float amax) {
    return amax > 0.f ? (amax > kFp8MinAmax ? amax : kFp8MinAmax) / 448.f : 1.f;
  }
  // A positive normal scale rounded up to the next power of two (itself when it is one).
  __host__ __device__ static float fp8ScalePow2(float scale) {
    std::uint32_t b = 0;
    memcpy(&b, &scale, 4);
    if ((b & 0x7fffffu) != 0u) b = (b & 0xff800000u) + 0x800000u;
    float r = 0.f;
    memcpy(&r, &b, 4);
    return r;
  }
  __host__ __device__ static unsigned char fp8E4m3(float x) {
    return static_cast<unsigned char>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
  }
};

// Reads the lane's part of an fp8 record from the wire (ld.global.cg: a peer wrote it).
struct Fp8WireRegs {
  uint2 q;
  float scale;
};
__device__ __forceinline__ Fp8WireRegs loadFp8Wire(const char* wire, int lane) {
  Fp8WireRegs r;
  r.q = __ldcg(reinterpret_cast<const uint2*>(wire + lane * 8));
  r.scale = __ldcg(reinterpret_cast<const float*>(wire + kFp8TileValues));
  return r;
}

// The same tiles handled by 8 lanes, 16 values each (16-byte loads and stores, three shuffles):
// the same scale and bytes as ProduceFp8E4m3 and loadFp8Wire, in the same wire record, with half
// the stores to a peer (the MoE records' writers and readers, kernels/moe/common.cuh). The 8 lanes
// of a tile are an aligned eighth of a warp, and all of them take part.
struct Fp8TileWide {
  static constexpr int kLanes = 8;
  uint4 q;      // this lane's 16 e4m3 values (tile bytes [lane x 16, lane x 16 + 16))
  float scale;  // the tile's scale (every lane holds it)

  // The lane's 16 bf16 values of a tile (32 bytes, already loaded: lo then hi).
  __device__ __forceinline__ static Fp8TileWide quantize(const uint4 lo, const uint4 hi, bool pow2) {
    const uint4 raw[2] = {lo, hi};
    float v[16];
    Fp8TileWide r;
    r.scale = ProduceFp8E4m3::laneScale<kLanes, 16>(raw, v, pow2);
    const float inv = 1.0f / r.scale;
    r.q = make_uint4(ProduceFp8E4m3::pack4(v, inv), ProduceFp8E4m3::pack4(v + 4, inv),
                     ProduceFp8E4m3::pack4(v + 8, inv), ProduceFp8E4m3::pack4(v + 12, inv));
    return r;
  }
  // Writes the lane's part of the wire record (lane 0 also the scale and its zeros).
  __device__ __forceinline__ void emit(char* wire, int lane) const {
    *reinterpret_cast<uint4*>(wire + lane * 16) = q;
    if (lane == 0) *reinterpret_cast<uint4*>(wire + kFp8TileValues) = make_uint4(__float_as_uint(scale), 0, 0, 0);
  }
  // Reads the lane's part of a wire record (ld.global.cg: a peer wrote it).
  __device__ __forceinline__ static Fp8TileWide load(const char* wire, int lane) {
    Fp8TileWide r;
    r.q = __ldcg(reinterpret_cast<const uint4*>(wire + lane * 16));
    r.scale = __ldcg(reinterpret_cast<const float*>(wire + kFp8TileValues));
    return r;
  }
};

// Keeps the fp8 record as received (the destination holds Fp8 records, kFp8TileWireBytes each).
struct ConsumeWire {
  static constexpr int kThreads = ProduceFp8E4m3::kThreads;
  __device__ __forceinline__ static void consume(const HookCtx& ctx, const Fp8WireRegs& r) {
    char* d = ctx.dst + ctx.tile * kFp8TileWireBytes;
    *reinterpret_cast<uint2*>(d + ctx.lane * 8) = r.q;
    if (ctx.lane == 0) {
      *reinterpret_cast<uint4*>(d + kFp8TileValues) = make_uint4(__float_as_uint(r.scale), 0, 0, 0);
    }
  }
};

// Dequantises to bf16: x = bf16(float(q) * scale).
struct ConsumeFp8ToBf16 {
  static constexpr int kThreads = ProduceFp8E4m3::kThreads;
  __host__ __device__ static __nv_bfloat16 dequant(unsigned char q, float scale) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(q), __NV_E4M3);
    return __float2bfloat16_rn(__half2float(__half(h)) * scale);
  }
  __device__ __forceinline__ static void consume(const HookCtx& ctx, const Fp8WireRegs& r) {
    uint4 out;
    __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&out);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const unsigned word = k < 4 ? r.q.x : r.q.y;
      o[k] = dequant(static_cast<unsigned char>(word >> (8 * (k & 3))), r.scale);
    }
    *reinterpret_cast<uint4*>(ctx.dst + ctx.tile * kFp8TileSrcBytes +
                              static_cast<std::uint64_t>(ctx.lane) * 16) = out;
  }
};

}  // namespace graphep
