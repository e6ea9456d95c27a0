// graphep-ll-probe: what a low-latency dispatch can reach on 2 GPUs, measured with two standalone
// kernels before the engine's latency path is rebuilt (docs/PERFORMANCE.md, "The low-latency
// dispatch"); neither is the engine's kernel. By default each sender writes every (token, expert)
// row, quantised to fp8, straight into its final place in the receiver's batched block, so that the
// receive only waits and publishes the layout; --records (below) sends one record per token and
// lets the receiver expand it.
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
// quantisation); each wrong row is counted. The operations alternate between two routings per
// rank, and the checked one writes into poisoned rows, tags and layout, so rows or counts left from
// the step before are caught; the check runs once both ranks have finished, so it does not test
// that a receiver waits long enough; and no sender waits for a receiver to release its buffer
// (nothing reads it), so the floor is optimistic.
//
//   graphep-ll-probe [--hidden H] [--experts E] [--topk K] [--tokens T] [--team N] [--iters N]
//                    [--ctas G,G,...] [--pdl] [--trace] [--ll-counts] [--wide] [--one-pass] [--apart] [--records] [--ll-payload]
//
// --pdl: each launch is the programmatic dependent of the one before (griddepcontrol), as the
// engine's graphs launch its operations; without it the launches are plain, in stream order.
// After the timed operations one more runs, launched after a synchronisation, with its phases
// stamped (global timer: when the first CTA started, and when the last CTA finished each step);
// --trace prints the stamps per rank after the row. The rows are checked after that operation.
// --ll-counts: the counts go as flagged 16-byte lines (a step beside each count, no fence and no
// flag word; the readers poll the lines), as NCCL's LL protocol sends small messages.
// --wide: 8 lanes quantise a 128-value tile (16 values each, 16-byte stores), not 16 (8-byte stores).
// --one-pass: the own rows are stored from the tiles quantised for the peer's rows, kept in
// registers across the wait for the peer's counts (without it they are quantised again).
// --apart: the two CTAs that post the counts take no tokens (without it they take their share
// after posting).
// --records: another kernel (probeRecords, below): the own rows first in each block, written by
// their sender; one record per token to the peer, expanded by the receiver. With it, --ll-counts
// sends the routing as flagged lines read before the arrival, --apart stores the own rows after
// the arrival is signalled; --team, --wide and --one-pass do not apply.
// --ll-payload (with --records --ll-counts): the peer's records go as flagged lines too (each 8 bytes
// of payload beside the step, NCCL's LL protocol: twice the bytes), so the sender needs no fence
// and no arrival, and the receiver polls each line it expands instead of waiting for the peer's CTAs.
//
// Needs 2 GPUs with peer access (exit 77 otherwise). One line per CTA count:
//   ll-probe hidden=7168 experts=256 topk=8 tokens=128 ctas=24 team=128 pdl=0 ll-counts=0 wide=0 one-pass=0 apart=0 us=... wrong=0
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

#include "kernels/common/flags.cuh"
#include "kernels/common/hooks.cuh"
#include "kernels/common/ptx.cuh"

namespace {

constexpr int kRanks = 2;
constexpr int kThreads = 512;
constexpr int kMaxEntries = 2048;    // T x K
constexpr int kMaxExperts = 512;
constexpr int kMaxWords = 8;         // T <= 256
constexpr int kMaxTilesPerLane = 8;  // --one-pass: the tiles a lane holds
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
  const std::int32_t* ids[2];            // [T][K] each, distinct experts per token: step parity's routing
  char* recv;                            // [L][R x T] rows of rowBytes: e4m3 bytes, then the scales
  std::int32_t* srcTag;                  // [L][R x T]: source << 16 | token
  std::int32_t* counts;                  // [2 parities][R sources][E]
  uint4* lineCounts;                     // --ll-counts: [2 parities][R sources][E / 2] {count, step, count, step}
  std::uint32_t* countFlags;             // [R sources]: the step whose counts are posted
  std::uint32_t* arrivals;               // [R sources]: CTAs done, cumulative
  std::int32_t* layout;                  // [L]: rows per local expert
  char* staging;                         // --records: [2 parities][R sources][T] records of rowBytes
  uint4* idLines;                        // --records --ll-counts: [2 parities][R sources][kMaxEntries / 2] {id, step, id, step}
  std::int32_t* stagedIds;               // --records: [2 parities][R sources][kMaxEntries] the sources' routing
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
  int lineCounts;                 // the counts travel as flagged lines (no fence, no flag word)
  int wide;                       // 8 lanes a tile, 16-byte stores (else 16 lanes, 8-byte stores)
  int onePass;                    // the own rows from the peer rows' quantised tiles, kept in registers
  int apart;                      // the CTAs that post the counts take no tokens
  int llPayload;                  // --records: the peer's records as flagged lines (no fence, no arrival)
  std::uint64_t stageBytes;       // --records: a staged record's bytes (rowBytes, or its lines)
};

