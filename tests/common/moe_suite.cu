#include "common/moe_suite.hpp"

#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <string>

#include "common/bf16.hpp"
#include "common/fp8_reference.hpp"
#include "common/graph_util.hpp"
#include "common/nccl_comms.hpp"
#include "engine/error.hpp"

namespace graphep::test {
namespace {

constexpr unsigned char kPoison = 0xff;      // payloads and outputs: 0xffff is a bf16 NaN
constexpr unsigned char kMetaPoison = 0x5a;  // metadata and layout words: 0x5a5a5a5a, not -1 or 0
constexpr std::uint32_t kMetaPoisonWord = 0x5a5a5a5au;

// The expert's output for the row of (source rank, token, top-k slot): exact in bf16.
__host__ __device__ inline float yValue(int s, int t, int k, int h) {
  const int n = (s * 131 + t * 31 + k * 7 + h * 3) % 61 - 30;
  return static_cast<float>(n) / 16.0f;
}

// A stand-in expert that reads exactly the rows the layout documents, as a real one does: local
// expert j = blockIdx.y owns rows [expertOffsets[j], expertOffsets[j] + expertCounts[j]), and
// each gets y(rowSrcRank, rowSrcToken, rowTopkSlot) x scale in `y` (the layout's expertOutput,
// or a caller's buffer of exactly `capacity` rows). A documented row outside [0, capacity) is
// counted in *violations; with `guard` it is then skipped, without it read and written as
// documented (compute-sanitizer memcheck sees where that lands).
__global__ void fakeExpertKernel(DispatchLayout v, void* y, float scale, unsigned long long* violations, bool guard) {
  const int j = static_cast<int>(blockIdx.y);
  const long long first = v.expertOffsets[j], count = v.expertCounts[j];
  for (long long row = first + blockIdx.x; row < first + count; row += gridDim.x) {
    if (row < 0 || row >= v.capacity) {
      if (threadIdx.x == 0) atomicAdd(violations, 1ull);
      if (guard) continue;
    }
    const int s = v.rowSrcRank[row], t = v.rowSrcToken[row], k = v.rowTopkSlot[row];
    auto* out = static_cast<__nv_bfloat16*>(y) + row * v.hidden;
    for (int h = static_cast<int>(threadIdx.x); h < v.hidden; h += static_cast<int>(blockDim.x)) {
      out[h] = __float2bfloat16_rn(yValue(s, t, k, h) * scale);
    }
  }
}

// The stand-in expert of the rank-major layout: each received row's output is its slots' sum, in
// slot order, of weight x y(rowSrcRank, rowSrcToken, slot) x scale, fp32 fma from 0, one bf16
// rounding (what the engine computes for a row in the other layouts, so combineRef holds).
__global__ void fakeRankMajorExpertKernel(DispatchLayout v, void* y, float scale, int K, unsigned long long* violations) {
  const long long rows = *v.numRecvRows;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    if (row < 0 || row >= v.capacity) {
      if (threadIdx.x == 0) atomicAdd(violations, 1ull);
      continue;
    }
    const int s = v.rowSrcRank[row], t = v.rowSrcToken[row];
    auto* out = static_cast<__nv_bfloat16*>(y) + row * v.hidden;
    for (int h = static_cast<int>(threadIdx.x); h < v.hidden; h += static_cast<int>(blockDim.x)) {
      float acc = 0.f;
      for (int k = 0; k < K; ++k) {
        if (v.rowExperts[row * K + k] >= 0) acc = __fmaf_rn(v.rowExpertWeights[row * K + k], yValue(s, t, k, h) * scale, acc);
      }
      out[h] = __float2bfloat16_rn(acc);
    }
  }
}

struct Inputs {
  int T = 0;                      // live count as passed (may exceed the maximum)
  std::vector<std::uint16_t> x;   // [T_max, H] bf16 bits
  std::vector<long long> idx;     // [T_max, K]
  std::vector<float> w;           // [T_max, K]
};


Inputs makeInputs(const MoeCase& c, int R, int rank, int T, std::uint64_t seed) {
  const MoeConfig& g = c.cfg;
  const int Tm = g.maxTokensPerRank, H = g.hidden, K = g.topK, E = g.numExperts, L = E / R;
  std::mt19937_64 rng(seed * 1000003ull + static_cast<std::uint64_t>(rank) * 7919ull + 17);
  std::uniform_real_distribution<float> val(-2.f, 2.f), wd(0.1f, 1.f);
  Inputs in;
  in.T = T;
  in.x.resize(static_cast<std::size_t>(Tm) * H);
  for (auto& v : in.x) v = bf16Bits(val(rng));
  if (g.dispatchType == DType::kFp8E4m3) {  // tiles of every kind of magnitude the quantiser meets
    for (int t = 0; t < Tm; ++t) {
      for (int tile = 0; tile < H / 128; ++tile) {
        std::uint16_t* v = in.x.data() + static_cast<std::size_t>(t) * H + tile * 128;
        switch (rng() % 6) {
          case 0:  // all zero: scale 1, every byte 0
            for (int i = 0; i < 128; ++i) v[i] = 0;
            break;
          case 1:  // one large value, the rest far below it: e4m3 subnormals and zeros
            for (int i = 0; i < 128; ++i) v[i] = bf16Bits(val(rng) * 1e-4f);
            v[rng() % 128] = bf16Bits(3.0f);
            break;
          case 2:  // large magnitudes
            for (int i = 0; i < 128; ++i) v[i] = bf16Bits(val(rng) * 1e30f);
            break;
          case 3:  // tiny magnitudes, bf16 subnormals among them
            for (int i = 0; i < 128; ++i) v[i] = bf16Bits(val(rng) * 1e-38f);
            break;
          default:  // the uniform values already there
            break;
        }
      }
    }
  }
  in.idx.assign(static_cast<std::size_t>(Tm) * K, -1);
  in.w.resize(static_cast<std::size_t>(Tm) * K);
  for (auto& v : in.w) v = wd(rng);
  // Pool of experts a token may pick.
  std::vector<int> pool;
  for (int e = 0; e < E; ++e) {
    if (c.routing == Routing::kRankEmpty && R > 1 && e / L == R - 1) continue;
    pool.push_back(e);
  }
  for (int t = 0; t < Tm; ++t) {
    if (c.routing == Routing::kAllMasked) continue;
    std::vector<int> p = pool;
    std::shuffle(p.begin(), p.end(), rng);
    if (c.routing == Routing::kSkewed) {
      auto it = std::find(p.begin(), p.end(), 0);
      std::iter_swap(p.begin(), it);
    }
    for (int k = 0; k < K && k < static_cast<int>(p.size()); ++k) {
      in.idx[static_cast<std::size_t>(t) * K + k] = p[static_cast<std::size_t>(k)];
    }
    if (c.routing == Routing::kDuplicates && K >= 2 && rng() % 2 == 0) {
      const std::size_t b = static_cast<std::size_t>(t) * K;
      in.idx[b + 1] = in.idx[b];
      if (K >= 4 && rng() % 2 == 0) in.idx[b + 3] = in.idx[b];
    }
    if (c.routing == Routing::kInvalidMixed) {
      const int k = static_cast<int>(rng() % static_cast<unsigned>(K));
      const long long bad[] = {-1, -2, E, E + 5, -1000, 1ll << 40};
      const long long b = bad[rng() % 6];
      if (c.indexType == IndexType::kInt32 && (b > INT32_MAX || b < INT32_MIN)) continue;
      if (rng() % 3 == 0) in.idx[static_cast<std::size_t>(t) * K + k] = b;
    }
  }
  return in;
}

int liveCount(const MoeConfig& g, int T) { return std::clamp(T, 0, g.maxTokensPerRank); }

// The expected dispatch layout of rank r: rows grouped by local expert in (source, token, slot)
// order, each expert's first row aligned (expert-major) or at j x rowsPerExpert (batched); rows
// whose place is at or past the capacity (batched: past their expert's block) dropped, and the
// published views clamped to what is kept (include/graphep/moe.hpp).
struct RefRow {
  int s = -1, t = -1, k = -1;
  float w = 0;
};
struct RefLayout {
  std::vector<int> counts, offsets, dropped;  // as published: kept rows, clamped offsets
  std::vector<int> routed;                    // rows routed to each expert (kept or dropped)
  std::vector<RefRow> rows;  // by position, [capacity]; s < 0: not written
  int numRows = 0;           // kept
  unsigned long long droppedTotal = 0;
  std::vector<long long> posOf;  // per (s, t, k) flattened: the row, or -1 (dropped / none)
  // Rank-major: each source's first row, then the end; per row and top-k slot, the local expert
  // (-1: not here) and its weight (0).
  std::vector<int> rankOffsets, rowExperts;
  std::vector<float> rowExpertWeights;
};

// The batched layout's rows per expert as documented (MoeConfig.rowsPerExpert, 0: R x T_max); 0
// for expert-major.
long long batchedRows(const MoeConfig& g, int R) {
  if (g.receiveLayout != ReceiveLayout::kBatched) return 0;
  return g.rowsPerExpert > 0 ? g.rowsPerExpert : static_cast<long long>(R) * g.maxTokensPerRank;
}

RefLayout refLayout(const MoeCase& c, const std::vector<Inputs>& all, int r, long long cap) {
  const MoeConfig& g = c.cfg;
  const int R = static_cast<int>(all.size()), K = g.topK, L = g.numExperts / R;
  const std::size_t Tm = static_cast<std::size_t>(g.maxTokensPerRank);
  RefLayout out;
  out.counts.assign(static_cast<std::size_t>(L), 0);
  out.dropped.assign(static_cast<std::size_t>(L), 0);
  out.routed.assign(static_cast<std::size_t>(L), 0);
  out.offsets.assign(static_cast<std::size_t>(L) + 1, 0);
  out.rows.assign(static_cast<std::size_t>(cap), RefRow{});
  out.posOf.assign(static_cast<std::size_t>(R) * Tm * K, -1);
  std::vector<std::vector<RefRow>> lists(static_cast<std::size_t>(L));
  for (int s = 0; s < R; ++s) {
    const int T = liveCount(g, all[static_cast<std::size_t>(s)].T);
    for (int t = 0; t < T; ++t) {
      for (int k = 0; k < K; ++k) {
        const long long e = all[static_cast<std::size_t>(s)].idx[static_cast<std::size_t>(t) * K + k];
        if (e < 0 || e >= g.numExperts || e / L != r) continue;
        lists[static_cast<std::size_t>(e % L)].push_back(
            RefRow{s, t, k, all[static_cast<std::size_t>(s)].w[static_cast<std::size_t>(t) * K + k]});
      }
    }
  }
  if (g.receiveLayout == ReceiveLayout::kRankMajor) {
    // One row per (source token, this rank) holding a valid slot here, sources and tokens in
    // order; the per-expert views count entries, packed.
    long long off = 0;
    for (int j = 0; j < L; ++j) {
      const int n = static_cast<int>(lists[static_cast<std::size_t>(j)].size());
      out.offsets[static_cast<std::size_t>(j)] = static_cast<int>(off);
      out.counts[static_cast<std::size_t>(j)] = n;
      out.routed[static_cast<std::size_t>(j)] = n;
      off += n;
    }
    out.offsets[static_cast<std::size_t>(L)] = static_cast<int>(off);
    out.rowExperts.assign(static_cast<std::size_t>(cap) * K, -1);
    out.rowExpertWeights.assign(static_cast<std::size_t>(cap) * K, 0.f);
    long long pos = 0;
    for (int s = 0; s < R; ++s) {
      out.rankOffsets.push_back(static_cast<int>(pos));
      const Inputs& in = all[static_cast<std::size_t>(s)];
      const int T = liveCount(g, in.T);
      for (int t = 0; t < T; ++t) {
        bool here = false;
        for (int k = 0; k < K; ++k) {
          const long long e = in.idx[static_cast<std::size_t>(t) * K + k];
          if (e < 0 || e >= g.numExperts || e / L != r) continue;
          here = true;
          out.rowExperts[static_cast<std::size_t>(pos) * K + k] = static_cast<int>(e % L);
          out.rowExpertWeights[static_cast<std::size_t>(pos) * K + k] = in.w[static_cast<std::size_t>(t) * K + k];
          out.posOf[(static_cast<std::size_t>(s) * Tm + static_cast<std::size_t>(t)) * K + k] = pos;
        }
        if (!here) continue;
        if (pos < cap) out.rows[static_cast<std::size_t>(pos)] = RefRow{s, t, -1, 0.f};
        ++pos;
      }
    }
    out.rankOffsets.push_back(static_cast<int>(pos));
    out.numRows = static_cast<int>(pos);
    return out;
  }
  const long long rpe = batchedRows(g, R);  // 0: expert-major
  long long off = 0;
  for (int j = 0; j < L; ++j) {
    const auto& list = lists[static_cast<std::size_t>(j)];
    const std::size_t js = static_cast<std::size_t>(j);
    if (rpe > 0) off = j * rpe;
    out.offsets[js] = static_cast<int>(std::min(off, cap));
    out.routed[js] = static_cast<int>(list.size());
    for (std::size_t q = 0; q < list.size(); ++q) {
      const long long pos = off + static_cast<long long>(q);
      const RefRow& row = list[q];
      if (pos >= cap || (rpe > 0 && static_cast<long long>(q) >= rpe)) {
        ++out.dropped[js];
        continue;
      }
      ++out.counts[js];
      out.rows[static_cast<std::size_t>(pos)] = row;
      out.posOf[(static_cast<std::size_t>(row.s) * Tm + static_cast<std::size_t>(row.t)) * K +
                static_cast<std::size_t>(row.k)] = pos;
    }
    out.numRows += out.counts[js];
    out.droppedTotal += static_cast<unsigned long long>(out.dropped[js]);
    off += (static_cast<long long>(list.size()) + g.expertAlignment - 1) / g.expertAlignment *
           g.expertAlignment;
  }
  out.offsets[static_cast<std::size_t>(L)] = static_cast<int>(rpe > 0 ? std::min(L * rpe, cap) : std::min(off, cap));
  return out;
}

unsigned long long invalidCount(const MoeConfig& g, const Inputs& in) {
  unsigned long long n = 0;
  const int T = liveCount(g, in.T);
  for (std::size_t i = 0; i < static_cast<std::size_t>(T) * g.topK; ++i) {
    if (in.idx[i] < -1 || in.idx[i] >= g.numExperts) ++n;
  }
  return n;
}

// Device inputs of one rank.
struct RankBuffers {
  void* x = nullptr;
  void* idx = nullptr;
  float* w = nullptr;
  int* numTokens = nullptr;
  void* out = nullptr;
  unsigned long long* violations = nullptr;  // documented rows outside the capacity (fakeExpertKernel)
  cudaStream_t stream = nullptr;
};

// Rank l's expected combine output for token t, element h (bf16 bits), and whether it is exact:
// the engine sums each destination rank's kept slots of the token in fp32 (fma, ascending slot
// order, from 0), rounds that partial to bf16, and sums the partials at home in fp32 in ascending
// rank order, rounded to bf16 (include/graphep/moe.hpp). The reference does the same operations in
// the same order, so every token is compared bit for bit (`bound`, the error two roundings allow,
// is printed beside a mismatch to tell an order slip from a wrong value).
struct CombineRef {
  double sum = 0, bound = 0;  // the exact sum and the rounding bound: a mismatch's diagnosis
  std::uint16_t bits = 0;     // what the engine must return
};
CombineRef combineRef(const MoeConfig& g, const Inputs& mine, const std::vector<RefLayout>& refs, int r, int t,
                      int h, float yScale) {
  const int K = g.topK, R = static_cast<int>(refs.size()), Lx = g.numExperts / R;
  const std::size_t Tm = static_cast<std::size_t>(g.maxTokensPerRank);
  std::vector<float> partial(static_cast<std::size_t>(R), 0.f);
  std::vector<double> exactPart(static_cast<std::size_t>(R), 0.0), magPart(static_cast<std::size_t>(R), 0.0);
  std::vector<bool> goes(static_cast<std::size_t>(R), false);
  for (int k = 0; k < K; ++k) {
    const long long e = mine.idx[static_cast<std::size_t>(t) * K + k];
    if (e < 0 || e >= g.numExperts) continue;
    const std::size_t d = static_cast<std::size_t>(e / Lx);
    goes[d] = true;  // the token's record goes to d, kept slots or not
    if (refs[d].posOf[(static_cast<std::size_t>(r) * Tm + t) * K + k] < 0) continue;  // dropped there
    const float w = mine.w[static_cast<std::size_t>(t) * K + k], y = yValue(r, t, k, h) * yScale;
    partial[d] = std::fmaf(w, y, partial[d]);
    exactPart[d] += static_cast<double>(w) * y;
    magPart[d] += std::fabs(static_cast<double>(w) * y);
  }
  CombineRef c;
  float home = 0.f;
  double mag = 0;
  for (int d = 0; d < R; ++d) {
    if (!goes[static_cast<std::size_t>(d)]) continue;
    home += bf16Value(bf16Bits(partial[static_cast<std::size_t>(d)]));
    c.sum += exactPart[static_cast<std::size_t>(d)];
    c.bound += std::fabs(exactPart[static_cast<std::size_t>(d)]) / 256.0;
    mag += magPart[static_cast<std::size_t>(d)];
  }
  c.bits = bf16Bits(home);
  // Each bf16 rounding is within 2^-8 relative (of each partial, then of the sum); the fp32
  // accumulations add at most K x 2^-24 of the magnitudes.
  c.bound += std::fabs(c.sum) / 256.0 + mag * K / 16777216.0 + 1e-30;
  return c;
}

// Counts the wrong values of one check; the first few become test failures prefixed by `where`.
class WrongValues {
 public:
  explicit WrongValues(std::string where) : where_(std::move(where)) {}
  void operator()(const std::string& what) {
    if (wrong_++ < 8) ADD_FAILURE() << where_ << ": " << what;
  }
  long long count() const { return wrong_; }

