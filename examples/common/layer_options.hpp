// The main job's flags (examples/01_moe_layer.cu). Bad flags print the usage and exit 2.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/layer_math.cuh"

namespace graphep::example {

struct LayerOptions {
  LayerShape shape;       // --tokens --hidden --ffn --experts --topk: Qwen3-30B-A3B's layer, 64 tokens per rank
  int steps = 200;        // --steps: decode steps timed (and as many of the one-GPU layer)
  int checkEvery = 50;    // --check-every: steps between checks against the reference (and the last)
  int ranks = 0;          // --ranks: 0 = one per GPU (2 emulated ranks on one GPU)
  int rowsPerExpert = 0;  // --rows-per-expert M: 0 = the worst case R * T (a token's top-k experts are distinct)
  bool oneGpu = false;    // --one-gpu: every rank on GPU 0 (emulated ranks), whatever the GPU count
};

inline LayerOptions parseLayerOptions(int argc, char** argv) {
  LayerOptions o;
  LayerShape& s = o.shape;
  const struct {
    const char* name;
    int* value;
  } flags[] = {{"--tokens", &s.tokensPerRank},   {"--hidden", &s.hidden}, {"--ffn", &s.ffn},
               {"--experts", &s.numExperts},     {"--topk", &s.topK},     {"--steps", &o.steps},
               {"--check-every", &o.checkEvery}, {"--ranks", &o.ranks},   {"--rows-per-expert", &o.rowsPerExpert}};
  for (int i = 1; i < argc; ++i) {
    bool known = std::strcmp(argv[i], "--one-gpu") == 0;
    o.oneGpu |= known;
    for (const auto& f : flags) {
      if (std::strcmp(argv[i], f.name) == 0 && i + 1 < argc) {
        *f.value = std::atoi(argv[++i]);
        known = true;
      }
    }
    if (!known) {
      std::printf(
          "usage: %s [--tokens T] [--hidden H] [--ffn F] [--experts E] [--topk K] [--steps S] "
          "[--check-every C] [--ranks R] [--rows-per-expert M] [--one-gpu]\n",
          argv[0]);
      std::exit(std::strcmp(argv[i], "--help") == 0 ? 0 : 2);
    }
  }
  if (s.hidden % 8 != 0 || s.ffn % 8 != 0 || s.topK < 1 || s.topK > std::min(kMaxTopK, s.numExperts) ||
      s.numExperts > kMaxRouterExperts || s.tokensPerRank < 1 || o.steps < 1 || o.checkEvery < 1 ||
      o.rowsPerExpert < 0 || o.ranks < 0 || o.ranks == 1) {
    std::fprintf(stderr,
                 "%s: hidden and ffn must be multiples of 8, 1 <= topk <= min(16, experts), experts <= 1024, "
                 "tokens/steps/check-every >= 1, rows-per-expert >= 0, ranks 0 or >= 2\n",
                 argv[0]);
    std::exit(2);
  }
  return o;
}

}  // namespace graphep::example
