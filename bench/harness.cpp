#include "bench/harness.hpp"

#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <set>
#include <utility>

#include <graphep/graphep.hpp>

#include "engine/error.hpp"

namespace graphep::bench {

Ranks::~Ranks() {
  for (size_t i = 0; i < streams.size(); ++i) {
    cudaSetDevice(devices[i]);
    cudaStreamDestroy(streams[i]);
  }
}

std::unique_ptr<Ranks> makeRanks(bool mpi, int ranks) {
  auto r = std::make_unique<Ranks>();
  const char* reason = nullptr;
  const int n = cudaDeviceCountOrZero(&reason);
  GRAPHEP_REQUIRE(n > 0, Status::kNoDevice, "graphep-bench needs a GPU (%s)", reason);
  if (mpi) {
    GRAPHEP_REQUIRE(ranks == 0, Status::kInvalidArgument,
                    "--ranks %d: under mpirun the ranks are the processes (-np)", ranks);
    r->mpi = true;
    r->comm = createMpiCommunicator(-1, /*withNccl=*/true);
    GRAPHEP_REQUIRE(r->comm->worldSize() >= 2, Status::kInvalidArgument,
                    "graphep-bench needs at least 2 ranks; mpirun started %d", r->comm->worldSize());
    r->devices = {r->comm->device(0)};
  } else {
    GRAPHEP_REQUIRE(ranks == 0 || (ranks >= 2 && ranks <= kMaxRanks), Status::kInvalidArgument,
                    "--ranks %d: expected 2 to %d", ranks, kMaxRanks);
    const int R = ranks > 0 ? ranks : std::min(std::max(n, 2), kMaxRanks);
    for (int i = 0; i < R; ++i) r->devices.push_back(i % n);  // round-robin over the visible GPUs
    r->comm = createLocalGroup(r->devices);
    if (R <= n) r->ncclGroup = createNcclGroup(r->devices);
  }
  for (int d : r->devices) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(d));
    cudaStream_t s;
    GRAPHEP_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    r->streams.push_back(s);
  }
  return r;
}

double timeIterations(Ranks& r, int warmup, int iters, const std::function<void()>& launch) {
  const size_t n = r.devices.size();
  for (int i = 0; i < warmup; ++i) launch();
  std::vector<cudaEvent_t> start(n), stop(n);
  for (size_t i = 0; i < n; ++i) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[i]));
    GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(r.streams[i]));
    GRAPHEP_CUDA_CHECK(cudaEventCreate(&start[i]));
    GRAPHEP_CUDA_CHECK(cudaEventCreate(&stop[i]));
    GRAPHEP_CUDA_CHECK(cudaEventRecord(start[i], r.streams[i]));
  }
  r.comm->barrier();  // processes start the timed region together
  for (int i = 0; i < iters; ++i) launch();
  double worst = 0;
  for (size_t i = 0; i < n; ++i) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[i]));
    GRAPHEP_CUDA_CHECK(cudaEventRecord(stop[i], r.streams[i]));
  }
  for (size_t i = 0; i < n; ++i) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[i]));
    GRAPHEP_CUDA_CHECK(cudaEventSynchronize(stop[i]));
    float ms = 0;
    GRAPHEP_CUDA_CHECK(cudaEventElapsedTime(&ms, start[i], stop[i]));
    worst = std::max(worst, static_cast<double>(ms));
    cudaEventDestroy(start[i]);
    cudaEventDestroy(stop[i]);
  }
  // The slowest rank anywhere: gather every local worst.
  std::vector<double> mine(n, worst), all(static_cast<size_t>(r.worldSize()));
  r.comm->allgather(mine.data(), all.data(), sizeof(double));
  for (double w : all) worst = std::max(worst, w);
  return worst * 1000.0 / std::max(iters, 1);
}

