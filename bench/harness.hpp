// The graphep-bench harness: nccl-tests-style flags, a fixed-width table with a correctness
// column beside every timing, an NCCL baseline in the same run, optional JSON output.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <graphep/comm.hpp>

#include "engine/heap.hpp"
#include "engine/movers.hpp"

namespace graphep::bench {

struct Options {
  std::string op = "pingpong";
  std::size_t minBytes = 1024, maxBytes = 1 << 20;  // -b -e
  double factor = 2.0;                              // -f
  int iters = 20;                                   // -n
  int warmup = 5;                                   // -w
  int repeats = 1;                                  // -R (timed loops per row; the median counts)
  bool check = true;                                // -c
  int opsPerGraph = 10;                             // -G (operations captured back to back per graph)
  int sms = 0;                                      // --sms (0: operation default)
  int epilogueSms = 0;                              // --epilogue-sms (moe: MoeConfig.epilogueSms)
  std::string json;                                 // --json FILE
  int warpsPerRole = 8;                             // --warps (movers: warps per role per CTA)
  std::size_t slotBytes = std::size_t{1} << 20;     // --slot (movers: staging slot size)
  int numSlots = 4;                                 // --slots (movers: slots per channel)
  std::size_t llBytes = 16384;                      // --ll (movers: LL capacity per channel)
  bool profile = false;                             // --profile (movers: staged phase times)
  int moeHidden = 7168;                             // --hidden (moe)
  int moeExperts = 256;                             // --experts (moe)
  int moeTopK = 8;                                  // --topk (moe)
  std::string moeDtype = "both";                    // --dtype bf16|fp8|both (moe dispatch)
  std::string moePath = "auto";                     // --path auto|latency|throughput (moe)
  std::string moeLayout = "expert-major";           // --layout expert-major|batched|rank-major (moe)
  bool hostCost = false;                            // --host-cost (moe): launch cost, graph vs eager
  int busyUs = 0;                                   // --microbatches US (moe): two in flight, expert of US
  int halvesUs = 0;                                 // --halves US (moe, latency path): send half, US idle, receive half
  bool combineWeights = false;                      // --combine-weights (moe, latency path): weights with the combine
  int ranks = 0;                                    // --ranks N (one process): 0 = one per visible GPU
};

struct Row {
  std::string op, variant;
  std::size_t bytes = 0;
  double timeUs = 0;        // graphep, per operation
  double algbwGBs = 0;      // 0 when not meaningful (latency rows)
  double busbwGBs = 0;      // nccl-tests bus bandwidth (bench/README.md)
  long long wrong = 0;      // mismatching elements / lost signals
  double ncclUs = 0;        // baseline through NCCL in the same run; 0 when not available
  std::string note;
};

// The R ranks a benchmark drives. In one process (the default): one rank per visible GPU, or
// --ranks N placed round-robin over them (2 emulated ranks on GPU 0 when there is one GPU); NCCL
// comms too when every rank has a GPU of its own (NCCL refuses two ranks on one GPU). Under
// `mpirun -np R`: one rank per process, NCCL from an MPI-broadcast unique id. Index i below is a
// local rank of this process; rank(i) its global rank in [0, R).
struct Ranks {
  std::unique_ptr<Communicator> comm;       // local group, or MPI (one rank per process)
  std::unique_ptr<Communicator> ncclGroup;  // in-process NCCL comms (a GPU per rank), or null
  std::vector<int> devices;                 // per local rank
  std::vector<cudaStream_t> streams;        // per local rank
  bool mpi = false;
  int numLocal() const { return static_cast<int>(devices.size()); }
  int worldSize() const { return comm->worldSize(); }
  int rank(int i) const { return comm->globalRank(i); }
  ncclComm_t ncclComm(int i) const {
    return mpi ? comm->ncclComm(i) : (ncclGroup ? ncclGroup->ncclComm(i) : nullptr);
  }
  bool hasNccl() const { return ncclComm(0) != nullptr; }
  ~Ranks();
};
// mpi: one rank per process under mpirun (MPI already initialised by the caller); ranks: in one
// process, how many (0: one per visible GPU, at least 2).
std::unique_ptr<Ranks> makeRanks(bool mpi, int ranks);

// Times `launch()` (which enqueues one iteration on every local rank's stream) with events on
// every stream, after a barrier across processes; returns microseconds per iteration of the
// slowest rank (across processes too).
double timeIterations(Ranks& r, int warmup, int iters, const std::function<void()>& launch);

// Captures `enqueue(rankIndex, stream)` for every rank into one graph per rank.
std::vector<cudaGraphExec_t> captureEach(Ranks& r, const std::function<void(int, cudaStream_t)>& enqueue);
// Captures enqueueAll(), which enqueues onto all ranks' streams at once (e.g. grouped NCCL calls).
std::vector<cudaGraphExec_t> captureAll(Ranks& r, const std::function<void()>& enqueueAll);
void launchEach(Ranks& r, const std::vector<cudaGraphExec_t>& execs);

// Operation timing as nccl-tests does it in graph mode: o.opsPerGraph back-to-back copies of the
// operation are captured into one graph per rank (so host launch cost is amortised), and the time
// per operation is the graph's time divided by o.opsPerGraph. captureOpsAll is for enqueues that
// drive every rank at once (grouped NCCL calls).
std::vector<cudaGraphExec_t> captureOps(const Options& o, Ranks& r,
                                        const std::function<void(int, cudaStream_t)>& enqueue);
std::vector<cudaGraphExec_t> captureOpsAll(const Options& o, Ranks& r, const std::function<void()>& enqueueAll);
// Times the graphs (o.warmup + o.iters launches), destroys them, returns microseconds per operation.
double timeOps(const Options& o, Ranks& r, std::vector<cudaGraphExec_t>& execs);
// The NCCL baseline of an all-to-all-v (nccl-tests' alltoall: grouped ncclSend/ncclRecv, timed as
// timeOps does): local rank i sends bytes(rank(i), q) from src[i] and receives bytes(q, rank(i))
// into dst[i], each side's segments packed in peer order. 0 when the ranks have no NCCL.
double ncclAllToAllvUs(const Options& o, Ranks& r, const std::vector<char*>& src, const std::vector<char*>& dst,
                       const std::function<std::size_t(int from, int to)>& bytes);
void destroyEach(Ranks& r, std::vector<cudaGraphExec_t>& execs);

// Output goes through the process that holds global rank 0 (setPrinter), one line per row.
void setPrinter(bool printer);
bool isPrinter();
void printHeader(const Options& o, const Ranks& r);
void printRow(const Row& row);
// A progress line on stderr (long sweeps and hangs show where they are).
void progress(const char* what);
// A comment line with a staged-transfer phase profile (MoverOptions.profile), per chunk and role.
void printProfile(const char* what, std::size_t bytes, const ProfileCounters& c);
void writeJson(const std::string& path, const Options& o, const std::vector<Row>& rows);

// Data patterns: byte i of a buffer for `salt` (fill on the device, count mismatches on the
// device; checkBytes synchronises rank i's stream and returns the count).
void fillBytes(void* p, std::size_t bytes, unsigned salt, cudaStream_t stream);
long long checkBytes(Ranks& r, int i, const void* p, std::size_t bytes, unsigned salt);

// Sum of a count over every process (each passes its own local total): rows show all ranks'
// wrong elements under mpirun too.
long long totalOverRanks(Ranks& r, long long mine);

// The bus bandwidth of a mover row (bench/README.md): the algbw itself (sendrecv), or
// algbw * (R - 1) / R for the collectives (allgather, alltoallv), as nccl-tests reports them.
enum class BusBw { kAlgBw, kCollective };
// Prints and keeps one row of a mover benchmark: `bytes` per operation in `us` (algbw = bytes /
// time), `wrong` this process's mismatches, summed over every process (a collective call: every
// process adds its row at the same point).
void addMoverRow(std::vector<Row>& rows, Ranks& r, const char* op, std::string variant, std::size_t bytes,
                 double us, BusBw bus, long long wrong, double ncclUs);

// Frees each local rank's buffer of every vector in `buffers` (one pointer per local rank) on its
// device, the end of a benchmark; errors are ignored, as nothing after the sweep would report them.
template <typename... Buffers>
void freeEach(Ranks& r, const Buffers&... buffers) {
  for (int i = 0; i < r.numLocal(); ++i) {
    cudaSetDevice(r.devices[static_cast<size_t>(i)]);
    (static_cast<void>(cudaFree(buffers[static_cast<size_t>(i)])), ...);
  }
}

// The heap and movers of a mover benchmark, built from --sms, --warps, --slot, --slots, with a
// `userBytes` symmetric user region (zero-copy destinations) and, where some peer is remote
// (across machines, or GRAPHEP_FORCE_TRANSPORT=remote), NCCL stages of `remoteBytesPerPeer` per
// peer for the all-to-all-v (MoverOptions::maxRemoteBytesPerPeer; 0: none, and a staged
// all-to-all-v to a remote peer is refused).
struct MoverBench {
  std::unique_ptr<SymmetricHeap> heap;
  std::vector<Movers> movers;
};
MoverBench makeMoverBench(const Options& o, Ranks& r, std::size_t userBytes, std::size_t remoteBytesPerPeer = 0);

// Throws naming the first device error any local rank recorded (a timeout, a dropped count).
void requireNoDeviceError(const SymmetricHeap& heap);

// Operations: each returns its rows.
std::vector<Row> runPingPong(const Options& o, Ranks& r);
std::vector<Row> runSendRecv(const Options& o, Ranks& r);
std::vector<Row> runAllGather(const Options& o, Ranks& r);
std::vector<Row> runAllToAllv(const Options& o, Ranks& r);
std::vector<Row> runMoe(const Options& o, Ranks& r);  // -b/-e are tokens per rank

}  // namespace graphep::bench
