// graphep::tokenLayout (include/graphep/moe.hpp): DeepEP's get_dispatch_layout, the argument checks
// here and the kernel in kernels/moe/token_layout.cu. Not collective and no engine: it reads one
// rank's top-k ids and writes its per-rank and per-expert counts and token-in-rank mask.
#include <graphep/moe.hpp>

#include "engine/device_pointer.hpp"
#include "engine/error.hpp"
#include "kernels/moe/moe.h"

namespace graphep {

void tokenLayout(const TokenLayoutArgs& a, cudaStream_t stream) {
  GRAPHEP_REQUIRE(a.numRanks >= 1 && a.numRanks <= kMaxRanks, Status::kInvalidArgument,
                  "tokenLayout: numRanks=%d is outside [1, %d]", a.numRanks, kMaxRanks);
  GRAPHEP_REQUIRE(a.numExperts >= 1 && a.numExperts % a.numRanks == 0, Status::kInvalidArgument,
                  "tokenLayout: numExperts=%d is not a positive multiple of numRanks=%d", a.numExperts, a.numRanks);
  GRAPHEP_REQUIRE(a.numExperts / a.numRanks <= kMoeMaxLocalExperts, Status::kInvalidArgument,
                  "tokenLayout: numExperts=%d is more than %d per rank", a.numExperts, kMoeMaxLocalExperts);
  GRAPHEP_REQUIRE(a.topK >= 1 && a.topK <= kMoeMaxTopK, Status::kInvalidArgument,
                  "tokenLayout: topK=%d is outside [1, %d]", a.topK, kMoeMaxTopK);
  // The kernel's token loop steps by its grid in int: keep it far from INT_MAX.
  GRAPHEP_REQUIRE(a.numTokens >= 0 && a.numTokens <= (1 << 30), Status::kInvalidArgument,
                  "tokenLayout: numTokens=%d is outside [0, %d]", a.numTokens, 1 << 30);
  GRAPHEP_REQUIRE(a.indexType == IndexType::kInt32 || a.indexType == IndexType::kInt64, Status::kInvalidArgument,
                  "tokenLayout: indexType=%d is not an IndexType", static_cast<int>(a.indexType));
  int device = 0;
  GRAPHEP_CUDA_CHECK(cudaGetDevice(&device));  // the kernel runs on the current device
  if (a.numTokens > 0) {
    detail::requireDevicePointer(a.topkIdx, device, "tokenLayout: topkIdx");
    detail::requireDevicePointer(a.tokenInRank, device, "tokenLayout: tokenInRank");
  }
  detail::requireDevicePointer(a.tokensPerRank, device, "tokenLayout: tokensPerRank");
  detail::requireDevicePointer(a.tokensPerExpert, device, "tokenLayout: tokensPerExpert");
  MoeTokenLayoutParams p{};
  p.topkIdx = a.topkIdx;
  p.int64Ids = a.indexType == IndexType::kInt64 ? 1 : 0;
  p.numTokens = a.numTokens;
  p.topK = a.topK;
  p.numExperts = a.numExperts;
  p.numRanks = a.numRanks;
  p.tokensPerRank = a.tokensPerRank;
  p.tokensPerExpert = a.tokensPerExpert;
  p.tokenInRank = reinterpret_cast<std::uint8_t*>(a.tokenInRank);
  GRAPHEP_CUDA_CHECK(launchMoeTokenLayout(p, stream));
}

}  // namespace graphep
