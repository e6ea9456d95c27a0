// The engine capabilities DeepEP's API needs (include/graphep/moe.hpp: DispatchArgs.topK, .tokenInRank,
// .input, .xScales, .outputs; CombineArgs.expertOutputRows, .rowValues; repeated operations), on
// every visible GPU (one rank each: the rank-major layout on the throughput path's direct
// dispatch), against a host reference built from every rank's inputs:
//
//   rank q's token t  --tokenInRank[t][d] (or the ranks of its top-k experts)-->  rank d's row
//   rank d's rows:    | from rank 0, its tokens in order | from rank 1 ... |   rankPrefix[i][d] ends rank i's
//   row slots:        expert k -> local id (id / L == d) or -1, weight or 0
//   combine:          out_q[t] = bf16(sum over d ascending of y_d[row]),  values likewise in fp32
//
// Inputs are fresh random data per call, every output is poisoned first (with guard rows past the
// caller's buffers), and results are compared exactly (the engine's arithmetic is exact here: a
// row is copied, the home sum is fp32 in rank order with one rounding).
#include <gtest/gtest.h>

#include <graphep/graphep.hpp>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/bf16.hpp"
#include "common/expect_error.hpp"
#include "common/fp8_reference.hpp"
#include "common/gpu_env.hpp"
#include "common/nccl_comms.hpp"
#include "engine/error.hpp"

namespace graphep::test {
namespace {

// The engines' T_max and hidden size: 80 tokens (three 32-token blocks, the last one partial) of
// 256 values, unless a test sets a larger shape for its engines (ShapeScope).
struct Shape {
  int tMax = 80;
  int hidden = 256;
};
Shape gShape;
struct ShapeScope {
  Shape saved = gShape;
  ShapeScope(int tMax, int hidden) { gShape = Shape{tMax, hidden}; }
  ~ShapeScope() { gShape = saved; }
};
constexpr int kK = 4;      // the config's top-k; calls may use fewer
constexpr int kLocal = 8;  // experts per rank
constexpr unsigned char kPoison = 0xAB;
constexpr int kGuardRows = 8;  // poisoned rows past every caller buffer: never written

// A device buffer of `n` elements of T on the current device, poisoned on request.
template <class T>
struct DeviceBuffer {
  T* p = nullptr;
  std::size_t n = 0;
  explicit DeviceBuffer(std::size_t count) : n(count) {
    GRAPHEP_CUDA_CHECK(cudaMalloc(&p, std::max<std::size_t>(n, 1) * sizeof(T)));
    poison();
  }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void poison() { GRAPHEP_CUDA_CHECK(cudaMemset(p, kPoison, std::max<std::size_t>(n, 1) * sizeof(T))); }
  void upload(const std::vector<T>& v) {
    GRAPHEP_CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> v(n);
    GRAPHEP_CUDA_CHECK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
};

template <class T>
T poisonValue() {
  T v;
  std::memset(&v, kPoison, sizeof(T));
  return v;
}

enum class Route {
  kTopk,         // to the ranks of the top-k experts (no mask)
  kMaskAndTopk,  // a mask: the experts' ranks, plus an extra rank for some tokens, minus one for others
  kMaskOnly,     // a random mask, no top-k (rows without slots)
  kOthersOnly,   // top-k experts of the other ranks only (no row for the token's own rank)
};

// One rank's inputs: a pure function of (seed, rank).
struct RankInputs {
  int T = 0;
  int topK = 0;                     // columns of ids / w (0: none)
  std::vector<std::uint16_t> x;     // [gShape.tMax][gShape.hidden] bf16
  std::vector<long long> ids;       // [gShape.tMax][topK]
  std::vector<float> w;             // [gShape.tMax][topK]
  std::vector<std::uint8_t> mask;   // [gShape.tMax][R] (the routing, whether or not it is passed)
  bool passMask = false;
  std::vector<std::uint8_t> xFp8;   // [gShape.tMax][gShape.hidden] e4m3 bytes (never NaN)
  std::vector<float> scalesT;       // [gShape.hidden / 128][gShape.tMax]: scale of (t, j) at j * gShape.tMax + t
};

RankInputs makeInputs(int rank, int R, int T, int topK, Route route, std::uint64_t seed) {
  std::mt19937_64 rng(seed * 1000003ull + static_cast<std::uint64_t>(rank));
  std::uniform_real_distribution<float> value(-2.f, 2.f), unit(0.f, 1.f);
  const int E = kLocal * R;
  RankInputs in;
  in.T = T;
  in.topK = route == Route::kMaskOnly ? 0 : topK;
  in.passMask = route != Route::kTopk;
  in.x.resize(static_cast<std::size_t>(gShape.tMax) * gShape.hidden);
  for (auto& v : in.x) v = bf16Bits(value(rng));
  in.xFp8.resize(in.x.size());
  for (auto& b : in.xFp8) {
    b = static_cast<std::uint8_t>(rng() & 0xff);
    if ((b & 0x7f) == 0x7f) b &= 0xfe;  // 0x7f / 0xff are NaN in e4m3
  }
  in.scalesT.resize(static_cast<std::size_t>(gShape.hidden / 128) * gShape.tMax);
  for (auto& s : in.scalesT) s = 0.01f + unit(rng);
  in.ids.assign(static_cast<std::size_t>(gShape.tMax) * std::max(in.topK, 1), -1);
  in.w.assign(in.ids.size(), 0.f);
  in.mask.assign(static_cast<std::size_t>(gShape.tMax) * R, 0);
  for (int t = 0; t < T; ++t) {
    std::uint8_t* m = &in.mask[static_cast<std::size_t>(t) * R];
    if (route == Route::kMaskOnly) {
      for (int r = 0; r < R; ++r) m[r] = unit(rng) < 0.6f ? 1 : 0;
      continue;
    }
    std::vector<int> picked;
    for (int k = 0; k < in.topK; ++k) {
      const std::size_t e = static_cast<std::size_t>(t) * in.topK + k;
      if (unit(rng) < 0.1f) continue;  // -1: no expert
      int id = 0;
      do {
        id = static_cast<int>(rng() % static_cast<std::uint64_t>(E));
      } while (std::find(picked.begin(), picked.end(), id) != picked.end() ||
               (route == Route::kOthersOnly && id / kLocal == rank));
      picked.push_back(id);
      in.ids[e] = id;
      in.w[e] = value(rng);
      m[id / kLocal] = 1;
    }
    if (route == Route::kMaskAndTopk) {
      const float u = unit(rng);
      const int r = static_cast<int>(rng() % static_cast<std::uint64_t>(R));
      if (u < 0.15f) m[r] = 1;  // a rank holding none of its experts: a row with no slots there
      if (u > 0.85f) m[r] = 0;  // a rank the mask leaves out: its entries are no slot anywhere
    }
  }
  return in;
}

// What rank d receives, in its row order.
struct RefRows {
  std::vector<int> srcRank, srcToken;
  std::vector<long long> experts;  // [n][topK]
  std::vector<float> weights;      // [n][topK]
  std::vector<int> expertCounts;   // [kLocal]: (row, slot) entries per local expert
  std::vector<int> prefix;         // [R][R]
  int n() const { return static_cast<int>(srcRank.size()); }
  // The row of (q, t), or -1.
  int rowOf(int q, int t) const {
    for (int i = 0; i < n(); ++i) {
      if (srcRank[static_cast<std::size_t>(i)] == q && srcToken[static_cast<std::size_t>(i)] == t) return i;
    }
    return -1;
  }
};

RefRows reference(const std::vector<RankInputs>& in, int d) {
  const int R = static_cast<int>(in.size()), K = in[0].topK;
  RefRows ref;
  ref.expertCounts.assign(kLocal, 0);
  ref.prefix.assign(static_cast<std::size_t>(R) * R, 0);
  for (int q = 0; q < R; ++q) {
    for (int j = 0; j < R; ++j) {
      int count = 0;
      for (int t = 0; t < in[q].T; ++t) count += in[q].mask[static_cast<std::size_t>(t) * R + j];
      ref.prefix[static_cast<std::size_t>(q) * R + j] = count + (q > 0 ? ref.prefix[static_cast<std::size_t>(q - 1) * R + j] : 0);
    }
    for (int t = 0; t < in[q].T; ++t) {
      if (in[q].mask[static_cast<std::size_t>(t) * R + d] == 0) continue;
      ref.srcRank.push_back(q);
      ref.srcToken.push_back(t);
      for (int k = 0; k < K; ++k) {
        const long long id = in[q].ids[static_cast<std::size_t>(t) * K + k];
        const bool here = id >= 0 && id / kLocal == d;
        ref.experts.push_back(here ? id % kLocal : -1);
        ref.weights.push_back(here ? in[q].w[static_cast<std::size_t>(t) * K + k] : 0.f);
        if (here) ++ref.expertCounts[static_cast<std::size_t>(id % kLocal)];
      }
    }
  }
  return ref;
}

// Counts and prints (the first few) differences.
struct Wrong {
  std::string what;
  long long n = 0;
  void operator()(const std::string& msg) {
    if (n++ < 8) ADD_FAILURE() << what << ": " << msg;
  }
};

// One rank's device side of one dispatch: inputs and the caller's outputs.
struct RankCall {
  std::unique_ptr<DeviceBuffer<std::uint16_t>> x;
  std::unique_ptr<DeviceBuffer<std::uint8_t>> xFp8, mask;
  std::unique_ptr<DeviceBuffer<long long>> ids64;
  std::unique_ptr<DeviceBuffer<int>> ids32, numTokens, srcRank, srcToken, prefix;
  std::unique_ptr<DeviceBuffer<float>> w, scalesT, recvScales, weightsOut;
  std::unique_ptr<DeviceBuffer<std::uint8_t>> recvX;  // bytes: bf16 or e4m3 rows
  std::unique_ptr<DeviceBuffer<long long>> expertsOut64;
  std::unique_ptr<DeviceBuffer<int>> expertsOut32;
  long long rows = 0;
};

struct CallOptions {
  DispatchInput input = DispatchInput::kConfig;
  bool int64Ids = true;
  int rowsLess = 0;  // the caller's buffers hold this many rows fewer than arrive
};

class Caps {
 public:
  explicit Caps(MoeConfig cfg = capsConfig(static_cast<int>(visibleGpus().size())))
      : comm_(createLocalGroup(visibleGpus())), cfg_(cfg) {
    engines_ = Engine::createAll(*comm_, cfg_);
    for (int l = 0; l < L(); ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(comm_->device(l)));
      cudaStream_t s = nullptr;
      GRAPHEP_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      streams_.push_back(s);
    }
  }
  ~Caps() {
    for (int l = 0; l < L(); ++l) {
      cudaSetDevice(comm_->device(l));
      cudaStreamSynchronize(streams_[static_cast<std::size_t>(l)]);
      cudaStreamDestroy(streams_[static_cast<std::size_t>(l)]);
    }
  }
  static MoeConfig capsConfig(int R) {
    MoeConfig c;
    c.maxTokensPerRank = gShape.tMax;
    c.hidden = gShape.hidden;
    c.numExperts = kLocal * R;
    c.topK = kK;
    c.receiveLayout = ReceiveLayout::kRankMajor;
    c.path = MoePath::kThroughput;
    c.smBudget = 8;
    return c;
  }
  int L() const { return comm_->numLocalRanks(); }
  int R() const { return comm_->worldSize(); }
  Engine& engine(int l) { return *engines_[static_cast<std::size_t>(l)]; }
  cudaStream_t stream(int l) const { return streams_[static_cast<std::size_t>(l)]; }
  void syncAll() {
    for (int l = 0; l < L(); ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(comm_->device(l)));
      GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(stream(l)));
    }
  }

