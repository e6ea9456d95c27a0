#include "common/moe/step_trace.hpp"

#include <gtest/gtest.h>

namespace graphep::test {

void expectStepTrace(const std::vector<MoeStepTrace>& steps, int r) {
  using E = MoeTraceEvent;
  int dispatches = 0, combines = 0;
  for (std::size_t k = 0; k < steps.size(); ++k) {
    const MoeStepTrace& t = steps[k];
    (t.combine ? combines : dispatches) += 1;
    EXPECT_NE(t.at(E::kEnter), 0u) << "rank " << r << ", operation " << k;
    EXPECT_LE(t.at(E::kEnter), t.at(E::kReady))
        << "rank " << r << ", operation " << k << ": entered after its wait returned";
    for (int e = 0; e < static_cast<int>(E::kCount); ++e) {
      if (t.ns[e] != 0) {
        EXPECT_LE(t.ns[e], t.at(E::kDone)) << "rank " << r << ", operation " << k << ", event " << e;
      }
    }
    EXPECT_EQ(t.at(E::kLayout) != 0, !t.combine) << "rank " << r << ", operation " << k;
    if (k > 0) {
      EXPECT_GE(t.at(E::kReady), steps[k - 1].at(E::kDone))
          << "rank " << r << ", operation " << k << " started its work before operation " << k - 1 << " ended";
    }
  }
  EXPECT_GE(dispatches, 1) << "rank " << r;
  EXPECT_GE(combines, 1) << "rank " << r;
}

}  // namespace graphep::test
