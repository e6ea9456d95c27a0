// The reference behind the main job's check: the layer computed token by token on CUDA cores (fp32
// dot products in a plain order: no tensor cores, no grouping, no graphep), with every expert's
// weights on one GPU, and a tolerance for each output value (derived in moe_reference.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "common/cuda_raii.hpp"
#include "common/layer_math.cuh"

namespace graphep::example {

struct CheckStats {
  long long checked = 0;
  long long wrong = 0;
  double worstRatio = 0;  // the largest |error| / tolerance seen
  int reported = 0;       // mismatches printed so far
};

class Reference {
 public:
  // The weights live on `device` (the unsharded layer's): router [H, E], gate/up [E, 2F, H] and
  // down [E, H, F] of all E experts.
  Reference(int device, const LayerShape& shape, const bf16* routerWeights, const bf16* gateUp, const bf16* down);

  // The outputs and tolerances of every rank's tokens at decode step `step`. Synchronises `device`.
  void compute(std::uint32_t step);

  // Compares `numTokens` rows of bf16 outputs (`out`, on `outDevice`) with reference rows
  // [firstToken, firstToken + numTokens) of the last compute(); prints the first mismatches to
  // stderr, labelled `what`.
  void compare(const bf16* out, int outDevice, int firstToken, int numTokens, const char* what,
               CheckStats& stats) const;

 private:
  int device_;
  LayerShape shape_;
  const bf16* routerWeights_;
  const bf16* gateUp_;
  const bf16* down_;
  std::uint32_t step_ = 0;
  DeviceBuffer<float> out_, tolerance_;  // [R * T, H]
  std::vector<float> hostOut_, hostTolerance_;
};

}  // namespace graphep::example