  // Uploads rank l's inputs and allocates its (poisoned) outputs for `ref.n() - o.rowsLess` rows.
  RankCall prepare(int l, const RankInputs& in, const RefRows& ref, const CallOptions& o) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm_->device(l)));
    RankCall c;
    c.rows = std::max(ref.n() - o.rowsLess, 1);
    const std::size_t rowsAlloc = static_cast<std::size_t>(c.rows) + kGuardRows;
    const int K = std::max(in.topK, 1);
    c.x = std::make_unique<DeviceBuffer<std::uint16_t>>(in.x.size());
    c.x->upload(in.x);
    c.xFp8 = std::make_unique<DeviceBuffer<std::uint8_t>>(in.xFp8.size());
    c.xFp8->upload(in.xFp8);
    c.scalesT = std::make_unique<DeviceBuffer<float>>(in.scalesT.size());
    c.scalesT->upload(in.scalesT);
    c.mask = std::make_unique<DeviceBuffer<std::uint8_t>>(in.mask.size());
    c.mask->upload(in.mask);
    c.ids64 = std::make_unique<DeviceBuffer<long long>>(in.ids.size());
    c.ids64->upload(in.ids);
    c.ids32 = std::make_unique<DeviceBuffer<int>>(in.ids.size());
    c.ids32->upload(std::vector<int>(in.ids.begin(), in.ids.end()));
    c.w = std::make_unique<DeviceBuffer<float>>(in.w.size());
    c.w->upload(in.w);
    c.numTokens = std::make_unique<DeviceBuffer<int>>(1);
    c.numTokens->upload({in.T});
    const bool fp8 = o.input == DispatchInput::kFp8 || o.input == DispatchInput::kFp8Quantize;
    c.recvX = std::make_unique<DeviceBuffer<std::uint8_t>>(rowsAlloc * gShape.hidden * (fp8 ? 1 : 2));
    c.recvScales = std::make_unique<DeviceBuffer<float>>(rowsAlloc * (gShape.hidden / 128));
    c.srcRank = std::make_unique<DeviceBuffer<int>>(rowsAlloc);
    c.srcToken = std::make_unique<DeviceBuffer<int>>(rowsAlloc);
    c.prefix = std::make_unique<DeviceBuffer<int>>(static_cast<std::size_t>(R()) * R());
    c.expertsOut64 = std::make_unique<DeviceBuffer<long long>>(rowsAlloc * K);
    c.expertsOut32 = std::make_unique<DeviceBuffer<int>>(rowsAlloc * K);
    c.weightsOut = std::make_unique<DeviceBuffer<float>>(rowsAlloc * K);
    // The uploads and poisons went to the legacy stream, which the rank's non-blocking stream is
    // not ordered after: landed before the call.
    GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
    return c;
  }

  DispatchArgs args(const RankInputs& in, const RankCall& c, const CallOptions& o) const {
    DispatchArgs a;
    a.input = o.input;
    a.x = o.input == DispatchInput::kFp8 ? static_cast<const void*>(c.xFp8->p) : static_cast<const void*>(c.x->p);
    if (o.input == DispatchInput::kFp8) {
      a.xScales = c.scalesT->p;
      a.scaleTokenStride = 1;  // DeepEP's column-major scales: (t, j) at j * T_max + t
      a.scaleHiddenStride = gShape.tMax;
    }
    if (in.topK > 0) {
      a.topkIdx = o.int64Ids ? static_cast<const void*>(c.ids64->p) : static_cast<const void*>(c.ids32->p);
      a.indexType = o.int64Ids ? IndexType::kInt64 : IndexType::kInt32;
      a.topkWeights = c.w->p;
      a.topK = in.topK;
    }
    a.numTokens = c.numTokens->p;
    if (in.passMask) a.tokenInRank = reinterpret_cast<const bool*>(c.mask->p);
    const bool fp8 = o.input == DispatchInput::kFp8 || o.input == DispatchInput::kFp8Quantize;
    a.outputs.recvX = c.recvX->p;
    a.outputs.recvScales = fp8 ? c.recvScales->p : nullptr;
    if (in.topK > 0) {
      a.outputs.rowExperts = o.int64Ids ? static_cast<void*>(c.expertsOut64->p) : static_cast<void*>(c.expertsOut32->p);
      a.outputs.rowExpertWeights = c.weightsOut->p;
    }
    a.outputs.rowSrcRank = c.srcRank->p;
    a.outputs.rowSrcToken = c.srcToken->p;
    a.outputs.rankPrefixMatrix = c.prefix->p;
    a.outputs.rows = c.rows;
    return a;
  }

  // Rank l's caller outputs against the reference (rows below c.rows; the rest and the guard rows
  // keep their poison), and with `layout` the engine's published counts (the last dispatch's).
  // Returns the wrong elements.
  long long check(int l, const std::vector<RankInputs>& in, const RefRows& ref, const RankCall& c,
                  const CallOptions& o, const std::string& what, bool layout = true) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm_->device(l)));
    Wrong wrong{what + ", rank " + std::to_string(comm_->globalRank(l))};
    const int K = in[0].topK, R = this->R();
    const std::size_t kept = static_cast<std::size_t>(std::min<long long>(ref.n(), c.rows));
    const bool fp8 = o.input == DispatchInput::kFp8 || o.input == DispatchInput::kFp8Quantize;
    const std::vector<std::uint8_t> x = c.recvX->download();
    const std::vector<float> scales = c.recvScales->download();
    const std::vector<int> srcRank = c.srcRank->download(), srcToken = c.srcToken->download();
    const std::size_t rowBytes = static_cast<std::size_t>(gShape.hidden) * (fp8 ? 1 : 2);
    for (std::size_t i = 0; i < c.recvX->n / rowBytes; ++i) {
      const std::uint8_t* got = &x[i * rowBytes];
      if (i >= kept) {  // never written: past the rows arrived or the caller's buffer
        for (std::size_t b = 0; b < rowBytes; ++b) {
          if (got[b] != kPoison) {
            wrong("row " + std::to_string(i) + " past the " + std::to_string(kept) + " kept rows was written");
            break;
          }
        }
        continue;
      }
      const RankInputs& src = in[static_cast<std::size_t>(ref.srcRank[i])];
      const int t = ref.srcToken[i];
      if (srcRank[i] != ref.srcRank[i] || srcToken[i] != t) {
        wrong("row " + std::to_string(i) + " from (" + std::to_string(srcRank[i]) + ", " + std::to_string(srcToken[i]) +
              "), reference (" + std::to_string(ref.srcRank[i]) + ", " + std::to_string(t) + ")");
      }
      std::vector<unsigned char> q;
      std::vector<float> sc;
      const std::uint8_t* want = nullptr;
      if (o.input == DispatchInput::kFp8) {
        want = &src.xFp8[static_cast<std::size_t>(t) * gShape.hidden];
        sc.resize(gShape.hidden / 128);
        for (int j = 0; j < gShape.hidden / 128; ++j) sc[static_cast<std::size_t>(j)] = src.scalesT[static_cast<std::size_t>(j) * gShape.tMax + t];
      } else if (fp8) {
        quantizeRow(&src.x[static_cast<std::size_t>(t) * gShape.hidden], gShape.hidden, &q, &sc);
        want = q.data();
      } else {
        want = reinterpret_cast<const std::uint8_t*>(&src.x[static_cast<std::size_t>(t) * gShape.hidden]);
      }
      if (std::memcmp(got, want, rowBytes) != 0) wrong("row " + std::to_string(i) + ": its bytes differ");
      if (fp8 && std::memcmp(&scales[i * (gShape.hidden / 128)], sc.data(), sc.size() * 4) != 0) {
        wrong("row " + std::to_string(i) + ": its scales differ");
      }
    }
    if (K > 0) {
      const std::vector<long long> e64 = c.expertsOut64->download();
      const std::vector<int> e32 = c.expertsOut32->download();
      const std::vector<float> wt = c.weightsOut->download();
      for (std::size_t i = 0; i < c.weightsOut->n / K; ++i) {
        for (int k = 0; k < K; ++k) {
          const std::size_t n = i * K + static_cast<std::size_t>(k);
          const long long got = o.int64Ids ? e64[n] : e32[n];
          const bool poisoned = o.int64Ids ? e64[n] == poisonValue<long long>() : e32[n] == poisonValue<int>();
          if (i >= kept) {
            if (!poisoned || wt[n] != poisonValue<float>()) wrong("row " + std::to_string(i) + "'s slots written");
          } else if (got != ref.experts[n] || wt[n] != ref.weights[n]) {
            wrong("row " + std::to_string(i) + " slot " + std::to_string(k) + ": expert " + std::to_string(got) + " weight " +
                  std::to_string(wt[n]) + ", reference " + std::to_string(ref.experts[n]) + " " + std::to_string(ref.weights[n]));
          }
        }
      }
    }
    if (c.prefix->download() != ref.prefix) wrong("the rank prefix matrix differs");
    if (!layout) return wrong.n;
    const DispatchLayout& v = engine(l).layout();
    std::vector<int> counts(kLocal), recvRows(1);
    GRAPHEP_CUDA_CHECK(cudaMemcpy(counts.data(), v.expertCounts, kLocal * 4, cudaMemcpyDeviceToHost));
    GRAPHEP_CUDA_CHECK(cudaMemcpy(recvRows.data(), v.numRecvRows, 4, cudaMemcpyDeviceToHost));
    if (counts != ref.expertCounts) wrong("expertCounts differ");
    if (recvRows[0] != ref.n()) wrong("numRecvRows " + std::to_string(recvRows[0]) + ", reference " + std::to_string(ref.n()));
    (void)R;
    return wrong.n;
  }

  // Dispatches `in` on every rank (each enqueued, then all synchronised) and checks it.
  void dispatchAndCheck(const std::vector<RankInputs>& in, const CallOptions& o, const std::string& what) {
    std::vector<RefRows> refs;
    std::vector<RankCall> calls;
    for (int l = 0; l < L(); ++l) refs.push_back(reference(in, comm_->globalRank(l)));
    for (int l = 0; l < L(); ++l) {
      calls.push_back(prepare(l, in[static_cast<std::size_t>(comm_->globalRank(l))], refs[static_cast<std::size_t>(l)], o));
    }
    for (int l = 0; l < L(); ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(comm_->device(l)));
      engine(l).dispatch(args(in[static_cast<std::size_t>(comm_->globalRank(l))], calls[static_cast<std::size_t>(l)], o),
                         stream(l));
    }
    syncAll();
    for (int l = 0; l < L(); ++l) {
      EXPECT_EQ(check(l, in, refs[static_cast<std::size_t>(l)], calls[static_cast<std::size_t>(l)], o, what), 0);
      const MoeStatus st = engine(l).status();
      const unsigned long long dropped = static_cast<unsigned long long>(
          std::max<long long>(refs[static_cast<std::size_t>(l)].n() - calls[static_cast<std::size_t>(l)].rows, 0));
      EXPECT_EQ(st.droppedRows, dropped) << what << ": " << st.describe();
      EXPECT_TRUE(st.deviceError.empty()) << st.deviceError;
      engine(l).clearStatus();
    }
  }

  std::vector<RankInputs> inputs(Route route, int topK, std::uint64_t seed, const std::vector<int>& tokens) {
    std::vector<RankInputs> in;
    for (int q = 0; q < R(); ++q) in.push_back(makeInputs(q, R(), tokens[static_cast<std::size_t>(q) % tokens.size()], topK, route, seed));
    return in;
  }
  std::vector<RankInputs> inputs(Route route, int topK, std::uint64_t seed, int tMin = 1) {
    std::vector<RankInputs> in;
    std::mt19937 rng(static_cast<unsigned>(seed));
    for (int q = 0; q < R(); ++q) {
      in.push_back(makeInputs(q, R(), tMin + static_cast<int>(rng() % static_cast<unsigned>(gShape.tMax - tMin + 1)), topK,
                              route, seed));
    }
    return in;
  }

  // One combine per rank of the last dispatch (of `in`): y [n][gShape.hidden] and values [n][K] random per row,
  // given as `yRows` rows (n - yLess); returns the wrong elements of out and outValues against the
  // reference (rows past yRows add nothing), and checks the status counts them.
  struct CombineCall {
    std::unique_ptr<DeviceBuffer<std::uint16_t>> y, out;
    std::unique_ptr<DeviceBuffer<float>> values, outValues;
    std::vector<std::uint16_t> yHost;
    std::vector<float> valuesHost;
    long long rows = 0;
  };
  CombineCall prepareCombine(int l, const RefRows& ref, int K, int yLess, std::uint64_t seed) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm_->device(l)));
    std::mt19937_64 rng(seed * 7919ull + static_cast<std::uint64_t>(comm_->globalRank(l)));
    std::uniform_real_distribution<float> value(-1.f, 1.f);
    CombineCall c;
    c.rows = std::max(ref.n() - yLess, 1);
    c.yHost.resize(static_cast<std::size_t>(c.rows) * gShape.hidden);
    for (auto& v : c.yHost) v = bf16Bits(value(rng));
    c.valuesHost.resize(static_cast<std::size_t>(c.rows) * std::max(K, 1));
    for (auto& v : c.valuesHost) v = value(rng);
    c.y = std::make_unique<DeviceBuffer<std::uint16_t>>(c.yHost.size());
    c.y->upload(c.yHost);
    c.values = std::make_unique<DeviceBuffer<float>>(c.valuesHost.size());
    c.values->upload(c.valuesHost);
    c.out = std::make_unique<DeviceBuffer<std::uint16_t>>(static_cast<std::size_t>(gShape.tMax) * gShape.hidden);
    c.outValues = std::make_unique<DeviceBuffer<float>>(static_cast<std::size_t>(gShape.tMax) * std::max(K, 1));
    GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());  // as in prepare: landed before the call
    return c;
  }
  void enqueueCombine(int l, const CombineCall& c, int K) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm_->device(l)));
    CombineArgs a;
    a.expertOutput = c.y->p;
    a.expertOutputRows = c.rows;
    a.out = c.out->p;
    if (K > 0) {
      a.rowValues = c.values->p;
      a.outValues = c.outValues->p;
      a.numValues = K;
    }
    engine(l).combine(a, stream(l));
  }

  // A dispatch and its combine on every rank: fresh top-k inputs with `tokens` live per rank, their
  // reference, every rank's call (inputs uploaded, outputs poisoned) and fresh expert outputs.
  struct Step {
    std::vector<RankInputs> in;
    std::vector<RefRows> ref;
    std::vector<RankCall> calls;
    std::vector<CombineCall> ys;
  };
  Step step(const std::vector<int>& tokens, std::uint64_t& seed, const CallOptions& o) {
    Step s;
    s.in = inputs(Route::kTopk, kK, ++seed, tokens);
    for (int d = 0; d < R(); ++d) s.ref.push_back(reference(s.in, d));
    for (int l = 0; l < L(); ++l) {
      s.calls.push_back(prepare(l, s.in[static_cast<std::size_t>(l)], s.ref[static_cast<std::size_t>(l)], o));
      s.ys.push_back(prepareCombine(l, s.ref[static_cast<std::size_t>(l)], kK, 0, ++seed));
    }
    return s;
  }
  // op 0: every rank's dispatch of the step; 1: every rank's combine (not waited for).
  void enqueueOp(int op, const Step& s, const CallOptions& o) {
    for (int l = 0; l < L(); ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(comm_->device(l)));
      if (op == 0) {
        engine(l).dispatch(args(s.in[static_cast<std::size_t>(l)], s.calls[static_cast<std::size_t>(l)], o), stream(l));
      } else {
        enqueueCombine(l, s.ys[static_cast<std::size_t>(l)], kK);
      }
    }
  }
  long long checkCombine(int l, const std::vector<RankInputs>& in, const std::vector<RefRows>& refs,
                         const std::vector<const CombineCall*>& calls, const CombineCall& mine, int K,
                         const std::string& what) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(comm_->device(l)));
    Wrong wrong{what + ", rank " + std::to_string(comm_->globalRank(l))};
    const int q = comm_->globalRank(l), R = this->R();
    const std::vector<std::uint16_t> out = mine.out->download();
    const std::vector<float> outValues = mine.outValues->download();
    for (int t = 0; t < gShape.tMax; ++t) {
      for (int h = 0; h < gShape.hidden; ++h) {
        const std::uint16_t got = out[static_cast<std::size_t>(t) * gShape.hidden + h];
        if (t >= in[static_cast<std::size_t>(q)].T) {
          if (got != poisonValue<std::uint16_t>()) wrong("out row " + std::to_string(t) + " past the live count written");
          break;
        }
        float acc = 0.f;
        for (int d = 0; d < R; ++d) {
          const int row = refs[static_cast<std::size_t>(d)].rowOf(q, t);
          if (row < 0 || row >= calls[static_cast<std::size_t>(d)]->rows) continue;
          acc += bf16Value(calls[static_cast<std::size_t>(d)]->yHost[static_cast<std::size_t>(row) * gShape.hidden + h]);
        }
        if (got != bf16Bits(acc)) {
          wrong("out[" + std::to_string(t) + "][" + std::to_string(h) + "] = " + std::to_string(bf16Value(got)) +
                ", reference " + std::to_string(acc));
        }
      }
      if (K == 0 || t >= in[static_cast<std::size_t>(q)].T) continue;
      for (int k = 0; k < K; ++k) {
        float sum = 0.f;
        for (int d = 0; d < R; ++d) {
          const int row = refs[static_cast<std::size_t>(d)].rowOf(q, t);
          if (row < 0 || row >= calls[static_cast<std::size_t>(d)]->rows) continue;
          sum += calls[static_cast<std::size_t>(d)]->valuesHost[static_cast<std::size_t>(row) * K + k];
        }
        const float got = outValues[static_cast<std::size_t>(t) * K + k];
        if (got != sum) {
          wrong("outValues[" + std::to_string(t) + "][" + std::to_string(k) + "] = " + std::to_string(got) +
                ", reference " + std::to_string(sum));
        }
      }
    }
    return wrong.n;
  }
  // The same for one call per local rank (calls[l] is local rank l's).
  long long checkCombine(int l, const std::vector<RankInputs>& in, const std::vector<RefRows>& refs,
                         const std::vector<CombineCall>& calls, int K, const std::string& what) {
    std::vector<const CombineCall*> all;
    for (const CombineCall& c : calls) all.push_back(&c);
    return checkCombine(l, in, refs, all, calls[static_cast<std::size_t>(l)], K, what);
  }

 private:
  std::unique_ptr<Communicator> comm_;
  MoeConfig cfg_;
  std::vector<std::unique_ptr<Engine>> engines_;
  std::vector<cudaStream_t> streams_;
};

