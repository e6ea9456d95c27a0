// graphep-bench [op] [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP] [-R REPEATS] [-c 0|1] [-G OPS_PER_GRAPH]
//               [--sms N] [--warps N] [--slot BYTES] [--slots N] [--ll BYTES] [--profile] [--json FILE]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

#include "bench/harness.hpp"
#include "engine/error.hpp"

#if defined(GRAPHEP_BENCH_MPI)
#include <mpi.h>
#endif

namespace {

std::size_t parseSize(const char* s) {
  char* end = nullptr;
  double v = std::strtod(s, &end);
  std::string unit(end ? end : "");
  double mul = 1;
  if (unit == "K" || unit == "k") mul = 1024;
  else if (unit == "M" || unit == "m") mul = 1024.0 * 1024;
  else if (unit == "G" || unit == "g") mul = 1024.0 * 1024 * 1024;
  else
    GRAPHEP_REQUIRE(unit.empty(), graphep::Status::kInvalidArgument,
                    "size '%s' has an unknown unit (use K, M or G)", s);
  return static_cast<std::size_t>(v * mul);
}

int usage() {
  std::fprintf(stderr,
               "usage: graphep-bench [pingpong|sendrecv|allgather|alltoallv|moe] [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] "
               "[-w WARMUP] [-R REPEATS] [-c 0|1] [-G OPS_PER_GRAPH] [--sms N] [--warps N] [--slot BYTES] [--slots N] [--ll BYTES] [--profile] [--host-cost] [--microbatches US] [--halves US] [--combine-weights] "
               "[--ranks N] [--json FILE]\n"
               "       in one process: one rank per visible GPU, or --ranks N round-robin over them; under mpirun: one per process\n"
               "       moe: -b/-e are tokens per rank; [--hidden H] [--experts E] [--topk K] [--dtype bf16|fp8|both] [--path auto|latency|throughput]\n"
               "            [--epilogue-sms N] [--layout expert-major|batched|rank-major]\n");
  return 2;
}

}  // namespace

// True when started by mpirun/srun with more than one process.
bool launchedByMpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"}) {
    const char* v = std::getenv(var);
    if (v != nullptr && std::atoi(v) > 1) return true;
  }
  return false;
}

int run(int argc, char** argv, bool mpi);

int main(int argc, char** argv) {
  const bool mpi = launchedByMpi();
#if defined(GRAPHEP_BENCH_MPI)
  if (mpi) MPI_Init(&argc, &argv);
  int rc = run(argc, argv, mpi);
  if (mpi) {
    int worst = 0;
    MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    MPI_Finalize();
    rc = worst;
  }
  return rc;
#else
  if (mpi) {
    std::fprintf(stderr, "graphep-bench: started by mpirun, but built without MPI\n");
    return 2;
  }
  return run(argc, argv, false);
#endif
}