std::vector<cudaGraphExec_t> captureEach(Ranks& r,
                                         const std::function<void(int, cudaStream_t)>& enqueue) {
  std::vector<cudaGraphExec_t> execs;
  for (size_t i = 0; i < r.devices.size(); ++i) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[i]));
    GRAPHEP_CUDA_CHECK(cudaStreamBeginCapture(r.streams[i], cudaStreamCaptureModeThreadLocal));
    enqueue(static_cast<int>(i), r.streams[i]);
    cudaGraph_t g;
    GRAPHEP_CUDA_CHECK(cudaStreamEndCapture(r.streams[i], &g));
    cudaGraphExec_t e;
    GRAPHEP_CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
    GRAPHEP_CUDA_CHECK(cudaGraphDestroy(g));
    execs.push_back(e);
  }
  return execs;
}

std::vector<cudaGraphExec_t> captureAll(Ranks& r, const std::function<void()>& enqueueAll) {
  for (size_t i = 0; i < r.devices.size(); ++i) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[i]));
    GRAPHEP_CUDA_CHECK(cudaStreamBeginCapture(r.streams[i], cudaStreamCaptureModeThreadLocal));
  }
  enqueueAll();
  // End every capture before instantiating: instantiation is not permitted while another stream
  // of this thread is still capturing.
  std::vector<cudaGraph_t> graphs;
  for (size_t i = 0; i < r.devices.size(); ++i) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[i]));
    cudaGraph_t g;
    GRAPHEP_CUDA_CHECK(cudaStreamEndCapture(r.streams[i], &g));
    graphs.push_back(g);
  }
  std::vector<cudaGraphExec_t> execs;
  for (size_t i = 0; i < r.devices.size(); ++i) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[i]));
    cudaGraphExec_t e;
    GRAPHEP_CUDA_CHECK(cudaGraphInstantiate(&e, graphs[i], 0));
    GRAPHEP_CUDA_CHECK(cudaGraphDestroy(graphs[i]));
    execs.push_back(e);
  }
  return execs;
}

std::vector<cudaGraphExec_t> captureOps(const Options& o, Ranks& r,
                                        const std::function<void(int, cudaStream_t)>& enqueue) {
  return captureEach(r, [&](int i, cudaStream_t s) {
    for (int k = 0; k < o.opsPerGraph; ++k) enqueue(i, s);
  });
}

std::vector<cudaGraphExec_t> captureOpsAll(const Options& o, Ranks& r, const std::function<void()>& enqueueAll) {
  return captureAll(r, [&] {
    for (int k = 0; k < o.opsPerGraph; ++k) enqueueAll();
  });
}

double ncclAllToAllvUs(const Options& o, Ranks& r, const std::vector<char*>& src, const std::vector<char*>& dst,
                       const std::function<std::size_t(int from, int to)>& bytes) {
  if (!r.hasNccl()) return 0;
  const int R = r.worldSize();
  auto execs = captureOpsAll(o, r, [&] {
    GRAPHEP_NCCL_CHECK(ncclGroupStart());
    for (int i = 0; i < r.numLocal(); ++i) {
      const int me = r.rank(i);
      const std::size_t li = static_cast<std::size_t>(i);
      std::size_t sendOff = 0, recvOff = 0;
      for (int q = 0; q < R; ++q) {
        const std::size_t out = bytes(me, q), in = bytes(q, me);
        if (out > 0) GRAPHEP_NCCL_CHECK(ncclSend(src[li] + sendOff, out, ncclChar, q, r.ncclComm(i), r.streams[li]));
        if (in > 0) GRAPHEP_NCCL_CHECK(ncclRecv(dst[li] + recvOff, in, ncclChar, q, r.ncclComm(i), r.streams[li]));
        sendOff += out;
        recvOff += in;
      }
    }
    GRAPHEP_NCCL_CHECK(ncclGroupEnd());
  });
  return timeOps(o, r, execs);
}

