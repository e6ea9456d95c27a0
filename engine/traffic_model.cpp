#include "engine/traffic_model.hpp"

#include <algorithm>

#include "engine/error.hpp"

namespace graphep {
namespace {

// C(n - b, k) / C(n, k): the chance that k distinct draws from n avoid a given b of them.
double avoidAll(long long n, long long b, int k) {
  double p = 1.0;
  for (int i = 0; i < k; ++i) {
    const double left = static_cast<double>(n - b - i);
    if (left <= 0) return 0.0;
    p *= left / static_cast<double>(n - i);
  }
  return p;
}

// C(n, k) as a double (small n: group counts).
double choose(int n, int k) {
  if (k < 0 || k > n) return 0.0;
  double c = 1.0;
  for (int i = 1; i <= k; ++i) c = c * (n - k + i) / i;
  return c;
}

// P(a token has no expert in a block of b consecutive experts that lies inside one group (b
// divides the group size S) or is made of whole groups (S divides b)).
double missBlock(const TrafficModelInput& in, long long b) {
  const long long S = in.numExperts / in.numGroups, pool = static_cast<long long>(in.groupsPerToken) * S;
  const int NG = in.numGroups, M = in.groupsPerToken;
  if (b <= S) {  // inside one group: missed unless the group is chosen and a draw lands in the block
    const double chosen = static_cast<double>(M) / NG;
    return 1.0 - chosen * (1.0 - avoidAll(pool, b, in.topK));
  }
  const int c = static_cast<int>(b / S);  // whole groups: j of them chosen (hypergeometric)
  double miss = 0.0;
  for (int j = 0; j <= std::min(c, M); ++j) {
    const double pj = choose(c, j) * choose(NG - c, M - j) / choose(NG, M);
    miss += pj * avoidAll(pool, j * S, in.topK);
  }
  return miss;
}

TrafficPhase phase(const TrafficModelInput& in, double nicRows, double nvlinkRows, double rowBytes) {
  TrafficPhase p;
  p.nicBytes = nicRows * rowBytes;
  p.nvlinkBytes = nvlinkRows * rowBytes;
  p.us = std::max(p.nicBytes / (in.nicGBps * 1e3), p.nvlinkBytes / (in.nvlinkGBps * 1e3));
  return p;
}

void validate(const TrafficModelInput& in) {
  GRAPHEP_REQUIRE(in.numRanks >= 1, Status::kInvalidArgument, "trafficModel: numRanks=%d is not positive", in.numRanks);
  GRAPHEP_REQUIRE(in.ranksPerNode >= 1 && in.numRanks % in.ranksPerNode == 0, Status::kInvalidArgument,
                  "trafficModel: ranksPerNode=%d does not divide numRanks=%d", in.ranksPerNode, in.numRanks);
  GRAPHEP_REQUIRE(in.tokensPerRank >= 0, Status::kInvalidArgument, "trafficModel: tokensPerRank=%lld is negative",
                  in.tokensPerRank);
  GRAPHEP_REQUIRE(in.numExperts >= 1 && in.numExperts % in.numRanks == 0, Status::kInvalidArgument,
                  "trafficModel: numExperts=%d is not a positive multiple of numRanks=%d", in.numExperts,
                  in.numRanks);
  GRAPHEP_REQUIRE(in.numGroups >= 1 && in.numExperts % in.numGroups == 0, Status::kInvalidArgument,
                  "trafficModel: numGroups=%d does not divide numExperts=%d", in.numGroups, in.numExperts);
  GRAPHEP_REQUIRE(in.groupsPerToken >= 1 && in.groupsPerToken <= in.numGroups, Status::kInvalidArgument,
                  "trafficModel: groupsPerToken=%d is outside [1, numGroups=%d]", in.groupsPerToken, in.numGroups);
  const long long S = in.numExperts / in.numGroups;
  GRAPHEP_REQUIRE(in.topK >= 1 && in.topK <= in.groupsPerToken * S, Status::kInvalidArgument,
                  "trafficModel: topK=%d is outside [1, groupsPerToken x experts per group = %lld]", in.topK,
                  in.groupsPerToken * S);
  for (const long long b : {static_cast<long long>(in.numExperts / in.numRanks),
                            static_cast<long long>(in.numExperts / in.numRanks) * in.ranksPerNode}) {
    GRAPHEP_REQUIRE(S % b == 0 || b % S == 0, Status::kInvalidArgument,
                    "trafficModel: a block of %lld experts (a rank's or a node's) neither lies in one group of %lld "
                    "nor is made of whole groups",
                    b, S);
  }
  GRAPHEP_REQUIRE(in.dispatchRowBytes > 0 && in.combineRowBytes > 0 && in.nicGBps > 0 && in.nvlinkGBps > 0,
                  Status::kInvalidArgument,
                  "trafficModel: row bytes (%g, %g) and link rates (%g, %g GB/s) must be positive",
                  in.dispatchRowBytes, in.combineRowBytes, in.nicGBps, in.nvlinkGBps);
}

}  // namespace

TrafficModelResult trafficModel(const TrafficModelInput& in) {
  validate(in);
  const long long perRank = in.numExperts / in.numRanks;
  const int G = in.ranksPerNode, N = in.numRanks / in.ranksPerNode;
  const double T = static_cast<double>(in.tokensPerRank);
  TrafficModelResult r;
  r.rankHit = 1.0 - missBlock(in, perRank);
  r.nodeHit = N > 1 ? 1.0 - missBlock(in, perRank * G) : 0.0;
  // Rows a rank sends per token. Flat: one per other rank hit, over the network for the R - G
  // ranks of other nodes. Node-aware: one per other node hit over the network; over NVLink, its own
  // node's hit ranks, and for each of the N - 1 other nodes the forwards its landing rank makes to
  // that node's other hit ranks (by symmetry every rank forwards as much as it lands).
  const double flatNic = T * (in.numRanks - G) * r.rankHit;
  const double localNvlink = T * (G - 1) * r.rankHit;
  const double awareNic = T * (N - 1) * r.nodeHit;
  const double awareNvlink = localNvlink * N;
  r.flatDispatch = phase(in, flatNic, localNvlink, in.dispatchRowBytes);
  r.flatCombine = phase(in, flatNic, localNvlink, in.combineRowBytes);
  r.nodeAwareDispatch = phase(in, awareNic, awareNvlink, in.dispatchRowBytes);
  r.nodeAwareCombine = phase(in, awareNic, awareNvlink, in.combineRowBytes);
  return r;
}

}  // namespace graphep
