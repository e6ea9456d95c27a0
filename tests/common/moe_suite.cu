#include "common/moe_suite.hpp"

#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <string>

#include "common/bf16.hpp"
#include "common/graph_util.hpp"
#include "common/nccl_comms.hpp"
#include "engine/error.hpp"
#include "kernels/common/hooks.cuh"

namespace graphep::test {
namespace {

constexpr unsigned char kPoison = 0xff;

// The expert's output for the row of (source rank, token, top-k slot): exact in bf16.
__host__ __device__ inline float yValue(int s, int t, int k, int h) {
  const int n = (s * 131 + t * 31 + k * 7 + h * 3) % 61 - 30;
  return static_cast<float>(n) / 16.0f;
}

// A stand-in expert: each received row r of local expert j gets y(rowSrcRank, rowSrcToken,
// rowTopkSlot) (reading the dispatch metadata, as a real expert reads its counts and offsets).
__global__ void fakeExpertKernel(DispatchLayout v, int L, float scale) {
  const long long row = blockIdx.x;
  if (row >= v.capacity) return;
  bool live = false;
  for (int j = 0; j < L; ++j) {
    if (row >= v.expertOffsets[j] && row < v.expertOffsets[j] + v.expertCounts[j]) live = true;
  }
  if (!live) return;
  const int s = v.rowSrcRank[row], t = v.rowSrcToken[row], k = v.rowTopkSlot[row];
  auto* y = static_cast<__nv_bfloat16*>(v.expertOutput) + row * v.hidden;
  for (int h = static_cast<int>(threadIdx.x); h < v.hidden; h += static_cast<int>(blockDim.x)) {
    y[h] = __float2bfloat16_rn(yValue(s, t, k, h) * scale);
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

// The expected dispatch layout of rank r.
struct RefRow {
  int s = -1, t = -1, k = -1;
  float w = 0;
};
struct RefLayout {
  std::vector<int> counts, offsets;
  std::vector<RefRow> rows;  // by position, [capacity]; s < 0: not written
  int numRows = 0;
  unsigned long long dropped = 0;
  std::vector<long long> posOf;  // per (s, t, k) flattened: the row, or -1 (dropped / none)
};

RefLayout refLayout(const MoeCase& c, const std::vector<Inputs>& all, int r, long long cap) {
  const MoeConfig& g = c.cfg;
  const int R = static_cast<int>(all.size()), K = g.topK, L = g.numExperts / R;
  const std::size_t Tm = static_cast<std::size_t>(g.maxTokensPerRank);
  RefLayout out;
  out.counts.assign(static_cast<std::size_t>(L), 0);
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
  long long off = 0;
  for (int j = 0; j < L; ++j) {
    const auto& list = lists[static_cast<std::size_t>(j)];
    out.offsets[static_cast<std::size_t>(j)] = static_cast<int>(off);
    out.counts[static_cast<std::size_t>(j)] = static_cast<int>(list.size());
    out.numRows += static_cast<int>(list.size());
    for (std::size_t q = 0; q < list.size(); ++q) {
      const long long pos = off + static_cast<long long>(q);
      const RefRow& row = list[q];
      if (pos >= cap) {
        ++out.dropped;
        continue;
      }
      out.rows[static_cast<std::size_t>(pos)] = row;
      out.posOf[(static_cast<std::size_t>(row.s) * Tm + static_cast<std::size_t>(row.t)) * K +
                static_cast<std::size_t>(row.k)] = pos;
    }
    off += (static_cast<long long>(list.size()) + g.expertAlignment - 1) / g.expertAlignment *
           g.expertAlignment;
  }
  out.offsets[static_cast<std::size_t>(L)] = static_cast<int>(off);
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

// The host fp8 record of one bf16 row: e4m3 bytes and one scale per 128 values, as the produce
// hook computes them.
void quantizeRow(const std::uint16_t* row, int H, std::vector<unsigned char>* q, std::vector<float>* scales) {
  q->resize(static_cast<std::size_t>(H));
  scales->resize(static_cast<std::size_t>(H / 128));
  for (int tile = 0; tile < H / 128; ++tile) {
    float amax = 0;
    for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(bf16Value(row[tile * 128 + i])));
    const float scale = ProduceFp8E4m3::fp8Scale(amax);
    const float inv = 1.0f / scale;
    (*scales)[static_cast<std::size_t>(tile)] = scale;
    for (int i = 0; i < 128; ++i) {
      (*q)[static_cast<std::size_t>(tile * 128 + i)] = ProduceFp8E4m3::fp8E4m3(bf16Value(row[tile * 128 + i]) * inv);
    }
  }
}

// Device inputs of one rank.
struct RankBuffers {
  void* x = nullptr;
  void* idx = nullptr;
  float* w = nullptr;
  int* numTokens = nullptr;
  void* out = nullptr;
  cudaStream_t stream = nullptr;
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
      RankBuffers b;
      GRAPHEP_CUDA_CHECK(cudaMalloc(&b.x, Tm * g.hidden * 2));
      GRAPHEP_CUDA_CHECK(cudaMalloc(&b.idx, Tm * g.topK * 8));
      GRAPHEP_CUDA_CHECK(cudaMalloc(&b.w, Tm * g.topK * 4));
      GRAPHEP_CUDA_CHECK(cudaMalloc(&b.numTokens, 4));
      GRAPHEP_CUDA_CHECK(cudaMalloc(&b.out, Tm * g.hidden * 2));
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

  // Uploads this rank's inputs and poisons every output (outside any graph). `numTokens`: where
  // the live count goes (nullptr: the rank's own scalar; a bucket graph reads its fixed one).
  void prepare(int l, const Inputs& in, int* numTokens = nullptr) {
    const MoeConfig& g = c_.cfg;
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
    const DispatchLayout& v = layout(l);
    const std::size_t cap = static_cast<std::size_t>(v.capacity);
    const bool fp8 = g.dispatchType == DType::kFp8E4m3;
    GRAPHEP_CUDA_CHECK(cudaMemset(v.recvX, kPoison, cap * g.hidden * (fp8 ? 1 : 2)));
    if (fp8) GRAPHEP_CUDA_CHECK(cudaMemset(v.recvScales, kPoison, cap * (g.hidden / 128) * 4));
    for (const void* p : {static_cast<const void*>(v.rowSrcRank), static_cast<const void*>(v.rowSrcToken),
                          static_cast<const void*>(v.rowTopkSlot), static_cast<const void*>(v.rowWeight)}) {
      GRAPHEP_CUDA_CHECK(cudaMemset(const_cast<void*>(p), kPoison, cap * 4));
    }
    GRAPHEP_CUDA_CHECK(cudaMemset(v.expertOutput, 0, cap * g.hidden * 2));
    GRAPHEP_CUDA_CHECK(cudaMemset(b.out, kPoison, static_cast<std::size_t>(g.maxTokensPerRank) * g.hidden * 2));
    GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  }

  // dispatch -> fake expert -> combine on this rank's stream.
  void enqueue(int l, cudaStream_t s) {
    const DispatchLayout& v = engine(l).dispatch(dispatchArgs(l, nullptr), s);
    expert(v, s, 1.0f);
    CombineArgs ca;
    ca.out = buf(l).out;
    engine(l).combine(ca, s);
  }

  // The stand-in expert on `s`: y = yValue x scale (a power of two: exact in bf16).
  static void expert(const DispatchLayout& v, cudaStream_t s, float scale) {
    fakeExpertKernel<<<static_cast<unsigned>(v.capacity), 128, 0, s>>>(v, v.numLocalExperts, scale);
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

  // Compares rank l's outputs with the reference (refs: every rank's expected layout); returns the
  // number of wrong values.
  long long check(int l, const std::vector<Inputs>& all, const std::vector<RefLayout>& refs,
                  const std::string& what) {
    const MoeConfig& g = c_.cfg;
    const int R = comm_.worldSize(), K = g.topK, H = g.hidden, Lx = g.numExperts / R;
    const int r = comm_.globalRank(l);
    const DispatchLayout& v = layout(l);
    const long long cap = v.capacity;
    const RefLayout& ref = refs[static_cast<std::size_t>(r)];
    const bool fp8 = g.dispatchType == DType::kFp8E4m3;
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm_.device(l)));
    long long wrong = 0;
    int reported = 0;
    auto fail = [&](const std::string& m) {
      ++wrong;
      if (reported++ < 8) ADD_FAILURE() << what << " rank " << r << ": " << m;
    };
    std::vector<int> counts(static_cast<std::size_t>(Lx)), offsets(static_cast<std::size_t>(Lx) + 1);
    int numRows = 0;
    GRAPHEP_CUDA_CHECK(cudaMemcpy(counts.data(), v.expertCounts, counts.size() * 4, cudaMemcpyDeviceToHost));
    GRAPHEP_CUDA_CHECK(cudaMemcpy(offsets.data(), v.expertOffsets, offsets.size() * 4, cudaMemcpyDeviceToHost));
    GRAPHEP_CUDA_CHECK(cudaMemcpy(&numRows, v.numRecvRows, 4, cudaMemcpyDeviceToHost));
    if (counts != ref.counts) fail("expert counts differ");
    if (offsets != ref.offsets) fail("expert offsets differ");
    if (numRows != ref.numRows) fail("numRecvRows " + std::to_string(numRows) + " != " + std::to_string(ref.numRows));
    const std::size_t capz = static_cast<std::size_t>(cap);
    std::vector<int> srank(capz), stok(capz), sslot(capz);
    std::vector<std::uint32_t> sw(capz);
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
        if (srank[pos] != -1 || stok[pos] != -1 || sslot[pos] != -1 || sw[pos] != 0xffffffffu ||
            std::any_of(got, got + rowBytes, [](unsigned char b) { return b != kPoison; })) {
          fail("row " + std::to_string(pos) + " was written but holds no received row");
        }
        continue;
      }
      std::uint32_t wbits;
      std::memcpy(&wbits, &e.w, 4);
      if (srank[pos] != e.s || stok[pos] != e.t || sslot[pos] != e.k || sw[pos] != wbits) {
        fail("row " + std::to_string(pos) + " metadata (" + std::to_string(srank[pos]) + ", " +
             std::to_string(stok[pos]) + ", " + std::to_string(sslot[pos]) + ") != (" +
             std::to_string(e.s) + ", " + std::to_string(e.t) + ", " + std::to_string(e.k) + ")");
        continue;
      }
      const std::uint16_t* src = all[static_cast<std::size_t>(e.s)].x.data() + static_cast<std::size_t>(e.t) * H;
      if (fp8) {
        quantizeRow(src, H, &q, &sc);
        if (std::memcmp(got, q.data(), static_cast<std::size_t>(H)) != 0 ||
            std::memcmp(rs.data() + pos * (H / 128), sc.data(), sc.size() * 4) != 0) {
          fail("row " + std::to_string(pos) + " fp8 payload or scales differ");
        }
      } else if (std::memcmp(got, src, rowBytes) != 0) {
        fail("row " + std::to_string(pos) + " payload differs");
      }
    }
    // Combine: out[t] = sum_k w_k y(r, t, k) over this rank's tokens whose rows were not dropped.
    const int T = liveCount(g, all[static_cast<std::size_t>(r)].T);
    const std::size_t Tm = static_cast<std::size_t>(g.maxTokensPerRank);
    std::vector<std::uint16_t> out(Tm * static_cast<std::size_t>(H));
    GRAPHEP_CUDA_CHECK(cudaMemcpy(out.data(), buf(l).out, out.size() * 2, cudaMemcpyDeviceToHost));
    // posOf of this rank's entries lives in the destination ranks' layouts.
    const std::vector<RefLayout>& dest = refs;
    const Inputs& mine = all[static_cast<std::size_t>(r)];
    for (int t = 0; t < static_cast<int>(Tm); ++t) {
      for (int h = 0; h < H; ++h) {
        const std::uint16_t gotBits = out[static_cast<std::size_t>(t) * H + h];
        if (t >= T) {
          if (gotBits != 0xffff) fail("out row " + std::to_string(t) + " past the live count was written");
          if (gotBits != 0xffff) break;
          continue;
        }
        if (nonFinite_.count(t) != 0) {  // a NaN or infinite weight: the output must not be finite
          if (std::isfinite(bf16Value(gotBits))) {
            fail("out[" + std::to_string(t) + "][" + std::to_string(h) + "] is finite; a weight of the token is not");
            break;
          }
          continue;
        }
        double sum = 0, mag = 0;
        for (int k = 0; k < K; ++k) {
          const long long e = mine.idx[static_cast<std::size_t>(t) * K + k];
          if (e < 0 || e >= g.numExperts) continue;
          const int d = static_cast<int>(e / Lx);
          const long long pos = dest[static_cast<std::size_t>(d)].posOf[(static_cast<std::size_t>(r) * Tm + t) * K + k];
          if (pos < 0) continue;  // dropped at the destination
          const double term = static_cast<double>(mine.w[static_cast<std::size_t>(t) * K + k]) * yValue(r, t, k, h) * yScale_;
          sum += term;
          mag += std::fabs(term);
        }
        const double got = bf16Value(gotBits);
        // Two bf16 roundings (the partial on the expert's rank, the sum at home), each within
        // 2^-8 relative (8 bits of precision), bound the error by 2^-7 of the sum of magnitudes.
        if (!(std::fabs(got - sum) <= mag / 128.0 + 1e-6)) {
          fail("out[" + std::to_string(t) + "][" + std::to_string(h) + "] = " + std::to_string(got) +
               ", reference " + std::to_string(sum));
          break;
        }
      }
    }
    return wrong;
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

std::string describeCase(const MoeCase& c) {
  const MoeConfig& g = c.cfg;
  return "T_max=" + std::to_string(g.maxTokensPerRank) + " H=" + std::to_string(g.hidden) +
         " E=" + std::to_string(g.numExperts) + " K=" + std::to_string(g.topK) +
         (g.dispatchType == DType::kFp8E4m3 ? " fp8" : " bf16") +
         (c.indexType == IndexType::kInt64 ? " int64" : " int32") +
         " routing=" + std::to_string(static_cast<int>(c.routing)) +
         " align=" + std::to_string(g.expertAlignment) + " cap=" + std::to_string(g.recvCapacity) +
         " replays=" + std::to_string(c.replays) +
         " path=" + std::to_string(static_cast<int>(c.cfg.path));
}

}  // namespace

void runMoeCase(Communicator& comm, const MoeCase& c) {
  SCOPED_TRACE(describeCase(c));
  const int R = comm.worldSize();
  MoeFixture f(comm, c);
  const int runs = c.replays > 0 ? c.replays : static_cast<int>(c.tokens.size());
  std::vector<cudaGraphExec_t> execs;
  if (c.replays > 0) {
    for (int l = 0; l < f.L(); ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
      execs.push_back(captureOnStream(f.buf(l).stream, [&](cudaStream_t s) { f.enqueue(l, s); }));
    }
  }
  std::vector<unsigned long long> expectInvalid(static_cast<std::size_t>(f.L()), 0);
  std::vector<unsigned long long> expectDropped(static_cast<std::size_t>(f.L()), 0);
  unsigned long long expectClamped = 0;
  std::vector<std::vector<unsigned long long>> expectTotals(static_cast<std::size_t>(f.L()));
  for (int run = 0; run < runs; ++run) {
    const int T = c.tokens[static_cast<std::size_t>(run) % c.tokens.size()];
    const std::uint64_t seed = 5000 + static_cast<std::uint64_t>(run) * 31;
    std::vector<Inputs> all;
    for (int q = 0; q < R; ++q) all.push_back(makeInputs(c, R, q, T, seed));
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
    if (T > c.cfg.maxTokensPerRank || T < 0) ++expectClamped;
    // Every rank's expected layout, once per run (the capacity is the same on every rank).
    std::vector<RefLayout> refs;
    for (int q = 0; q < R; ++q) refs.push_back(refLayout(c, all, q, f.engine(0).layout().capacity));
    for (int l = 0; l < f.L(); ++l) {
      const int r = comm.globalRank(l);
      const std::string what = "run " + std::to_string(run) + " T=" + std::to_string(T);
      EXPECT_EQ(f.check(l, all, refs, what), 0) << what << " rank " << r;
      expectInvalid[static_cast<std::size_t>(l)] += invalidCount(c.cfg, all[static_cast<std::size_t>(r)]);
      const RefLayout& ref = refs[static_cast<std::size_t>(r)];
      expectDropped[static_cast<std::size_t>(l)] += ref.dropped;
      auto& tot = expectTotals[static_cast<std::size_t>(l)];
      tot.resize(ref.counts.size(), 0);
      for (std::size_t j = 0; j < ref.counts.size(); ++j) tot[j] += static_cast<unsigned long long>(ref.counts[j]);
    }
    comm.barrier();
  }
  for (int l = 0; l < f.L(); ++l) {
    const MoeStatus st = f.engine(l).status();
    const int r = comm.globalRank(l);
    EXPECT_EQ(st.invalidExpertIds, expectInvalid[static_cast<std::size_t>(l)]) << "rank " << r;
    EXPECT_EQ(st.droppedRows, expectDropped[static_cast<std::size_t>(l)]) << "rank " << r;
    EXPECT_EQ(st.clampedTokenCounts, expectClamped) << "rank " << r;
    EXPECT_EQ(st.deviceError, "") << "rank " << r;
    std::vector<unsigned long long> totals(expectTotals[static_cast<std::size_t>(l)].size());
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    GRAPHEP_CUDA_CHECK(cudaMemcpy(totals.data(), f.engine(l).layout().expertTotals, totals.size() * 8,
                                  cudaMemcpyDeviceToHost));
    EXPECT_EQ(totals, expectTotals[static_cast<std::size_t>(l)]) << "rank " << r << ": cumulative expert totals";
    if (c.cfg.profile) {  // every kernel of the path ran, in order, each span well formed
      const std::vector<MoeKernelSpan> spans = f.engine(l).timeline();
      const std::size_t want = 6;  // throughput: six kernels; latency: three phases of each of two
      EXPECT_EQ(spans.size(), want) << "rank " << r;
      for (std::size_t k = 0; k < spans.size(); ++k) {
        EXPECT_LE(spans[k].startUs, spans[k].endUs) << spans[k].kernel;
        if (k > 0) EXPECT_LE(spans[k - 1].startUs, spans[k].startUs) << spans[k].kernel;
      }
    }
    if (!execs.empty()) cudaGraphExecDestroy(execs[static_cast<std::size_t>(l)]);
  }
  comm.barrier();
}

std::vector<MoeCase> standardMoeCases(int R, bool large) {
  std::vector<MoeCase> cases;
  auto base = [&](int T, int H, int E, int K) {
    MoeCase c;
    c.cfg.maxTokensPerRank = T;
    c.cfg.hidden = H;
    c.cfg.numExperts = E;
    c.cfg.topK = K;
    return c;
  };
  {  // uniform, T varying between calls (0, T_max and a clamped count included)
    MoeCase c = base(64, 128, 2 * R, 2);
    c.tokens = {64, 17, 0, 64, 70};
    cases.push_back(c);
    c.indexType = IndexType::kInt64;
    c.cfg.dispatchType = DType::kFp8E4m3;
    c.tokens = {33, 64};
    cases.push_back(c);
  }
  {
    MoeCase c = base(64, 256, 4 * R, 2);
    c.routing = Routing::kSkewed;
    c.tokens = {64};
    cases.push_back(c);
    if (R > 1) {
      c.routing = Routing::kRankEmpty;
      c.tokens = {40};
      cases.push_back(c);
    }
    c.routing = Routing::kAllMasked;
    c.tokens = {64, 0};
    cases.push_back(c);
    c.routing = Routing::kInvalidMixed;
    c.tokens = {50};
    cases.push_back(c);
    c.indexType = IndexType::kInt64;
    cases.push_back(c);
  }
  {  // top-1 with one expert per rank; top-8 of 256 experts
    MoeCase c = base(32, 128, R, 1);
    c.tokens = {32};
    cases.push_back(c);
    if (256 % R == 0) {
      c = base(32, 128, 256, 8);
      c.tokens = {32, 5};
      cases.push_back(c);
    }
  }
  {  // per-expert alignment, and a capacity too small for skewed routing (rows dropped, counted)
    MoeCase c = base(64, 128, 2 * R, 2);
    c.cfg.expertAlignment = 16;
    c.tokens = {64, 9};
    cases.push_back(c);
    c.routing = Routing::kSkewed;
    c.cfg.recvCapacity = 40;
    c.tokens = {64};
    cases.push_back(c);
  }
  {  // a token naming one expert in several slots: one row per slot, in (token, slot) order
    MoeCase c = base(64, 128, 4 * R, 4);
    c.routing = Routing::kDuplicates;
    c.tokens = {64, 45};
    cases.push_back(c);
  }
  {  // a budget of 3 CTAs per kernel: every group loops over many records and tokens
    MoeCase c = base(64, 256, 2 * R, 2);
    c.cfg.smBudget = 3;
    c.tokens = {64, 23};
    cases.push_back(c);
  }
  {  // fp8 at a wider row
    MoeCase c = base(64, 2048, 4 * R, 4);
    c.cfg.dispatchType = DType::kFp8E4m3;
    c.tokens = {64, 31};
    cases.push_back(c);
  }
  {  // one captured graph (dispatch -> expert -> combine) replayed with new data and counts
    MoeCase c = base(64, 256, 2 * R, 2);
    c.tokens = {64, 3, 0, 50, 64, 1};
    c.replays = 30;
    c.cfg.profile = true;  // and the kernel timeline stamps
    cases.push_back(c);
    c.cfg.profile = false;
    c.cfg.dispatchType = DType::kFp8E4m3;
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
    MoeCase c = base(128, 7168, 256, 8);
    c.tokens = {128, 77};
    cases.push_back(c);
    c.cfg.dispatchType = DType::kFp8E4m3;
    cases.push_back(c);
    c.cfg.dispatchType = DType::kBf16;
    c.replays = 20;
    c.tokens = {128, 1, 100};
    cases.push_back(c);
    c.cfg.path = MoePath::kThroughput;
    cases.push_back(c);
    MoeCase p = base(512, 2048, 16, 2);
    p.routing = Routing::kSkewed;
    p.tokens = {512};
    cases.push_back(p);
    p = base(512, 256, 16, 4);  // duplicates across 16 32-token blocks
    p.routing = Routing::kDuplicates;
    p.tokens = {512, 300};
    cases.push_back(p);
  }
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
  c.cfg.maxTokensPerRank = maxTokens;
  c.cfg.hidden = 256;
  c.cfg.numExperts = 4 * comm.worldSize();
  c.cfg.topK = 2;
  c.cfg.path = path;
  return c;
}

}  // namespace

void runMoeMisuse(Communicator& comm, MoePath path) {
  const MoeCase c = smallCase(comm, 32, path);
  SCOPED_TRACE("misuse, " + describeCase(c));
  const int R = comm.worldSize();
  MoeFixture f(comm, c), other(comm, c);
  std::vector<Inputs> in;
  for (int q = 0; q < R; ++q) in.push_back(makeInputs(c, R, q, 32, 4711));
  for (int l = 0; l < f.L(); ++l) f.prepare(l, in[static_cast<std::size_t>(comm.globalRank(l))]);
  comm.barrier();

  // Bad pointers: named errors, thrown before anything is enqueued (so no peer waits on them).
  {
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

  // Out of order: dispatch, dispatch, combine, combine on every rank: one of each is counted, none
  // hangs; after clearStatus a paired operation is correct again.
  for (int l = 0; l < f.L(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    f.engine(l).dispatch(f.dispatchArgs(l, nullptr), f.buf(l).stream);
  }
  for (int l = 0; l < f.L(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    f.engine(l).dispatch(f.dispatchArgs(l, nullptr), f.buf(l).stream);
  }
  for (int round = 0; round < 2; ++round) {
    for (int l = 0; l < f.L(); ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
      CombineArgs ca;
      ca.out = f.buf(l).out;
      f.engine(l).combine(ca, f.buf(l).stream);
    }
  }
  f.syncAll();
  for (int l = 0; l < f.L(); ++l) {
    const MoeStatus st = f.engine(l).status();
    EXPECT_EQ(st.unpairedDispatches, 1ull) << st.describe();
    EXPECT_EQ(st.unpairedCombines, 1ull) << st.describe();
    EXPECT_EQ(st.deviceError, "");
    EXPECT_NE(st.describe().find("before the previous dispatch was combined"), std::string::npos) << st.describe();
    f.engine(l).clearStatus();
  }
  comm.barrier();

  // NaN and infinite weights propagate to their tokens' outputs; every other token stays correct.
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
                                       [](const DispatchLayout& v, cudaStream_t s) { MoeFixture::expert(v, s, 1.0f); }));
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

void runMoeMicroBatches(Communicator& comm, MoePath path, int rounds, int smBudget) {
  MoeCase c = smallCase(comm, 64, path);
  c.cfg.smBudget = smBudget;
  SCOPED_TRACE("two micro-batches in flight, " + describeCase(c));
  const int R = comm.worldSize();
  MoeFixture a(comm, c), b(comm, c);  // two engines: two buffer sets
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

void runMoeGraphSuite(Communicator& comm, MoePath path, int iterations) {
  const MoeCase c = smallCase(comm, 64, path);
  SCOPED_TRACE("MoeGraph suite, " + describeCase(c));
  const int R = comm.worldSize();
  MoeFixture f(comm, c);
  const std::vector<int> buckets = {1, 8, 33, 64};
  enum Kind { kCallback, kChild, kBucket0, kBucket1, kBucket2, kBucket3, kPair, kUserGlobal, kUserThreadLocal,
              kUserRelaxed, kKinds };
  const cudaStreamCaptureMode userModes[] = {cudaStreamCaptureModeGlobal, cudaStreamCaptureModeThreadLocal,
                                             cudaStreamCaptureModeRelaxed};
  struct RankGraphs {
    std::unique_ptr<MoeGraph> callback, child, bucket[4], dispatch, combine;
    cudaGraphExec_t user[3] = {nullptr, nullptr, nullptr};
    cudaGraph_t experts[3] = {nullptr, nullptr, nullptr};  // x1 (one node), x2 (one node), x4 (two nodes)
    int* bucketT[4] = {nullptr, nullptr, nullptr, nullptr};
  };
  const float expertScale[3] = {1.0f, 2.0f, 4.0f};
  std::vector<RankGraphs> g(static_cast<std::size_t>(f.L()));
  for (int l = 0; l < f.L(); ++l) {
    RankGraphs& rg = g[static_cast<std::size_t>(l)];
    Engine& e = f.engine(l);
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    cudaStream_t s = f.buf(l).stream;
    MoeGraphArgs args;
    args.dispatch = f.dispatchArgs(l, nullptr);
    args.out = f.buf(l).out;
    rg.callback = MoeGraph::capture(e, args, [](const DispatchLayout& v, cudaStream_t st) { MoeFixture::expert(v, st, 1.0f); });
    for (int x = 0; x < 3; ++x) {
      GRAPHEP_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      const DispatchLayout& v = e.layout();
      if (x == 2) GRAPHEP_CUDA_CHECK(cudaMemsetAsync(v.expertOutput, 0, static_cast<std::size_t>(v.capacity) * v.hidden * 2, s));
      MoeFixture::expert(v, s, expertScale[x]);
      GRAPHEP_CUDA_CHECK(cudaStreamEndCapture(s, &rg.experts[x]));
    }
    rg.child = MoeGraph::withExpertGraph(e, args, rg.experts[0]);
    for (int b = 0; b < 4; ++b) {
      GRAPHEP_CUDA_CHECK(cudaMalloc(&rg.bucketT[b], 4));
      GRAPHEP_CUDA_CHECK(cudaMemcpy(rg.bucketT[b], &buckets[static_cast<std::size_t>(b)], 4, cudaMemcpyHostToDevice));
      MoeGraphArgs ba = args;
      ba.dispatch = f.dispatchArgs(l, rg.bucketT[b]);
      rg.bucket[b] = MoeGraph::capture(e, ba, [](const DispatchLayout& v, cudaStream_t st) { MoeFixture::expert(v, st, 1.0f); });
    }
    rg.dispatch = MoeGraph::dispatchOnly(e, args.dispatch);
    CombineArgs ca;
    ca.out = args.out;
    rg.combine = MoeGraph::combineOnly(e, ca);
    for (int m = 0; m < 3; ++m) {  // the engine's operations inside the caller's own capture
      GRAPHEP_CUDA_CHECK(cudaStreamBeginCapture(s, userModes[m]));
      f.enqueue(l, s);
      cudaGraph_t ug = nullptr;
      GRAPHEP_CUDA_CHECK(cudaStreamEndCapture(s, &ug));
      GRAPHEP_CUDA_CHECK(cudaGraphInstantiate(&rg.user[m], ug, 0));
      GRAPHEP_CUDA_CHECK(cudaGraphDestroy(ug));
    }
  }
  comm.barrier();
  std::mt19937 rng(4242);  // the same sequence on every process
  int expertNow = 0, expectedReinstantiations = 0;
  for (int it = 0; it < iterations; ++it) {
    const int kind = it < kKinds ? it : static_cast<int>(rng() % kKinds);
    if (kind == kChild && it >= kKinds) {  // swap the experts: x1 -> x2 (in place) -> x4 (new topology) -> x1
      const int next = (expertNow + 1) % 3;
      if (next == 2 || expertNow == 2) ++expectedReinstantiations;
      for (int l = 0; l < f.L(); ++l) g[static_cast<std::size_t>(l)].child->setExpertGraph(g[static_cast<std::size_t>(l)].experts[next]);
      expertNow = next;
    }
    const bool bucket = kind >= kBucket0 && kind <= kBucket3;
    const int T = bucket ? buckets[static_cast<std::size_t>(kind - kBucket0)] : static_cast<int>(rng() % 65);
    const std::uint64_t seed = 9000 + static_cast<std::uint64_t>(it) * 13;
    std::vector<Inputs> all;
    for (int q = 0; q < R; ++q) all.push_back(makeInputs(c, R, q, T, seed));
    for (int l = 0; l < f.L(); ++l) {
      f.prepare(l, all[static_cast<std::size_t>(comm.globalRank(l))],
                bucket ? g[static_cast<std::size_t>(l)].bucketT[kind - kBucket0] : nullptr);
    }
    comm.barrier();
    for (int l = 0; l < f.L(); ++l) {
      RankGraphs& rg = g[static_cast<std::size_t>(l)];
      GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
      cudaStream_t s = f.buf(l).stream;
      switch (kind) {
        case kCallback: rg.callback->launch(s); break;
        case kChild: rg.child->launch(s); break;
        case kPair:
          rg.dispatch->launch(s);
          MoeFixture::expert(rg.dispatch->layout(), s, 1.0f);
          rg.combine->launch(s);
          break;
        case kUserGlobal:
        case kUserThreadLocal:
        case kUserRelaxed: GRAPHEP_CUDA_CHECK(cudaGraphLaunch(rg.user[kind - kUserGlobal], s)); break;
        default: rg.bucket[kind - kBucket0]->launch(s); break;
      }
    }
    f.syncAll();
    f.setYScale(kind == kChild ? expertScale[expertNow] : 1.0f);
    std::vector<RefLayout> refs;
    for (int q = 0; q < R; ++q) refs.push_back(refLayout(c, all, q, f.engine(0).layout().capacity));
    const std::string what = "iteration " + std::to_string(it) + " graph kind " + std::to_string(kind) + " T=" + std::to_string(T);
    for (int l = 0; l < f.L(); ++l) EXPECT_EQ(f.check(l, all, refs, what), 0) << what;
    comm.barrier();
  }
  for (int l = 0; l < f.L(); ++l) {
    RankGraphs& rg = g[static_cast<std::size_t>(l)];
    EXPECT_EQ(rg.child->reinstantiations(), expectedReinstantiations) << "rank " << comm.globalRank(l);
    const MoeStatus st = f.engine(l).status();
    EXPECT_TRUE(st.ok()) << st.describe();
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
    for (cudaGraphExec_t u : rg.user) cudaGraphExecDestroy(u);
    for (cudaGraph_t x : rg.experts) cudaGraphDestroy(x);
    for (int* b : rg.bucketT) cudaFree(b);
  }
  comm.barrier();
}

}  // namespace graphep::test