 private:
  std::string where_;
  long long wrong_ = 0;
};

class MoeFixture {
 public:
  MoeFixture(Communicator& comm, const MoeCase& c) : comm_(comm), c_(c) {
    engines_ = Engine::createAll(comm, c.cfg);
    for (const auto& e : engines_) layouts_.push_back(e->layout());
    const MoeConfig& g = c.cfg;
    const std::size_t Tm = static_cast<std::size_t>(g.maxTokensPerRank);
    for (int l = 0; l < comm.numLocalRanks(); ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
      // Load the test's kernel now: a lazy load at its first launch would wait for the device,
      // where this rank's dispatch already spins on peers that this thread has not enqueued yet.
      cudaFuncAttributes attr{};
      GRAPHEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, fakeExpertKernel));
      GRAPHEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, fakeRankMajorExpertKernel));
      RankBuffers b;
      GRAPHEP_CUDA_CHECK(cudaMalloc(&b.x, Tm * g.hidden * 2));
      GRAPHEP_CUDA_CHECK(cudaMalloc(&b.idx, Tm * g.topK * 8));
      GRAPHEP_CUDA_CHECK(cudaMalloc(&b.w, Tm * g.topK * 4));
      GRAPHEP_CUDA_CHECK(cudaMalloc(&b.numTokens, 4));
      GRAPHEP_CUDA_CHECK(cudaMalloc(&b.out, Tm * g.hidden * 2));
      GRAPHEP_CUDA_CHECK(cudaMalloc(&b.violations, sizeof(unsigned long long)));
      GRAPHEP_CUDA_CHECK(cudaMemset(b.violations, 0, sizeof(unsigned long long)));
      GRAPHEP_CUDA_CHECK(cudaStreamCreateWithFlags(&b.stream, cudaStreamNonBlocking));
      bufs_.push_back(b);
    }
  }
  ~MoeFixture() {
    for (int l = 0; l < comm_.numLocalRanks(); ++l) {
      cudaSetDevice(comm_.device(l));
      const RankBuffers& b = bufs_[static_cast<std::size_t>(l)];
      cudaStreamSynchronize(b.stream);
      cudaFree(b.x);
      cudaFree(b.idx);
      cudaFree(b.w);
      cudaFree(b.numTokens);
      cudaFree(b.out);
      cudaFree(b.violations);
      cudaStreamDestroy(b.stream);
    }
  }

  int L() const { return comm_.numLocalRanks(); }
  Engine& engine(int l) { return *engines_[static_cast<std::size_t>(l)]; }
  // The layout views of rank l (kept when the engines are dropped).
  const DispatchLayout& layout(int l) const { return layouts_[static_cast<std::size_t>(l)]; }
  // Destroys the Engine objects (graphs built over them keep their buffers alive).
  void dropEngines() { engines_.clear(); }
  RankBuffers& buf(int l) { return bufs_[static_cast<std::size_t>(l)]; }

  // Uploads this rank's inputs (x, ids, weights, the live count) only.
  void upload(int l, const Inputs& in, int* numTokens = nullptr) {
    RankBuffers& b = buf(l);
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm_.device(l)));
    const std::size_t n = in.idx.size();
    GRAPHEP_CUDA_CHECK(cudaMemcpy(b.x, in.x.data(), in.x.size() * 2, cudaMemcpyHostToDevice));
    if (c_.indexType == IndexType::kInt64) {
      GRAPHEP_CUDA_CHECK(cudaMemcpy(b.idx, in.idx.data(), n * 8, cudaMemcpyHostToDevice));
    } else {
      std::vector<std::int32_t> v(in.idx.begin(), in.idx.end());
      GRAPHEP_CUDA_CHECK(cudaMemcpy(b.idx, v.data(), n * 4, cudaMemcpyHostToDevice));
    }
    GRAPHEP_CUDA_CHECK(cudaMemcpy(b.w, in.w.data(), n * 4, cudaMemcpyHostToDevice));
    GRAPHEP_CUDA_CHECK(cudaMemcpy(numTokens != nullptr ? numTokens : b.numTokens, &in.T, 4, cudaMemcpyHostToDevice));
  }

  // Poisons every output of rank l: the layout views (counts, offsets, dropped, rows, metadata
  // with a word that is neither -1 nor 0), recv_x and scales, the expert outputs (NaN: a dropped or
  // padding row that reaches combine shows), and out.
  void poison(int l) {
    const MoeConfig& g = c_.cfg;
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm_.device(l)));
    const DispatchLayout& v = layout(l);
    const std::size_t cap = static_cast<std::size_t>(v.capacity), Ls = static_cast<std::size_t>(v.numLocalExperts);
    const bool fp8 = g.dispatchType == DType::kFp8E4m3;
    GRAPHEP_CUDA_CHECK(cudaMemset(v.recvX, kPoison, cap * g.hidden * (fp8 ? 1 : 2)));
    if (fp8) GRAPHEP_CUDA_CHECK(cudaMemset(v.recvScales, kPoison, cap * (g.hidden / 128) * 4));
    for (const void* p : {static_cast<const void*>(v.rowSrcRank), static_cast<const void*>(v.rowSrcToken),
                          static_cast<const void*>(v.rowTopkSlot), static_cast<const void*>(v.rowWeight)}) {
      GRAPHEP_CUDA_CHECK(cudaMemset(const_cast<void*>(p), kMetaPoison, cap * 4));
    }
    GRAPHEP_CUDA_CHECK(cudaMemset(const_cast<int*>(v.expertOffsets), kMetaPoison, (Ls + 1) * 4));
    GRAPHEP_CUDA_CHECK(cudaMemset(const_cast<int*>(v.expertCounts), kMetaPoison, Ls * 4));
    GRAPHEP_CUDA_CHECK(cudaMemset(const_cast<int*>(v.expertDropped), kMetaPoison, Ls * 4));
    GRAPHEP_CUDA_CHECK(cudaMemset(const_cast<int*>(v.numRecvRows), kMetaPoison, 4));
    if (v.rankOffsets != nullptr) {  // rank-major
      const std::size_t R = static_cast<std::size_t>(comm_.worldSize()), K = static_cast<std::size_t>(g.topK);
      GRAPHEP_CUDA_CHECK(cudaMemset(const_cast<int*>(v.rankOffsets), kMetaPoison, (R + 1) * 4));
      GRAPHEP_CUDA_CHECK(cudaMemset(const_cast<int*>(v.rowExperts), kMetaPoison, cap * K * 4));
      GRAPHEP_CUDA_CHECK(cudaMemset(const_cast<float*>(v.rowExpertWeights), kMetaPoison, cap * K * 4));
    }
    GRAPHEP_CUDA_CHECK(cudaMemset(v.expertOutput, kPoison, cap * g.hidden * 2));
    GRAPHEP_CUDA_CHECK(cudaMemset(buf(l).out, kPoison, static_cast<std::size_t>(g.maxTokensPerRank) * g.hidden * 2));
  }

  // Uploads this rank's inputs and poisons every output (outside any graph). `numTokens`: where
  // the live count goes (nullptr: the rank's own scalar; a bucket graph reads its fixed one).
  void prepare(int l, const Inputs& in, int* numTokens = nullptr) {
    upload(l, in, numTokens);
    poison(l);
    GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  }

  // dispatch -> fake expert -> combine on this rank's stream.
  void enqueue(int l, cudaStream_t s) {
    const DispatchLayout& v = engine(l).dispatch(dispatchArgs(l, nullptr), s);
    expert(l, v, s, 1.0f);
    CombineArgs ca;
    ca.out = buf(l).out;
    engine(l).combine(ca, s);
  }

  // The stand-in expert of rank l on `s`: y = yValue x scale (a power of two: exact in bf16), into
  // `y` (nullptr: the layout's expertOutput), documented rows outside the capacity counted (and,
  // with `guard`, skipped).
  void expert(int l, const DispatchLayout& v, cudaStream_t s, float scale, void* y = nullptr, bool guard = true) {
    if (v.receiveLayout == ReceiveLayout::kRankMajor) {
      fakeRankMajorExpertKernel<<<64, 128, 0, s>>>(v, y != nullptr ? y : v.expertOutput, scale, c_.cfg.topK,
                                                   buf(l).violations);
    } else {
      const dim3 grid(64, static_cast<unsigned>(v.numLocalExperts));
      fakeExpertKernel<<<grid, 128, 0, s>>>(v, y != nullptr ? y : v.expertOutput, scale, buf(l).violations, guard);
    }
    GRAPHEP_CUDA_CHECK(cudaGetLastError());
  }

  DispatchArgs dispatchArgs(int l, const int* numTokens) {
    RankBuffers& b = buf(l);
    DispatchArgs a;
    a.x = b.x;
    a.topkIdx = b.idx;
    a.indexType = c_.indexType;
    a.topkWeights = b.w;
    a.numTokens = numTokens != nullptr ? numTokens : b.numTokens;
    return a;
  }

  // The expert outputs the next checks expect: yValue x scale.
  void setYScale(float scale) { yScale_ = scale; }
  // Tokens whose weights include a NaN or an infinity (every rank's): their outputs must not be finite.
  void setNonFiniteTokens(std::set<int> t) { nonFinite_ = std::move(t); }

  void syncAll() {
    for (int l = 0; l < L(); ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(comm_.device(l)));
      GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(buf(l).stream));
    }
    comm_.barrier();
  }

  // Compares rank l's dispatch layout with the reference (refs: every rank's expected layout);
  // returns the number of wrong values.
  long long checkLayout(int l, const std::vector<Inputs>& all, const std::vector<RefLayout>& refs,
                        const std::string& what) {
    const MoeConfig& g = c_.cfg;
    const int R = comm_.worldSize(), H = g.hidden, Lx = g.numExperts / R;
    const int r = comm_.globalRank(l);
    const DispatchLayout& v = layout(l);
    const long long cap = v.capacity;
    const RefLayout& ref = refs[static_cast<std::size_t>(r)];
    const bool fp8 = g.dispatchType == DType::kFp8E4m3;
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm_.device(l)));
    WrongValues fail(what + " rank " + std::to_string(r));
    std::vector<int> counts(static_cast<std::size_t>(Lx)), offsets(static_cast<std::size_t>(Lx) + 1),
        dropped(static_cast<std::size_t>(Lx));
    int numRows = 0;
    unsigned long long violations = 0;
    GRAPHEP_CUDA_CHECK(cudaMemcpy(counts.data(), v.expertCounts, counts.size() * 4, cudaMemcpyDeviceToHost));
    GRAPHEP_CUDA_CHECK(cudaMemcpy(offsets.data(), v.expertOffsets, offsets.size() * 4, cudaMemcpyDeviceToHost));
    GRAPHEP_CUDA_CHECK(cudaMemcpy(dropped.data(), v.expertDropped, dropped.size() * 4, cudaMemcpyDeviceToHost));
    GRAPHEP_CUDA_CHECK(cudaMemcpy(&numRows, v.numRecvRows, 4, cudaMemcpyDeviceToHost));
    GRAPHEP_CUDA_CHECK(cudaMemcpy(&violations, buf(l).violations, sizeof(violations), cudaMemcpyDeviceToHost));
    if (violations != 0) fail(std::to_string(violations) + " documented row(s) lie outside [0, capacity)");
    const bool rankMajor = g.receiveLayout == ReceiveLayout::kRankMajor;  // its expert views count entries
    for (int j = 0; j <= Lx && !rankMajor; ++j) {  // the overflow contract, whatever the reference says
      const std::size_t js = static_cast<std::size_t>(j);
      if (offsets[js] < 0 || offsets[js] > cap || (j < Lx && (counts[js] < 0 || offsets[js] + static_cast<long long>(counts[js]) > cap))) {
        fail("expert " + std::to_string(j) + " documents rows [" + std::to_string(offsets[js]) + ", +" +
             (j < Lx ? std::to_string(counts[js]) : std::string("end")) + ") outside the capacity " + std::to_string(cap));
      }
    }
    if (numRows < 0 || numRows > cap) fail("numRecvRows " + std::to_string(numRows) + " exceeds the capacity");
    if (counts != ref.counts) fail("expert counts differ");
    if (offsets != ref.offsets) fail("expert offsets differ");
    if (dropped != ref.dropped) fail("per-expert dropped counts differ");
    if (numRows != ref.numRows) fail("numRecvRows " + std::to_string(numRows) + " != " + std::to_string(ref.numRows));
    const std::size_t capz = static_cast<std::size_t>(cap);
    std::vector<std::uint32_t> srank(capz), stok(capz), sslot(capz), sw(capz);
    GRAPHEP_CUDA_CHECK(cudaMemcpy(srank.data(), v.rowSrcRank, capz * 4, cudaMemcpyDeviceToHost));
    GRAPHEP_CUDA_CHECK(cudaMemcpy(stok.data(), v.rowSrcToken, capz * 4, cudaMemcpyDeviceToHost));
    GRAPHEP_CUDA_CHECK(cudaMemcpy(sslot.data(), v.rowTopkSlot, capz * 4, cudaMemcpyDeviceToHost));
    GRAPHEP_CUDA_CHECK(cudaMemcpy(sw.data(), v.rowWeight, capz * 4, cudaMemcpyDeviceToHost));
    const std::size_t rowBytes = static_cast<std::size_t>(H) * (fp8 ? 1 : 2);
    std::vector<unsigned char> rx(capz * rowBytes);
    GRAPHEP_CUDA_CHECK(cudaMemcpy(rx.data(), v.recvX, rx.size(), cudaMemcpyDeviceToHost));
    std::vector<float> rs(fp8 ? capz * (H / 128) : 0);
    if (fp8) GRAPHEP_CUDA_CHECK(cudaMemcpy(rs.data(), v.recvScales, rs.size() * 4, cudaMemcpyDeviceToHost));
    std::vector<unsigned char> q;
    std::vector<float> sc;
    for (std::size_t pos = 0; pos < capz; ++pos) {
      const RefRow& e = ref.rows[pos];
      const unsigned char* got = rx.data() + pos * rowBytes;
      if (e.s < 0) {  // padding or unused: untouched
        if (srank[pos] != kMetaPoisonWord || stok[pos] != kMetaPoisonWord || sslot[pos] != kMetaPoisonWord ||
            sw[pos] != kMetaPoisonWord || std::any_of(got, got + rowBytes, [](unsigned char b) { return b != kPoison; })) {
          fail("row " + std::to_string(pos) + " was written but holds no received row");
        }
        continue;
      }
      std::uint32_t wbits;
      std::memcpy(&wbits, &e.w, 4);
      if (static_cast<int>(srank[pos]) != e.s || static_cast<int>(stok[pos]) != e.t ||
          static_cast<int>(sslot[pos]) != e.k || sw[pos] != wbits) {
        fail("row " + std::to_string(pos) + " metadata (" + std::to_string(static_cast<int>(srank[pos])) + ", " +
             std::to_string(static_cast<int>(stok[pos])) + ", " + std::to_string(static_cast<int>(sslot[pos])) +
             ") != (" + std::to_string(e.s) + ", " + std::to_string(e.t) + ", " + std::to_string(e.k) + ")");
        continue;
      }
      const std::uint16_t* src = all[static_cast<std::size_t>(e.s)].x.data() + static_cast<std::size_t>(e.t) * H;
      if (fp8) {
        quantizeRow(src, H, &q, &sc);
        for (int h = 0; h < H; ++h) {
          if (got[h] != q[static_cast<std::size_t>(h)]) {
            fail("row " + std::to_string(pos) + " fp8 byte " + std::to_string(h) + " = " + std::to_string(got[h]) +
                 ", reference " + std::to_string(q[static_cast<std::size_t>(h)]) + " (bf16 value " +
                 std::to_string(bf16Value(src[h])) + ", tile scale " + std::to_string(sc[static_cast<std::size_t>(h / 128)]) + ")");
            break;
          }
        }
        if (std::memcmp(rs.data() + pos * (H / 128), sc.data(), sc.size() * 4) != 0) {
          fail("row " + std::to_string(pos) + " fp8 scales differ");
        }
      } else if (std::memcmp(got, src, rowBytes) != 0) {
        fail("row " + std::to_string(pos) + " payload differs");
      }
    }
    if (rankMajor) {  // the source offsets and each row's slots, bit for bit (unused rows untouched)
      const std::size_t K = static_cast<std::size_t>(g.topK);
      std::vector<int> rankOffsets(static_cast<std::size_t>(R) + 1), experts(capz * K);
      std::vector<std::uint32_t> weights(capz * K);
      GRAPHEP_CUDA_CHECK(cudaMemcpy(rankOffsets.data(), v.rankOffsets, rankOffsets.size() * 4, cudaMemcpyDeviceToHost));
      GRAPHEP_CUDA_CHECK(cudaMemcpy(experts.data(), v.rowExperts, experts.size() * 4, cudaMemcpyDeviceToHost));
      GRAPHEP_CUDA_CHECK(cudaMemcpy(weights.data(), v.rowExpertWeights, weights.size() * 4, cudaMemcpyDeviceToHost));
      if (rankOffsets != ref.rankOffsets) fail("rank offsets differ");
      for (std::size_t pos = 0; pos < capz; ++pos) {
        for (std::size_t k = 0; k < K; ++k) {
          const std::size_t i = pos * K + k;
          const bool used = ref.rows[pos].s >= 0;
          std::uint32_t want = kMetaPoisonWord;
          if (used) std::memcpy(&want, &ref.rowExpertWeights[i], 4);
          if (experts[i] != (used ? ref.rowExperts[i] : static_cast<int>(kMetaPoisonWord)) || weights[i] != want) {
            fail("row " + std::to_string(pos) + " slot " + std::to_string(k) + ": expert " + std::to_string(experts[i]) +
                 " (reference " + std::to_string(used ? ref.rowExperts[i] : -2) + ") or its weight differs");
          }
        }
      }
    }
    return fail.count();
  }

  // Compares rank l's combine output with the reference: bit for bit for tokens whose kept slots
  // live on one rank, within two bf16 roundings of the terms summed otherwise (combineRef), NaN
  // and infinite weights propagating to their tokens only, rows past the live count untouched.
  long long checkCombine(int l, const std::vector<Inputs>& all, const std::vector<RefLayout>& refs,
                         const std::string& what) {
    const MoeConfig& g = c_.cfg;
    const int H = g.hidden, r = comm_.globalRank(l);
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm_.device(l)));
    WrongValues fail(what + " rank " + std::to_string(r));
    const Inputs& mine = all[static_cast<std::size_t>(r)];
    const int T = liveCount(g, mine.T);
    const std::size_t Tm = static_cast<std::size_t>(g.maxTokensPerRank);
    std::vector<std::uint16_t> out(Tm * static_cast<std::size_t>(H));
    GRAPHEP_CUDA_CHECK(cudaMemcpy(out.data(), buf(l).out, out.size() * 2, cudaMemcpyDeviceToHost));
    for (int t = 0; t < static_cast<int>(Tm); ++t) {
      for (int h = 0; h < H; ++h) {
        const std::uint16_t gotBits = out[static_cast<std::size_t>(t) * H + h];
        if (t >= T) {
          if (gotBits != 0xffff) {
            fail("out row " + std::to_string(t) + " past the live count was written");
            break;
          }
          continue;
        }
        if (nonFinite_.count(t) != 0) {  // a NaN or infinite weight: the output must not be finite
          if (std::isfinite(bf16Value(gotBits))) {
            fail("out[" + std::to_string(t) + "][" + std::to_string(h) + "] is finite; a weight of the token is not");
            break;
          }
          continue;
        }
        const CombineRef ref = combineRef(g, mine, refs, r, t, h, yScale_);
        const double got = bf16Value(gotBits);
        if (gotBits != ref.bits) {  // within the bound: an order or rounding slip; past it: a wrong value
          fail("out[" + std::to_string(t) + "][" + std::to_string(h) + "] = " + std::to_string(got) +
               ", bit-exact reference " + std::to_string(bf16Value(ref.bits)) + " (exact sum " +
               std::to_string(ref.sum) + " +- " + std::to_string(ref.bound) + ")");
          break;
        }
      }
    }
    return fail.count();
  }

  long long check(int l, const std::vector<Inputs>& all, const std::vector<RefLayout>& refs, const std::string& what) {
    return checkLayout(l, all, refs, what) + checkCombine(l, all, refs, what);
  }

 private:
  Communicator& comm_;
  MoeCase c_;
  std::vector<std::unique_ptr<Engine>> engines_;
  std::vector<DispatchLayout> layouts_;
  std::vector<RankBuffers> bufs_;
  float yScale_ = 1.0f;
  std::set<int> nonFinite_;
};