int run(int argc, char** argv, bool mpi) {
  using namespace graphep::bench;
  Options o;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // rows appear as they are measured, even into a file
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto next = [&]() -> const char* {
        GRAPHEP_REQUIRE(i + 1 < argc, graphep::Status::kInvalidArgument, "%s needs a value",
                        a.c_str());
        return argv[++i];
      };
      if (a == "-b") o.minBytes = parseSize(next());
      else if (a == "-e") o.maxBytes = parseSize(next());
      else if (a == "-f") o.factor = std::atof(next());
      else if (a == "-n") o.iters = std::atoi(next());
      else if (a == "-w") o.warmup = std::atoi(next());
      else if (a == "-R") o.repeats = std::atoi(next());
      else if (a == "-c") o.check = std::atoi(next()) != 0;
      else if (a == "-G") o.opsPerGraph = std::atoi(next());
      else if (a == "--sms") o.sms = std::atoi(next());
      else if (a == "--epilogue-sms") o.epilogueSms = std::atoi(next());
      else if (a == "--warps") o.warpsPerRole = std::atoi(next());
      else if (a == "--slot") o.slotBytes = parseSize(next());
      else if (a == "--slots") o.numSlots = std::atoi(next());
      else if (a == "--ll") o.llBytes = parseSize(next());
      else if (a == "--profile") o.profile = true;
      else if (a == "--host-cost") o.hostCost = true;
      else if (a == "--microbatches") o.busyUs = std::atoi(next());
      else if (a == "--halves") o.halvesUs = std::atoi(next());
      else if (a == "--combine-weights") o.combineWeights = true;
      else if (a == "--hidden") o.moeHidden = std::atoi(next());
      else if (a == "--experts") o.moeExperts = std::atoi(next());
      else if (a == "--topk") o.moeTopK = std::atoi(next());
      else if (a == "--dtype") o.moeDtype = next();
      else if (a == "--path") o.moePath = next();
      else if (a == "--layout") o.moeLayout = next();
      else if (a == "--json") o.json = next();
      else if (a == "--ranks") o.ranks = std::atoi(next());
      else if (a == "-h" || a == "--help") return usage();
      else if (a[0] != '-') o.op = a;
      else return usage();
    }
    GRAPHEP_REQUIRE(o.iters > 0 && o.warmup >= 0, graphep::Status::kInvalidArgument,
                    "-n %d / -w %d: iterations must be positive", o.iters, o.warmup);
    GRAPHEP_REQUIRE(o.opsPerGraph >= 1, graphep::Status::kInvalidArgument,
                    "-G %d: operations per graph must be at least 1", o.opsPerGraph);
    GRAPHEP_REQUIRE(o.halvesUs >= 0, graphep::Status::kInvalidArgument, "--halves %d: microseconds must not be negative",
                    o.halvesUs);
    GRAPHEP_REQUIRE(o.repeats >= 1, graphep::Status::kInvalidArgument,
                    "-R %d: repeats must be at least 1", o.repeats);
    auto ranks = makeRanks(mpi, o.ranks);
    setPrinter(ranks->rank(0) == 0);
    printHeader(o, *ranks);
    std::vector<Row> rows;
    if (o.op == "pingpong") {
      rows = runPingPong(o, *ranks);
    } else if (o.op == "sendrecv") {
      rows = runSendRecv(o, *ranks);
    } else if (o.op == "allgather") {
      rows = runAllGather(o, *ranks);
    } else if (o.op == "alltoallv") {
      rows = runAllToAllv(o, *ranks);
    } else if (o.op == "moe") {
      GRAPHEP_REQUIRE(o.moeDtype == "bf16" || o.moeDtype == "fp8" || o.moeDtype == "both",
                      graphep::Status::kInvalidArgument, "--dtype %s: expected bf16, fp8 or both",
                      o.moeDtype.c_str());
      GRAPHEP_REQUIRE(o.moePath == "auto" || o.moePath == "latency" || o.moePath == "throughput",
                      graphep::Status::kInvalidArgument,
                      "--path %s: expected auto, latency or throughput", o.moePath.c_str());
      GRAPHEP_REQUIRE(o.moeLayout == "expert-major" || o.moeLayout == "batched" || o.moeLayout == "rank-major",
                      graphep::Status::kInvalidArgument, "--layout %s: expected expert-major, batched or rank-major",
                      o.moeLayout.c_str());
      rows = runMoe(o, *ranks);
    } else {
      GRAPHEP_FAIL(graphep::Status::kInvalidArgument,
                   "unknown operation '%s' (known: pingpong, sendrecv, allgather, alltoallv, moe)", o.op.c_str());
    }
    long long wrong = 0;
    for (const Row& r : rows) wrong += r.wrong;
    if (!o.json.empty()) writeJson(o.json, o, rows);
    if (isPrinter()) std::printf("# total #wrong: %lld\n", wrong);
    return wrong == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "graphep-bench: %s\n", e.what());
    return 1;
  }
}
