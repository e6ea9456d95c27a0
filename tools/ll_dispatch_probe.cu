// graphep-ll-probe: the floor of a low-latency dispatch in which each sender writes every
// (token, expert) row, quantised to fp8, straight into its final place in the receiver's batched
// block, so that the receive only waits and publishes the layout (docs/PERFORMANCE.md, "The
// low-latency target"). It measures whether such a kernel could meet issue 26's low-latency target
// on 2 GPUs before the engine's latency path is rebuilt around it; it is not the engine's kernel.
//
// One kernel per rank and operation, G CTAs of 512 threads, both GPUs at once, back to back:
//   1. every CTA routes all T x K entries in shared memory (a bit per token for each expert);
//   2. CTA r (r < 2) writes this rank's per-expert counts into rank r's count table, then its flag;
//   3. the peer's rows: each team of threads takes a token, quantises its row once per 128-value
//      tile and stores it to every slot whose expert lives on the peer, at its final row: each
//      expert block holds the peer's rows first (base 0, known without waiting), then the block
//      owner's own;
//   4. once the peer's counts have come (the own rows' base), the own rows the same way;
//   5. each CTA adds 1 to every rank's arrival counter for this rank; CTA 0 waits for every
//      source's G arrivals and publishes the layout (rows per local expert).
// Every wait is bounded (2 s) and a timeout is reported. After the timed loop the rows, their
// scales, their source tags and the layout are checked against a host reference (the same
// quantisation); each wrong row is counted. Every operation writes the same rows, so the check
// proves where and what the kernel writes, not its synchronisation; and no sender waits for a
// receiver to release its buffer (nothing reads it), so the floor is optimistic.
//
//   graphep-ll-probe [--hidden H] [--experts E] [--topk K] [--tokens T] [--team N] [--iters N]
//                    [--ctas G,G,...] [--pdl] [--trace]
//
// --pdl: each launch is the programmatic dependent of the one before (griddepcontrol), as the
// engine's graphs launch its operations; without it the launches are plain, in stream order.
// After the timed operations one more runs, launched after a synchronisation, with its phases
// stamped (global timer: when the first CTA started, and when the last CTA finished each step);
// --trace prints the stamps per rank after the row. The rows are checked after that operation.
//
// Needs 2 GPUs with peer access (exit 77 otherwise). One line per CTA count:
//   ll-probe hidden=7168 experts=256 topk=8 tokens=128 ctas=24 team=128 pdl=0 us=... wrong=0
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/common/hooks.cuh"
#include "kernels/common/ptx.cuh"