const char* routingName(Routing r) {
  switch (r) {
    case Routing::kUniform: return "uniform";
    case Routing::kSkewed: return "skewed";
    case Routing::kRankEmpty: return "rank_empty";
    case Routing::kAllMasked: return "all_masked";
    case Routing::kInvalidMixed: return "invalid_mixed";
    case Routing::kDuplicates: return "duplicates";
  }
  return "?";
}

const char* pathName(MoePath p) {
  switch (p) {
    case MoePath::kAuto: return "auto";
    case MoePath::kLatency: return "latency";
    case MoePath::kThroughput: return "throughput";
  }
  return "?";
}

// The receive layout in words (batched: with its rows per expert as configured, 0: the default).
std::string layoutName(const MoeConfig& g) {
  switch (g.receiveLayout) {
    case ReceiveLayout::kExpertMajor: return "expert-major";
    case ReceiveLayout::kBatched: return "batched rows/expert=" + std::to_string(g.rowsPerExpert);
    case ReceiveLayout::kRankMajor: return "rank-major";
  }
  return "?";
}

std::string describeCase(const MoeCase& c) {
  const MoeConfig& g = c.cfg;
  std::string tokens;
  for (int t : c.tokens) tokens += (tokens.empty() ? "" : ",") + std::to_string(t);
  return c.name + ": T_max=" + std::to_string(g.maxTokensPerRank) + " H=" + std::to_string(g.hidden) +
         " E=" + std::to_string(g.numExperts) + " K=" + std::to_string(g.topK) +
         (g.dispatchType == DType::kFp8E4m3 ? " fp8" : " bf16") +
         (c.indexType == IndexType::kInt64 ? " int64" : " int32") + " routing=" + routingName(c.routing) +
         " align=" + std::to_string(g.expertAlignment) + " cap=" + std::to_string(g.recvCapacity) +
         " layout=" + layoutName(g) + " sms=" + std::to_string(g.smBudget) + " tokens={" + tokens + "} replays=" + std::to_string(c.replays) +
         " path=" + pathName(g.path);
}

