// The SwiGLU expert MLPs of a contiguous range of experts on tensor cores (cuBLAS), over the batched
// layout [numExperts, M, H]: row m of expert j's block is one (token, top-k slot) routed to expert j;
// rows past the expert's live count are padding, computed and never read.
//
//   x [n, M, H] --GEMM x.Wgu^T--> gateUp [n, M, 2F] --silu(gate) * up--> act [n, M, F] --GEMM act.Wd^T--> y [n, M, H]
//
// Both GEMMs are one cublasGemmStridedBatchedEx each (one batch entry per expert, bf16 in, fp32
// accumulate, bf16 out): fixed shapes, so they are captured once and replayed. The weights are laid
// out as checkpoints store them (nn.Linear's [out, in]): Wgu [n, 2F, H] (F gate rows, then F up
// rows) and Wd [n, H, F].
//
// Padding costs little at decode. Each expert computes all M rows whatever its count; with M = R * T
// (the most rows an expert can receive) at the default shape (T = 64, R = 2: M = 128, 64 experts
// per rank) a rank's GEMMs do 77.3 GFLOP, 16x (E / K) the 4.8 GFLOP of its 512 real rows. But they
// must read 604 MB of weights, >= 126 us at an H200's 4.8 TB/s, while 77.3 GFLOP take 78 us at its
// 989 TFLOP/s dense bf16 peak: the GEMMs stay bound by the weight reads, as unpadded ones would be.
// At T = 128 (M = 256) the padded work doubles (155 GFLOP, >= 156 us at peak) and passes the weight
// time; a smaller M (--rows-per-expert in the main job) trims it, counting any row it would drop.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "common/cuda_raii.hpp"
#include "common/layer_math.cuh"

namespace graphep::example {

class BatchedExperts {
 public:
  // Setup, not capturable: allocates, fills the weights of global experts [firstExpert,
  // firstExpert + numExperts), creates the cuBLAS handle with its own workspace (so that nothing is
  // allocated while a graph is captured) and runs the MLP once, which loads cuBLAS's kernels
  // before any capture. Synchronises `device`.
  BatchedExperts(int device, const LayerShape& shape, int firstExpert, int numExperts, int rowsPerExpert);

  // Capturable: the two GEMMs and the SwiGLU on `stream` (of this object's device); no allocation,
  // no host synchronisation.
  void enqueue(cudaStream_t stream);

  bf16* input() { return x_.get(); }                            // [n, M, H]: written by a gather
  const bf16* output() const { return y_.get(); }               // [n, M, H]
  const bf16* gateUpWeights() const { return wGateUp_.get(); }  // [n, 2F, H]
  const bf16* downWeights() const { return wDown_.get(); }      // [n, H, F]
  const LayerShape& shape() const { return shape_; }
  int device() const { return device_; }
  int firstExpert() const { return firstExpert_; }
  int numExperts() const { return numExperts_; }
  int rowsPerExpert() const { return rowsPerExpert_; }
  // FLOPs of one row through the MLP (2 * H * 3F: gate, up and down), and of one padded call.
  double flopsPerRow() const { return 2.0 * shape_.hidden * 3.0 * shape_.ffn; }
  double paddedFlops() const { return flopsPerRow() * numExperts_ * rowsPerExpert_; }
  std::size_t weightBytes() const { return wGateUp_.bytes() + wDown_.bytes(); }

 private:
  int device_;
  LayerShape shape_;
  int firstExpert_, numExperts_, rowsPerExpert_;
  DeviceBuffer<bf16> wGateUp_, wDown_, x_, gateUp_, act_, y_;
  DeviceBuffer<std::byte> workspace_;
  CublasHandle cublas_;
};

// Prints the rates of one enqueue() that took `us` with `realRows` real rows: useful TFLOP/s (the
// real rows' FLOPs), padded TFLOP/s (every row's) and the weights' read bandwidth.
void printExpertRates(const BatchedExperts& experts, double realRows, double us);

}  // namespace graphep::example
