// The communication kernels' CTA count (see engine/sm_model.hpp).
#include "engine/sm_model.hpp"

#include <algorithm>
#include <cmath>

namespace graphep {

double remoteStoreShare(int worldSize) {
  return worldSize > 1 ? static_cast<double>(worldSize - 1) / worldSize : 1.0;
}

int commCtasFor(const LinkRates& rates, int maxCtas, double remoteShare, double margin) {
  const int cap = std::max(maxCtas, 1);
  if (!(rates.perCtaGBps > 0) || !(rates.linkGBps > 0) || !(remoteShare > 0) || !(margin > 0)) return cap;
  const double share = std::min(remoteShare, 1.0);
  const double need = std::ceil(rates.linkGBps / (rates.perCtaGBps * share) * margin - 1e-9);
  if (!(need < static_cast<double>(cap))) return cap;
  return std::max(1, static_cast<int>(need));
}

int clusterSizeFor(int preferred, int grid, const std::function<bool(int)>& fits) {
  int size = 1;
  while (size * 2 <= preferred && size * 2 <= grid) size *= 2;
  for (; size > 1; size /= 2) {
    if (fits(size)) return size;
  }
  return 1;
}

}  // namespace graphep
