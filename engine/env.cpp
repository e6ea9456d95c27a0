#include "engine/env.hpp"

#include <cctype>
#include <cerrno>
#include <cstdlib>

#include "engine/error.hpp"

namespace graphep::env {

const StringVar kDebug({"GRAPHEP_DEBUG", Type::kString, "WARN",
                        "log level: NONE, WARN, INFO or TRACE", nullptr, 0, 0});
const StringVar kDebugSubsys({"GRAPHEP_DEBUG_SUBSYS", Type::kString, "ALL",
                              "comma-separated subsystems to log (INIT,COMM,HEAP,TOPO,SYNC,GRAPH,"
                              "TUNE,ALL); a leading ^ excludes them",
                              nullptr, 0, 0});
const IntVar kTimeoutMs({"GRAPHEP_TIMEOUT_MS", Type::kInt, "10000",
                         "bound in milliseconds on every device spin-wait; on expiry the wait "
                         "reports rank, peer, site, expected and observed values and stops",
                         nullptr, 1, 3600000});
const BoolVar kTrapOnTimeout({"GRAPHEP_TRAP_ON_TIMEOUT", Type::kBool, "0",
                              "trap (kill the kernel's context) on a device wait timeout instead "
                              "of recording the error and returning",
                              nullptr, 0, 0});
const ChoiceVar kForceTransport({"GRAPHEP_FORCE_TRANSPORT", Type::kChoice, "auto",
                                 "auto: classify peers from hardware facts; remote: treat every "
                                 "other rank as remote (NCCL transport) to test the mixed path",
                                 "auto|remote", 0, 0});

const IntVar kEpilogueCluster({"GRAPHEP_EPILOGUE_CLUSTER", Type::kInt, "1",
                                "preferred thread-block cluster size of the direct path's epilogue "
                                "kernels (dispatch receive, combine reduce and final); setup takes "
                                "the largest power of two up to it that the GPU can place, down to 1",
                                nullptr, 1, 16});

const ChoiceVar kMoeKernels({"GRAPHEP_MOE_KERNELS", Type::kChoice, "auto",
                             "auto: the MoE throughput path runs its direct kernels wherever every peer is "
                             "reached by load/store (ranks sharing a GPU included, when their share of it holds "
                             "the kernels); movers: it runs over the movers instead (tests, comparison); read at "
                             "engine setup, and any rank asking for the movers moves every rank to them",
                             "auto|movers", 0, 0});

const IntVar kExchangeChunks({"GRAPHEP_EXCHANGE_CHUNKS", Type::kInt, "0",
                               "the MoE throughput path over the movers exchanges records and partials in this "
                               "many chunks, so that pack, exchange and expand overlap (0: automatic, 2 from "
                               "4,096 tokens where some peer is reached through NCCL, else 1); read at engine "
                               "setup, the largest over the ranks",
                               nullptr, 0, 8});

const IntVar kEmulatedNodes({"GRAPHEP_EMULATED_NODES", Type::kInt, "0",
                              "tests only: the ranks split into this many equal nodes of consecutive ranks (each "
                              "inside one machine), and the movers count the bytes their all-to-all-v carries "
                              "between nodes as an emulated network's (Movers::networkBytes; the MoE engine then "
                              "runs over the movers); 0: the nodes are the machines; read at setup",
                              nullptr, 0, 32});

const IntVar kEmulatedNetworkMbps({"GRAPHEP_EMULATED_NETWORK_MBPS", Type::kInt, "0",
                                    "tests and benchmarks, with GRAPHEP_EMULATED_NODES: each rank's sending rate to "
                                    "the other nodes, in MB/s (50000: a 400 Gb/s NIC); each all-to-all-v holds its "
                                    "exchange until its bytes between nodes would have left at that rate; 0: no "
                                    "cap; read at setup",
                                    nullptr, 0, 100'000'000});

const ChoiceVar kNodeAware({"GRAPHEP_NODE_AWARE", Type::kChoice, "auto",
                             "the MoE throughput path over the movers, with ranks on several nodes (some with "
                             "several ranks), sends a token once per remote node and forwards it inside the node "
                             "(on), or once per remote rank (off: the flat scheme); auto: on for emulated nodes "
                             "(GRAPHEP_EMULATED_NODES), off across real machines, where its NCCL exchange has not "
                             "run yet; read at engine setup, off on any rank makes every rank flat, else on on "
                             "any rank turns it on",
                             "auto|on|off", 0, 0});

const StringVar kFaultAfterLaunch({"GRAPHEP_FAULT_AFTER_LAUNCH", Type::kString, "",
                                   "tests only: an MoE operation fails right after queuing the named launch "
                                   "(e.g. direct-send), as a refused later launch would; read at engine setup",
                                   nullptr, 0, 0});

const StringVar kSlowCombineFinal({"GRAPHEP_SLOW_COMBINE_FINAL", Type::kString, "",
                                   "tests only: RANK:US makes that rank's direct combine final kernel wait US "
                                   "microseconds before it reads its peers' partials (a lagging reader); read "
                                   "at engine setup",
                                   nullptr, 0, 0});

const std::vector<const Var*>& all() {
  static const std::vector<const Var*> vars = {
      &kDebug, &kDebugSubsys, &kTimeoutMs, &kTrapOnTimeout, &kForceTransport, &kEpilogueCluster, &kMoeKernels,
      &kExchangeChunks, &kEmulatedNodes, &kEmulatedNetworkMbps, &kNodeAware, &kFaultAfterLaunch, &kSlowCombineFinal};
  return vars;
}

const char* typeName(Type t) {
  switch (t) {
    case Type::kInt: return "int";
    case Type::kBool: return "bool";
    case Type::kString: return "string";
    case Type::kChoice: return "choice";
  }
  return "?";
}

bool Var::isSet() const {
  const char* v = std::getenv(info_.name);
  return v != nullptr && *v != '\0';
}

std::string Var::raw() const {
  const char* v = std::getenv(info_.name);
  return (v != nullptr && *v != '\0') ? std::string(v) : std::string(info_.defaultValue);
}

namespace {
std::string lower(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (!std::isspace(static_cast<unsigned char>(c)))
      out.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  }
  return out;
}
}  // namespace