double timeOps(const Options& o, Ranks& r, std::vector<cudaGraphExec_t>& execs) {
  // -R repeats the timed loop and keeps the median (the slowest rank's time in each repeat, so
  // every process takes the same value).
  std::vector<double> times;
  for (int k = 0; k < o.repeats; ++k) {
    times.push_back(timeIterations(r, k == 0 ? o.warmup : 0, o.iters, [&] { launchEach(r, execs); }));
  }
  destroyEach(r, execs);
  std::sort(times.begin(), times.end());
  const std::size_t n = times.size();
  const double median = n % 2 == 1 ? times[n / 2] : 0.5 * (times[n / 2 - 1] + times[n / 2]);
  return median / o.opsPerGraph;
}

MoverBench makeMoverBench(const Options& o, Ranks& r, std::size_t userBytes, std::size_t remoteBytesPerPeer) {
  HeapConfig cfg;
  cfg.numRanks = r.worldSize();
  cfg.userBytes = userBytes;
  cfg.moverSlotBytes = o.slotBytes;
  cfg.moverSlots = o.numSlots;
  cfg.moverBlocks = std::max(HeapConfig{}.moverBlocks, o.sms);
  cfg.moverWarps = o.warpsPerRole;
  cfg.moverLLBytes = o.llBytes;
  MoverBench b;
  b.heap = SymmetricHeap::create(*r.comm, cfg);
  MoverOptions mo;
  mo.profile = o.profile;
  mo.maxRemoteBytesPerPeer = remoteBytesPerPeer;  // the NCCL stages, made only where some peer is remote
  b.movers = Movers::createAll(*b.heap, mo);
  return b;
}

void printProfile(const char* what, std::size_t bytes, const ProfileCounters& c) {
  if (!isPrinter()) return;
  auto per = [](const unsigned long long* v, int i) {
    return v[3] > 0 ? static_cast<double>(v[i]) / 1e3 / static_cast<double>(v[3]) : 0.0;
  };
  std::printf("# profile %s %zu B, us per chunk (rank 0, thread 0 of each role): sender wait %.2f "
              "copy %.2f publish %.2f (%llu chunks); receiver wait %.2f copy %.2f publish %.2f "
              "(%llu chunks)\n",
              what, bytes, per(c.send, 0), per(c.send, 1), per(c.send, 2), c.send[3], per(c.recv, 0),
              per(c.recv, 1), per(c.recv, 2), c.recv[3]);
}

void requireNoDeviceError(const SymmetricHeap& heap) {
  for (int i = 0; i < heap.numLocalRanks(); ++i) {
    const std::string err = heap.errorMessage(i);
    GRAPHEP_REQUIRE(err.empty(), Status::kRemoteError, "device error: %s", err.c_str());
  }
}

long long totalOverRanks(Ranks& r, long long mine) {
  std::vector<long long> local(static_cast<size_t>(r.numLocal()), 0);
  local[0] = mine;
  std::vector<long long> all(static_cast<size_t>(r.worldSize()));
  r.comm->allgather(local.data(), all.data(), sizeof(long long));
  long long total = 0;
  for (long long v : all) total += v;
  return total;
}

void addMoverRow(std::vector<Row>& rows, Ranks& r, const char* op, std::string variant, std::size_t bytes,
                 double us, BusBw bus, long long wrong, double ncclUs) {
  const int R = r.worldSize();
  const double algbw = us > 0 ? static_cast<double>(bytes) / (us * 1e3) : 0;
  Row row{op, std::move(variant), bytes, us, algbw, bus == BusBw::kCollective ? algbw * (R - 1) / R : algbw,
          totalOverRanks(r, wrong), ncclUs, ""};
  printRow(row);
  rows.push_back(row);
}

void launchEach(Ranks& r, const std::vector<cudaGraphExec_t>& execs) {
  for (size_t i = 0; i < execs.size(); ++i) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[i]));
    GRAPHEP_CUDA_CHECK(cudaGraphLaunch(execs[i], r.streams[i]));
  }
}

void destroyEach(Ranks& r, std::vector<cudaGraphExec_t>& execs) {
  for (size_t i = 0; i < execs.size(); ++i) {
    cudaSetDevice(r.devices[i]);
    cudaGraphExecDestroy(execs[i]);
  }
  execs.clear();
}

