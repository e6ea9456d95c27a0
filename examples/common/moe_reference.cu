// The reference layer (moe_reference.cuh) and its tolerance.
//
// The tolerance. The layer under test (cuBLAS tensor-core GEMMs, graphep's combine) and this
// reference compute the same rounded quantities,
//
//   g, u = bf16(x . Wg[f]), bf16(x . Wu[f])    act_f = bf16(silu(g) u)    y_k = bf16(act . Wd[c])
//   out = bf16(sum_k w_k y_k)                  (the reference keeps out in fp32)
//
// from the same bf16 inputs and the same router (layer_math.cuh: same experts, same weights w_k),
// but their fp32 sums add in different orders. Products of bf16 values are exact in fp32, so two
// fp32 sums of the same n terms differ by at most about n * 2^-23 of the sum of |terms| (n * 2^-24
// for each side; doubled to cover tensor cores' truncating adds): slack(n) = n * 2^-22 below. After
// such sums, a rounding to bf16 (8 significant bits) gives either the same value on both sides or
// neighbours one ulp apart, at most 2^-7 of the value. Per output value c:
//
//   - y_kc's rounding:                          2^-7 |y_kc|
//   - y_kc's fp32 sum:                          slack(F) sum_f |act_f Wd_cf|
//   - act values that round to neighbours: act_f moves by at most
//       flip_f = 2^-7 (|act_f| + 2.1 |g_f u_f|)
//     (its own ulp; a gate ulp through |silu'| <= 1.1, an up ulp through |silu(g)| <= |g|). Such
//     flips are rare (two orders of these sums typically differ by ~2^-23 of the value, so a flip
//     needs a value that close to a rounding boundary) and of either sign, so their effect on y_kc
//     is bounded by the root sum of squares sqrt(sum_f (flip_f Wd_cf)^2): one standard deviation
//     if every term flipped, many more at the real rate.
//   - the combine's fp32 sum:                   slack(K) sum_k w_k |y_kc|
//   - out's rounding on the layer's side:       2^-7 |out_c|
//
//   tolerance_c = 2^-7 |out_c| + sum_k w_k (2^-7 |y_kc| + sqrt(sum_f (flip_f Wd_cf)^2)
//                                           + slack(F) sum_f |act_f Wd_cf| + slack(K) |y_kc|)
//
// That is about 6% of a typical |y_kc|; a float32 model of the two summation orders at the default
// shape stays below 0.08 of it. A bug moves values by more: a wrong or missing top-k slot by
// w_k |y_kc| (the model fails 60-80% of a token's values when one slot is dropped), a wrong row or
// expert by about |y_kc|. Small scale errors (a weight off by 10%) can pass.
#include "common/moe_reference.cuh"

#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>

