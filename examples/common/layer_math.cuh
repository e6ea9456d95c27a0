// The arithmetic of the example MoE layer that must give the same bits wherever it runs: the
// deterministic values (weights, the tokens of each decode step) and the router (scores, top-k,
// softmax weights). The ranks' graphs, the unsharded one-GPU layer and the reference all call these
// functions, so every token meets the same weights and goes to the same experts with the same
// weights in all three.
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

namespace graphep::example {

using bf16 = __nv_bfloat16;

constexpr int kMaxTopK = 16;
constexpr int kMaxRouterExperts = 1024;  // topkSoftmax: 32 experts per lane of one warp

// The layer's shape; the defaults are Qwen3-30B-A3B's MoE layer at a decode batch.
struct LayerShape {
  int hidden = 2048;       // H
  int ffn = 768;           // F: each expert's intermediate size (gate and up are F wide each)
  int numExperts = 128;    // E
  int topK = 8;            // K
  int tokensPerRank = 64;  // T: one rank's decode batch
  int numRanks = 2;        // R
  int numTokens() const { return tokensPerRank * numRanks; }
};

// The tensor a deterministic value belongs to.
enum class Tensor : std::uint64_t { kRouter = 1, kGateUp = 2, kDown = 3, kToken = 4 };

// A uniform value in [-1, 1) from a 64-bit key (multiply-xorshift mixing).
__host__ __device__ inline float hashUniform(std::uint64_t key) {
  key ^= key >> 33;
  key *= 0xff51afd7ed558ccdull;
  key ^= key >> 33;
  key *= 0xc4ceb9fe1a85ec53ull;
  key ^= key >> 33;
  return static_cast<float>(key >> 40) / static_cast<float>(1ull << 23) - 1.0f;
}

__host__ __device__ inline std::uint64_t valueKey(Tensor t, std::uint64_t a, std::uint64_t b, std::uint64_t c) {
  return (((static_cast<std::uint64_t>(t) * 1000003ull + a) * 1000033ull + b) * 1000037ull + c) * 0x9e3779b97f4a7c15ull;
}

// Element i of global expert e's matrix of `tensor` (the router is "expert" 0): uniform with
// variance 1 / fanIn, so activations keep their scale through the layer.
__device__ inline bf16 weightValue(Tensor tensor, std::uint64_t expert, std::uint64_t i, int fanIn) {
  return __float2bfloat16_rn(sqrtf(3.0f / static_cast<float>(fanIn)) * hashUniform(valueKey(tensor, expert, i, 0)));
}

// Element h of token t of rank r at decode step s: new tokens every step.
__device__ inline bf16 tokenValue(std::uint32_t step, int rank, int token, int h) {
  return __float2bfloat16_rn(
      hashUniform(valueKey(Tensor::kToken, step, static_cast<std::uint64_t>(rank) * 65536 + token, h)));
}

// Router score of expert e for the token row x (router weights [H, E]): four interleaved fp32
// accumulators over h, summed in a fixed order. H is a multiple of 4.
__device__ inline float routerScore(const bf16* x, const bf16* routerWeights, int H, int E, int e) {
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int h = 0; h < H; h += 4) {
    for (int i = 0; i < 4; ++i) {
      const float w = __bfloat162float(routerWeights[static_cast<std::size_t>(h + i) * E + e]);
      acc[i] = __fmaf_rn(__bfloat162float(x[h + i]), w, acc[i]);
    }
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// The K best of scores[0, E) (ties: the lower expert id) and their softmax weights (Qwen3's
// norm_topk_prob: softmax over all experts renormalised over the chosen ones, the same values).
// Warp 0 of the calling block does the work, lane e % 32 owning expert e; the caller synchronises
// the block before (scores complete) and after (ids and weights written). E <= kMaxRouterExperts.
__device__ inline void topkSoftmax(const float* scores, int E, int K, int* ids, float* weights) {
  if (threadIdx.x >= 32) return;
  const int lane = static_cast<int>(threadIdx.x);
  std::uint32_t taken = 0;  // bit i: expert lane + 32 i is chosen
  float chosen[kMaxTopK];
  for (int k = 0; k < K; ++k) {
    float best = -INFINITY;
    int bestId = E;  // E: none yet
    for (int e = lane, i = 0; e < E; e += 32, ++i) {
      if (!((taken >> i) & 1u) && (bestId == E || scores[e] > best)) {
        best = scores[e];
        bestId = e;
      }
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float otherBest = __shfl_xor_sync(0xffffffffu, best, offset);
      const int otherId = __shfl_xor_sync(0xffffffffu, bestId, offset);
      if (otherId != E && (bestId == E || otherBest > best || (otherBest == best && otherId < bestId))) {
        best = otherBest;
        bestId = otherId;
      }
    }
    if (bestId % 32 == lane) taken |= 1u << (bestId / 32);
    chosen[k] = best;
    if (lane == 0) ids[k] = bestId;
  }
  if (lane == 0) {
    float sum = 0.f;
    for (int k = 0; k < K; ++k) sum += expf(chosen[k] - chosen[0]);
    for (int k = 0; k < K; ++k) weights[k] = expf(chosen[k] - chosen[0]) / sum;
  }
}

// SwiGLU of one column: silu(gate) * up.
__host__ __device__ inline float swiglu(float gate, float up) { return gate / (1.0f + expf(-gate)) * up; }

}  // namespace graphep::example