namespace {
bool gPrinter = true;
}  // namespace

void setPrinter(bool printer) { gPrinter = printer; }
bool isPrinter() { return gPrinter; }

namespace {
// Copy-engine peer copy bandwidth, the link ceiling printed in the header: 0 -> 1 alone, and per
// direction with both GPUs copying to each other at once (what a bidirectional sendrecv faces).
struct LinkCeiling {
  double oneWay = 0, bothWays = 0;
};
LinkCeiling peerCopyGBs(const Ranks& r) {
  if (r.numLocal() < 2 || r.devices[0] == r.devices[1]) return {};
  const size_t bytes = size_t{256} << 20;
  void* src[2] = {};
  void* dst[2] = {};
  cudaEvent_t s[2], e[2];
  for (int i = 0; i < 2; ++i) {
    // Without peer access the copy is staged through host memory: enable it first.
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[static_cast<size_t>(i)]));
    cudaError_t pe = cudaDeviceEnablePeerAccess(r.devices[static_cast<size_t>(1 - i)], 0);
    if (pe != cudaSuccess && pe != cudaErrorPeerAccessAlreadyEnabled) GRAPHEP_CUDA_CHECK(pe);
    cudaGetLastError();
    GRAPHEP_CUDA_CHECK(cudaMalloc(&src[i], bytes));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&dst[i], bytes));
    GRAPHEP_CUDA_CHECK(cudaMemset(src[i], 1 + i, bytes));
    GRAPHEP_CUDA_CHECK(cudaEventCreate(&s[i]));
    GRAPHEP_CUDA_CHECK(cudaEventCreate(&e[i]));
  }
  const int reps = 5;
  // One timed batch of `reps` copies per direction in `dirs`; returns GB/s per direction.
  auto timed = [&](int dirs) {
    for (int i = 0; i < dirs; ++i) {  // warm-up copy, then the timed batch
      const size_t me = static_cast<size_t>(i), peer = static_cast<size_t>(1 - i);
      GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[me]));
      GRAPHEP_CUDA_CHECK(cudaMemcpyPeerAsync(dst[1 - i], r.devices[peer], src[i], r.devices[me],
                                             bytes, r.streams[me]));
    }
    for (int i = 0; i < dirs; ++i) GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(r.streams[static_cast<size_t>(i)]));
    for (int i = 0; i < dirs; ++i) {
      const size_t me = static_cast<size_t>(i), peer = static_cast<size_t>(1 - i);
      GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[me]));
      GRAPHEP_CUDA_CHECK(cudaEventRecord(s[i], r.streams[me]));
      for (int k = 0; k < reps; ++k)
        GRAPHEP_CUDA_CHECK(cudaMemcpyPeerAsync(dst[1 - i], r.devices[peer], src[i], r.devices[me],
                                               bytes, r.streams[me]));
      GRAPHEP_CUDA_CHECK(cudaEventRecord(e[i], r.streams[me]));
    }
    double worst = 1e300;
    for (int i = 0; i < dirs; ++i) {
      GRAPHEP_CUDA_CHECK(cudaEventSynchronize(e[i]));
      float ms = 0;
      GRAPHEP_CUDA_CHECK(cudaEventElapsedTime(&ms, s[i], e[i]));
      worst = std::min(worst, static_cast<double>(bytes) * reps / (ms * 1e-3) / 1e9);
    }
    return worst;
  };
  LinkCeiling c;
  c.oneWay = timed(1);
  c.bothWays = timed(2);
  for (int i = 0; i < 2; ++i) {
    cudaSetDevice(r.devices[static_cast<size_t>(i)]);
    cudaEventDestroy(s[i]);
    cudaEventDestroy(e[i]);
    cudaFree(src[i]);
    cudaFree(dst[i]);
  }
  return c;
}
}  // namespace