namespace {

constexpr int kRanks = 2;
constexpr int kThreads = 512;
constexpr int kMaxEntries = 2048;    // T x K
constexpr int kMaxExperts = 512;
constexpr int kMaxWords = 8;         // T <= 256
constexpr unsigned long long kWaitNs = 2000000000ull;

#define CHECK(call)                                                                                     \
  do {                                                                                                  \
    const cudaError_t e_ = (call);                                                                      \
    if (e_ != cudaSuccess) {                                                                            \
      std::fprintf(stderr, "graphep-ll-probe: %s: %s (line %d)\n", #call, cudaGetErrorString(e_), __LINE__); \
      std::exit(1);                                                                                     \
    }                                                                                                   \
  } while (0)

struct Rank {                            // one rank's buffers (device pointers, UVA)
  const __nv_bfloat16* x;                // [T][H]
  const std::int32_t* ids;               // [T][K], distinct experts per token
  char* recv;                            // [L][R x T] rows of rowBytes: e4m3 bytes, then the scales
  std::int32_t* srcTag;                  // [L][R x T]: source << 16 | token
  std::int32_t* counts;                  // [2 parities][R sources][E]
  std::uint32_t* countFlags;             // [R sources]: the step whose counts are posted
  std::uint32_t* arrivals;               // [R sources]: CTAs done, cumulative
  std::int32_t* layout;                  // [L]: rows per local expert
  std::uint32_t* error;                  // a wait that timed out: 1 + what it waited for
  unsigned long long* trace;             // --trace: [kPhases] global-timer stamps (min for the start, max after)
};

// The phases a traced operation stamps (Rank::trace): the first CTA's start, then when the last CTA
// to stamp a step finished it: every CTA stamps each step but two, "counts posted" (the two
// posting CTAs) and "arrivals seen" (CTA 0).
constexpr int kPhases = 7;
constexpr const char* kPhaseNames[kPhases] = {"start", "routed", "counts posted", "peer rows stored",
                                              "peer counts seen", "own rows stored", "arrivals seen"};

struct Params {
  Rank rank[kRanks];
  int me, T, H, E, K, team;
  std::uint64_t rowBytes;
  std::uint32_t step;             // this operation's, from 1
  std::uint32_t arrivalsTarget;   // every source's cumulative arrivals once this step is done
};

// Waits until *p reaches `target` (mod 2^32); after kWaitNs it gives up and records `what` in
// *error (the first timeout only), which the host reports.
__device__ void waitAtLeast(const std::uint32_t* p, std::uint32_t target, std::uint32_t* error, std::uint32_t what) {
  const std::uint64_t start = graphep::ptx::globalTimerNs();
  while (static_cast<std::int32_t>(graphep::ptx::ldAcquireSys(p) - target) < 0) {
    if (graphep::ptx::globalTimerNs() - start > kWaitNs) {
      atomicCAS(error, 0u, what);
      return;
    }
  }
}

// Stamps phase `ph` of a traced operation (thread 0 of each CTA calls it).
__device__ __forceinline__ void stamp(const Rank& r, int ph) {
  if (r.trace == nullptr) return;
  const unsigned long long now = graphep::ptx::globalTimerNs();
  if (ph == 0) {
    atomicMin(r.trace, now);
  } else {
    atomicMax(r.trace + ph, now);
  }
}

__device__ __forceinline__ int popcBelow(const std::uint32_t* bits, int t) {
  int c = 0;
  for (int w = 0; w < (t >> 5); ++w) c += __popc(bits[w]);
  if ((t & 31) != 0) c += __popc(bits[t >> 5] & ((1u << (t & 31)) - 1u));
  return c;
}

// Team `team` of the grid stores token t's rows to every slot whose expert lives on rank r, each at
// base[local expert] + the entry's index among that expert's entries from this rank.
__device__ void storeRows(const Params& p, const std::int32_t* ids, const std::uint32_t* expBits, const int* base,
                          int r, int t, int lane) {
  const int L = p.E / kRanks, W = (p.T + 31) / 32, tiles = p.H / 128;
  const Rank& dst = p.rank[r];
  const std::uint64_t blockRows = static_cast<std::uint64_t>(kRanks) * p.T;
  char* rows[16];
  int n = 0;
  for (int k = 0; k < p.K; ++k) {
    const int e = ids[t * p.K + k];
    if (e / L != r) continue;
    const std::uint64_t row = static_cast<std::uint64_t>(e % L) * blockRows + base[e % L] + popcBelow(expBits + e * W, t);
    rows[n++] = dst.recv + row * p.rowBytes;
    if (lane == 0) dst.srcTag[row] = p.me << 16 | t;
  }
  const int half = lane >> 4, l16 = lane & 15, halves = p.team >> 4;
  const char* src = reinterpret_cast<const char*>(p.rank[p.me].x) + static_cast<std::uint64_t>(t) * p.H * 2;
  for (int tile = half; tile < tiles; tile += halves) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src + static_cast<std::uint64_t>(tile) * 256 + l16 * 16);
    const graphep::ProduceFp8E4m3::Regs q = graphep::ProduceFp8E4m3::quantize(raw);
    for (int i = 0; i < n; ++i) {
      *reinterpret_cast<uint2*>(rows[i] + static_cast<std::uint64_t>(tile) * 128 + l16 * 8) = q.q;
      if (l16 == 0) *reinterpret_cast<float*>(rows[i] + p.H + tile * 4) = q.scale;
    }
  }
}