// Rank q's live count in run `run`: the case's counts rotate over the ranks, so ranks differ in a
// run (one may send nothing while its peers send).
int rankTokens(const MoeCase& c, int run, int q) {
  return c.tokens[static_cast<std::size_t>(run + q) % c.tokens.size()];
}

// The first invalid entry the device may have recorded: any invalid (token, slot) of the first
// dispatch that had one (which of them is a race between device threads).
bool isInvalidEntry(const MoeConfig& g, const Inputs& in, long long id, int token, int slot) {
  const int T = liveCount(g, in.T);
  if (token < 0 || token >= T || slot < 0 || slot >= g.topK) return false;
  const long long e = in.idx[static_cast<std::size_t>(token) * g.topK + slot];
  return e == id && (e < -1 || e >= g.numExperts);
}

// The case in each receive layout, one after the other: as written (expert-major), batched, then
// rank-major. Alignment is the expert-major layout's, so a case that only tests it runs once; a
// capacity that overflows becomes 9 rows per expert (a batched expert overflows on its own) and
// the rank-major layout's full R x T_max rows (it cannot overflow). A case written in another
// layout runs as written only.
// The latency path's step trace (Engine::stepTrace) of rank r: at least one dispatch and one
// combine; in each operation the send CTA's start before its wait's return, and every event no
// later than the step's advance (the launch's last CTA, after every other); the count messages
// and the receive's view of them for a dispatch only; and in stream order each operation's wait
// returning no earlier than the previous operation's advance (its kernel waited for that one).
void expectStepTrace(const std::vector<MoeStepTrace>& steps, int r) {
  constexpr int kReady = 1, kLayout = 4, kDone = 7;  // MoeStepTrace's ns[] (include/graphep/moe.hpp)
  constexpr int kEvents = static_cast<int>(sizeof(MoeStepTrace::ns) / sizeof(MoeStepTrace::ns[0]));
  int dispatches = 0, combines = 0;
  for (std::size_t k = 0; k < steps.size(); ++k) {
    const MoeStepTrace& t = steps[k];
    (t.combine ? combines : dispatches) += 1;
    EXPECT_NE(t.ns[0], 0u) << "rank " << r << ", operation " << k;
    EXPECT_LE(t.ns[0], t.ns[kReady]) << "rank " << r << ", operation " << k << ": entered after its wait returned";
    for (int e = 0; e < kEvents; ++e) {
      if (t.ns[e] != 0) EXPECT_LE(t.ns[e], t.ns[kDone]) << "rank " << r << ", operation " << k << ", event " << e;
    }
    EXPECT_EQ(t.ns[kLayout] != 0, !t.combine) << "rank " << r << ", operation " << k;
    if (k > 0) {
      EXPECT_GE(t.ns[kReady], steps[k - 1].ns[kDone])
          << "rank " << r << ", operation " << k << " started its work before operation " << k - 1 << " ended";
    }
  }
  EXPECT_GE(dispatches, 1) << "rank " << r;
  EXPECT_GE(combines, 1) << "rank " << r;
}