void printHeader(const Options& o, const Ranks& r) {
  if (!gPrinter) return;
  const LinkCeiling link = peerCopyGBs(r);  // in-process 2 GPUs only; 0 otherwise
  int nccl = 0;
  ncclGetVersion(&nccl);
  std::printf("# graphep-bench %s  op=%s  ops/graph=%d  graph launches=%d  warmup=%d  NCCL %d\n",
              versionString(), o.op.c_str(), o.opsPerGraph, o.iters, o.warmup, nccl);
  for (int i = 0; i < r.numLocal(); ++i) {
    cudaDeviceProp p{};
    cudaGetDeviceProperties(&p, r.devices[static_cast<size_t>(i)]);
    std::printf("#  rank %d: device %d %s (%d SMs)\n", r.rank(i), r.devices[static_cast<size_t>(i)],
                p.name, p.multiProcessorCount);
  }
  const int R = r.worldSize();
  if (r.mpi) {
    std::printf("#  mpirun: %d processes, one GPU each (only rank 0 prints)\n", R);
  } else if (r.devices[0] != r.devices[1]) {
    int atomics = 0, can = 0;
    cudaDeviceCanAccessPeer(&can, r.devices[0], r.devices[1]);
    cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, r.devices[0],
                              r.devices[1]);
    std::printf("#  link 0<->1: p2p=%d native-atomics=%d, copy-engine peer copy 256 MiB: %.1f GB/s "
                "one way, %.1f GB/s per direction both ways at once\n",
                can, atomics, link.oneWay, link.bothWays);
  }
  if (!r.mpi && !r.hasNccl()) {
    const std::size_t gpus = std::set<int>(r.devices.begin(), r.devices.end()).size();
    std::printf("#  %d ranks on %zu GPU(s): no NCCL baseline (NCCL refuses two ranks on one GPU)\n", R, gpus);
  }
  std::printf("#\n# %-10s %-28s %12s %10s %10s %10s %8s %12s %8s\n", "op", "variant", "size",
              "time", "algbw", "busbw", "#wrong", "nccl", "ratio");
  std::printf("# %-10s %-28s %12s %10s %10s %10s %8s %12s %8s\n", "", "", "(B)", "(us)", "(GB/s)",
              "(GB/s)", "", "(us)", "(x)");
}

void printRow(const Row& row) {
  if (!gPrinter) return;
  char nccl[32] = "n/a", ratio[32] = "n/a";
  if (row.ncclUs > 0) {
    std::snprintf(nccl, sizeof(nccl), "%.2f", row.ncclUs);
    std::snprintf(ratio, sizeof(ratio), "%.2f", row.ncclUs / row.timeUs);
  }
  std::printf("  %-10s %-28s %12zu %10.2f %10.2f %10.2f %8lld %12s %8s  %s\n", row.op.c_str(),
              row.variant.c_str(), row.bytes, row.timeUs, row.algbwGBs, row.busbwGBs, row.wrong,
              nccl, ratio, row.note.c_str());
  std::fflush(stdout);
}

void progress(const char* what) {
  if (!gPrinter) return;
  std::fprintf(stderr, "# ... %s\n", what);
  std::fflush(stderr);
}

void writeJson(const std::string& path, const Options& o, const std::vector<Row>& rows) {
  if (!gPrinter) return;
  std::ofstream f(path);
  GRAPHEP_REQUIRE(f.good(), Status::kSystemError, "cannot write --json file '%s'", path.c_str());
  f << "{\"graphep\":\"" << versionString() << "\",\"op\":\"" << o.op << "\",\"rows\":[";
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    f << (i ? "," : "") << "{\"op\":\"" << r.op << "\",\"variant\":\"" << r.variant
      << "\",\"bytes\":" << r.bytes << ",\"time_us\":" << r.timeUs << ",\"algbw_gbs\":"
       << r.algbwGBs << ",\"busbw_gbs\":" << r.busbwGBs << ",\"wrong\":" << r.wrong << ",\"nccl_us\":" << r.ncclUs << "}";
  }
  f << "]}\n";
}

}  // namespace graphep::bench