__global__ void __launch_bounds__(kThreads) probeDispatch(const __grid_constant__ Params p) {
  __shared__ std::int32_t ids[kMaxEntries];
  __shared__ std::uint32_t expBits[kMaxExperts * kMaxWords];
  __shared__ int base[kMaxExperts / kRanks];
  const int tid = static_cast<int>(threadIdx.x), L = p.E / kRanks, W = (p.T + 31) / 32;
  const int parity = static_cast<int>(p.step & 1u), peer = 1 - p.me;
  const Rank& mine = p.rank[p.me];
  // With --pdl each launch is the programmatic dependent of the one before (as the engine's graphs
  // launch): it may be placed early, and waits here until that one has finished.
  graphep::ptx::gridDependencyWait();
  if (tid == 0) stamp(mine, 0);
  // 1. Routing.
  for (int i = tid; i < p.E * W; i += kThreads) expBits[i] = 0;
  __syncthreads();
  for (int i = tid; i < p.T * p.K; i += kThreads) {
    const int e = mine.ids[i];
    ids[i] = e;
    atomicOr(&expBits[e * W + (i / p.K >> 5)], 1u << (i / p.K & 31));
  }
  __syncthreads();
  if (tid == 0) stamp(mine, 1);
  // 2. This rank's counts to rank r = blockIdx.x (every expert: the receiver sums the sources).
  if (static_cast<int>(blockIdx.x) < kRanks) {
    const Rank& to = p.rank[blockIdx.x];
    std::int32_t* c = to.counts + (static_cast<std::uint64_t>(parity) * kRanks + p.me) * p.E;
    for (int e = tid; e < p.E; e += kThreads) c[e] = popcBelow(expBits + e * W, p.T);
    __syncthreads();
    if (tid == 0) {
      graphep::ptx::fenceAcqRelSys();
      graphep::ptx::stReleaseSys(to.countFlags + p.me, p.step);
      stamp(mine, 2);
    }
  }
  // 3. The peer's rows: this rank's rows come first in each of the peer's expert blocks.
  for (int j = tid; j < L; j += kThreads) base[j] = 0;
  __syncthreads();
  const int lane = tid % p.team, teams = static_cast<int>(gridDim.x) * (kThreads / p.team);
  const int team = static_cast<int>(blockIdx.x) * (kThreads / p.team) + tid / p.team;
  for (int t = team; t < p.T; t += teams) storeRows(p, ids, expBits, base, peer, t, lane);
  // 4. The own rows, after the peer's rows in each block of this rank: their base is the peer's count.
  __syncthreads();
  if (tid == 0) stamp(mine, 3);
  if (tid == 0) waitAtLeast(mine.countFlags + peer, p.step, mine.error, 1);
  if (tid == 0) stamp(mine, 4);
  __syncthreads();
  const std::int32_t* peerCounts = mine.counts + (static_cast<std::uint64_t>(parity) * kRanks + peer) * p.E;
  for (int j = tid; j < L; j += kThreads) base[j] = __ldcg(peerCounts + p.me * L + j);
  __syncthreads();
  for (int t = team; t < p.T; t += teams) storeRows(p, ids, expBits, base, p.me, t, lane);
  // 5. Arrivals, then CTA 0 publishes the layout once every source's CTAs have arrived.
  graphep::ptx::launchDependents();
  __syncthreads();
  if (tid == 0) stamp(mine, 5);
  if (tid < kRanks) {
    graphep::ptx::fenceAcqRelSys();
    graphep::ptx::redReleaseSysAdd(p.rank[tid].arrivals + p.me, 1u);
  }
  if (blockIdx.x != 0) return;
  if (tid < kRanks) waitAtLeast(mine.arrivals + tid, p.arrivalsTarget, mine.error, 2 + tid);
  __syncthreads();
  if (tid == 0) stamp(mine, 6);
  const std::int32_t* own = mine.counts + (static_cast<std::uint64_t>(parity) * kRanks + p.me) * p.E;
  for (int j = tid; j < L; j += kThreads) mine.layout[j] = __ldcg(peerCounts + p.me * L + j) + __ldcg(own + p.me * L + j);
}

