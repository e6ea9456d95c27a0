// Launch shapes chosen at setup, as pure functions of what setup measured or queried, so that their
// rules are unit-tested on the CPU: the communication kernels' CTA count when MoeConfig.smBudget is
// 0 (docs/DESIGN.md §5.5, rates from measureLinkRates), and the direct epilogues' cluster size.
#pragma once

#include <functional>

namespace graphep {

// What one CTA pushing 16-byte stores to a load/store peer reaches alone, and what the link carries
// with many CTAs pushing at once (GB/s; both directions busy, as in a dispatch).
struct LinkRates {
  double perCtaGBps = 0;
  double linkGBps = 0;
};

// Headroom over the bare ratio: CTAs also read their rows, write metadata and wait at fences.
inline constexpr double kCommCtaMargin = 1.25;

// The share of a send CTA's stores that cross the link when every rank is an equally likely
// destination (uniform routing): of a token's rows, those for the worldSize - 1 other ranks go out,
// the one for this rank stays in local memory, yet each costs the CTA the same store issue. 1 for a
// world of one (nothing to share with).
double remoteStoreShare(int worldSize);

// The fewest CTAs whose pushes carry the link with the margin: ceil(link / (perCta x remoteShare)
// x margin), within [1, maxCtas]; a CTA pushing a remoteShare of its stores over the link carries
// that share of its one-CTA rate. maxCtas when a rate or the share is unknown (0, negative or not a
// number); a share above 1 counts as 1.
int commCtasFor(const LinkRates& rates, int maxCtas, double remoteShare = 1.0, double margin = kCommCtaMargin);

// The thread-block cluster size a kernel of `grid` CTAs launches with when it prefers `preferred`:
// the largest power of two no larger than either for which `fits(size)` says the GPU can place
// such clusters (cudaOccupancyMaxActiveClusters > 0), falling back by halves down to 1, which
// always fits (1 is a plain launch). The kernel's results must not depend on the size it gets.
int clusterSizeFor(int preferred, int grid, const std::function<bool(int)>& fits);

}  // namespace graphep