// Dispatch into the caller's buffers: routed by top-k (int32 and int64 ids, the config's top-k and
// fewer), by a mask with top-k (extra ranks: rows with no slots; missing ranks: entries left out),
// and by a mask alone; rows past the caller's buffer dropped and counted.
TEST(Gpu2_MoeCapabilities, RoutingAndCallerOutputs) {
  GRAPHEP_REQUIRE_GPUS(2);
  Caps caps;
  std::uint64_t seed = 11;
  for (Route route : {Route::kTopk, Route::kMaskAndTopk, Route::kMaskOnly}) {
    for (int topK : {kK, 2}) {
      for (bool int64Ids : {true, false}) {
        CallOptions o;
        o.int64Ids = int64Ids;
        const std::string what = "route " + std::to_string(static_cast<int>(route)) + ", topK " + std::to_string(topK) +
                                 (int64Ids ? ", int64" : ", int32");
        caps.dispatchAndCheck(caps.inputs(route, topK, ++seed), o, what);
      }
    }
  }
  CallOptions o;
  o.rowsLess = 5;  // every rank's buffers 5 rows short: 5 rows dropped and counted, nothing written past
  caps.dispatchAndCheck(caps.inputs(Route::kMaskAndTopk, kK, ++seed, 20), o, "5 rows short");
}

