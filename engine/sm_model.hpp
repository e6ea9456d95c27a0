// The communication kernels' CTA count when MoeConfig.smBudget is 0 (docs/DESIGN.md §5.5): a pure
// function of rates measured at setup (measureLinkRates), so its rule is unit-tested on the CPU.
#pragma once

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

}  // namespace graphep
