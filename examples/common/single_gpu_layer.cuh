// The same MoE layer on one GPU, unsharded, for the main job's comparison: the tokens of all R ranks
// (the ones the ranks generate), the router, all E experts through BatchedExperts with the same rows
// per expert, and the top-k weighted sum, captured once as one graph:
//
//   router (R * T tokens) -> group rows by expert -> BatchedExperts (E experts) -> weighted sum -> step + 1
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/batched_experts.cuh"
#include "common/cuda_raii.hpp"
#include "common/layer_math.cuh"

namespace graphep::example {

class SingleGpuLayer {
 public:
  // Setup: weights, buffers, the captured graph. Synchronises `device`.
  SingleGpuLayer(int device, const LayerShape& shape, int rowsPerExpert);

  // One decode step (one graph launch) on `stream` of this layer's device.
  void launch(cudaStream_t stream);

  const bf16* out() const { return out_.get(); }  // [R * T, H]: the last step's outputs
  const bf16* routerWeights() const { return routerWeights_.get(); }
  const BatchedExperts& experts() const { return experts_; }
  int device() const { return device_; }
  // Rows past rowsPerExpert over every step so far (not computed). Synchronises the device.
  unsigned long long overflowRows() const;

 private:
  int device_;
  LayerShape shape_;
  DeviceBuffer<bf16> routerWeights_, x_, out_;
  DeviceBuffer<int> topkIds_, rowOf_;
  DeviceBuffer<float> topkWeights_;
  DeviceBuffer<std::uint32_t> step_;
  DeviceBuffer<unsigned long long> overflow_;
  BatchedExperts experts_;
  GraphExec exec_;
};

}  // namespace graphep::example