// fp8 per dispatch on a bf16 engine: the caller's e4m3 bytes and column-major scales passed through
// unchanged, and the engine's quantisation of bf16 rows.
TEST(Gpu2_MoeCapabilities, Fp8InputsOnABf16Engine) {
  GRAPHEP_REQUIRE_GPUS(2);
  Caps caps;
  std::uint64_t seed = 101;
  for (DispatchInput input : {DispatchInput::kFp8, DispatchInput::kFp8Quantize}) {
    for (Route route : {Route::kMaskAndTopk, Route::kMaskOnly}) {
      CallOptions o;
      o.input = input;
      caps.dispatchAndCheck(caps.inputs(route, kK, ++seed), o,
                            std::string(input == DispatchInput::kFp8 ? "caller fp8" : "engine fp8") + ", route " +
                                std::to_string(static_cast<int>(route)));
    }
  }
  // bf16 again on the same engine: the records' payload type is the dispatch's own.
  caps.dispatchAndCheck(caps.inputs(Route::kTopk, kK, ++seed), CallOptions{}, "bf16 after fp8");
}

// Dispatch A, dispatch B, combine x2 enqueued back to back on every rank (one host sync per round):
// A's and B's outputs, and both combines of B (an [n, H] input each, with per-row values), exact.
// A short combine input: its missing rows add nothing and are counted.
TEST(Gpu2_MoeCapabilities, RepeatedOperationsAndCombineInputs) {
  GRAPHEP_REQUIRE_GPUS(2);
  Caps caps;
  const int L = caps.L(), R = caps.R();
  std::uint64_t seed = 1001;
  for (int round = 0; round < 12; ++round) {
    const Route route = round % 3 == 0 ? Route::kTopk : (round % 3 == 1 ? Route::kMaskAndTopk : Route::kMaskOnly);
    const int topK = round % 2 == 0 ? kK : 3;
    const std::vector<RankInputs> a = caps.inputs(route, topK, ++seed), b = caps.inputs(route, topK, ++seed);
    const int K = b[0].topK;
    const CallOptions o;
    std::vector<RefRows> refA, refB;
    for (int d = 0; d < R; ++d) {
      refA.push_back(reference(a, d));
      refB.push_back(reference(b, d));
    }
    std::vector<RankCall> ca, cb;
    std::vector<Caps::CombineCall> y1, y2;
    const int yLess = round == 11 ? 2 : 0;  // the last round's second combine: 2 rows short
    for (int l = 0; l < L; ++l) {
      const int q = l;  // one process: local rank l is global rank l
      ca.push_back(caps.prepare(l, a[static_cast<std::size_t>(q)], refA[static_cast<std::size_t>(q)], o));
      cb.push_back(caps.prepare(l, b[static_cast<std::size_t>(q)], refB[static_cast<std::size_t>(q)], o));
      y1.push_back(caps.prepareCombine(l, refB[static_cast<std::size_t>(q)], K, 0, ++seed));
      y2.push_back(caps.prepareCombine(l, refB[static_cast<std::size_t>(q)], K, yLess, ++seed));
    }
    for (int l = 0; l < L; ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(l));
      caps.engine(l).dispatch(caps.args(a[static_cast<std::size_t>(l)], ca[static_cast<std::size_t>(l)], o), caps.stream(l));
      caps.engine(l).dispatch(caps.args(b[static_cast<std::size_t>(l)], cb[static_cast<std::size_t>(l)], o), caps.stream(l));
      caps.enqueueCombine(l, y1[static_cast<std::size_t>(l)], K);
      caps.enqueueCombine(l, y2[static_cast<std::size_t>(l)], K);
    }
    caps.syncAll();
    const std::string what = "round " + std::to_string(round);
    for (int l = 0; l < L; ++l) {
      EXPECT_EQ(caps.check(l, a, refA[static_cast<std::size_t>(l)], ca[static_cast<std::size_t>(l)], o, what + " dispatch A",
                           false), 0);  // the layout is B's
      EXPECT_EQ(caps.check(l, b, refB[static_cast<std::size_t>(l)], cb[static_cast<std::size_t>(l)], o, what + " dispatch B"), 0);
      EXPECT_EQ(caps.checkCombine(l, b, refB, y1, K, what + " combine 1"), 0);
      EXPECT_EQ(caps.checkCombine(l, b, refB, y2, K, what + " combine 2"), 0);
      const MoeStatus st = caps.engine(l).status();
      const long long missing = std::max<long long>(refB[static_cast<std::size_t>(l)].n() - y2[static_cast<std::size_t>(l)].rows, 0);
      EXPECT_EQ(st.missingCombineRows, static_cast<unsigned long long>(missing)) << what << ": " << st.describe();
      EXPECT_EQ(st.unpairedDispatches, 0ull);
      EXPECT_EQ(st.unpairedCombines, 0ull);
      EXPECT_TRUE(st.deviceError.empty()) << st.deviceError;
      caps.engine(l).clearStatus();
    }
  }
}