// A flagged line {a, step, b, step} (written with one vector store, each 8-byte half whole, so a
// reader that sees the step in both halves sees both values, without a fence: NCCL's LL protocol),
// read once both halves carry `step`. After kWaitNs it gives up, records `what` in *error (the
// first timeout only, which the host reports) and returns false, v holding what it last read.
__device__ bool waitLine(const uint4* line, std::uint32_t step, std::uint32_t* error, std::uint32_t what, uint4& v) {
  const std::uint64_t start = graphep::ptx::globalTimerNs();
  v = graphep::ptx::ldVolatileV4(line);
  while (!graphep::flaggedLineReady(v, step)) {
    if (graphep::ptx::globalTimerNs() - start > kWaitNs) {
      atomicCAS(error, 0u, what);
      return false;
    }
    v = graphep::ptx::ldVolatileV4(line);
  }
  return true;
}

// --ll-counts: source q's counts of experts 2i and 2i + 1 in one flagged line. Count e of source
// q, once its line carries `step`; on timeout 0 (waitLine records it).
__device__ void lineCount(const Params& p, int q, int e, int* out) {
  const uint4* line = p.rank[p.me].lineCounts + (static_cast<std::uint64_t>(p.step & 1u) * kRanks + q) * (p.E / 2) + e / 2;
  uint4 v;
  *out = !waitLine(line, p.step, p.rank[p.me].error, 1u, v) ? 0 : static_cast<int>((e & 1) != 0 ? v.z : v.x);
}

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

// Token t's rows on rank r: each at base[local expert] + the entry's index among that expert's
// entries from this rank; lane 0 of the team writes their source tags. Returns how many.
__device__ int rowsOf(const Params& p, const std::int32_t* ids, const std::uint32_t* expBits, const int* base, int r, int t,
                      int lane, char** rows) {
  const int L = p.E / kRanks, W = (p.T + 31) / 32;
  const Rank& dst = p.rank[r];
  const std::uint64_t blockRows = static_cast<std::uint64_t>(kRanks) * p.T;
  int n = 0;
  for (int k = 0; k < p.K; ++k) {
    const int e = ids[t * p.K + k];
    if (e / L != r) continue;
    const std::uint64_t row = static_cast<std::uint64_t>(e % L) * blockRows + base[e % L] + popcBelow(expBits + e * W, t);
    rows[n++] = dst.recv + row * p.rowBytes;
    if (lane == 0) dst.srcTag[row] = p.me << 16 | t;
  }
  return n;
}

// One lane's share of a 128-value tile, quantised: 8 values (16 lanes a tile, `q.x, q.y` used) or,
// with --wide, 16 values (8 lanes a tile, all of q): the same scale and bytes either way.
struct Tile {
  uint4 q;
  float scale;
};

__device__ __forceinline__ Tile quantizeTile(const char* src, int tile, int sub, bool wide) {
  Tile out{};
  if (!wide) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src + static_cast<std::uint64_t>(tile) * 256 + sub * 16);
    const graphep::ProduceFp8E4m3::Regs r = graphep::ProduceFp8E4m3::quantize(raw);
    out.q = make_uint4(r.q.x, r.q.y, 0, 0);
    out.scale = r.scale;
    return out;
  }
  const uint4* at = reinterpret_cast<const uint4*>(src + static_cast<std::uint64_t>(tile) * 256 + sub * 32);
  const graphep::Fp8TileWide r = graphep::Fp8TileWide::quantize(at[0], at[1], false);
  out.q = r.q;
  out.scale = r.scale;
  return out;
}

__device__ __forceinline__ void storeTile(char* const* rows, int n, const Params& p, int tile, int sub, const Tile& q) {
  for (int i = 0; i < n; ++i) {
    char* at = rows[i] + static_cast<std::uint64_t>(tile) * 128;
    if (p.wide) {
      *reinterpret_cast<uint4*>(at + sub * 16) = q.q;
    } else {
      *reinterpret_cast<uint2*>(at + sub * 8) = make_uint2(q.q.x, q.q.y);
    }
    if (sub == 0) *reinterpret_cast<float*>(rows[i] + p.H + tile * 4) = q.scale;
  }
}

