// SingleGpuLayer (single_gpu_layer.cuh): grouping the routed rows by expert, the top-k weighted
// sum, and the captured graph.
#include "common/single_gpu_layer.cuh"

#include <stdexcept>
#include <string>

#include "common/layer_inputs.cuh"

namespace graphep::example {

namespace {

constexpr int kGroupThreads = 256;
constexpr int kSumThreads = 256;
constexpr std::size_t kMaxStaticSmem = 48 * 1024;

struct GroupParams {
  const int* topkIds = nullptr;            // [N, K]
  const bf16* x = nullptr;                 // [N, H]
  bf16* batched = nullptr;                 // [E, M, H]: the experts' input
  int* rowOf = nullptr;                    // [N, K] out: each (token, slot)'s batched row, -1 past M
  unsigned long long* overflow = nullptr;  // rows past M, summed
  int numEntries = 0;                      // N * K
  int topK = 0;
  int rowsPerExpert = 0;  // M
  int hidden = 0;         // H, a multiple of 8
};

}  // namespace

// Block e: expert e. Finds the (token, slot) entries that chose e in token order (the order
// graphep's layout has too: source rank, token, slot), gives each the next of the expert's M rows
// and copies its token row there. Shared memory: the tokens of the expert's rows [M].
__global__ void __launch_bounds__(kGroupThreads) groupByExpertKernel(const GroupParams p) {
  extern __shared__ int rowToken[];
  __shared__ int warpHits[kGroupThreads / 32];
  __shared__ int numHits;
  const int e = static_cast<int>(blockIdx.x), M = p.rowsPerExpert;
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  if (threadIdx.x == 0) numHits = 0;
  __syncthreads();
  for (int base = 0; base < p.numEntries; base += kGroupThreads) {
    const int i = base + static_cast<int>(threadIdx.x);
    const bool hit = i < p.numEntries && p.topkIds[i] == e;
    const unsigned hits = __ballot_sync(0xffffffffu, hit);
    if (lane == 0) warpHits[warp] = __popc(hits);
    __syncthreads();
    int pos = numHits + __popc(hits & ((1u << lane) - 1u));
    for (int w = 0; w < warp; ++w) pos += warpHits[w];
    if (hit) {
      if (pos < M) rowToken[pos] = i / p.topK;
      p.rowOf[i] = pos < M ? e * M + pos : -1;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 0; w < kGroupThreads / 32; ++w) numHits += warpHits[w];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0 && numHits > M) atomicAdd(p.overflow, static_cast<unsigned long long>(numHits - M));
  const int rows = min(numHits, M), vecsPerRow = p.hidden / 8;
  const auto* x = reinterpret_cast<const uint4*>(p.x);
  auto* batched = reinterpret_cast<uint4*>(p.batched) + static_cast<std::size_t>(e) * M * vecsPerRow;
  for (int v = static_cast<int>(threadIdx.x); v < rows * vecsPerRow; v += kGroupThreads) {
    batched[v] = x[static_cast<std::size_t>(rowToken[v / vecsPerRow]) * vecsPerRow + v % vecsPerRow];
  }
}

// Block t: token t. out[t] = sum over k of topkWeights[t][k] * y[rowOf[t][k]], fp32 in slot order,
// rounded to bf16.
__global__ void __launch_bounds__(kSumThreads)
    weightedSumKernel(const bf16* y, const int* rowOf, const float* weights, bf16* out, int K, int H) {
  const std::size_t t = blockIdx.x;
  for (int c = static_cast<int>(threadIdx.x); c < H; c += kSumThreads) {
    float acc = 0.f;
    for (int k = 0; k < K; ++k) {
      const int row = rowOf[t * K + k];  // -1: dropped (past M), counted in the overflow
      if (row < 0) continue;
      acc = __fmaf_rn(weights[t * K + k], __bfloat162float(y[static_cast<std::size_t>(row) * H + c]), acc);
    }
    out[t * H + c] = __float2bfloat16_rn(acc);
  }
}

SingleGpuLayer::SingleGpuLayer(int device, const LayerShape& shape, int rowsPerExpert)
    : device_(device),
      shape_(shape),
      routerWeights_(device, static_cast<std::size_t>(shape.hidden) * shape.numExperts),
      x_(device, static_cast<std::size_t>(shape.numTokens()) * shape.hidden),
      out_(device, static_cast<std::size_t>(shape.numTokens()) * shape.hidden),
      topkIds_(device, static_cast<std::size_t>(shape.numTokens()) * shape.topK),
      rowOf_(device, static_cast<std::size_t>(shape.numTokens()) * shape.topK),
      topkWeights_(device, static_cast<std::size_t>(shape.numTokens()) * shape.topK),
      step_(device, 1),
      overflow_(device, 1),
      experts_(device, shape, 0, shape.numExperts, rowsPerExpert) {
  const std::size_t groupSmem = static_cast<std::size_t>(rowsPerExpert) * sizeof(int);
  if (groupSmem > kMaxStaticSmem) {
    throw std::invalid_argument("SingleGpuLayer: rowsPerExpert=" + std::to_string(rowsPerExpert) +
                                " needs more than 48 KiB of shared memory to group the rows");
  }
  DeviceGuard guard(device);
  const Stream stream = makeStream(device);
  fillWeights(routerWeights_.get(), routerWeights_.size(), Tensor::kRouter, 0, routerWeights_.size(), shape.hidden,
              stream.get());
  GRAPHEP_EXAMPLE_CUDA_CHECK(cudaMemsetAsync(step_.get(), 0, step_.bytes(), stream.get()));
  GRAPHEP_EXAMPLE_CUDA_CHECK(cudaMemsetAsync(overflow_.get(), 0, overflow_.bytes(), stream.get()));
  GRAPHEP_EXAMPLE_CUDA_CHECK(cudaStreamSynchronize(stream.get()));

  const Graph graph = capture(device, stream.get(), [&](cudaStream_t s) {
    routeTokens({.routerWeights = routerWeights_.get(), .step = step_.get(), .x = x_.get(), .topkIds = topkIds_.get(),
                 .topkWeights = topkWeights_.get(), .numTokens = shape.numTokens(), .shape = shape},
                s);
    const GroupParams group{.topkIds = topkIds_.get(), .x = x_.get(), .batched = experts_.input(),
                            .rowOf = rowOf_.get(), .overflow = overflow_.get(),
                            .numEntries = shape.numTokens() * shape.topK, .topK = shape.topK,
                            .rowsPerExpert = rowsPerExpert, .hidden = shape.hidden};
    groupByExpertKernel<<<static_cast<unsigned>(shape.numExperts), kGroupThreads, groupSmem, s>>>(group);
    GRAPHEP_EXAMPLE_CUDA_CHECK(cudaGetLastError());
    experts_.enqueue(s);
    weightedSumKernel<<<static_cast<unsigned>(shape.numTokens()), kSumThreads, 0, s>>>(
        experts_.output(), rowOf_.get(), topkWeights_.get(), out_.get(), shape.topK, shape.hidden);
    GRAPHEP_EXAMPLE_CUDA_CHECK(cudaGetLastError());
    advanceStep(step_.get(), s);
  });
  exec_ = instantiate(graph);
}

void SingleGpuLayer::launch(cudaStream_t stream) { GRAPHEP_EXAMPLE_CUDA_CHECK(cudaGraphLaunch(exec_.get(), stream)); }

unsigned long long SingleGpuLayer::overflowRows() const { return readDeviceValue(overflow_.get(), device_); }

}  // namespace graphep::example