// Dispatch -> dispatch while a peer still reads: rank 0 sends 2,048 records of 7,168 values to the
// others (none to itself) and they send it 16, and every receive runs on 2 CTAs (epilogueSms), so
// rank 0's receive of A (16 records) ends, and its dispatch B starts, while the others still
// expand rank 0's records of A. B must
// wait for their acknowledgement (mutant 21 drops the wait: B's records then overwrite A's before
// they are read, and A's rows come out as B's).
TEST(Gpu2_MoeCapabilities, DispatchAfterDispatchWhileAPeerStillReads) {
  GRAPHEP_REQUIRE_GPUS(2);
  const ShapeScope shape(2048, 7168);
  MoeConfig cfg = Caps::capsConfig(static_cast<int>(visibleGpus().size()));
  cfg.epilogueSms = 2;  // a slow receive: the lagging reader
  Caps caps(cfg);
  const int L = caps.L(), R = caps.R();
  const CallOptions o;
  std::uint64_t seed = 5001;
  for (int round = 0; round < 4; ++round) {
    const std::vector<RankInputs> a = caps.inputs(Route::kOthersOnly, kK, ++seed, {2048, 16});
    const std::vector<RankInputs> b = caps.inputs(Route::kOthersOnly, kK, ++seed, {2048, 16});
    std::vector<RefRows> refA, refB;
    for (int d = 0; d < R; ++d) {
      refA.push_back(reference(a, d));
      refB.push_back(reference(b, d));
    }
    std::vector<RankCall> ca, cb;
    for (int l = 0; l < L; ++l) {
      ca.push_back(caps.prepare(l, a[static_cast<std::size_t>(l)], refA[static_cast<std::size_t>(l)], o));
      cb.push_back(caps.prepare(l, b[static_cast<std::size_t>(l)], refB[static_cast<std::size_t>(l)], o));
    }
    for (int l = 0; l < L; ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(l));
      caps.engine(l).dispatch(caps.args(a[static_cast<std::size_t>(l)], ca[static_cast<std::size_t>(l)], o), caps.stream(l));
      caps.engine(l).dispatch(caps.args(b[static_cast<std::size_t>(l)], cb[static_cast<std::size_t>(l)], o), caps.stream(l));
    }
    caps.syncAll();
    const std::string what = "uneven round " + std::to_string(round);
    for (int l = 0; l < L; ++l) {
      EXPECT_EQ(caps.check(l, a, refA[static_cast<std::size_t>(l)], ca[static_cast<std::size_t>(l)], o, what + " dispatch A",
                           false), 0);
      EXPECT_EQ(caps.check(l, b, refB[static_cast<std::size_t>(l)], cb[static_cast<std::size_t>(l)], o, what + " dispatch B"), 0);
      const MoeStatus st = caps.engine(l).status();
      EXPECT_TRUE(st.ok()) << what << ": " << st.describe();
    }
  }
}

