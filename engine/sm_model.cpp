// The communication kernels' CTA count (see engine/sm_model.hpp).
#include "engine/sm_model.hpp"

#include <algorithm>
#include <cmath>

namespace graphep {

int commCtasFor(const LinkRates& rates, int maxCtas, double margin) {
  const int cap = std::max(maxCtas, 1);
  if (!(rates.perCtaGBps > 0) || !(rates.linkGBps > 0) || !(margin > 0)) return cap;
  const double need = std::ceil(rates.linkGBps / rates.perCtaGBps * margin - 1e-9);
  if (!(need < static_cast<double>(cap))) return cap;
  return std::max(1, static_cast<int>(need));
}

}  // namespace graphep