namespace graphep::example {

namespace {

constexpr int kRefThreads = 256;
constexpr int kRefWarps = kRefThreads / 32;
constexpr float kUlp = 1.0f / 128.0f;  // one bf16 ulp relative to the value, at most: 2^-7
constexpr std::size_t kMaxStaticSmem = 48 * 1024;
constexpr int kMaxReported = 5;

__device__ inline float slack(int n) { return static_cast<float>(n) * (1.0f / 4194304.0f); }  // n * 2^-22

__device__ inline float warpSum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ inline float roundBf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

struct ReferenceParams {
  const bf16* routerWeights = nullptr;  // [H, E]
  const bf16* gateUp = nullptr;         // [E, 2F, H]
  const bf16* down = nullptr;           // [E, H, F]
  float* out = nullptr;                 // [R * T, H]
  float* tolerance = nullptr;           // [R * T, H]
  std::uint32_t step = 0;
  LayerShape shape;
};

}  // namespace

// Block i: token i of the layer (token i % T of rank i / T). Warps take the MLP's output rows in
// turn; lane 0 of the warp that owns output column c is the only writer of out[c] and tolerance[c].
// Shared memory: x [H] bf16, scores [E], act [F], flip [F] fp32.
__global__ void __launch_bounds__(kRefThreads) referenceKernel(const __grid_constant__ ReferenceParams p) {
  extern __shared__ float4 smem[];
  const int H = p.shape.hidden, F = p.shape.ffn, E = p.shape.numExperts, K = p.shape.topK;
  const int T = p.shape.tokensPerRank;
  auto* x = reinterpret_cast<bf16*>(smem);
  float* scores = reinterpret_cast<float*>(x + H);
  float* act = scores + E;
  float* flip = act + F;
  __shared__ int ids[kMaxTopK];
  __shared__ float weights[kMaxTopK];
  const int i = static_cast<int>(blockIdx.x);
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  float* out = p.out + static_cast<std::size_t>(i) * H;
  float* tolerance = p.tolerance + static_cast<std::size_t>(i) * H;
  for (int h = tid; h < H; h += kRefThreads) x[h] = tokenValue(p.step, i / T, i % T, h);
  for (int c = warp; c < H; c += kRefWarps) {
    if (lane == 0) out[c] = tolerance[c] = 0.f;
  }
  __syncthreads();
  for (int e = tid; e < E; e += kRefThreads) scores[e] = routerScore(x, p.routerWeights, H, E, e);
  __syncthreads();
  topkSoftmax(scores, E, K, ids, weights);
  __syncthreads();
  const auto* x2 = reinterpret_cast<const __nv_bfloat162*>(x);
  for (int k = 0; k < K; ++k) {
    const std::size_t expert = static_cast<std::size_t>(ids[k]);
    const float w = weights[k];
    // act and flip of one intermediate column per warp and step.
    for (int f = warp; f < F; f += kRefWarps) {
      const auto* gateRow = reinterpret_cast<const __nv_bfloat162*>(p.gateUp + (expert * 2 * F + f) * H);
      const auto* upRow = reinterpret_cast<const __nv_bfloat162*>(p.gateUp + (expert * 2 * F + F + f) * H);
      float g = 0.f, u = 0.f;
      for (int h2 = lane; h2 < H / 2; h2 += 32) {
        const float2 xv = __bfloat1622float2(x2[h2]);
        const float2 gv = __bfloat1622float2(gateRow[h2]);
        const float2 uv = __bfloat1622float2(upRow[h2]);
        g = __fmaf_rn(xv.y, gv.y, __fmaf_rn(xv.x, gv.x, g));
        u = __fmaf_rn(xv.y, uv.y, __fmaf_rn(xv.x, uv.x, u));
      }
      g = roundBf16(warpSum(g));
      u = roundBf16(warpSum(u));
      if (lane == 0) {
        const float a = roundBf16(swiglu(g, u));
        act[f] = a;
        flip[f] = kUlp * (fabsf(a) + 2.1f * fabsf(g * u));
      }
    }
    __syncthreads();
    // y of one output column per warp and step, and its share of the tolerance.
    for (int c = warp; c < H; c += kRefWarps) {
      const auto* downRow = reinterpret_cast<const __nv_bfloat162*>(p.down + (expert * H + c) * F);
      float y = 0.f, magnitude = 0.f, flips = 0.f;
      for (int f2 = lane; f2 < F / 2; f2 += 32) {
        const float2 d = __bfloat1622float2(downRow[f2]);
        const float t0 = act[2 * f2] * d.x, t1 = act[2 * f2 + 1] * d.y;
        const float s0 = flip[2 * f2] * d.x, s1 = flip[2 * f2 + 1] * d.y;
        y += t0 + t1;
        magnitude += fabsf(t0) + fabsf(t1);
        flips += s0 * s0 + s1 * s1;
      }
      y = roundBf16(warpSum(y));
      magnitude = warpSum(magnitude);
      flips = warpSum(flips);
      if (lane == 0) {
        out[c] += w * y;
        tolerance[c] += w * (kUlp * fabsf(y) + sqrtf(flips) + slack(F) * magnitude + slack(K) * fabsf(y));
      }
    }
    __syncthreads();  // act and flip are rewritten for the next expert
  }
  for (int c = warp; c < H; c += kRefWarps) {
    if (lane == 0) tolerance[c] += kUlp * fabsf(out[c]);
  }
}

Reference::Reference(int device, const LayerShape& shape, const bf16* routerWeights, const bf16* gateUp,
                     const bf16* down)
    : device_(device),
      shape_(shape),
      routerWeights_(routerWeights),
      gateUp_(gateUp),
      down_(down),
      out_(device, static_cast<std::size_t>(shape.numTokens()) * shape.hidden),
      tolerance_(device, static_cast<std::size_t>(shape.numTokens()) * shape.hidden),
      hostOut_(out_.size()),
      hostTolerance_(tolerance_.size()) {}

void Reference::compute(std::uint32_t step) {
  const LayerShape& s = shape_;
  const std::size_t smem = static_cast<std::size_t>(s.hidden) * sizeof(bf16) +
                           (static_cast<std::size_t>(s.numExperts) + 2 * static_cast<std::size_t>(s.ffn)) * 4;
  if (smem > kMaxStaticSmem || s.ffn % 2 != 0) {
    throw std::invalid_argument("Reference: hidden=" + std::to_string(s.hidden) + ", ffn=" + std::to_string(s.ffn) +
                                " and " + std::to_string(s.numExperts) + " experts need " + std::to_string(smem) +
                                " bytes of shared memory (48 KiB at most) and an even ffn");
  }
  DeviceGuard guard(device_);
  ReferenceParams p;
  p.routerWeights = routerWeights_;
  p.gateUp = gateUp_;
  p.down = down_;
  p.out = out_.get();
  p.tolerance = tolerance_.get();
  p.step = step;
  p.shape = s;
  referenceKernel<<<static_cast<unsigned>(s.numTokens()), kRefThreads, smem>>>(p);
  GRAPHEP_EXAMPLE_CUDA_CHECK(cudaGetLastError());
  GRAPHEP_EXAMPLE_CUDA_CHECK(cudaMemcpy(hostOut_.data(), out_.get(), out_.bytes(), cudaMemcpyDeviceToHost));
  GRAPHEP_EXAMPLE_CUDA_CHECK(
      cudaMemcpy(hostTolerance_.data(), tolerance_.get(), tolerance_.bytes(), cudaMemcpyDeviceToHost));
  step_ = step;
}

void Reference::compare(const bf16* out, int outDevice, int firstToken, int numTokens, const char* what,
                        CheckStats& stats) const {
  const std::size_t H = static_cast<std::size_t>(shape_.hidden);
  std::vector<bf16> got(static_cast<std::size_t>(numTokens) * H);
  {
    DeviceGuard guard(outDevice);
    GRAPHEP_EXAMPLE_CUDA_CHECK(cudaMemcpy(got.data(), out, got.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
  }
  const std::size_t first = static_cast<std::size_t>(firstToken) * H;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double value = static_cast<double>(__bfloat162float(got[i]));
    const double expected = hostOut_[first + i], tolerance = hostTolerance_[first + i];
    const double error = std::fabs(value - expected);
    ++stats.checked;
    if (error <= tolerance) {
      stats.worstRatio = std::max(stats.worstRatio, error / tolerance);
      continue;
    }
    ++stats.wrong;
    stats.worstRatio = std::max(stats.worstRatio, std::isnan(error) ? INFINITY : error / tolerance);
    if (stats.reported < kMaxReported) {
      ++stats.reported;
      std::fprintf(stderr, "%s: step %u token %zu column %zu: %g, reference %g (tolerance %g)\n", what, step_,
                   static_cast<std::size_t>(firstToken) + i / H, i % H, value, expected, tolerance);
    }
  }
}

}  // namespace graphep::example