// The direct path's block flags keep pace with the steps (the first open finding of
// docs/RELIABILITY.md): after every dispatch every peer's record-block flag here equals the
// dispatch step, and after every combine every partial-block flag the combine step, the blocks
// the operation left empty included. Posting only the filled blocks left the others as old as
// the last operation that filled them; 2^31 steps on, a wait's wrap-safe comparison would read
// such a flag as ahead and take stale records. The same holds for the combine's local flags by
// which the reduce tells this rank's send that a peer's block of partials is ready (a block left
// unmarked that long would be sent unreduced). The token counts go from full to few (80 tokens
// are 3 blocks of 32).
TEST(Gpu2_MoeCapabilities, DirectBlockFlagsKeepPaceWithTheSteps) {
  GRAPHEP_REQUIRE_GPUS(2);
  Caps caps;
  const int L = caps.L(), R = caps.R();
  ASSERT_GT(caps.engine(0).directBlockFlags().blocksPerRank, 0) << "not the direct path";
  const CallOptions o;
  std::uint64_t seed = 9001;
  for (const int T : {80, 1, 33, 2, 80, 5}) {
    // Uneven: each source leaves a different number of blocks empty (80 tokens are 3 blocks).
    const Caps::Step st = caps.step({T, 81 - T}, seed, o);
    const std::vector<RankInputs>& in = st.in;
    const std::vector<RefRows>& ref = st.ref;
    const std::vector<RankCall>& calls = st.calls;
    const std::vector<Caps::CombineCall>& ys = st.ys;
    for (int op = 0; op < 2; ++op) {  // the dispatch, then its combine
      caps.enqueueOp(op, st, o);
      caps.syncAll();
      for (int l = 0; l < L; ++l) {
        const std::string what = "T=" + std::to_string(T) + (op == 0 ? " dispatch" : " combine");
        if (op == 0) {  // the operation's results too, so that flags posted anywhere else cannot pass
          EXPECT_EQ(caps.check(l, in, ref[static_cast<std::size_t>(l)], calls[static_cast<std::size_t>(l)], o, what), 0);
        } else {
          std::vector<const Caps::CombineCall*> all;
          for (int m = 0; m < L; ++m) all.push_back(&ys[static_cast<std::size_t>(m)]);
          EXPECT_EQ(caps.checkCombine(l, in, ref, all, ys[static_cast<std::size_t>(l)], kK, what), 0);
        }
        const DirectBlockFlags f = caps.engine(l).directBlockFlags();
        const std::vector<std::uint32_t>& flags = op == 0 ? f.records : f.partials;
        const std::uint32_t want = op == 0 ? f.dispatchStep : f.combineStep;
        int stale = 0;
        for (int q = 0; q < R; ++q) {
          for (int w = 0; w < f.blocksPerRank && q != caps.engine(l).rank(); ++w) {
            stale += flags[static_cast<std::size_t>(q * f.blocksPerRank + w)] != want;
          }
        }
        EXPECT_EQ(stale, 0) << "T=" << T << (op == 0 ? " dispatch" : " combine") << ", rank " << l << ": " << stale
                            << " block flags differ from the step " << want;
        int notReady = 0;  // the combine's local ready flags, every peer's block, records or not
        for (int q = 0; q < R && op == 1; ++q) {
          for (int w = 0; w < f.blocksPerRank && q != caps.engine(l).rank(); ++w) {
            notReady += f.partialsReady[static_cast<std::size_t>(q * f.blocksPerRank + w)] != want;
          }
        }
        EXPECT_EQ(notReady, 0) << "T=" << T << " combine, rank " << l << ": " << notReady
                               << " ready flags of the reduce differ from the step " << want;
        EXPECT_TRUE(caps.engine(l).status().ok()) << caps.engine(l).status().describe();
      }
    }
  }
}