long long IntVar::parse(std::string_view text) const {
  std::string t(text);
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(t.c_str(), &end, 10);
  GRAPHEP_REQUIRE(!t.empty() && end != nullptr && *end == '\0' && errno == 0,
                  Status::kInvalidArgument, "%s='%s' is not an integer", info_.name, t.c_str());
  GRAPHEP_REQUIRE(v >= info_.min && v <= info_.max, Status::kInvalidArgument,
                  "%s=%lld is out of range [%lld, %lld]", info_.name, v, info_.min, info_.max);
  return v;
}

bool BoolVar::parse(std::string_view text) const {
  std::string t = lower(text);
  if (t == "1" || t == "true" || t == "yes" || t == "on") return true;
  if (t == "0" || t == "false" || t == "no" || t == "off") return false;
  GRAPHEP_FAIL(Status::kInvalidArgument, "%s='%.*s' is not a boolean (1/0, true/false, yes/no, on/off)",
               info_.name, static_cast<int>(text.size()), text.data());
}

std::string ChoiceVar::parse(std::string_view text) const {
  std::string t = lower(text);
  std::string_view choices(info_.choices);
  size_t pos = 0;
  while (pos <= choices.size()) {
    size_t bar = choices.find('|', pos);
    std::string_view c = choices.substr(pos, bar == std::string_view::npos ? bar : bar - pos);
    if (c == t) return t;
    if (bar == std::string_view::npos) break;
    pos = bar + 1;
  }
  GRAPHEP_FAIL(Status::kInvalidArgument, "%s='%.*s' is not one of %s", info_.name,
               static_cast<int>(text.size()), text.data(), info_.choices);
}

}  // namespace graphep::env
