// The layer's inputs: weight filling, the router (tokens, scores, top-k), the step counter. The
// launchers are below their kernels.
#include "common/layer_inputs.cuh"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/cuda_raii.hpp"

namespace graphep::example {

namespace {

constexpr int kFillThreads = 256;
constexpr int kRouterThreads = 256;
constexpr std::size_t kMaxStaticSmem = 48 * 1024;  // dynamic shared memory without an opt-in

}  // namespace

__global__ void fillWeightsKernel(bf16* w, std::size_t count, Tensor tensor, int firstExpert, std::size_t perExpert,
                                  int fanIn) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < count; i += stride) {
    w[i] = weightValue(tensor, firstExpert + i / perExpert, i % perExpert, fanIn);
  }
}

void fillWeights(bf16* w, std::size_t count, Tensor tensor, int firstExpert, std::size_t perExpert, int fanIn,
                 cudaStream_t stream) {
  if (perExpert == 0 || count % perExpert != 0) {
    throw std::invalid_argument("fillWeights: count=" + std::to_string(count) +
                                " is not a multiple of perExpert=" + std::to_string(perExpert));
  }
  const auto blocks = static_cast<unsigned>(std::min<std::size_t>((count + kFillThreads - 1) / kFillThreads, 8192));
  fillWeightsKernel<<<blocks, kFillThreads, 0, stream>>>(w, count, tensor, firstExpert, perExpert, fanIn);
  GRAPHEP_EXAMPLE_CUDA_CHECK(cudaGetLastError());
}

// Block i: token i. Shared memory: the token row [H] bf16, then the scores [E] fp32.
__global__ void __launch_bounds__(kRouterThreads) routeTokensKernel(const __grid_constant__ RouterParams p) {
  extern __shared__ float4 smem[];
  const int H = p.shape.hidden, E = p.shape.numExperts, K = p.shape.topK, T = p.shape.tokensPerRank;
  auto* x = reinterpret_cast<bf16*>(smem);
  auto* scores = reinterpret_cast<float*>(x + H);
  const int i = static_cast<int>(blockIdx.x);
  const std::uint32_t step = *p.step;
  bf16* row = p.x + static_cast<std::size_t>(i) * H;
  for (int h = static_cast<int>(threadIdx.x); h < H; h += blockDim.x) {
    x[h] = tokenValue(step, p.firstRank + i / T, i % T, h);
    row[h] = x[h];
  }
  __syncthreads();
  for (int e = static_cast<int>(threadIdx.x); e < E; e += blockDim.x) {
    scores[e] = routerScore(x, p.routerWeights, H, E, e);
  }
  __syncthreads();
  topkSoftmax(scores, E, K, p.topkIds + static_cast<std::size_t>(i) * K,
              p.topkWeights + static_cast<std::size_t>(i) * K);
}

void routeTokens(const RouterParams& p, cudaStream_t stream) {
  const LayerShape& s = p.shape;
  if (s.hidden % 8 != 0) {
    throw std::invalid_argument("routeTokens: hidden=" + std::to_string(s.hidden) + " is not a multiple of 8");
  }
  if (s.numExperts > kMaxRouterExperts) {
    throw std::invalid_argument("routeTokens: numExperts=" + std::to_string(s.numExperts) + " exceeds " +
                                std::to_string(kMaxRouterExperts));
  }
  if (s.topK < 1 || s.topK > std::min(kMaxTopK, s.numExperts)) {
    throw std::invalid_argument("routeTokens: topK=" + std::to_string(s.topK) + " is outside [1, min(16, experts)]");
  }
  const std::size_t smem =
      static_cast<std::size_t>(s.hidden) * sizeof(bf16) + static_cast<std::size_t>(s.numExperts) * 4;
  if (smem > kMaxStaticSmem) {
    throw std::invalid_argument("routeTokens: hidden=" + std::to_string(s.hidden) + " and " +
                                std::to_string(s.numExperts) + " experts need " + std::to_string(smem) +
                                " bytes of shared memory (48 KiB at most)");
  }
  if (p.numTokens < 1) return;
  routeTokensKernel<<<static_cast<unsigned>(p.numTokens), kRouterThreads, smem, stream>>>(p);
  GRAPHEP_EXAMPLE_CUDA_CHECK(cudaGetLastError());
}

__global__ void advanceStepKernel(std::uint32_t* step) { *step += 1; }

void advanceStep(std::uint32_t* step, cudaStream_t stream) {
  advanceStepKernel<<<1, 1, 0, stream>>>(step);
  GRAPHEP_EXAMPLE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace graphep::example