// The direct path under the active-rank mask (DESIGN §5.6): every dispatch and combine runs under
// a mask set on both ranks (both, one alone, both, the other alone, both). After each operation,
// on each rank in the mask: the steps it shared with each rank grew by one exactly where both took
// part; every block flag from a peer in the mask equals the steps they shared (the flags of a
// dispatch, or of a combine); and no flag of a rank left out moved (nothing was posted to it).
// Every status stays ok (a wait for a rank left out would time out). The outputs under masks are
// checked by the MoE case suite's active_mask cases; this checks the protocol's counters.
TEST(Gpu2_MoeCapabilities, DirectPairStepsUnderTheMask) {
  GRAPHEP_REQUIRE_GPUS(2);
  Caps caps;
  const int L = caps.L(), R = caps.R();
  ASSERT_GT(caps.engine(0).directBlockFlags().blocksPerRank, 0) << "not the direct path";
  const CallOptions o;
  std::uint64_t seed = 9101;
  for (const std::uint32_t mask : {3u, 1u, 3u, 2u, 3u, 1u, 1u, 3u}) {
    const Caps::Step st = caps.step({80, 47}, seed, o);
    for (int op = 0; op < 2; ++op) {  // the dispatch, then its combine
      std::vector<DirectBlockFlags> before;
      for (int l = 0; l < L; ++l) before.push_back(caps.engine(l).directBlockFlags());
      for (int l = 0; op == 0 && l < L; ++l) {
        GRAPHEP_CUDA_CHECK(cudaSetDevice(l));
        caps.engine(l).setActiveRanks(mask, caps.stream(l));
      }
      caps.enqueueOp(op, st, o);
      caps.syncAll();
      for (int l = 0; l < L; ++l) {
        const int me = caps.engine(l).rank();
        const std::string what = "mask " + std::to_string(mask) + (op == 0 ? " dispatch" : " combine") + ", rank " +
                                 std::to_string(me);
        EXPECT_TRUE(caps.engine(l).status().ok()) << what << ": " << caps.engine(l).status().describe();
        const DirectBlockFlags& b = before[static_cast<std::size_t>(l)];
        const DirectBlockFlags f = caps.engine(l).directBlockFlags();
        const std::vector<std::uint32_t>& flags = op == 0 ? f.records : f.partials;
        const std::vector<std::uint32_t>& was = op == 0 ? b.records : b.partials;
        const bool meIn = ((mask >> me) & 1u) != 0;
        for (int q = 0; q < R; ++q) {
          const bool both = meIn && ((mask >> q) & 1u) != 0;
          const std::size_t at = static_cast<std::size_t>(op * R + q);
          if (op == 0 || q != me) {  // a combine shares no steps with this rank itself
            EXPECT_EQ(f.pairSteps[at], b.pairSteps[at] + (both ? 1u : 0u)) << what << ": the steps shared with rank " << q;
          }
          if (q == me) continue;
          int off = 0;
          for (int w = 0; w < f.blocksPerRank; ++w) {
            const std::size_t k = static_cast<std::size_t>(q * f.blocksPerRank + w);
            off += both ? flags[k] != f.pairSteps[at] : flags[k] != was[k];
          }
          EXPECT_EQ(off, 0) << what << ": " << off << " block flags from rank " << q
                            << (both ? " differ from the steps they shared" : " moved though it was left out");
        }
      }
    }
  }
}

// An operation stopped part-way (the third open finding of docs/RELIABILITY.md): a launch failing
// once the operation's first launches are queued (made to happen with GRAPHEP_FAULT_AFTER_LAUNCH
// right after the direct dispatch's send, then after the direct combine's send) reaches the
// caller, and the engine enters its failed state naming the operation and what was queued: its
// counters may no longer match its peers'. The next operation is refused with kRemoteError,
// naming it; status() stays readable.
TEST(Gpu2_MoeCapabilities, OperationStoppedPartWayFailsTheEngineByName) {
  GRAPHEP_REQUIRE_GPUS(2);
  for (const char* after : {"direct-send", "direct-combine-send"}) {
    SCOPED_TRACE(after);
    const ScopedEnv fault("GRAPHEP_FAULT_AFTER_LAUNCH", after);
    Caps caps;
    const int L = caps.L(), R = caps.R();
    const bool inDispatch = std::string(after) == "direct-send";
    const char* op = inDispatch ? "dispatch" : "combine";
    const CallOptions o;
    const std::vector<RankInputs> in = caps.inputs(Route::kTopk, kK, 9501, {40});
    std::vector<RefRows> ref;
    for (int d = 0; d < R; ++d) ref.push_back(reference(in, d));
    std::vector<RankCall> calls;
    std::vector<Caps::CombineCall> ys;
    for (int l = 0; l < L; ++l) {
      calls.push_back(caps.prepare(l, in[static_cast<std::size_t>(l)], ref[static_cast<std::size_t>(l)], o));
      ys.push_back(caps.prepareCombine(l, ref[static_cast<std::size_t>(l)], kK, 0, 9601));
    }
    for (int l = 0; l < L; ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(l));
      const auto dispatch = [&] {
        caps.engine(l).dispatch(caps.args(in[static_cast<std::size_t>(l)], calls[static_cast<std::size_t>(l)], o), caps.stream(l));
      };
      if (inDispatch) {
        expectError(dispatch, Status::kCudaError, "dispatch: the launch after direct-send failed");
      } else {
        dispatch();
        expectError([&] { caps.enqueueCombine(l, ys[static_cast<std::size_t>(l)], kK); }, Status::kCudaError,
                    "combine: the launch after direct-combine-send failed");
      }
      EXPECT_TRUE(caps.engine(l).failed());
      expectError(dispatch, Status::kRemoteError,
                  std::string(op) + " stopped part-way (" + after + " was queued, a later launch failed)");
    }
    caps.syncAll();  // what was queued completes: the sends do not wait for the receives
    for (int l = 0; l < L; ++l) (void)caps.engine(l).status();
  }
}

