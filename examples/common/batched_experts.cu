// BatchedExperts (batched_experts.cuh): the SwiGLU kernel, the batched GEMM call and the setup.
#include "common/batched_experts.cuh"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "common/layer_inputs.cuh"

namespace graphep::example {

namespace {

constexpr std::size_t kCublasWorkspaceBytes = std::size_t{32} << 20;  // cuBLAS's recommendation on Hopper
constexpr int kSwigluThreads = 256;
constexpr int kVec = 8;  // bf16 values per 16-byte access

// y[j] = x[j] . w[j]^T for each of `batch` experts: x [batch, rows, in], w [batch, out, in] and
// y [batch, rows, out], all row-major. In cuBLAS's column-major view the same memory holds x[j]^T
// (in x rows), w[j]^T (in x out) and y[j]^T (out x rows), and y[j]^T = (w[j]^T)^T . x[j]^T.
void batchedLinear(cublasHandle_t handle, const bf16* x, const bf16* w, bf16* y, int batch, int rows, int in, int out) {
  const float one = 1.0f, zero = 0.0f;
  GRAPHEP_EXAMPLE_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      handle, CUBLAS_OP_T, CUBLAS_OP_N, out, rows, in, &one, w, CUDA_R_16BF, in, static_cast<long long>(out) * in, x,
      CUDA_R_16BF, in, static_cast<long long>(rows) * in, &zero, y, CUDA_R_16BF, out,
      static_cast<long long>(rows) * out, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace

// act[r][c] = swiglu(gateUp[r][c], gateUp[r][F + c]) rounded to bf16, for every row r of every
// expert (padding rows included: cheaper than reading the counts); 8 columns per thread.
__global__ void __launch_bounds__(kSwigluThreads) swigluKernel(const bf16* gateUp, bf16* act, std::size_t rows, int F) {
  const std::size_t vecsPerRow = static_cast<std::size_t>(F) / kVec;
  const std::size_t total = rows * vecsPerRow;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < total; i += stride) {
    const std::size_t r = i / vecsPerRow, c = (i % vecsPerRow) * kVec;
    const uint4 gate = *reinterpret_cast<const uint4*>(gateUp + r * 2 * F + c);
    const uint4 up = *reinterpret_cast<const uint4*>(gateUp + r * 2 * F + F + c);
    const auto* g = reinterpret_cast<const bf16*>(&gate);
    const auto* u = reinterpret_cast<const bf16*>(&up);
    uint4 packed;
    auto* a = reinterpret_cast<bf16*>(&packed);
    for (int j = 0; j < kVec; ++j) a[j] = __float2bfloat16_rn(swiglu(__bfloat162float(g[j]), __bfloat162float(u[j])));
    *reinterpret_cast<uint4*>(act + r * F + c) = packed;
  }
}

BatchedExperts::BatchedExperts(int device, const LayerShape& shape, int firstExpert, int numExperts, int rowsPerExpert)
    : device_(device),
      shape_(shape),
      firstExpert_(firstExpert),
      numExperts_(numExperts),
      rowsPerExpert_(rowsPerExpert) {
  if (shape.hidden % kVec != 0 || shape.ffn % kVec != 0) {
    throw std::invalid_argument("BatchedExperts: hidden=" + std::to_string(shape.hidden) +
                                " and ffn=" + std::to_string(shape.ffn) + " must be multiples of 8");
  }
  if (numExperts < 1 || rowsPerExpert < 1) {
    throw std::invalid_argument("BatchedExperts: numExperts=" + std::to_string(numExperts) +
                                " and rowsPerExpert=" + std::to_string(rowsPerExpert) + " must be positive");
  }
  const std::size_t H = shape.hidden, F = shape.ffn, n = numExperts, rows = n * rowsPerExpert;
  wGateUp_ = DeviceBuffer<bf16>(device, n * 2 * F * H);
  wDown_ = DeviceBuffer<bf16>(device, n * H * F);
  x_ = DeviceBuffer<bf16>(device, rows * H);
  gateUp_ = DeviceBuffer<bf16>(device, rows * 2 * F);
  act_ = DeviceBuffer<bf16>(device, rows * F);
  y_ = DeviceBuffer<bf16>(device, rows * H);
  workspace_ = DeviceBuffer<std::byte>(device, kCublasWorkspaceBytes);

  DeviceGuard guard(device);
  const Stream setup = makeStream(device);
  fillWeights(wGateUp_.get(), wGateUp_.size(), Tensor::kGateUp, firstExpert, 2 * F * H, shape.hidden, setup.get());
  fillWeights(wDown_.get(), wDown_.size(), Tensor::kDown, firstExpert, H * F, shape.ffn, setup.get());
  // Padding rows are computed on: zeros keep them finite until real rows land there.
  GRAPHEP_EXAMPLE_CUDA_CHECK(cudaMemsetAsync(x_.get(), 0, x_.bytes(), setup.get()));
  cublasHandle_t handle = nullptr;
  GRAPHEP_EXAMPLE_CUBLAS_CHECK(cublasCreate(&handle));
  cublas_ = CublasHandle(device, handle);
  // Split-K partial sums are reduced in fp32, not in the bf16 output type: the reference's
  // tolerance (moe_reference.cu) assumes fp32 accumulation up to each bf16 rounding.
  GRAPHEP_EXAMPLE_CUBLAS_CHECK(cublasSetMathMode(
      handle, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  enqueue(setup.get());
  GRAPHEP_EXAMPLE_CUDA_CHECK(cudaStreamSynchronize(setup.get()));
}

void BatchedExperts::enqueue(cudaStream_t stream) {
  const int H = shape_.hidden, F = shape_.ffn, n = numExperts_, M = rowsPerExpert_;
  cublasHandle_t handle = cublas_.get();
  GRAPHEP_EXAMPLE_CUBLAS_CHECK(cublasSetStream(handle, stream));
  // cublasSetStream resets the workspace to cuBLAS's own pool: point it back at ours.
  GRAPHEP_EXAMPLE_CUBLAS_CHECK(cublasSetWorkspace(handle, workspace_.get(), workspace_.bytes()));
  batchedLinear(handle, x_.get(), wGateUp_.get(), gateUp_.get(), n, M, H, 2 * F);
  const std::size_t rows = static_cast<std::size_t>(n) * M;
  const std::size_t vecs = rows * (F / kVec);
  const auto blocks = static_cast<unsigned>(std::min<std::size_t>((vecs + kSwigluThreads - 1) / kSwigluThreads, 4096));
  swigluKernel<<<blocks, kSwigluThreads, 0, stream>>>(gateUp_.get(), act_.get(), rows, F);
  GRAPHEP_EXAMPLE_CUDA_CHECK(cudaGetLastError());
  batchedLinear(handle, act_.get(), wDown_.get(), y_.get(), n, M, F, H);
}

void printExpertRates(const BatchedExperts& experts, double realRows, double us) {
  const double useful = realRows * experts.flopsPerRow(), padded = experts.paddedFlops();
  const double weightBytes = static_cast<double>(experts.weightBytes());
  std::printf(
      "  expert GEMMs + SwiGLU (%d experts x %d rows): %.0f real rows, %.2f GFLOP = %.1f TFLOP/s useful; "
      "%.1f GFLOP = %.1f TFLOP/s padded; %.0f MB of weights read at %.2f TB/s\n",
      experts.numExperts(), experts.rowsPerExpert(), realRows, useful * 1e-9, useful / us * 1e-6, padded * 1e-9,
      padded / us * 1e-6, weightBytes * 1e-6, weightBytes / us * 1e-6);
}

}  // namespace graphep::example
