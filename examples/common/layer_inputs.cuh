// What feeds the experts: the layer's deterministic weights, each decode step's tokens and the router.
// Kernels in layer_inputs.cu; these launchers check their arguments and throw std::invalid_argument
// naming the offending value.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/layer_math.cuh"

namespace graphep::example {

// Setup: fills `count` values of `tensor`, `perExpert` values for each global expert from
// `firstExpert` on (the router: firstExpert 0, perExpert = count), with variance 1 / fanIn.
void fillWeights(bf16* w, std::size_t count, Tensor tensor, int firstExpert, std::size_t perExpert, int fanIn,
                 cudaStream_t stream);

struct RouterParams {
  const bf16* routerWeights = nullptr;  // [H, E]
  const std::uint32_t* step = nullptr;  // device step counter: the tokens of step *step are routed
  bf16* x = nullptr;                    // [numTokens, H] out: the tokens
  int* topkIds = nullptr;               // [numTokens, K] out: global expert ids
  float* topkWeights = nullptr;         // [numTokens, K] out
  // Token i is token i % T of rank firstRank + i / T: one rank's batch (numTokens = T) or every
  // rank's (numTokens = R * T, firstRank 0).
  int numTokens = 0;
  int firstRank = 0;
  LayerShape shape;
};

// Capturable: one block per token writes its row of x, scores the E experts and picks the top K.
void routeTokens(const RouterParams& p, cudaStream_t stream);

// Capturable: *step += 1 (the next replay routes the next step's tokens).
void advanceStep(std::uint32_t* step, cudaStream_t stream);

}  // namespace graphep::example