int intArg(const std::vector<std::string>& a, const char* name, int dflt) {
  for (std::size_t i = 0; i + 1 < a.size(); ++i) {
    if (a[i] == name) return std::atoi(a[i + 1].c_str());
  }
  return dflt;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  const int H = intArg(args, "--hidden", 7168), E = intArg(args, "--experts", 256), K = intArg(args, "--topk", 8);
  const int T = intArg(args, "--tokens", 128), team = intArg(args, "--team", 128), iters = intArg(args, "--iters", 200);
  const bool pdl = std::find(args.begin(), args.end(), "--pdl") != args.end();
  const bool trace = std::find(args.begin(), args.end(), "--trace") != args.end();
  std::vector<int> ctaList = {24, 48, 96, 132};
  for (std::size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] != "--ctas") continue;
    ctaList.clear();
    for (const char* s = args[i + 1].c_str(); *s != '\0';) {
      ctaList.push_back(std::atoi(s));
      while (*s != '\0' && *s != ',') ++s;
      if (*s == ',') ++s;
    }
  }
  const int L = E / kRanks;
  if (H % 128 != 0 || E % kRanks != 0 || E > kMaxExperts || T > 32 * kMaxWords || T * K > kMaxEntries || K > 16 ||
      K > L * kRanks || team % 16 != 0 || team < 16 || team > kThreads || kThreads % team != 0) {
    std::fprintf(stderr, "graphep-ll-probe: unsupported shape (hidden %% 128, experts <= %d even, tokens <= %d, "
                 "topk <= 16, team a multiple of 16 dividing %d)\n", kMaxExperts, 32 * kMaxWords, kThreads);
    return 2;
  }
  int devices = 0, canAccess = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;  // no driver: no GPU
  if (devices >= 2) CHECK(cudaDeviceCanAccessPeer(&canAccess, 0, 1));
  if (devices < 2 || canAccess == 0) {
    std::printf("graphep-ll-probe: SKIPPED: needs 2 GPUs with peer access\n");
    return 77;
  }
  const std::uint64_t rowBytes = (static_cast<std::uint64_t>(H) + H / 128 * 4 + 15) / 16 * 16;
  const std::uint64_t rows = static_cast<std::uint64_t>(L) * kRanks * T;
  std::mt19937 gen(12345);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<std::vector<__nv_bfloat16>> hx(kRanks, std::vector<__nv_bfloat16>(static_cast<std::size_t>(T) * H));
  std::vector<std::vector<std::int32_t>> hids(kRanks, std::vector<std::int32_t>(static_cast<std::size_t>(T) * K));
  std::vector<int> perm(static_cast<std::size_t>(E));
  for (int r = 0; r < kRanks; ++r) {
    for (auto& v : hx[static_cast<std::size_t>(r)]) v = __float2bfloat16(normal(gen) * 3.f);
    for (int t = 0; t < T; ++t) {
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), gen);
      for (int k = 0; k < K; ++k) hids[static_cast<std::size_t>(r)][static_cast<std::size_t>(t) * K + k] = perm[static_cast<std::size_t>(k)];
    }
  }
  Params p{};
  p.T = T, p.H = H, p.E = E, p.K = K, p.team = team, p.rowBytes = rowBytes;
  cudaStream_t streams[kRanks];
  for (int r = 0; r < kRanks; ++r) {
    CHECK(cudaSetDevice(r));
    CHECK(cudaDeviceEnablePeerAccess(1 - r, 0));
    CHECK(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
    Rank& k = p.rank[r];
    void* v = nullptr;
    CHECK(cudaMalloc(&v, hx[static_cast<std::size_t>(r)].size() * 2));
    CHECK(cudaMemcpy(v, hx[static_cast<std::size_t>(r)].data(), hx[static_cast<std::size_t>(r)].size() * 2, cudaMemcpyHostToDevice));
    k.x = static_cast<const __nv_bfloat16*>(v);
    CHECK(cudaMalloc(&v, hids[static_cast<std::size_t>(r)].size() * 4));
    CHECK(cudaMemcpy(v, hids[static_cast<std::size_t>(r)].data(), hids[static_cast<std::size_t>(r)].size() * 4, cudaMemcpyHostToDevice));
    k.ids = static_cast<const std::int32_t*>(v);
    CHECK(cudaMalloc(&k.recv, rows * rowBytes));
    CHECK(cudaMemset(k.recv, 0xff, rows * rowBytes));  // poison
    CHECK(cudaMalloc(&k.srcTag, rows * 4));
    CHECK(cudaMemset(k.srcTag, 0xff, rows * 4));
    CHECK(cudaMalloc(&k.counts, 2ull * kRanks * E * 4));
    CHECK(cudaMalloc(&k.countFlags, kRanks * 4));
    CHECK(cudaMemset(k.countFlags, 0, kRanks * 4));
    CHECK(cudaMalloc(&k.arrivals, kRanks * 4));
    CHECK(cudaMemset(k.arrivals, 0, kRanks * 4));
    CHECK(cudaMalloc(&k.layout, static_cast<std::size_t>(L) * 4));
    CHECK(cudaMalloc(&k.error, 4));
    CHECK(cudaMemset(k.error, 0, 4));
    CHECK(cudaMalloc(&k.trace, kPhases * sizeof(unsigned long long)));
  }
  for (int r = 0; r < kRanks; ++r) {
    CHECK(cudaSetDevice(r));
    CHECK(cudaDeviceSynchronize());
  }
  std::uint32_t step = 0, arrivals = 0;
  auto launchBoth = [&](int ctas, bool traced = false) {
    ++step;
    arrivals += static_cast<std::uint32_t>(ctas);
    for (int r = 0; r < kRanks; ++r) {
      Params q = p;
      q.me = r, q.step = step, q.arrivalsTarget = arrivals;
      if (!traced) {
        for (Rank& k : q.rank) k.trace = nullptr;
      }
      CHECK(cudaSetDevice(r));
      cudaLaunchAttribute attr{};
      attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr.val.programmaticStreamSerializationAllowed = 1;
      cudaLaunchConfig_t cfg{};
      cfg.gridDim = dim3(static_cast<unsigned>(ctas));
      cfg.blockDim = dim3(kThreads);
      cfg.stream = streams[r];
      cfg.attrs = &attr;
      cfg.numAttrs = pdl ? 1 : 0;
      CHECK(cudaLaunchKernelEx(&cfg, probeDispatch, q));
    }
  };
  // Host reference of one row: e4m3 bytes and scales of x[t] as ProduceFp8E4m3 makes them.
  auto reference = [&](int r, int t, std::vector<unsigned char>& out) {
    out.assign(rowBytes, 0);
    for (int tile = 0; tile < H / 128; ++tile) {
      float amax = 0.f;
      const __nv_bfloat16* v = hx[static_cast<std::size_t>(r)].data() + static_cast<std::size_t>(t) * H + tile * 128;
      for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(__bfloat162float(v[i])));
      const float scale = graphep::ProduceFp8E4m3::fp8Scale(amax), inv = 1.0f / scale;
      for (int i = 0; i < 128; ++i) out[static_cast<std::size_t>(tile) * 128 + i] = graphep::ProduceFp8E4m3::fp8E4m3(__bfloat162float(v[i]) * inv);
      std::memcpy(out.data() + H + tile * 4, &scale, 4);
    }
  };
  int status = 0;
  for (const int ctas : ctaList) {
    if (ctas < kRanks) {
      std::fprintf(stderr, "graphep-ll-probe: ctas=%d (at least %d)\n", ctas, kRanks);
      return 2;
    }
    for (int i = 0; i < 20; ++i) launchBoth(ctas);
    cudaEvent_t ev[kRanks][2];
    for (int r = 0; r < kRanks; ++r) {
      CHECK(cudaSetDevice(r));
      CHECK(cudaEventCreate(&ev[r][0]));
      CHECK(cudaEventCreate(&ev[r][1]));
      CHECK(cudaEventRecord(ev[r][0], streams[r]));
    }
    for (int i = 0; i < iters; ++i) launchBoth(ctas);
    float worst = 0.f;
    for (int r = 0; r < kRanks; ++r) {
      CHECK(cudaSetDevice(r));
      CHECK(cudaEventRecord(ev[r][1], streams[r]));
    }
    for (int r = 0; r < kRanks; ++r) {
      CHECK(cudaSetDevice(r));
      CHECK(cudaStreamSynchronize(streams[r]));
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, ev[r][0], ev[r][1]));
      worst = std::max(worst, ms);
    }
    // One more operation, traced (both ranks' stamps zeroed, the start at its maximum).
    std::vector<unsigned long long> stamps(kPhases, 0);
    for (int r = 0; r < kRanks; ++r) {
      stamps[0] = ~0ull;
      CHECK(cudaSetDevice(r));
      CHECK(cudaMemcpyAsync(p.rank[r].trace, stamps.data(), kPhases * sizeof(unsigned long long), cudaMemcpyHostToDevice,
                            streams[r]));  // in the launches' stream order
      CHECK(cudaStreamSynchronize(streams[r]));  // `stamps` is reused for the next rank
    }
    launchBoth(ctas, true);
    std::string phases;
    for (int r = 0; r < kRanks; ++r) {
      CHECK(cudaSetDevice(r));
      CHECK(cudaStreamSynchronize(streams[r]));
      CHECK(cudaMemcpy(stamps.data(), p.rank[r].trace, kPhases * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
      char line[96];
      phases += " | rank " + std::to_string(r) + ", us after the start:";
      for (int ph = 1; ph < kPhases; ++ph) {
        std::snprintf(line, sizeof line, " %s %.2f", kPhaseNames[ph], (stamps[static_cast<std::size_t>(ph)] - stamps[0]) * 1e-3);
        phases += line;
      }
    }
    // The check: every rank's rows, tags and layout after the last operation.
    long long wrong = 0;
    std::vector<unsigned char> got(rows * rowBytes), want;
    std::vector<std::int32_t> tags(rows), layout(static_cast<std::size_t>(L));
    for (int r = 0; r < kRanks; ++r) {
      std::uint32_t err = 0;
      CHECK(cudaMemcpy(&err, p.rank[r].error, 4, cudaMemcpyDeviceToHost));
      if (err != 0) {
        std::printf("ll-probe: rank %d timed out waiting for %s\n", r,
                    err == 1 ? "the peer's counts" : err == 2 ? "rank 0's arrivals" : "rank 1's arrivals");
        return 1;
      }
      CHECK(cudaMemcpy(got.data(), p.rank[r].recv, got.size(), cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(tags.data(), p.rank[r].srcTag, tags.size() * 4, cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(layout.data(), p.rank[r].layout, layout.size() * 4, cudaMemcpyDeviceToHost));
      for (int j = 0; j < L; ++j) {
        const int e = r * L + j;
        std::uint64_t row = static_cast<std::uint64_t>(j) * kRanks * T;
        for (const int s : {1 - r, r}) {  // the peer's rows first, then the own
          for (int t = 0; t < T; ++t) {
            const std::int32_t* id = hids[static_cast<std::size_t>(s)].data() + static_cast<std::size_t>(t) * K;
            if (std::find(id, id + K, e) == id + K) continue;
            reference(s, t, want);
            if (tags[row] != (s << 16 | t) || std::memcmp(got.data() + row * rowBytes, want.data(), H + H / 128 * 4) != 0) ++wrong;
            ++row;
          }
        }
        if (layout[static_cast<std::size_t>(j)] != static_cast<std::int32_t>(row - static_cast<std::uint64_t>(j) * kRanks * T)) ++wrong;
      }
    }
    std::printf("ll-probe hidden=%d experts=%d topk=%d tokens=%d ctas=%d team=%d pdl=%d us=%.2f wrong=%lld\n", H, E, K,
                T, ctas, team, pdl ? 1 : 0, worst * 1e3f / iters, wrong);
    if (trace) std::printf("#%s\n", phases.c_str());
    std::fflush(stdout);
    if (wrong != 0) status = 1;
    for (int r = 0; r < kRanks; ++r) {
      CHECK(cudaEventDestroy(ev[r][0]));
      CHECK(cudaEventDestroy(ev[r][1]));
    }
  }
  return status;
}
