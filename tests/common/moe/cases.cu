// The MoE cases: the standard and mixed-placement lists, their names and indices, and the path each
// is expected to take.
#include "common/gpu_env.hpp"
#include "common/moe/harness.cuh"

namespace graphep::test {

using namespace moe;


bool linePeers(Communicator& comm) {
  std::vector<int> devices;
  if (comm.numLocalRanks() == comm.worldSize()) {
    for (int l = 0; l < comm.numLocalRanks(); ++l) devices.push_back(comm.device(l));
  } else {
    devices = visibleGpus();  // other processes' ranks: on this machine's GPUs
  }
  return gpusTakeWholeLines(devices);
}

MoePath expectedPath(const MoeConfig& cfg, Communicator& comm) {
  if (cfg.path != MoePath::kAuto) return cfg.path;
  const bool remote = envIs("GRAPHEP_FORCE_TRANSPORT", "remote");
  const bool fits = cfg.maxTokensPerRank <= 256 && cfg.maxTokensPerRank * cfg.topK <= 4096;
  return fits && !remote && linePeers(comm) ? MoePath::kLatency : MoePath::kThroughput;
}

bool expectedDirect() {
  const char* nodes = std::getenv("GRAPHEP_EMULATED_NODES");
  const bool emulated = nodes != nullptr && std::atoi(nodes) > 0;
  return !envIs("GRAPHEP_MOE_KERNELS", "movers") && !envIs("GRAPHEP_FORCE_TRANSPORT", "remote") && !emulated;
}

std::string moeCaseName(const MoeCase& c) {
  std::string n = c.name + "_" + name(c.cfg.path);
  for (char& ch : n) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return n;
}


std::vector<MoeCase> standardMoeCases(int R, bool large) {
  std::vector<MoeCase> cases;
  auto base = [&](const char* name, int T, int H, int E, int K) {
    MoeCase c;
    c.name = name;
    c.cfg.maxTokensPerRank = T;
    c.cfg.hidden = H;
    c.cfg.numExperts = E;
    c.cfg.topK = K;
    return c;
  };
  {  // uniform, T varying between calls and across ranks (0, T_max, a negative and a clamped count)
    MoeCase c = base("uniform_varying_T", 64, 128, 2 * R, 2);
    c.tokens = {64, 17, 0, 64, 70, -5};
    cases.push_back(c);
    c.name = "fp8_int64";
    c.indexType = IndexType::kInt64;
    c.cfg.dispatchType = DType::kFp8E4m3;
    c.tokens = {33, 64};
    cases.push_back(c);
  }
  {
    MoeCase c = base("skewed", 64, 256, 4 * R, 2);
    c.routing = Routing::kSkewed;
    c.tokens = {64};
    cases.push_back(c);
    c.name = "rank_empty";  // (one rank: uniform)
    c.routing = Routing::kRankEmpty;
    c.tokens = {40};
    cases.push_back(c);
    c.name = "all_masked";
    c.routing = Routing::kAllMasked;
    c.tokens = {64, 0};
    cases.push_back(c);
    c.name = "invalid_ids";
    c.routing = Routing::kInvalidMixed;
    c.tokens = {50, 7};
    cases.push_back(c);
    c.name = "invalid_ids_int64";
    c.indexType = IndexType::kInt64;
    cases.push_back(c);
  }
  {  // top-1 with one expert per rank (every token bit-exact); top-8 of 256 experts
    MoeCase c = base("top1", 32, 128, R, 1);
    c.tokens = {32, 0, 9};
    cases.push_back(c);
    c = base("top8_of_256", 32, 128, 256 % R == 0 ? 256 : 32 * R, 8);
    c.tokens = {32, 5};
    cases.push_back(c);
  }
  {  // per-expert alignment; a capacity too small for skewed routing (rows dropped, counted, the
     // layout clamped); both together
    MoeCase c = base("aligned", 64, 128, 2 * R, 2);
    c.cfg.expertAlignment = 16;
    c.tokens = {64, 9};
    cases.push_back(c);
    c.name = "overflow_aligned";
    c.routing = Routing::kSkewed;
    c.cfg.recvCapacity = 40;
    c.tokens = {64, 30};
    cases.push_back(c);
    c.name = "overflow";
    c.cfg.expertAlignment = 1;
    c.cfg.recvCapacity = 37;
    c.tokens = {64, 0, 20};
    cases.push_back(c);
  }
  {  // a token naming one expert in several slots: one row per slot, in (token, slot) order
    MoeCase c = base("duplicates", 64, 128, 4 * R, 4);
    c.routing = Routing::kDuplicates;
    c.tokens = {64, 45};
    cases.push_back(c);
  }
  {  // a budget of 3 CTAs per kernel: every group loops over many records and tokens
    MoeCase c = base("budget3", 64, 256, 2 * R, 2);
    c.cfg.smBudget = 3;
    c.tokens = {64, 23};
    cases.push_back(c);
  }
  {  // fp8 at a wider row
    MoeCase c = base("fp8_wide", 64, 2048, 4 * R, 4);
    c.cfg.dispatchType = DType::kFp8E4m3;
    c.tokens = {64, 31};
    cases.push_back(c);
  }
  {  // few tokens at a row past 2,048 values: the latency combine's sums take a token a group of 8
     // warps (every token has one) and each warp sums two chunks or more
    MoeCase c = base("few_wide_rows", 16, 4096, 4 * R, 4);
    c.tokens = {16, 5};
    cases.push_back(c);
  }
  {  // one captured graph (dispatch -> expert -> combine) replayed with new data and counts
    MoeCase c = base("graph_replays", 64, 256, 2 * R, 2);
    c.tokens = {64, 3, 0, 50, 64, 1};
    c.replays = 30;
    c.cfg.profile = true;  // and the kernel timeline stamps
    cases.push_back(c);
    c.name = "graph_replays_fp8";
    c.cfg.profile = false;
    c.cfg.dispatchType = DType::kFp8E4m3;
    c.replays = 12;
    cases.push_back(c);
    c.name = "graph_replays_overflow";
    c.cfg.dispatchType = DType::kBf16;
    c.routing = Routing::kSkewed;
    c.cfg.recvCapacity = 45;
    c.cfg.expertAlignment = 4;
    c.replays = 12;
    cases.push_back(c);
  }
  // Every case so far on both paths: kAuto picks the latency path for these sizes.
  const std::size_t n = cases.size();
  for (std::size_t q = 0; q < n; ++q) {
    MoeCase c = cases[q];
    c.cfg.path = MoePath::kThroughput;
    cases.push_back(c);
  }
  {  // the active-rank mask changed between runs: every rank, ranks left out, put back in. On
     // the latency path (kAuto) and the throughput path; engines that take no mask (the movers:
     // ranks sharing a GPU, or forced remote) run the case with every rank
    MoeCase c = base("active_mask", 64, 256, 4 * R, 4);
    c.tokens = {64, 33, 1, 0, 64, 50, 17};
    c.masks = {~0u, 0b1110u, 0b0110u, ~0u, 0b0101u, 0b1011u, 0b0001u, 0b1101u, 0b0010u};
    cases.push_back(c);
    c.name = "active_mask_graph";  // one captured graph, the mask changed between replays
    c.replays = 18;
    cases.push_back(c);
    for (const char* name : {"active_mask", "active_mask_graph"}) {
      c.name = name;
      c.replays = c.name == "active_mask" ? 0 : 18;
      c.cfg.path = MoePath::kThroughput;
      cases.push_back(c);
    }
  }
  if (large) {  // the DeepSeek-V3 shape at decode size, both paths
    MoeCase c = base("deepseek_v3_decode", 128, 7168, 256, 8);
    c.tokens = {128, 77};
    cases.push_back(c);
    c.name = "deepseek_v3_decode_fp8";
    c.cfg.dispatchType = DType::kFp8E4m3;
    cases.push_back(c);
    c.name = "deepseek_v3_decode_graph";
    c.cfg.dispatchType = DType::kBf16;
    c.replays = 6;  // every token count once, two again; the host reference takes about 1 s a replay
    c.tokens = {128, 1, 100, 0};
    cases.push_back(c);
    c.cfg.path = MoePath::kThroughput;
    cases.push_back(c);
    MoeCase p = base("prefill_skewed", 512, 2048, 16, 2);
    p.routing = Routing::kSkewed;
    p.tokens = {512, 260};
    cases.push_back(p);
    p = base("prefill_duplicates", 512, 256, 16, 4);  // duplicates across 16 32-token blocks
    p.routing = Routing::kDuplicates;
    p.tokens = {512, 300};
    cases.push_back(p);
  }
  return cases;
}

// The case of the issue that found the mixed co-residency defect: 8 ranks over 2 GPUs, throughput
// path, H = 2048, 128 experts, top-8, 512 tokens, int64 ids (and its latency-path twin at 256).
std::vector<MoeCaseIndex> moeCaseIndices(MoeCaseList list) {
  std::vector<MoeCaseIndex> out;
  const std::vector<MoeCase> cases = moeCases(list, 2);
  for (std::size_t i = 0; i < cases.size(); ++i) out.push_back(MoeCaseIndex{list, static_cast<int>(i), moeCaseName(cases[i])});
  return out;
}

std::vector<MoeCaseIndex> throughputCaseIndices() {
  std::vector<MoeCaseIndex> out;
  std::string tail = "_";
  tail += name(MoePath::kThroughput);
  for (const MoeCaseIndex& c : moeCaseIndices(MoeCaseList::kSmall)) {
    if (c.name.size() > tail.size() && c.name.compare(c.name.size() - tail.size(), tail.size(), tail) == 0) out.push_back(c);
  }
  return out;
}

std::vector<MoeCase> moeCases(MoeCaseList list, int worldSize) {
  switch (list) {
    case MoeCaseList::kSmall: return standardMoeCases(worldSize, false);
    case MoeCaseList::kLarge: return standardMoeCases(worldSize, true);
    case MoeCaseList::kMixedPlacement: return mixedPlacementMoeCases();
  }
  return {};
}

void runMoeCaseAt(Communicator& comm, const MoeCaseIndex& at) {
  const std::vector<MoeCase> cases = moeCases(at.list, comm.worldSize());
  ASSERT_LT(static_cast<std::size_t>(at.index), cases.size());
  const MoeCase& c = cases[static_cast<std::size_t>(at.index)];
  ASSERT_EQ(moeCaseName(c), at.name) << "the case list depends on the world size";
  runMoeCase(comm, c);
}

std::vector<MoeCase> mixedPlacementMoeCases() {
  std::vector<MoeCase> cases;
  MoeCase c;
  c.name = "prefill_h2048_e128_top8";
  c.cfg.maxTokensPerRank = 512;
  c.cfg.hidden = 2048;
  c.cfg.numExperts = 128;
  c.cfg.topK = 8;
  c.cfg.path = MoePath::kThroughput;
  c.indexType = IndexType::kInt64;
  c.tokens = {512, 100, 0};
  cases.push_back(c);
  c.name = "prefill_h2048_e128_top8_sms64";  // 64 channels per link asked for: the cap must hold
  c.cfg.smBudget = 64;
  c.tokens = {512};
  cases.push_back(c);
  c.cfg.smBudget = 0;
  c.name = "decode_h2048_e128_top8";
  c.cfg.maxTokensPerRank = 128;
  c.cfg.path = MoePath::kAuto;
  c.tokens = {128, 31, 0};
  cases.push_back(c);
  return cases;
}


}  // namespace graphep::test