std::vector<MoeCase> inEveryLayout(const MoeCase& c) {
  std::vector<MoeCase> out{c};
  if (c.cfg.receiveLayout != ReceiveLayout::kExpertMajor || (c.cfg.expertAlignment > 1 && c.cfg.recvCapacity == 0)) {
    return out;
  }
  MoeCase b = c;
  b.cfg.receiveLayout = ReceiveLayout::kBatched;
  b.cfg.expertAlignment = 1;
  if (b.cfg.recvCapacity > 0) {
    b.cfg.recvCapacity = 0;
    b.cfg.rowsPerExpert = 9;
  }
  out.push_back(b);
  MoeCase m = c;
  m.cfg.receiveLayout = ReceiveLayout::kRankMajor;
  m.cfg.expertAlignment = 1;
  m.cfg.recvCapacity = 0;
  out.push_back(m);
  return out;
}

// body(case) for each case of inEveryLayout(c) in turn (each names its layout in its
// SCOPED_TRACE, through describeCase); a fatal failure stops the layouts after it.
template <class F>
void forEveryLayout(const MoeCase& c, F&& body) {
  const std::vector<MoeCase> cases = inEveryLayout(c);
  for (std::size_t i = 0; i < cases.size(); ++i) {
    if (i > 0 && ::testing::Test::HasFatalFailure()) return;
    body(cases[i]);
  }
}

// What a rank's layout views `v` say of their layout: its kind; batched, E_local x rowsPerExpert
// rows; rank-major, one row per (source token, this rank) and the source offsets.
void expectLayoutShape(const MoeCase& c, const DispatchLayout& v, int R) {
  EXPECT_EQ(v.receiveLayout, c.cfg.receiveLayout);
  if (c.cfg.receiveLayout == ReceiveLayout::kBatched) {
    const long long L = c.cfg.numExperts / R;
    EXPECT_EQ(v.rowsPerExpert, batchedRows(c.cfg, R));
    EXPECT_EQ(v.capacity, L * batchedRows(c.cfg, R));
  }
  if (c.cfg.receiveLayout == ReceiveLayout::kRankMajor) {
    EXPECT_EQ(v.capacity, static_cast<long long>(R) * c.cfg.maxTokensPerRank);
    EXPECT_NE(v.rankOffsets, nullptr);
  }
}

}  // namespace

MoePath expectedPath(const MoeConfig& cfg, int worldSize) {
  if (cfg.path != MoePath::kAuto) return cfg.path;
  const char* force = std::getenv("GRAPHEP_FORCE_TRANSPORT");
  const bool remote = force != nullptr && std::string(force) == "remote";
  const bool fits = cfg.maxTokensPerRank <= 256 && cfg.maxTokensPerRank * cfg.topK <= 4096;
  return fits && !remote ? MoePath::kLatency : MoePath::kThroughput;
}

std::string moeCaseName(const MoeCase& c) {
  std::string n = c.name + "_" + pathName(c.cfg.path);
  for (char& ch : n) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return n;
}

namespace {
void runMoeCaseInLayout(Communicator& comm, const MoeCase& c);
}  // namespace

// Every case in each receive layout (inEveryLayout).
void runMoeCase(Communicator& comm, const MoeCase& c) {
  forEveryLayout(c, [&](const MoeCase& v) { runMoeCaseInLayout(comm, v); });
}

namespace {
void runMoeCaseInLayout(Communicator& comm, const MoeCase& c) {
  SCOPED_TRACE(describeCase(c));
  const int R = comm.worldSize();
  MoeFixture f(comm, c);
  for (int l = 0; l < f.L(); ++l) {
    EXPECT_EQ(f.engine(l).path(), expectedPath(c.cfg, R)) << "rank " << comm.globalRank(l);
  }
  const int runs = c.replays > 0 ? c.replays : static_cast<int>(c.tokens.size());
  std::vector<cudaGraphExec_t> execs;
  if (c.replays > 0) {
    for (int l = 0; l < f.L(); ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
      execs.push_back(captureOnStream(f.buf(l).stream, [&](cudaStream_t s) { f.enqueue(l, s); }));
    }
  }
  const std::size_t nl = static_cast<std::size_t>(f.L());
  std::vector<unsigned long long> expectInvalid(nl, 0), expectDropped(nl, 0), expectClamped(nl, 0);
  std::vector<int> firstInvalidRun(nl, -1), firstClamped(nl, 0);
  std::vector<std::vector<Inputs>> history;  // every run's inputs (the first-error fields name one)
  std::vector<std::vector<unsigned long long>> expectTotals(nl);
  for (int run = 0; run < runs; ++run) {
    const std::uint64_t seed = 5000 + static_cast<std::uint64_t>(run) * 31;
    std::vector<Inputs> all;
    for (int q = 0; q < R; ++q) all.push_back(makeInputs(c, R, q, rankTokens(c, run, q), seed));
    for (int l = 0; l < f.L(); ++l) f.prepare(l, all[static_cast<std::size_t>(comm.globalRank(l))]);
    comm.barrier();
    for (int l = 0; l < f.L(); ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
      if (c.replays > 0) {
        GRAPHEP_CUDA_CHECK(cudaGraphLaunch(execs[static_cast<std::size_t>(l)], f.buf(l).stream));
      } else {
        f.enqueue(l, f.buf(l).stream);
      }
    }
    f.syncAll();
    // Every rank's expected layout, once per run (the capacity is the same on every rank).
    std::vector<RefLayout> refs;
    for (int q = 0; q < R; ++q) refs.push_back(refLayout(c, all, q, f.layout(0).capacity));
    expectLayoutShape(c, f.layout(0), R);
    for (int l = 0; l < f.L(); ++l) {
      const std::size_t ls = static_cast<std::size_t>(l);
      const int r = comm.globalRank(l);
      const Inputs& mine = all[static_cast<std::size_t>(r)];
      const std::string what = "run " + std::to_string(run) + " T=" + std::to_string(mine.T);
      EXPECT_EQ(f.check(l, all, refs, what), 0) << what << " rank " << r;
      const unsigned long long invalid = invalidCount(c.cfg, mine);
      if (invalid > 0 && firstInvalidRun[ls] < 0) firstInvalidRun[ls] = run;
      expectInvalid[ls] += invalid;
      if (mine.T > c.cfg.maxTokensPerRank || mine.T < 0) {
        if (expectClamped[ls]++ == 0) firstClamped[ls] = mine.T;
      }
      const RefLayout& ref = refs[static_cast<std::size_t>(r)];
      expectDropped[ls] += ref.droppedTotal;
      auto& tot = expectTotals[ls];
      tot.resize(ref.routed.size(), 0);
      for (std::size_t j = 0; j < ref.routed.size(); ++j) tot[j] += static_cast<unsigned long long>(ref.routed[j]);
    }
    history.push_back(std::move(all));
    comm.barrier();
  }
  for (int l = 0; l < f.L(); ++l) {
    const std::size_t ls = static_cast<std::size_t>(l);
    const MoeStatus st = f.engine(l).status();
    const int r = comm.globalRank(l);
    EXPECT_EQ(st.invalidExpertIds, expectInvalid[ls]) << "rank " << r;
    EXPECT_EQ(st.droppedRows, expectDropped[ls]) << "rank " << r;
    EXPECT_EQ(st.clampedTokenCounts, expectClamped[ls]) << "rank " << r;
    if (expectClamped[ls] > 0) EXPECT_EQ(st.firstClampedCount, firstClamped[ls]) << "rank " << r;
    if (firstInvalidRun[ls] >= 0) {
      const Inputs& in = history[static_cast<std::size_t>(firstInvalidRun[ls])][static_cast<std::size_t>(r)];
      EXPECT_TRUE(isInvalidEntry(c.cfg, in, st.firstInvalidId, st.firstInvalidToken, st.firstInvalidSlot))
          << "rank " << r << ": the first invalid id recorded, topk_idx[" << st.firstInvalidToken << "]["
          << st.firstInvalidSlot << "] = " << st.firstInvalidId << ", is not an invalid entry of run "
          << firstInvalidRun[ls];
      EXPECT_NE(st.describe().find("topk_idx[" + std::to_string(st.firstInvalidToken) + "]"), std::string::npos)
          << st.describe();
    }
    EXPECT_EQ(st.deviceError, "") << "rank " << r;
    std::vector<unsigned long long> totals(expectTotals[ls].size());
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    GRAPHEP_CUDA_CHECK(cudaMemcpy(totals.data(), f.engine(l).layout().expertTotals, totals.size() * 8,
                                  cudaMemcpyDeviceToHost));
    EXPECT_EQ(totals, expectTotals[ls]) << "rank " << r << ": cumulative expert totals";
    if (c.cfg.profile) {  // every kernel of the path ran, in order, each span well formed
      const std::vector<MoeKernelSpan> spans = f.engine(l).timeline();
      std::vector<std::string> names;
      for (const MoeKernelSpan& sp : spans) names.push_back(sp.kernel);
      // Throughput: six kernels, or with the direct dispatch and combine (every peer by load/store,
      // one rank per GPU) six, seven for fp8 (the quantise kernel), plus the receive's two phases;
      // latency: the dispatch's route and records (sender), layout and expand (receiver), the
      // combine's reduce of the peers' records (sender), then its own rows and sums (receiver).
      const std::vector<std::vector<std::string>> want =
          f.engine(l).path() == MoePath::kLatency
              ? std::vector<std::vector<std::string>>{{"latency route", "latency records", "latency layout",
                                                       "latency expand", "latency combine", "latency combine own rows",
                                                       "latency combine receive"}}
              : std::vector<std::vector<std::string>>{
                    {"route", "pack", "offsets", "expand", "combine reduce", "combine final"},
                    {"route", "direct send", "direct receive", "direct own rows", "direct peers' rows",
                     "direct combine reduce", "direct combine send", "direct combine final"},
                    {"route", "direct quantise", "direct send", "direct receive", "direct own rows",
                     "direct peers' rows", "direct combine reduce", "direct combine send", "direct combine final"}};
      EXPECT_NE(std::find(want.begin(), want.end(), names), want.end())
          << "rank " << r << ": the kernels that ran: " << ::testing::PrintToString(names);
      // Phases start in this order; on the latency path each kernel's receive part runs beside its
      // send part (CTAs of their own), so only the phases within one part are ordered.
      const std::map<std::string, std::string> after = {{"latency records", "latency route"},
                                                        {"latency expand", "latency layout"},
                                                        {"latency combine receive", "latency combine own rows"}};
      for (std::size_t k = 0; k < spans.size(); ++k) {
        EXPECT_LE(spans[k].startUs, spans[k].endUs) << spans[k].kernel;
        if (k == 0) continue;
        if (f.engine(l).path() != MoePath::kLatency) {
          EXPECT_LE(spans[k - 1].startUs, spans[k].startUs) << spans[k].kernel;
        } else if (after.count(names[k]) != 0) {
          const std::size_t before = static_cast<std::size_t>(
              std::find(names.begin(), names.end(), after.at(names[k])) - names.begin());
          ASSERT_LT(before, k) << names[k];
          EXPECT_LE(spans[before].startUs, spans[k].startUs) << spans[k].kernel;
        }
      }
      if (f.engine(l).path() == MoePath::kLatency) expectStepTrace(f.engine(l).stepTrace(), r);
    }
    if (!execs.empty()) cudaGraphExecDestroy(execs[ls]);
  }
  comm.barrier();
}
}  // namespace

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
  if (large) {  // the DeepSeek-V3 shape at decode size, both paths
    MoeCase c = base("deepseek_v3_decode", 128, 7168, 256, 8);
    c.tokens = {128, 77};
    cases.push_back(c);
    c.name = "deepseek_v3_decode_fp8";
    c.cfg.dispatchType = DType::kFp8E4m3;
    cases.push_back(c);
    c.name = "deepseek_v3_decode_graph";
    c.cfg.dispatchType = DType::kBf16;
    c.replays = 20;
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

namespace {

// Runs `call`, which must throw graphep::Error with `status` and a message containing `needle`.
template <class F>
void expectError(F&& call, Status status, const std::string& needle) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one naming '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), status) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// The small shape of the misuse, micro-batch and graph suites: H = 256, 4 experts per rank, top-2.
MoeCase smallCase(const Communicator& comm, int maxTokens, MoePath path) {
  MoeCase c;
  c.name = "small";
  c.cfg.maxTokensPerRank = maxTokens;
  c.cfg.hidden = 256;
  c.cfg.numExperts = 4 * comm.worldSize();
  c.cfg.topK = 2;
  c.cfg.path = path;
  return c;
}

// Bad pointers: named errors, thrown before anything is enqueued (so no peer waits on them).
void misuseBadPointers(Communicator& comm, MoeFixture& f, MoeFixture& other) {
  Engine& e = f.engine(0);
  GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(0)));
  cudaStream_t s = f.buf(0).stream;
  DispatchArgs a = f.dispatchArgs(0, nullptr);
  a.x = nullptr;
  expectError([&] { e.dispatch(a, s); }, Status::kInvalidArgument, "dispatch: x");
  a = f.dispatchArgs(0, nullptr);
  a.x = static_cast<const char*>(a.x) + 2;
  expectError([&] { e.dispatch(a, s); }, Status::kInvalidArgument, "is not 16-byte aligned");
  void* pinned = nullptr;
  GRAPHEP_CUDA_CHECK(cudaMallocHost(&pinned, 4096));
  a = f.dispatchArgs(0, nullptr);
  a.topkIdx = pinned;
  expectError([&] { e.dispatch(a, s); }, Status::kInvalidArgument, "host memory");
  std::vector<float> hostWeights(64);
  a = f.dispatchArgs(0, nullptr);
  a.topkWeights = hostWeights.data();
  expectError([&] { e.dispatch(a, s); }, Status::kInvalidArgument, "dispatch: topkWeights");
  GRAPHEP_CUDA_CHECK(cudaFreeHost(pinned));
  CombineArgs ca;
  expectError([&] { e.combine(ca, s); }, Status::kInvalidArgument, "combine: out");
  ca.out = f.buf(0).out;
  ca.expertOutput = other.engine(0).layout().expertOutput;
  expectError([&] { e.combine(ca, s); }, Status::kInvalidArgument, "another engine");
}

