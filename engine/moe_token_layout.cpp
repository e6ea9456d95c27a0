// graphep::tokenLayout (include/graphep/moe.hpp): DeepEP's get_dispatch_layout, the argument checks
// here and the kernel in kernels/moe_token_layout.cu. Not collective and no engine: it reads one
// rank's top-k ids and writes its per-rank and per-expert counts and token-in-rank mask.
#include <graphep/moe.hpp>

#include "engine/error.hpp"
#include "kernels/moe.h"

namespace graphep {
namespace {

// A pointer the kernel dereferences: device (or managed) memory of the current device.
void requireDevice(const void* p, const char* what) {
  GRAPHEP_REQUIRE(p != nullptr, Status::kInvalidArgument, "tokenLayout: %s is null", what);
  cudaPointerAttributes a{};
  const cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    cudaGetLastError();
    GRAPHEP_FAIL(Status::kInvalidArgument, "tokenLayout: %s (%p) is not a CUDA allocation: %s", what, p,
                 cudaGetErrorString(e));
  }
  GRAPHEP_REQUIRE(a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged, Status::kInvalidArgument,
                  "tokenLayout: %s (%p) is host memory, not device memory", what, p);
}

}  // namespace

void tokenLayout(const TokenLayoutArgs& a, cudaStream_t stream) {
  GRAPHEP_REQUIRE(a.numRanks >= 1 && a.numRanks <= kMaxRanks, Status::kInvalidArgument,
                  "tokenLayout: numRanks=%d is outside [1, %d]", a.numRanks, kMaxRanks);
  GRAPHEP_REQUIRE(a.numExperts >= 1 && a.numExperts % a.numRanks == 0, Status::kInvalidArgument,
                  "tokenLayout: numExperts=%d is not a positive multiple of numRanks=%d", a.numExperts, a.numRanks);
  GRAPHEP_REQUIRE(a.topK >= 1 && a.topK <= kMoeMaxTopK, Status::kInvalidArgument,
                  "tokenLayout: topK=%d is outside [1, %d]", a.topK, kMoeMaxTopK);
  GRAPHEP_REQUIRE(a.numTokens >= 0, Status::kInvalidArgument, "tokenLayout: numTokens=%d is negative", a.numTokens);
  GRAPHEP_REQUIRE(a.indexType == IndexType::kInt32 || a.indexType == IndexType::kInt64, Status::kInvalidArgument,
                  "tokenLayout: indexType=%d is not an IndexType", static_cast<int>(a.indexType));
  if (a.numTokens > 0) {
    requireDevice(a.topkIdx, "topkIdx");
    requireDevice(a.tokenInRank, "tokenInRank");
  }
  requireDevice(a.tokensPerRank, "tokensPerRank");
  requireDevice(a.tokensPerExpert, "tokensPerExpert");
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