__global__ void __launch_bounds__(kThreads) probeDispatch(const __grid_constant__ Params p) {
  __shared__ std::int32_t ids[kMaxEntries];
  __shared__ std::uint32_t expBits[kMaxExperts * kMaxWords];
  __shared__ int zeros[kMaxExperts / kRanks];
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
  for (int j = tid; j < L; j += kThreads) zeros[j] = 0;
  __syncthreads();
  for (int i = tid; i < p.T * p.K; i += kThreads) {
    const int e = mine.ids[parity][i];
    ids[i] = e;
    atomicOr(&expBits[e * W + (i / p.K >> 5)], 1u << (i / p.K & 31));
  }
  __syncthreads();
  if (tid == 0) stamp(mine, 1);
  // 2. This rank's counts to rank r = blockIdx.x (every expert: the receiver sums the sources).
  if (static_cast<int>(blockIdx.x) < kRanks && p.lineCounts) {
    uint4* lines = p.rank[blockIdx.x].lineCounts + (static_cast<std::uint64_t>(parity) * kRanks + p.me) * (p.E / 2);
    for (int i = tid; i < p.E / 2; i += kThreads) {
      graphep::ptx::stVolatileV4(lines + i, graphep::flaggedLine(static_cast<unsigned>(popcBelow(expBits + 2 * i * W, p.T)),
                                                                 static_cast<unsigned>(popcBelow(expBits + (2 * i + 1) * W, p.T)), p.step));
    }
    __syncthreads();
    if (tid == 0) stamp(mine, 2);
  } else if (static_cast<int>(blockIdx.x) < kRanks) {
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
  // 3-4. The rows. Each team takes tokens team, team + teams, ...: the peer's rows first (this
  // rank's rows come first in each of the peer's expert blocks: base 0, no wait), then, once the
  // peer's counts are in (the own rows' base in this rank's blocks), the own rows. --apart: the
  // counts' CTAs take no tokens. --one-pass: the own rows from the tiles quantised for the peer's
  // (kept in registers), else quantised again after every peer row is stored.
  const int first = p.apart ? kRanks : 0;
  const bool tokens = static_cast<int>(blockIdx.x) >= first;
  const int perCta = kThreads / p.team, lane = tid % p.team;
  const int team = (static_cast<int>(blockIdx.x) - first) * perCta + tid / p.team;
  const int teams = (static_cast<int>(gridDim.x) - first) * perCta;
  const int rounds = (p.T + teams - 1) / teams;
  const int lanesPerTile = p.wide ? 8 : 16, sub = lane % lanesPerTile, group = lane / lanesPerTile;
  const int groups = p.team / lanesPerTile, tiles = p.H / 128;
  const Rank& self = mine;
  auto ownBase = [&] {  // every thread of the CTA
    __syncthreads();
    if (tid == 0) stamp(mine, 3);
    if (p.lineCounts) {
      for (int j = tid; j < L; j += kThreads) lineCount(p, peer, p.me * L + j, &base[j]);
    } else {
      if (tid == 0) waitAtLeast(self.countFlags + peer, p.step, self.error, 1);
      __syncthreads();
      const std::int32_t* peerCounts = self.counts + (static_cast<std::uint64_t>(parity) * kRanks + peer) * p.E;
      for (int j = tid; j < L; j += kThreads) base[j] = __ldcg(peerCounts + p.me * L + j);
    }
    __syncthreads();
    if (tid == 0) stamp(mine, 4);
  };
  char* rows[16];
  if (p.onePass) {
    Tile held[kMaxTilesPerLane];
    for (int round = 0; round < rounds; ++round) {
      const int t = team + round * teams;
      const bool has = tokens && t < p.T;
      const char* src = reinterpret_cast<const char*>(p.rank[p.me].x) + static_cast<std::uint64_t>(t) * p.H * 2;
      if (has) {
        const int n = rowsOf(p, ids, expBits, zeros, peer, t, lane, rows);
#pragma unroll
        for (int i = 0; i < kMaxTilesPerLane; ++i) {  // unrolled: `held` stays in registers
          const int tile = group + i * groups;
          if (tile < tiles) {
            held[i] = quantizeTile(src, tile, sub, p.wide);
            storeTile(rows, n, p, tile, sub, held[i]);
          }
        }
      }
      if (round == 0 && tokens) ownBase();
      if (has) {
        const int n = rowsOf(p, ids, expBits, base, p.me, t, lane, rows);
#pragma unroll
        for (int i = 0; i < kMaxTilesPerLane; ++i) {
          const int tile = group + i * groups;
          if (tile < tiles) storeTile(rows, n, p, tile, sub, held[i]);
        }
      }
    }
  } else if (tokens) {
    for (int pass = 0; pass < 2; ++pass) {
      const int r = pass == 0 ? peer : p.me;
      if (pass == 1) ownBase();
      for (int round = 0; round < rounds; ++round) {
        const int t = team + round * teams;
        if (t >= p.T) continue;
        const char* src = reinterpret_cast<const char*>(p.rank[p.me].x) + static_cast<std::uint64_t>(t) * p.H * 2;
        const int n = rowsOf(p, ids, expBits, pass == 0 ? zeros : base, r, t, lane, rows);
        for (int tile = group; tile < tiles; tile += groups) storeTile(rows, n, p, tile, sub, quantizeTile(src, tile, sub, p.wide));
      }
    }
  }
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
  const std::int32_t* peerCounts = mine.counts + (static_cast<std::uint64_t>(parity) * kRanks + peer) * p.E;
  for (int j = tid; j < L; j += kThreads) {
    int a = 0, b = 0;
    if (p.lineCounts) {
      lineCount(p, peer, p.me * L + j, &a);
      lineCount(p, p.me, p.me * L + j, &b);
    } else {
      a = __ldcg(peerCounts + p.me * L + j);
      b = __ldcg(own + p.me * L + j);
    }
    mine.layout[j] = a + b;
  }
}

// --records: the dispatch as records. Each sender writes its own rows straight to their final
// places in its own expert blocks (each block holds the own rows first, at base 0: no wait), and
// sends the peer one record per token (the row quantised once, with its scales) into a fixed slot
// [parity][source][token], plus its routing (T x K ids); then each CTA adds 1 to the peer's
// arrival counter. The receiver, once every peer CTA has arrived, routes the peer's ids in shared
// memory and expands each record into the rows of its local experts, after the own rows (base:
// the own counts, known locally). No count message: the routing travels with the records.
// A warp takes an item (token, 4 tiles) at a time, 8 lanes to a tile (16 values each).
constexpr const char* kRecordPhaseNames[kPhases] = {"start", "routed", "ids sent", "sent (arrival next)",
                                                    "arrivals seen", "peer routed", "peer rows expanded"};

__global__ void __launch_bounds__(kThreads) probeRecords(const __grid_constant__ Params p) {
  __shared__ std::int32_t ids[kMaxEntries];
  __shared__ std::uint32_t expBits[kMaxExperts * kMaxWords];   // this rank's tokens per expert
  __shared__ std::uint32_t peerBits[kMaxExperts / kRanks * kMaxWords];  // the peer's tokens per local expert
  __shared__ std::uint32_t toPeer[kMaxWords];                  // this rank's tokens with a slot on the peer
  __shared__ int ownCount[kMaxExperts / kRanks];
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, L = p.E / kRanks, W = (p.T + 31) / 32;
  const int parity = static_cast<int>(p.step & 1u), peer = 1 - p.me, K = p.K;
  const Rank& mine = p.rank[p.me];
  const std::uint64_t blockRows = static_cast<std::uint64_t>(kRanks) * p.T;
  const std::uint64_t recBytes = p.stageBytes;
  const int tiles = p.H / 128, chunks = (tiles + 3) / 4;
  // Items go round the CTAs first (warp w of CTA c is the grid's warp w x G + c), so that few items
  // still spread over every SM.
  const int warp = tid / 32 * static_cast<int>(gridDim.x) + static_cast<int>(blockIdx.x), warps = static_cast<int>(gridDim.x) * (kThreads / 32);
  const int sub = lane & 7;
  graphep::ptx::gridDependencyWait();
  if (tid == 0) stamp(mine, 0);
  // 1. Routing (this rank's tokens).
  for (int i = tid; i < p.E * W; i += kThreads) expBits[i] = 0;
  for (int i = tid; i < L * W; i += kThreads) peerBits[i] = 0;
  for (int i = tid; i < W; i += kThreads) toPeer[i] = 0;
  __syncthreads();
  const std::int32_t* myIds = mine.ids[parity];
  for (int i = tid; i < p.T * K; i += kThreads) {
    const int e = myIds[i];
    ids[i] = e;
    atomicOr(&expBits[e * W + (i / K >> 5)], 1u << (i / K & 31));
    if (e / L == peer) atomicOr(&toPeer[i / K >> 5], 1u << (i / K & 31));
  }
  __syncthreads();
  if (tid == 0) stamp(mine, 1);
  // 2. The routing to the peer (CTA 0): plain stores that the arrival orders, or with --ll-counts
  // flagged lines {id, step, id, step} that the receiver reads as they land, before the arrival.
  if (blockIdx.x == 0) {
    if (p.lineCounts) {
      uint4* lines = p.rank[peer].idLines + (static_cast<std::uint64_t>(parity) * kRanks + p.me) * (kMaxEntries / 2);
      for (int i = tid; i < (p.T * K + 1) / 2; i += kThreads) {
        const int b = 2 * i + 1 < p.T * K ? ids[2 * i + 1] : -1;
        graphep::ptx::stVolatileV4(lines + i, graphep::flaggedLine(static_cast<unsigned>(ids[2 * i]), static_cast<unsigned>(b), p.step));
      }
    } else {
      std::int32_t* dst = p.rank[peer].stagedIds + (static_cast<std::uint64_t>(parity) * kRanks + p.me) * kMaxEntries;
      for (int i = tid; i < p.T * K; i += kThreads) dst[i] = ids[i];
    }
    if (tid == 0) stamp(mine, 2);
  }
  // 3. The peer's records and the own rows (base 0 in each own block), item = (token, 4 tiles).
  // With --apart the records go first, the arrival next, and the own rows after it (off the
  // peer's path); without, each item stores its record and its own rows together.
  const char* x = reinterpret_cast<const char*>(mine.x);
  char* staging = p.rank[peer].staging + (static_cast<std::uint64_t>(parity) * kRanks + p.me) * p.T * recBytes;
  auto sendItems = [&](bool toRecords, bool toOwn) {
    for (int item = warp; item < p.T * chunks; item += warps) {
      const int t = item / chunks, tile = (item % chunks) * 4 + (lane >> 3);
      char* rows[16];
      int n = 0;
      if (toOwn) {
        for (int k = 0; k < K; ++k) {
          const int e = ids[t * K + k];
          if (e / L != p.me) continue;
          const std::uint64_t row = static_cast<std::uint64_t>(e % L) * blockRows + popcBelow(expBits + e * W, t);
          rows[n++] = mine.recv + row * p.rowBytes;
          if (lane == 0 && item % chunks == 0) mine.srcTag[row] = p.me << 16 | t;
        }
      }
      const bool toLines = toRecords && p.llPayload && ((toPeer[t >> 5] >> (t & 31)) & 1u);
      if (toRecords && !p.llPayload && ((toPeer[t >> 5] >> (t & 31)) & 1u)) rows[n++] = staging + static_cast<std::uint64_t>(t) * recBytes;
      if ((n == 0 && !toLines) || tile >= tiles) continue;
      const Tile q = quantizeTile(x + static_cast<std::uint64_t>(t) * p.H * 2, tile, sub, true);
      if (toLines) {  // each 16-byte piece as two lines {a, step, b, step}, the scale as one more
        uint4* lines = reinterpret_cast<uint4*>(staging + static_cast<std::uint64_t>(t) * recBytes);
        graphep::ptx::stVolatileV4(lines + 2 * (tile * 8 + sub), graphep::flaggedLine(q.q.x, q.q.y, p.step));
        graphep::ptx::stVolatileV4(lines + 2 * (tile * 8 + sub) + 1, graphep::flaggedLine(q.q.z, q.q.w, p.step));
        if (sub == 0) graphep::ptx::stVolatileV4(lines + tiles * 16 + tile, graphep::flaggedLine(__float_as_uint(q.scale), 0u, p.step));
      }
      for (int i = 0; i < n; ++i) {
        *reinterpret_cast<uint4*>(rows[i] + static_cast<std::uint64_t>(tile) * 128 + sub * 16) = q.q;
        if (sub == 0) *reinterpret_cast<float*>(rows[i] + p.H + tile * 4) = q.scale;
      }
    }
  };
  sendItems(true, !p.apart);
  __syncthreads();
  if (tid == 0) {
    stamp(mine, 3);
    if (!p.llPayload) {  // flagged lines need no arrival
      graphep::ptx::fenceAcqRelSys();
      graphep::ptx::redReleaseSysAdd(p.rank[peer].arrivals + p.me, 1u);
    }
  }
  if (p.apart) sendItems(false, true);
  // 4. Every CTA: the peer's routing, the peer's CTAs arrived, then its records expanded after the
  // own rows. The own ids in shared memory give way to the peer's.
  for (int j = tid; j < L; j += kThreads) ownCount[j] = popcBelow(expBits + (p.me * L + j) * W, p.T);
  __syncthreads();
  if (p.lineCounts) {
    const uint4* lines = mine.idLines + (static_cast<std::uint64_t>(parity) * kRanks + peer) * (kMaxEntries / 2);
    for (int i = tid; i < (p.T * K + 1) / 2; i += kThreads) {
      uint4 v;
      waitLine(lines + i, p.step, mine.error, 1u, v);
      const int e[2] = {static_cast<int>(v.x), static_cast<int>(v.z)};
      for (int h = 0; h < 2 && 2 * i + h < p.T * K; ++h) {
        const int at = 2 * i + h;
        ids[at] = e[h];
        if (e[h] >= 0 && e[h] / L == p.me) atomicOr(&peerBits[(e[h] % L) * W + (at / K >> 5)], 1u << (at / K & 31));
      }
    }
    __syncthreads();
    if (tid == 0) stamp(mine, 5);
  }
  if (tid == 0 && !p.llPayload) waitAtLeast(mine.arrivals + peer, p.arrivalsTarget, mine.error, 2 + peer);
  __syncthreads();
  graphep::ptx::launchDependents();
  if (tid == 0) stamp(mine, 4);
  if (!p.lineCounts) {
    const std::int32_t* peerIds = mine.stagedIds + (static_cast<std::uint64_t>(parity) * kRanks + peer) * kMaxEntries;
    for (int i = tid; i < p.T * K; i += kThreads) {
      const int e = __ldcg(peerIds + i);
      ids[i] = e;
      if (e / L == p.me) atomicOr(&peerBits[(e % L) * W + (i / K >> 5)], 1u << (i / K & 31));
    }
    __syncthreads();
    if (tid == 0) stamp(mine, 5);
  }
  const char* from = mine.staging + (static_cast<std::uint64_t>(parity) * kRanks + peer) * p.T * recBytes;
  for (int item = warp; item < p.T * chunks; item += warps) {
    const int t = item / chunks, tile = (item % chunks) * 4 + (lane >> 3);
    char* rows[16];
    int n = 0;
    for (int k = 0; k < K; ++k) {
      const int e = ids[t * K + k];
      if (e / L != p.me) continue;
      const std::uint64_t row = static_cast<std::uint64_t>(e % L) * blockRows + ownCount[e % L] + popcBelow(peerBits + (e % L) * W, t);
      rows[n++] = mine.recv + row * p.rowBytes;
      if (lane == 0 && item % chunks == 0) mine.srcTag[row] = peer << 16 | t;
    }
    if (n == 0 || tile >= tiles) continue;
    const char* rec = from + static_cast<std::uint64_t>(t) * recBytes;
    uint4 q;
    float scale = 0.f;
    if (p.llPayload) {  // the piece's two lines (and the scale's), once they carry this step
      const uint4* lines = reinterpret_cast<const uint4*>(rec);
      const uint4* at[3] = {lines + 2 * (tile * 8 + sub), lines + 2 * (tile * 8 + sub) + 1, lines + tiles * 16 + tile};
      // All loaded before any is checked (one round trip when they have landed), then waited for.
      uint4 a = graphep::ptx::ldVolatileV4(at[0]), b = graphep::ptx::ldVolatileV4(at[1]);
      uint4 c = sub == 0 ? graphep::ptx::ldVolatileV4(at[2]) : graphep::flaggedLine(0u, 0u, p.step);
      if (!graphep::flaggedLineReady(a, p.step) || !graphep::flaggedLineReady(b, p.step) || !graphep::flaggedLineReady(c, p.step)) {
        waitLine(at[0], p.step, mine.error, 4u, a);
        waitLine(at[1], p.step, mine.error, 4u, b);
        if (sub == 0) waitLine(at[2], p.step, mine.error, 4u, c);
      }
      q = make_uint4(a.x, a.z, b.x, b.z);
      scale = __uint_as_float(c.x);
    } else {
      q = __ldcg(reinterpret_cast<const uint4*>(rec + static_cast<std::uint64_t>(tile) * 128 + sub * 16));
      scale = sub == 0 ? __ldcg(reinterpret_cast<const float*>(rec + p.H + tile * 4)) : 0.f;
    }
    for (int i = 0; i < n; ++i) {
      *reinterpret_cast<uint4*>(rows[i] + static_cast<std::uint64_t>(tile) * 128 + sub * 16) = q;
      if (sub == 0) *reinterpret_cast<float*>(rows[i] + p.H + tile * 4) = scale;
    }
  }
  __syncthreads();
  if (tid == 0) stamp(mine, 6);
  if (blockIdx.x == 0) {
    for (int j = tid; j < L; j += kThreads) {
      int c = 0;
      for (int w = 0; w < W; ++w) c += __popc(peerBits[j * W + w]);
      mine.layout[j] = ownCount[j] + c;
    }
  }
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
  const bool llCounts = std::find(args.begin(), args.end(), "--ll-counts") != args.end();
  const bool wide = std::find(args.begin(), args.end(), "--wide") != args.end();
  const bool onePass = std::find(args.begin(), args.end(), "--one-pass") != args.end();
  const bool apart = std::find(args.begin(), args.end(), "--apart") != args.end();
  const bool records = std::find(args.begin(), args.end(), "--records") != args.end();
  const bool llPayload = std::find(args.begin(), args.end(), "--ll-payload") != args.end();
  if (llPayload && (!records || !llCounts)) {
    std::fprintf(stderr, "graphep-ll-probe: --ll-payload needs --records and --ll-counts\n");
    return 2;
  }
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
  // Two routings per rank, [parity][rank]: the operations alternate between them, so counts or
  // rows left from the step before are wrong for this one.
  std::vector<std::vector<std::int32_t>> hids(2 * kRanks, std::vector<std::int32_t>(static_cast<std::size_t>(T) * K));
  std::vector<int> perm(static_cast<std::size_t>(E));
  for (int r = 0; r < kRanks; ++r) {
    for (auto& v : hx[static_cast<std::size_t>(r)]) v = __float2bfloat16(normal(gen) * 3.f);
    for (int par = 0; par < 2; ++par) {
      for (int t = 0; t < T; ++t) {
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), gen);
        for (int k = 0; k < K; ++k) {
          hids[static_cast<std::size_t>(par * kRanks + r)][static_cast<std::size_t>(t) * K + k] = perm[static_cast<std::size_t>(k)];
        }
      }
    }
  }
  Params p{};
  p.T = T, p.H = H, p.E = E, p.K = K, p.team = team, p.rowBytes = rowBytes, p.lineCounts = llCounts ? 1 : 0;
  p.wide = wide ? 1 : 0, p.onePass = onePass ? 1 : 0, p.apart = apart ? 1 : 0, p.llPayload = llPayload ? 1 : 0;
  p.stageBytes = llPayload ? static_cast<std::uint64_t>(H / 128) * 272 : rowBytes;  // per tile: 16 pieces' lines, a scale line
  const int tilesPerLane = (H / 128 + team / (wide ? 8 : 16) - 1) / (team / (wide ? 8 : 16));
  if (onePass && tilesPerLane > kMaxTilesPerLane) {
    std::fprintf(stderr, "graphep-ll-probe: --one-pass holds %d tiles a lane at hidden %d, team %d (at most %d): a larger team\n",
                 tilesPerLane, H, team, kMaxTilesPerLane);
    return 2;
  }
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
    for (int par = 0; par < 2; ++par) {
      const std::vector<std::int32_t>& h = hids[static_cast<std::size_t>(par * kRanks + r)];
      CHECK(cudaMalloc(&v, h.size() * 4));
      CHECK(cudaMemcpy(v, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
      k.ids[par] = static_cast<const std::int32_t*>(v);
    }
    CHECK(cudaMalloc(&k.recv, rows * rowBytes));
    CHECK(cudaMemset(k.recv, 0xff, rows * rowBytes));  // poison
    CHECK(cudaMalloc(&k.srcTag, rows * 4));
    CHECK(cudaMemset(k.srcTag, 0xff, rows * 4));
    CHECK(cudaMalloc(&k.counts, 2ull * kRanks * E * 4));
    CHECK(cudaMalloc(&k.lineCounts, 2ull * kRanks * (E / 2) * sizeof(uint4)));
    CHECK(cudaMemset(k.lineCounts, 0, 2ull * kRanks * (E / 2) * sizeof(uint4)));
    CHECK(cudaMalloc(&k.countFlags, kRanks * 4));
    CHECK(cudaMemset(k.countFlags, 0, kRanks * 4));
    CHECK(cudaMalloc(&k.arrivals, kRanks * 4));
    CHECK(cudaMemset(k.arrivals, 0, kRanks * 4));
    CHECK(cudaMalloc(&k.layout, static_cast<std::size_t>(L) * 4));
    CHECK(cudaMalloc(&k.error, 4));
    CHECK(cudaMemset(k.error, 0, 4));
    CHECK(cudaMalloc(&k.trace, kPhases * sizeof(unsigned long long)));
    CHECK(cudaMalloc(&k.staging, 2ull * kRanks * T * p.stageBytes));
    CHECK(cudaMemset(k.staging, 0, 2ull * kRanks * T * p.stageBytes));
    CHECK(cudaMalloc(&k.stagedIds, 2ull * kRanks * kMaxEntries * 4));
    CHECK(cudaMalloc(&k.idLines, 2ull * kRanks * kMaxEntries / 2 * sizeof(uint4)));
    CHECK(cudaMemset(k.idLines, 0, 2ull * kRanks * kMaxEntries / 2 * sizeof(uint4)));
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
      CHECK(records ? cudaLaunchKernelEx(&cfg, probeRecords, q) : cudaLaunchKernelEx(&cfg, probeDispatch, q));
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
    if (ctas < kRanks + (apart ? 1 : 0)) {
      std::fprintf(stderr, "graphep-ll-probe: ctas=%d (at least %d)\n", ctas, kRanks + (apart ? 1 : 0));
      return 2;
    }
    for (int i = 0; i < 20; ++i) launchBoth(ctas);
    for (int r = 0; r < kRanks; ++r) {  // a wait that timed out in the warm-up ends the run here
      std::uint32_t err = 0;
      CHECK(cudaSetDevice(r));
      CHECK(cudaStreamSynchronize(streams[r]));
      CHECK(cudaMemcpy(&err, p.rank[r].error, 4, cudaMemcpyDeviceToHost));
      if (err != 0) {
        std::printf("ll-probe: rank %d timed out in the warm-up (what %u)\n", r, err);
        return 1;
      }
    }
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
    // One more operation, traced (both ranks' stamps zeroed, the start at its maximum), into
    // poisoned rows, tags and layout: the check below sees only what it wrote.
    std::vector<unsigned long long> stamps(kPhases, 0);
    for (int r = 0; r < kRanks; ++r) {
      stamps[0] = ~0ull;
      CHECK(cudaSetDevice(r));
      CHECK(cudaMemsetAsync(p.rank[r].recv, 0xff, rows * rowBytes, streams[r]));  // in the launches' stream order
      CHECK(cudaMemsetAsync(p.rank[r].srcTag, 0xff, rows * 4, streams[r]));
      CHECK(cudaMemsetAsync(p.rank[r].layout, 0xff, static_cast<std::size_t>(L) * 4, streams[r]));
      CHECK(cudaMemcpyAsync(p.rank[r].trace, stamps.data(), kPhases * sizeof(unsigned long long), cudaMemcpyHostToDevice,
                            streams[r]));
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
        std::snprintf(line, sizeof line, " %s %.2f", (records ? kRecordPhaseNames : kPhaseNames)[ph], (stamps[static_cast<std::size_t>(ph)] - stamps[0]) * 1e-3);
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
                    err == 1 ? "the peer's counts" : err == 2 ? "rank 0's arrivals" : err == 3 ? "rank 1's arrivals" : "the peer's record lines");
        return 1;
      }
      CHECK(cudaMemcpy(got.data(), p.rank[r].recv, got.size(), cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(tags.data(), p.rank[r].srcTag, tags.size() * 4, cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(layout.data(), p.rank[r].layout, layout.size() * 4, cudaMemcpyDeviceToHost));
      for (int j = 0; j < L; ++j) {
        const int e = r * L + j;
        std::uint64_t row = static_cast<std::uint64_t>(j) * kRanks * T;
        // The peer's rows first, then the own; --records: the own first.
        const int order[2] = {records ? r : 1 - r, records ? 1 - r : r};
        for (const int s : order) {
          for (int t = 0; t < T; ++t) {
            const std::int32_t* id = hids[static_cast<std::size_t>((step & 1u) * kRanks + s)].data() + static_cast<std::size_t>(t) * K;
            if (std::find(id, id + K, e) == id + K) continue;
            reference(s, t, want);
            if (tags[row] != (s << 16 | t) || std::memcmp(got.data() + row * rowBytes, want.data(), H + H / 128 * 4) != 0) ++wrong;
            ++row;
          }
        }
        if (layout[static_cast<std::size_t>(j)] != static_cast<std::int32_t>(row - static_cast<std::uint64_t>(j) * kRanks * T)) ++wrong;
      }
    }
    std::printf("ll-probe hidden=%d experts=%d topk=%d tokens=%d ctas=%d team=%d pdl=%d ll-counts=%d wide=%d one-pass=%d apart=%d records=%d ll-payload=%d us=%.2f wrong=%lld\n",
                H, E, K, T, ctas, team, pdl ? 1 : 0, llCounts ? 1 : 0, wide ? 1 : 0, onePass ? 1 : 0, apart ? 1 : 0, records ? 1 : 0, llPayload ? 1 : 0, worst * 1e3f / iters, wrong);
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