// Repeated operations: dispatch A (the inputs already uploaded), dispatch B, expert, combine,
// expert x2, combine on every rank: both orders are defined (nothing counted, nothing hangs) and
// each does what moe.hpp says. A dispatch over an uncombined one replaces it: the layout and the
// first combine are B's. A combine with no new dispatch combines the last dispatch again: the
// second combine is B's with the new expert outputs.
void repeatedOperations(Communicator& comm, const MoeCase& c, MoeFixture& f) {
  const int R = comm.worldSize();
  std::vector<Inputs> inB;
  for (int q = 0; q < R; ++q) inB.push_back(makeInputs(c, R, q, 32 - 5 * q % 32, 4712));
  for (int l = 0; l < f.L(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    f.engine(l).dispatch(f.dispatchArgs(l, nullptr), f.buf(l).stream);
  }
  f.syncAll();
  for (int l = 0; l < f.L(); ++l) f.prepare(l, inB[static_cast<std::size_t>(comm.globalRank(l))]);
  comm.barrier();
  for (int l = 0; l < f.L(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    const DispatchLayout& v = f.engine(l).dispatch(f.dispatchArgs(l, nullptr), f.buf(l).stream);
    f.expert(l, v, f.buf(l).stream, 1.0f);
    CombineArgs ca;
    ca.out = f.buf(l).out;
    f.engine(l).combine(ca, f.buf(l).stream);
  }
  f.syncAll();
  std::vector<RefLayout> refs;
  for (int q = 0; q < R; ++q) refs.push_back(refLayout(c, inB, q, f.layout(0).capacity));
  for (int l = 0; l < f.L(); ++l) EXPECT_EQ(f.check(l, inB, refs, "a dispatch over an uncombined one"), 0);
  comm.barrier();
  for (int l = 0; l < f.L(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    GRAPHEP_CUDA_CHECK(cudaMemset(f.buf(l).out, kPoison,
                                  static_cast<std::size_t>(c.cfg.maxTokensPerRank) * c.cfg.hidden * 2));
    GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  }
  comm.barrier();
  for (int l = 0; l < f.L(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    f.expert(l, f.layout(l), f.buf(l).stream, 2.0f);
    CombineArgs ca;
    ca.out = f.buf(l).out;
    f.engine(l).combine(ca, f.buf(l).stream);
  }
  f.syncAll();
  f.setYScale(2.0f);
  for (int l = 0; l < f.L(); ++l) {
    EXPECT_EQ(f.checkCombine(l, inB, refs, "a combine with no new dispatch"), 0);
    const MoeStatus st = f.engine(l).status();
    EXPECT_TRUE(st.ok()) << st.describe();  // dispatch -> dispatch and combine -> combine are defined
  }
  f.setYScale(1.0f);
  comm.barrier();
}

// NaN and infinite weights (of `in`) propagate to their tokens' outputs; every other token stays
// correct.
void misuseNonFiniteWeights(Communicator& comm, const MoeCase& c, MoeFixture& f, std::vector<Inputs> in) {
  const int R = comm.worldSize();
  for (Inputs& x : in) {
    x.w[0] = std::numeric_limits<float>::quiet_NaN();                   // token 0, slot 0
    x.w[static_cast<std::size_t>(c.cfg.topK)] = std::numeric_limits<float>::infinity();  // token 1, slot 0
  }
  for (int l = 0; l < f.L(); ++l) f.prepare(l, in[static_cast<std::size_t>(comm.globalRank(l))]);
  comm.barrier();
  for (int l = 0; l < f.L(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    f.enqueue(l, f.buf(l).stream);
  }
  f.syncAll();
  f.setNonFiniteTokens({0, 1});
  std::vector<RefLayout> refs;
  for (int q = 0; q < R; ++q) refs.push_back(refLayout(c, in, q, f.engine(0).layout().capacity));
  for (int l = 0; l < f.L(); ++l) {
    EXPECT_EQ(f.check(l, in, refs, "non-finite weights"), 0);
    const MoeStatus st = f.engine(l).status();
    EXPECT_TRUE(st.ok()) << st.describe();
  }
  comm.barrier();
}

void runMoeMisuseInLayout(Communicator& comm, const MoeCase& c) {
  SCOPED_TRACE("misuse, " + describeCase(c));
  const int R = comm.worldSize();
  MoeFixture f(comm, c), other(comm, c);
  expectLayoutShape(c, f.layout(0), R);
  std::vector<Inputs> in;
  for (int q = 0; q < R; ++q) in.push_back(makeInputs(c, R, q, 32, 4711));
  for (int l = 0; l < f.L(); ++l) f.prepare(l, in[static_cast<std::size_t>(comm.globalRank(l))]);
  comm.barrier();
  misuseBadPointers(comm, f, other);
  repeatedOperations(comm, c, f);
  misuseNonFiniteWeights(comm, c, f, std::move(in));
}

}  // namespace

// Every layout (inEveryLayout). The suite tests no config validation (Engine::validate's layout
// rules, rowsPerExpert among them, are tests/unit/test_moe_config.cpp's), so nothing here differs
// by layout but the rows the stand-in expert reads and the reference it is checked against.
void runMoeMisuse(Communicator& comm, MoePath path) {
  forEveryLayout(smallCase(comm, 32, path), [&](const MoeCase& c) { runMoeMisuseInLayout(comm, c); });
}

void runMoeMissingRank(Communicator& comm, MoePath path) {
  ScopedEnv timeout("GRAPHEP_TIMEOUT_MS", "300");  // read when the engines' heap is created
  const MoeCase c = smallCase(comm, 32, path);
  SCOPED_TRACE("a rank that never launches, " + describeCase(c));
  const int R = comm.worldSize(), missing = R - 1;
  MoeFixture f(comm, c);
  std::vector<Inputs> in;
  for (int q = 0; q < R; ++q) in.push_back(makeInputs(c, R, q, 32, 99));
  for (int l = 0; l < f.L(); ++l) f.prepare(l, in[static_cast<std::size_t>(comm.globalRank(l))]);
  comm.barrier();
  for (int l = 0; l < f.L(); ++l) {
    if (comm.globalRank(l) == missing) continue;  // this rank never launches
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    f.engine(l).dispatch(f.dispatchArgs(l, nullptr), f.buf(l).stream);
  }
  for (int l = 0; l < f.L(); ++l) {
    if (comm.globalRank(l) == missing) continue;
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(f.buf(l).stream));  // returns: every wait is bounded
    const MoeStatus st = f.engine(l).status();
    EXPECT_NE(st.deviceError.find("peer " + std::to_string(missing)), std::string::npos)
        << "rank " << comm.globalRank(l) << ": " << st.deviceError;
    EXPECT_TRUE(f.engine(l).failed());
    expectError([&] { f.engine(l).dispatch(f.dispatchArgs(l, nullptr), f.buf(l).stream); }, Status::kRemoteError,
                "failed state");
  }
  comm.barrier();
}  // the engines are destroyed here, without waiting on the missing rank

void runMoeWatchdog(Communicator& comm) {
  ScopedEnv timeout("GRAPHEP_TIMEOUT_MS", "20000");  // the device waits outlast the watchdog
  const MoeCase c = smallCase(comm, 32, MoePath::kLatency);
  SCOPED_TRACE("host watchdog, " + describeCase(c));
  const int R = comm.worldSize(), late = R - 1;
  MoeFixture f(comm, c);
  std::vector<Inputs> in;
  for (int q = 0; q < R; ++q) in.push_back(makeInputs(c, R, q, 32, 98));
  for (int l = 0; l < f.L(); ++l) f.prepare(l, in[static_cast<std::size_t>(comm.globalRank(l))]);
  comm.barrier();
  int lateLocal = -1;
  for (int l = 0; l < f.L(); ++l) {
    if (comm.globalRank(l) == late) {
      lateLocal = l;
      continue;  // launches only after the watchdog has looked
    }
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    f.engine(l).dispatch(f.dispatchArgs(l, nullptr), f.buf(l).stream);
  }
  for (int l = 0; l < f.L(); ++l) {
    if (l == lateLocal) continue;
    const HealthReport h = f.engine(l).checkHealth(f.buf(l).stream, std::chrono::milliseconds(200));
    EXPECT_FALSE(h.ok);
    EXPECT_NE(h.message.find("rank " + std::to_string(late) + "'s count message"), std::string::npos) << h.message;
    EXPECT_TRUE(f.engine(l).failed());
  }
  comm.barrier();
  if (lateLocal >= 0) {  // the late rank arrives: the others complete, and stay failed
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(lateLocal)));
    f.engine(lateLocal).dispatch(f.dispatchArgs(lateLocal, nullptr), f.buf(lateLocal).stream);
  }
  f.syncAll();
  for (int l = 0; l < f.L(); ++l) {
    if (l == lateLocal) {
      EXPECT_TRUE(f.engine(l).checkHealth(f.buf(l).stream, std::chrono::milliseconds(1000)).ok);
      continue;
    }
    expectError([&] { f.engine(l).combine(CombineArgs{nullptr, f.buf(l).out}, f.buf(l).stream); },
                Status::kRemoteError, "failed state");
  }
  comm.barrier();
}

void runMoeGraphOutlivesEngine(Communicator& comm) {
  const MoeCase c = smallCase(comm, 64, MoePath::kAuto);
  SCOPED_TRACE("MoeGraph replayed after its Engine object is destroyed, " + describeCase(c));
  const int R = comm.worldSize();
  MoeFixture f(comm, c);
  std::vector<std::unique_ptr<MoeGraph>> graphs;
  for (int l = 0; l < f.L(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    MoeGraphArgs args;
    args.dispatch = f.dispatchArgs(l, nullptr);
    args.out = f.buf(l).out;
    graphs.push_back(MoeGraph::capture(f.engine(l), args,
                                       [&f, l](const DispatchLayout& v, cudaStream_t s) { f.expert(l, v, s, 1.0f); }));
  }
  comm.barrier();
  f.dropEngines();
  for (int round = 0; round < 3; ++round) {
    std::vector<Inputs> in;
    for (int q = 0; q < R; ++q) in.push_back(makeInputs(c, R, q, 64 - 20 * round, 300 + round));
    for (int l = 0; l < f.L(); ++l) f.prepare(l, in[static_cast<std::size_t>(comm.globalRank(l))]);
    comm.barrier();
    for (int l = 0; l < f.L(); ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
      graphs[static_cast<std::size_t>(l)]->launch(f.buf(l).stream);
    }
    f.syncAll();
    std::vector<RefLayout> refs;
    for (int q = 0; q < R; ++q) refs.push_back(refLayout(c, in, q, f.layout(0).capacity));
    for (int l = 0; l < f.L(); ++l) EXPECT_EQ(f.check(l, in, refs, "after the Engine objects were destroyed"), 0);
    comm.barrier();
  }
  graphs.clear();  // the engines' buffers go with the last graph
  comm.barrier();
}

namespace {

void runMoeMicroBatchesInLayout(Communicator& comm, const MoeCase& c, int rounds) {
  SCOPED_TRACE("two micro-batches in flight, " + describeCase(c));
  const int R = comm.worldSize();
  MoeFixture a(comm, c), b(comm, c);  // two engines: two buffer sets
  expectLayoutShape(c, a.layout(0), R);
  for (int round = 0; round < rounds; ++round) {
    const int Ta = 1 + round * 13 % 64, Tb = 64 - round * 7 % 64;
    std::vector<Inputs> inA, inB;
    for (int q = 0; q < R; ++q) {
      inA.push_back(makeInputs(c, R, q, Ta, 700 + round));
      inB.push_back(makeInputs(c, R, q, Tb, 900 + round));
    }
    for (int l = 0; l < a.L(); ++l) {
      a.prepare(l, inA[static_cast<std::size_t>(comm.globalRank(l))]);
      b.prepare(l, inB[static_cast<std::size_t>(comm.globalRank(l))]);
    }
    comm.barrier();
    for (int l = 0; l < a.L(); ++l) {  // B's operations start while A's are in flight (its own stream)
      GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
      a.enqueue(l, a.buf(l).stream);
      b.enqueue(l, b.buf(l).stream);
    }
    a.syncAll();
    b.syncAll();
    std::vector<RefLayout> refA, refB;
    for (int q = 0; q < R; ++q) {
      refA.push_back(refLayout(c, inA, q, a.engine(0).layout().capacity));
      refB.push_back(refLayout(c, inB, q, b.engine(0).layout().capacity));
    }
    for (int l = 0; l < a.L(); ++l) {
      EXPECT_EQ(a.check(l, inA, refA, "micro-batch A round " + std::to_string(round)), 0);
      EXPECT_EQ(b.check(l, inB, refB, "micro-batch B round " + std::to_string(round)), 0);
    }
    comm.barrier();
  }
}

}  // namespace

// Every layout (inEveryLayout), each all `rounds` (a few: the rounds differ in their counts).
void runMoeMicroBatches(Communicator& comm, MoePath path, int rounds, int smBudget) {
  MoeCase c = smallCase(comm, 64, path);
  c.cfg.smBudget = smBudget;
  forEveryLayout(c, [&](const MoeCase& v) { runMoeMicroBatchesInLayout(comm, v, rounds); });
}

namespace {

// One run of the overflow suite on every rank: dispatch, the expert into the caller's `y` (exactly
// `capacity` rows each, poisoned first) unguarded, combine, and the full check. Adds each local
// rank's expected drops to `expectDropped`; returns this process's.
unsigned long long overflowRun(Communicator& comm, const MoeCase& c, MoeFixture& f, const std::vector<void*>& y,
                               int run, std::vector<unsigned long long>& expectDropped) {
  const int R = comm.worldSize();
  const std::size_t cap = static_cast<std::size_t>(f.layout(0).capacity), rowBytes = static_cast<std::size_t>(c.cfg.hidden) * 2;
  std::vector<Inputs> all;
  for (int q = 0; q < R; ++q) all.push_back(makeInputs(c, R, q, rankTokens(c, run, q), 777 + run));
  for (int l = 0; l < f.L(); ++l) {
    f.prepare(l, all[static_cast<std::size_t>(comm.globalRank(l))]);
    GRAPHEP_CUDA_CHECK(cudaMemset(y[static_cast<std::size_t>(l)], kPoison, cap * rowBytes));  // NaN
    GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  }
  comm.barrier();
  for (int l = 0; l < f.L(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    cudaStream_t s = f.buf(l).stream;
    const DispatchLayout& v = f.engine(l).dispatch(f.dispatchArgs(l, nullptr), s);
    f.expert(l, v, s, 1.0f, y[static_cast<std::size_t>(l)], /*guard=*/false);
    CombineArgs ca;
    ca.expertOutput = y[static_cast<std::size_t>(l)];
    ca.out = f.buf(l).out;
    f.engine(l).combine(ca, s);
  }
  f.syncAll();
  std::vector<RefLayout> refs;
  for (int q = 0; q < R; ++q) refs.push_back(refLayout(c, all, q, static_cast<long long>(cap)));
  unsigned long long dropped = 0;
  for (int l = 0; l < f.L(); ++l) {
    const RefLayout& ref = refs[static_cast<std::size_t>(comm.globalRank(l))];
    EXPECT_EQ(f.check(l, all, refs, "overflow run " + std::to_string(run)), 0);
    expectDropped[static_cast<std::size_t>(l)] += ref.droppedTotal;
    dropped += ref.droppedTotal;
  }
  comm.barrier();
  return dropped;
}

void runMoeOverflowInLayout(Communicator& comm, const MoeCase& c) {
  SCOPED_TRACE("overflow, " + describeCase(c));
  MoeFixture f(comm, c);
  expectLayoutShape(c, f.layout(0), comm.worldSize());
  const std::size_t cap = static_cast<std::size_t>(f.layout(0).capacity), rowBytes = static_cast<std::size_t>(c.cfg.hidden) * 2;
  std::vector<void*> y(static_cast<std::size_t>(f.L()), nullptr);  // the caller's: exactly `capacity` rows
  for (int l = 0; l < f.L(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&y[static_cast<std::size_t>(l)], cap * rowBytes));
  }
  unsigned long long droppedSeen = 0;
  std::vector<unsigned long long> expectDropped(static_cast<std::size_t>(f.L()), 0);
  for (int run = 0; run < 3; ++run) droppedSeen += overflowRun(comm, c, f, y, run, expectDropped);
  for (int l = 0; l < f.L(); ++l) {
    const MoeStatus st = f.engine(l).status();
    EXPECT_EQ(st.droppedRows, expectDropped[static_cast<std::size_t>(l)]) << st.describe();
    EXPECT_EQ(st.deviceError, "");
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    GRAPHEP_CUDA_CHECK(cudaFree(y[static_cast<std::size_t>(l)]));
  }
  if (c.cfg.receiveLayout == ReceiveLayout::kRankMajor) {  // one row per source token: nothing to drop
    EXPECT_EQ(droppedSeen, 0ull) << "the rank-major layout cannot overflow";
  } else {
    EXPECT_GT(droppedSeen, 0ull) << "the case must overflow";
  }
  comm.barrier();
}

}  // namespace

// Every layout (inEveryLayout): expert-major drops at the capacity, batched past 9 rows per expert,
// rank-major (full capacity) must drop nothing; then the aligned case, in expert-major only
// (alignment is that layout's alone).
void runMoeOverflow(Communicator& comm, MoePath path) {
  MoeCase c = smallCase(comm, 64, path);
  c.name = "overflow_memcheck";
  c.routing = Routing::kSkewed;
  c.cfg.recvCapacity = 29;  // far below what skewed routing sends every rank
  c.tokens = {64, 50, 0};
  forEveryLayout(c, [&](const MoeCase& v) { runMoeOverflowInLayout(comm, v); });
  if (::testing::Test::HasFatalFailure()) return;
  c.cfg.expertAlignment = 8;
  runMoeOverflowInLayout(comm, c);
}

namespace {

// The graph suite's launches, every kind once and then at random.
enum GraphKind { kCallback, kChild, kBucket0, kBucket1, kBucket2, kBucket3, kPair, kUserGlobal, kUserThreadLocal,
                 kUserRelaxed, kGraphKinds };
constexpr int kGraphBuckets[4] = {1, 8, 33, 64};      // the live counts the bucket graphs bake in
constexpr float kExpertScale[3] = {1.0f, 2.0f, 4.0f};  // the child's three expert graphs
constexpr cudaStreamCaptureMode kUserModes[3] = {cudaStreamCaptureModeGlobal, cudaStreamCaptureModeThreadLocal,
                                                 cudaStreamCaptureModeRelaxed};

// One rank's graphs of the suite.
struct RankGraphs {
  std::unique_ptr<MoeGraph> callback, child, bucket[4], dispatch, combine;
  cudaGraphExec_t user[3] = {nullptr, nullptr, nullptr};
  cudaGraph_t experts[3] = {nullptr, nullptr, nullptr};  // x1 (one node), x2 (one node), x4 (two nodes)
  int* bucketT[4] = {nullptr, nullptr, nullptr, nullptr};
};

// Rank l's graphs of every kind: an expert callback graph; three expert graphs and a child graph
// over the first; the bucket graphs; a dispatch-only + combine-only pair; the engine's operations
// inside the caller's own capture in each mode.
void captureRankGraphs(Communicator& comm, MoeFixture& f, int l, RankGraphs& rg) {
  Engine& e = f.engine(l);
  GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
  cudaStream_t s = f.buf(l).stream;
  MoeGraphArgs args;
  args.dispatch = f.dispatchArgs(l, nullptr);
  args.out = f.buf(l).out;
  rg.callback = MoeGraph::capture(e, args, [&f, l](const DispatchLayout& v, cudaStream_t st) { f.expert(l, v, st, 1.0f); });
  for (int x = 0; x < 3; ++x) {
    GRAPHEP_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    const DispatchLayout& v = e.layout();
    if (x == 2) GRAPHEP_CUDA_CHECK(cudaMemsetAsync(v.expertOutput, 0, static_cast<std::size_t>(v.capacity) * v.hidden * 2, s));
    f.expert(l, v, s, kExpertScale[x]);
    GRAPHEP_CUDA_CHECK(cudaStreamEndCapture(s, &rg.experts[x]));
  }
  rg.child = MoeGraph::withExpertGraph(e, args, rg.experts[0]);
  for (int b = 0; b < 4; ++b) {
    GRAPHEP_CUDA_CHECK(cudaMalloc(&rg.bucketT[b], 4));
    GRAPHEP_CUDA_CHECK(cudaMemcpy(rg.bucketT[b], &kGraphBuckets[b], 4, cudaMemcpyHostToDevice));
    MoeGraphArgs ba = args;
    ba.dispatch = f.dispatchArgs(l, rg.bucketT[b]);
    rg.bucket[b] = MoeGraph::capture(e, ba, [&f, l](const DispatchLayout& v, cudaStream_t st) { f.expert(l, v, st, 1.0f); });
  }
  rg.dispatch = MoeGraph::dispatchOnly(e, args.dispatch);
  CombineArgs ca;
  ca.out = args.out;
  rg.combine = MoeGraph::combineOnly(e, ca);
  for (int m = 0; m < 3; ++m) {  // the engine's operations inside the caller's own capture
    GRAPHEP_CUDA_CHECK(cudaStreamBeginCapture(s, kUserModes[m]));
    f.enqueue(l, s);
    cudaGraph_t ug = nullptr;
    GRAPHEP_CUDA_CHECK(cudaStreamEndCapture(s, &ug));
    GRAPHEP_CUDA_CHECK(cudaGraphInstantiate(&rg.user[m], ug, 0));
    GRAPHEP_CUDA_CHECK(cudaGraphDestroy(ug));
  }
}

// Launches rank l's graph of `kind` on its stream.
void launchRankGraph(Communicator& comm, MoeFixture& f, int l, RankGraphs& rg, int kind) {
  GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
  cudaStream_t s = f.buf(l).stream;
  switch (kind) {
    case kCallback: rg.callback->launch(s); break;
    case kChild: rg.child->launch(s); break;
    case kPair:
      rg.dispatch->launch(s);
      f.expert(l, rg.dispatch->layout(), s, 1.0f);
      rg.combine->launch(s);
      break;
    case kUserGlobal:
    case kUserThreadLocal:
    case kUserRelaxed: GRAPHEP_CUDA_CHECK(cudaGraphLaunch(rg.user[kind - kUserGlobal], s)); break;
    default: rg.bucket[kind - kBucket0]->launch(s); break;
  }
}

// Every rank's inputs of iteration `it`: a bucket graph bakes its count in (the same on every
// rank); the others read each rank's own, drawn per rank (0 included: a rank silent while its
// peers send).
std::vector<Inputs> graphInputs(const MoeCase& c, int R, int kind, int it, std::mt19937& rng) {
  const bool bucket = kind >= kBucket0 && kind <= kBucket3;
  std::vector<int> Ts(static_cast<std::size_t>(R));
  for (int& t : Ts) t = bucket ? kGraphBuckets[kind - kBucket0] : static_cast<int>(rng() % 65);
  const std::uint64_t seed = 9000 + static_cast<std::uint64_t>(it) * 13;
  std::vector<Inputs> all;
  for (int q = 0; q < R; ++q) all.push_back(makeInputs(c, R, q, Ts[static_cast<std::size_t>(q)], seed));
  return all;
}

// The child graph's reinstantiations and every rank's status, then the graphs' own resources.
void finishRankGraphs(Communicator& comm, MoeFixture& f, int l, RankGraphs& rg, int expectedReinstantiations) {
  EXPECT_EQ(rg.child->reinstantiations(), expectedReinstantiations) << "rank " << comm.globalRank(l);
  const MoeStatus st = f.engine(l).status();
  EXPECT_TRUE(st.ok()) << st.describe();
  GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
  for (cudaGraphExec_t u : rg.user) cudaGraphExecDestroy(u);
  for (cudaGraph_t x : rg.experts) cudaGraphDestroy(x);
  for (int* b : rg.bucketT) cudaFree(b);
}

void runMoeGraphSuiteInLayout(Communicator& comm, const MoeCase& c, int iterations) {
  SCOPED_TRACE("MoeGraph suite, " + describeCase(c));
  const int R = comm.worldSize();
  MoeFixture f(comm, c);
  expectLayoutShape(c, f.layout(0), R);
  std::vector<RankGraphs> g(static_cast<std::size_t>(f.L()));
  for (int l = 0; l < f.L(); ++l) captureRankGraphs(comm, f, l, g[static_cast<std::size_t>(l)]);
  comm.barrier();
  std::mt19937 rng(4242);  // the same sequence on every process
  int expertNow = 0, expectedReinstantiations = 0;
  for (int it = 0; it < iterations; ++it) {
    const int kind = it < kGraphKinds ? it : static_cast<int>(rng() % kGraphKinds);
    if (kind == kChild && it >= kGraphKinds) {  // swap the experts: x1 -> x2 (in place) -> x4 (new topology) -> x1
      const int next = (expertNow + 1) % 3;
      if (next == 2 || expertNow == 2) ++expectedReinstantiations;
      for (RankGraphs& rg : g) rg.child->setExpertGraph(rg.experts[next]);
      expertNow = next;
    }
    const bool bucket = kind >= kBucket0 && kind <= kBucket3;
    const std::vector<Inputs> all = graphInputs(c, R, kind, it, rng);
    for (int l = 0; l < f.L(); ++l) {
      f.prepare(l, all[static_cast<std::size_t>(comm.globalRank(l))],
                bucket ? g[static_cast<std::size_t>(l)].bucketT[kind - kBucket0] : nullptr);
    }
    comm.barrier();
    for (int l = 0; l < f.L(); ++l) launchRankGraph(comm, f, l, g[static_cast<std::size_t>(l)], kind);
    f.syncAll();
    f.setYScale(kind == kChild ? kExpertScale[expertNow] : 1.0f);
    std::vector<RefLayout> refs;
    for (int q = 0; q < R; ++q) refs.push_back(refLayout(c, all, q, f.engine(0).layout().capacity));
    const std::string what = "iteration " + std::to_string(it) + " graph kind " + std::to_string(kind) + " T=" + std::to_string(all[0].T);
    for (int l = 0; l < f.L(); ++l) EXPECT_EQ(f.check(l, all, refs, what), 0) << what;
    comm.barrier();
  }
  for (int l = 0; l < f.L(); ++l) finishRankGraphs(comm, f, l, g[static_cast<std::size_t>(l)], expectedReinstantiations);
  comm.barrier();
}

}  // namespace

// Every layout (inEveryLayout), `iterations` shared among them: each layout launches every kind
// once and then at least 6 graphs at random (the same sequence in each layout).
void runMoeGraphSuite(Communicator& comm, MoePath path, int iterations) {
  const MoeCase c = smallCase(comm, 64, path);
  const int each = std::max(iterations / static_cast<int>(inEveryLayout(c).size()), kGraphKinds + 6);
  forEveryLayout(c, [&](const MoeCase& v) { runMoeGraphSuiteInLayout(comm, v, each); });
}

}  // namespace graphep::test
