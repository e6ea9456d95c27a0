// graphep-traffic-model: the byte model of expert-parallel traffic across nodes (engine/traffic_model.hpp,
// docs/DESIGN.md §5.10) for EP 16 to 128 at DeepSeek-V3's shape and routing, flat against node-aware.
// No GPU needed.
//
//   graphep-traffic-model [TOKENS_PER_RANK [NIC_GBPS [NVLINK_GBPS]]]   (defaults 4096, 50, 160)
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <initializer_list>

#include "engine/traffic_model.hpp"

int main(int argc, char** argv) {
  try {
    graphep::TrafficModelInput in;
    in.tokensPerRank = argc > 1 ? std::atoll(argv[1]) : 4096;
    in.nicGBps = argc > 2 ? std::atof(argv[2]) : 50.0;     // 400 Gb/s per NIC, one per GPU
    in.nvlinkGBps = argc > 3 ? std::atof(argv[3]) : 160.0;  // H800's NVLink as DeepEP states it
    in.ranksPerNode = 8;
    in.hidden = 7168;
    in.numExperts = 256;
    in.topK = 8;
    in.numGroups = 8;
    in.groupsPerToken = 4;
    in.dispatchRowBytes = in.hidden + in.hidden / 128 * 4 + 16;  // fp8 with its scales, as DeepEP counts
    in.combineRowBytes = 2.0 * in.hidden;                          // bf16
    std::printf("DeepSeek-V3 shape (H %d, top-%d of %d, %d groups, %d per token), %lld tokens per rank, "
                "%d GPUs per node, NIC %.0f GB/s, NVLink %.0f GB/s per GPU and direction; per rank:\n",
                in.hidden, in.topK, in.numExperts, in.numGroups, in.groupsPerToken, in.tokensPerRank,
                in.ranksPerNode, in.nicGBps, in.nvlinkGBps);
    std::printf("%4s %-10s %9s %9s | %10s %10s %9s | %10s %10s %9s\n", "EP", "scheme", "rank hit", "node hit",
                "disp NIC", "disp NVL", "disp", "comb NIC", "comb NVL", "comb");
    std::printf("%4s %-10s %9s %9s | %10s %10s %9s | %10s %10s %9s\n", "", "", "", "", "(MB)", "(MB)", "(us)",
                "(MB)", "(MB)", "(us)");
    for (int R : {16, 32, 64, 128}) {
      in.numRanks = R;
      const graphep::TrafficModelResult m = graphep::trafficModel(in);
      const struct {
        const char* name;
        const graphep::TrafficPhase &d, &c;
      } rows[] = {{"flat", m.flatDispatch, m.flatCombine}, {"node-aware", m.nodeAwareDispatch, m.nodeAwareCombine}};
      for (const auto& row : rows) {
        std::printf("%4d %-10s %9.4f %9.4f | %10.1f %10.1f %9.1f | %10.1f %10.1f %9.1f\n", R, row.name, m.rankHit,
                    m.nodeHit, row.d.nicBytes / 1e6, row.d.nvlinkBytes / 1e6, row.d.us, row.c.nicBytes / 1e6,
                    row.c.nvlinkBytes / 1e6, row.c.us);
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "graphep-traffic-model: %s\n", e.what());
    return 1;
  }
}