// Combine -> combine with no host synchronisation between them (the combine's acknowledgement,
// the second open finding of docs/RELIABILITY.md): rank 0's final kernel lags 2 ms before it
// reads its peers' partials (GRAPHEP_SLOW_COMBINE_FINAL), while the others finish the first
// combine (rank 0's partials reach them before its final starts) and start the second. Their
// second partials must wait for rank 0's acknowledgement (mutant 28 drops the wait: they then
// overwrite the first combine's partials before rank 0 reads them, and its first sums come out
// with the second combine's values). Both combines' sums are checked on every rank.
TEST(Gpu2_MoeCapabilities, CombineAfterCombineWhileAPeerStillReads) {
  GRAPHEP_REQUIRE_GPUS(2);
  const ScopedEnv slow("GRAPHEP_SLOW_COMBINE_FINAL", "0:2000");  // read at setup
  Caps caps;
  const int L = caps.L(), R = caps.R();
  const CallOptions o;
  std::uint64_t seed = 6001;
  for (int round = 0; round < 4; ++round) {
    const std::vector<RankInputs> in = caps.inputs(Route::kTopk, kK, ++seed);
    std::vector<RefRows> ref;
    for (int d = 0; d < R; ++d) ref.push_back(reference(in, d));
    std::vector<RankCall> calls;
    std::vector<Caps::CombineCall> y1, y2;
    for (int l = 0; l < L; ++l) {
      calls.push_back(caps.prepare(l, in[static_cast<std::size_t>(l)], ref[static_cast<std::size_t>(l)], o));
      y1.push_back(caps.prepareCombine(l, ref[static_cast<std::size_t>(l)], kK, 0, ++seed));
      y2.push_back(caps.prepareCombine(l, ref[static_cast<std::size_t>(l)], kK, 0, ++seed));
    }
    for (int l = 0; l < L; ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(l));
      caps.engine(l).dispatch(caps.args(in[static_cast<std::size_t>(l)], calls[static_cast<std::size_t>(l)], o), caps.stream(l));
      caps.enqueueCombine(l, y1[static_cast<std::size_t>(l)], kK);
      caps.enqueueCombine(l, y2[static_cast<std::size_t>(l)], kK);
    }
    caps.syncAll();
    const std::string what = "round " + std::to_string(round);
    for (int l = 0; l < L; ++l) {
      EXPECT_EQ(caps.checkCombine(l, in, ref, y1, kK, what + " combine 1"), 0);
      EXPECT_EQ(caps.checkCombine(l, in, ref, y2, kK, what + " combine 2"), 0);
      const MoeStatus st = caps.engine(l).status();
      EXPECT_TRUE(st.ok()) << what << ": " << st.describe();
    }
  }
}

// A combine before the engine's first dispatch has nothing to combine: counted, named, no hang.
TEST(Gpu2_MoeCapabilities, CombineBeforeAnyDispatchIsCounted) {
  GRAPHEP_REQUIRE_GPUS(2);
  Caps caps;
  std::vector<std::unique_ptr<DeviceBuffer<std::uint16_t>>> outs;
  for (int l = 0; l < caps.L(); ++l) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(l));
    outs.push_back(std::make_unique<DeviceBuffer<std::uint16_t>>(static_cast<std::size_t>(gShape.tMax) * gShape.hidden));
    CombineArgs a;
    a.out = outs.back()->p;
    caps.engine(l).combine(a, caps.stream(l));
  }
  caps.syncAll();
  for (int l = 0; l < caps.L(); ++l) {
    const MoeStatus st = caps.engine(l).status();
    EXPECT_EQ(st.unpairedCombines, 1ull) << st.describe();
    EXPECT_NE(st.describe().find("before any dispatch"), std::string::npos) << st.describe();
    caps.engine(l).clearStatus();
  }
  caps.dispatchAndCheck(caps.inputs(Route::kTopk, kK, 7), CallOptions{}, "after the early combine");
}

// Bad arguments of the new fields: a named error before anything is enqueued.
TEST(Gpu2_MoeCapabilities, BadArgumentsAreNamed) {
  GRAPHEP_REQUIRE_GPUS(2);
  Caps caps;
  const std::vector<RankInputs> in = caps.inputs(Route::kMaskAndTopk, kK, 5);
  const RefRows ref = reference(in, 0);
  const CallOptions o;
  RankCall c = caps.prepare(0, in[0], ref, o);
  Engine& e = caps.engine(0);
  cudaStream_t s = caps.stream(0);
  DispatchArgs a = caps.args(in[0], c, o);
  a.topK = kK + 1;
  expectError([&] { e.dispatch(a, s); }, Status::kInvalidArgument, "topK=5 is outside [1, MoeConfig.topK=4]");
  a = caps.args(in[0], c, o);
  a.input = DispatchInput::kFp8;
  a.outputs.recvScales = c.recvScales->p;
  a.xScales = nullptr;
  expectError([&] { e.dispatch(a, s); }, Status::kInvalidArgument, "dispatch: xScales");
  a = caps.args(in[0], c, o);
  a.xScales = c.scalesT->p;
  expectError([&] { e.dispatch(a, s); }, Status::kInvalidArgument, "xScales is set but input=0 is not kFp8");
  a = caps.args(in[0], c, o);
  a.input = DispatchInput::kFp8Quantize;
  a.scaleFormat = Fp8Scales::kUe8m0;
  expectError([&] { e.dispatch(a, s); }, Status::kNotSupported, "scaleFormat other than kFloat applies to the latency path");
  a = caps.args(in[0], c, o);
  a.scaleFormat = Fp8Scales::kPow2;
  expectError([&] { e.dispatch(a, s); }, Status::kInvalidArgument, "scaleFormat=1 applies to an fp8 dispatch");
  a = caps.args(in[0], c, o);
  a.scaleFormat = static_cast<Fp8Scales>(7);
  expectError([&] { e.dispatch(a, s); }, Status::kInvalidArgument, "scaleFormat=7 is not an Fp8Scales");
  a = caps.args(in[0], c, o);
  a.half = MoeHalf::kSend;
  expectError([&] { e.dispatch(a, s); }, Status::kNotSupported, "half=kSend applies to the latency path");
  a = caps.args(in[0], c, o);
  a.outputs.rows = 0;
  expectError([&] { e.dispatch(a, s); }, Status::kInvalidArgument, "outputs.rows=0");
  a = caps.args(in[0], c, o);
  a.outputs.recvScales = c.recvScales->p;
  expectError([&] { e.dispatch(a, s); }, Status::kInvalidArgument, "recvScales is set for a bf16 dispatch");
  a = caps.args(in[0], c, o);
  a.input = static_cast<DispatchInput>(9);
  expectError([&] { e.dispatch(a, s); }, Status::kInvalidArgument, "input=9 is not a DispatchInput");
  a = caps.args(in[0], c, o);
  a.topkIdx = nullptr;
  a.tokenInRank = nullptr;
  expectError([&] { e.dispatch(a, s); }, Status::kInvalidArgument, "topkIdx is null");
  CombineArgs ca;
  ca.out = c.x->p;
  ca.rowValues = c.w->p;
  expectError([&] { e.combine(ca, s); }, Status::kInvalidArgument, "rowValues");
  ca.outValues = c.weightsOut->p;
  ca.numValues = 17;
  expectError([&] { e.combine(ca, s); }, Status::kInvalidArgument, "numValues=17 is outside [1, 16]");
  ca = CombineArgs{};
  ca.out = c.x->p;
  ca.expertOutputRows = -1;
  expectError([&] { e.combine(ca, s); }, Status::kInvalidArgument, "expertOutputRows=-1 is negative");

  // The rank-major capabilities on an expert-major engine: refused by name.
  MoeConfig em = Caps::capsConfig(caps.R());
  em.receiveLayout = ReceiveLayout::kExpertMajor;
  Caps other(em);
  Engine& e2 = other.engine(0);
  GRAPHEP_CUDA_CHECK(cudaSetDevice(0));
  a = other.args(in[0], c, o);
  a.outputs = DispatchOutputs{};
  expectError([&] { e2.dispatch(a, other.stream(0)); }, Status::kNotSupported, "tokenInRank applies to the rank-major");
  a.tokenInRank = nullptr;
  a.outputs.recvX = c.recvX->p;
  a.outputs.rows = c.rows;
  expectError([&] { e2.dispatch(a, other.stream(0)); }, Status::kNotSupported, "DispatchOutputs applies to the rank-major");
}

}  // namespace
}  // namespace graphep::test
