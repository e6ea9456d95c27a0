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

// The fewest CTAs whose pushes carry the link with the margin: ceil(link / perCta x margin), within
// [1, maxCtas]; maxCtas when a rate is unknown (0, negative or not a number).
int commCtasFor(const LinkRates& rates, int maxCtas, double margin = kCommCtaMargin);

// The thread-block cluster size a kernel of `grid` CTAs launches with when it prefers `preferred`:
// the largest power of two no larger than either for which `fits(size)` says the GPU can place
// such clusters (cudaOccupancyMaxActiveClusters > 0), falling back by halves down to 1, which
// always fits (1 is a plain launch). The kernel's results must not depend on the size it gets.
int clusterSizeFor(int preferred, int grid, const std::function<bool(int)>& fits);

}  // namespace graphep
