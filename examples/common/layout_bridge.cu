// The gather and scatter between graphep's expert-major layout and the batched layout
// (layout_bridge.cuh): one kernel, its direction a template parameter, launchers below it.
#include "common/layout_bridge.cuh"

#include <stdexcept>
#include <string>

namespace graphep::example {

namespace {

constexpr int kBridgeThreads = 256;
constexpr int kRowsPerBlock = 4;

struct BridgeParams {
  const int* expertOffsets = nullptr;  // [n]: first expert-major row of each local expert
  const int* expertCounts = nullptr;   // [n]: its rows
  // Gather: recv_x [capacity, H] -> the experts' input [n, M, H]; scatter: the experts' output
  // [n, M, H] -> expertOutput [capacity, H].
  const bf16* src = nullptr;
  bf16* dst = nullptr;
  unsigned long long* overflow = nullptr;  // gather: rows past M, summed
  int rowsPerExpert = 0;                   // M
  int hidden = 0;                          // H, a multiple of 8
};

void checkMatch(const graphep::DispatchLayout& layout, const BatchedExperts& experts, const char* what) {
  if (layout.numLocalExperts != experts.numExperts() || layout.hidden != experts.shape().hidden) {
    throw std::invalid_argument(std::string(what) + ": the layout has " + std::to_string(layout.numLocalExperts) +
                                " local experts of hidden=" + std::to_string(layout.hidden) + ", the experts " +
                                std::to_string(experts.numExperts()) +
                                " of hidden=" + std::to_string(experts.shape().hidden));
  }
  if (layout.recvScales != nullptr) {
    throw std::invalid_argument(std::string(what) + ": the layout is fp8 (recvScales set); the MLP reads bf16 rows");
  }
}

}  // namespace

// Grid (n, ceil(M / kRowsPerBlock)): block (j, b) copies expert j's rows [b * 4, b * 4 + 4) that
// exist, 16 bytes per thread and step.
template <bool kGather>
__global__ void __launch_bounds__(kBridgeThreads) bridgeRowsKernel(const BridgeParams p) {
  const int j = static_cast<int>(blockIdx.x);
  const int count = p.expertCounts[j];
  const int rows = min(count, p.rowsPerExpert);
  if constexpr (kGather) {
    if (blockIdx.y == 0 && threadIdx.x == 0 && count > p.rowsPerExpert) {
      atomicAdd(p.overflow, static_cast<unsigned long long>(count - p.rowsPerExpert));
    }
  }
  const int row0 = static_cast<int>(blockIdx.y) * kRowsPerBlock;
  if (row0 >= rows) return;
  const int vecsPerRow = p.hidden / 8;
  const int numVecs = min(kRowsPerBlock, rows - row0) * vecsPerRow;
  const std::size_t majorRow = static_cast<std::size_t>(p.expertOffsets[j]) + row0;
  const std::size_t batchedRow = static_cast<std::size_t>(j) * p.rowsPerExpert + row0;
  const auto* src = reinterpret_cast<const uint4*>(p.src) + (kGather ? majorRow : batchedRow) * vecsPerRow;
  auto* dst = reinterpret_cast<uint4*>(p.dst) + (kGather ? batchedRow : majorRow) * vecsPerRow;
  for (int v = static_cast<int>(threadIdx.x); v < numVecs; v += kBridgeThreads) dst[v] = src[v];
}

namespace {

template <bool kGather>
void launchBridge(const BridgeParams& p, int numExperts, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(numExperts),
                  static_cast<unsigned>((p.rowsPerExpert + kRowsPerBlock - 1) / kRowsPerBlock));
  bridgeRowsKernel<kGather><<<grid, kBridgeThreads, 0, stream>>>(p);
  GRAPHEP_EXAMPLE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void gatherFromLayout(const graphep::DispatchLayout& layout, BatchedExperts& experts, unsigned long long* overflow,
                      cudaStream_t stream) {
  checkMatch(layout, experts, "gatherFromLayout");
  BridgeParams p;
  p.expertOffsets = layout.expertOffsets;
  p.expertCounts = layout.expertCounts;
  p.src = static_cast<const bf16*>(layout.recvX);
  p.dst = experts.input();
  p.overflow = overflow;
  p.rowsPerExpert = experts.rowsPerExpert();
  p.hidden = layout.hidden;
  launchBridge<true>(p, experts.numExperts(), stream);
}

void scatterToLayout(const BatchedExperts& experts, const graphep::DispatchLayout& layout, cudaStream_t stream) {
  checkMatch(layout, experts, "scatterToLayout");
  BridgeParams p;
  p.expertOffsets = layout.expertOffsets;
  p.expertCounts = layout.expertCounts;
  p.src = experts.output();
  p.dst = static_cast<bf16*>(layout.expertOutput);
  p.rowsPerExpert = experts.rowsPerExpert();
  p.hidden = layout.hidden;
  launchBridge<false>(p, experts.numExperts(), stream);
}

}  // namespace graphep::example
