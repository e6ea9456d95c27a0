// The latency path's capabilities (include/graphep/moe.hpp: DispatchArgs.half and CombineArgs.half
// with Engine::receive, CombineArgs.topkWeights, DispatchArgs.scaleFormat, DispatchLayout
// .expertSourceRanges, DispatchArgs.recvStats), on GPUs 0 and 1 (one rank each, one process driving
// both), against a host reference built from both ranks' inputs:
//
//   rank q, token t, slot k:  expert e = topkIdx[t][k] (-1: none)  -->  rank d = e / 16, local j = e % 16
//   rank d, expert j's rows:  offsets[j] + i, i over (source q, token t) ascending
//                             batched: offsets[j] = j x R x T_max; expert-major: aligned prefix sum
//   expertSourceRanges[j][q] = (j's rows from ranks < q) << 32 | (j's rows from q)
//   combine:   partial_d = bf16(fma chain over t's slots on d, ascending k, of w[t][k] x y_d[row])
//              out_q[t]  = bf16(sum over d ascending of partial_d)          (fp32; exact on the host)
//   fp8:       per 128 values: scale = max(amax, 448 x 2^-126) / 448 (1 when amax = 0), rounded up to
//              a power of two for kPow2 / kUe8m0 (kUe8m0 stores its exponent byte); q = e4m3(v x (1 / scale))
//
// Every step has fresh random inputs (tokens past the live count hold valid routing that the engine
// must not read), every output is poisoned with 0xFF bytes (NaN in bf16, e4m3 and fp32; exponent 255
// in UE8M0: never a result) before every operation, and results are compared exactly, element by
// element, the wrong ones counted.
#include <gtest/gtest.h>

#include <graphep/graphep.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/bf16.hpp"
#include "common/expect_error.hpp"
#include "common/fp8_reference.hpp"
#include "common/gpu_env.hpp"
#include "common/graph_util.hpp"
#include "common/moe/step_trace.hpp"
#include "common/nccl_comms.hpp"
#include "engine/error.hpp"

namespace graphep::test {
namespace {

constexpr int kRanks = 2;
constexpr int kExperts = 32;
constexpr int kLocal = kExperts / kRanks;  // experts per rank
constexpr int kTopK = 8;
constexpr int kTMax = 128;
constexpr int kTokenCounts[] = {128, 77, 1};  // live tokens: rank r of step s takes entry (s + r) mod 3
constexpr unsigned char kPoison = 0xFF;

std::size_t at(long long i) { return static_cast<std::size_t>(i); }

// A latency-path engine config: T_max 128, 32 experts (16 per rank), top-8, bf16.
MoeConfig latencyConfig(int hidden, ReceiveLayout layout) {
  return {.maxTokensPerRank = kTMax,
          .hidden = hidden,
          .numExperts = kExperts,
          .topK = kTopK,
          .dispatchType = DType::kBf16,
          .expertAlignment = layout == ReceiveLayout::kExpertMajor ? 8 : 1,  // expert-major: padded experts
          .receiveLayout = layout,  // batched: rowsPerExpert 0, i.e. R x T_max
          .path = MoePath::kLatency};
}

// The rows of recv_x the documentation gives this config (Engine::receiveCapacity's comment).
long long referenceCapacity(const MoeConfig& c) {
  if (c.receiveLayout == ReceiveLayout::kBatched) return static_cast<long long>(kLocal) * kRanks * kTMax;
  return static_cast<long long>(kTMax) * kRanks * std::min(kTopK, kLocal) + kLocal * (c.expertAlignment - 1);
}

// --- Random inputs ----------------------------------------------------------------------------

// SplitMix64: the bulk random values (rows of x and y), cheap and the same on every platform.
class Bits {
 public:
  explicit Bits(std::uint64_t seed) : s_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

 private:
  std::uint64_t s_;
};

// n nonzero bf16 values of magnitudes in [2^e, 2^(e + 4)): random sign, mantissa and two exponent bits.
void fillBf16(std::uint16_t* v, int n, int e, Bits& bits) {
  for (int i = 0; i < n; i += 4) {
    const std::uint64_t r = bits.next();
    for (int j = 0; j < 4 && i + j < n; ++j) {
      const unsigned u = static_cast<unsigned>(r >> (16 * j)) & 0xffffu;
      const unsigned biased = static_cast<unsigned>(127 + e + static_cast<int>((u >> 7) & 3u));
      v[i + j] = static_cast<std::uint16_t>((u & 0x807fu) | (biased << 7));
    }
  }
}

// x [T_max][H]: each 128-value block has a magnitude of its own (2^-8 .. 2^12), so that the fp8 scales
// differ; about one block in 23 is zeros (scale 1) and one in 29 lies below 448 x 2^-126 (the
// scale's floor).
std::vector<std::uint16_t> randomX(std::uint64_t seed, int H) {
  Bits bits(seed);
  std::vector<std::uint16_t> x(at(kTMax) * H, 0);
  for (int t = 0; t < kTMax; ++t) {
    for (int b = 0; b < H; b += 128) {
      const std::uint64_t kind = bits.next();
      const int n = std::min(128, H - b);
      if (kind % 23 == 0) continue;  // zeros
      const int e = kind % 29 == 1 ? -126 : static_cast<int>((kind >> 8) % 17) - 8;
      fillBf16(&x[at(t) * H + b], n, e, bits);
    }
  }
  return x;
}

// Top-k ids [T_max][K] (past the live count too): distinct experts; every 11th token names none,
// every 7th only experts of one rank (its combine is one partial, bit for bit), the others any
// experts with about 15% of their slots -1.
std::vector<int> randomRouting(std::mt19937_64& rng) {
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  std::vector<int> ids(at(kTMax) * kTopK, -1);
  std::vector<int> pool;
  for (int t = 0; t < kTMax; ++t) {
    if (t % 11 == 4) continue;
    const bool oneRank = t % 7 == 2;
    pool.resize(oneRank ? kLocal : kExperts);
    std::iota(pool.begin(), pool.end(), oneRank ? (t / 7) % kRanks * kLocal : 0);
    std::shuffle(pool.begin(), pool.end(), rng);
    for (int k = 0; k < kTopK; ++k) {
      if (unit(rng) >= 0.15f) ids[at(t) * kTopK + k] = pool[at(k)];
    }
  }
  return ids;
}

std::vector<float> randomWeights(std::mt19937_64& rng, float lo, float hi) {
  std::uniform_real_distribution<float> value(lo, hi);
  std::vector<float> w(at(kTMax) * kTopK);
  for (float& v : w) v = value(rng);
  return w;
}

// One rank's inputs of one step: a pure function of (seed, rank, T, H).
struct RankInputs {
  int T = 0;                      // live tokens
  std::vector<int> ids;           // [T_max][K] global expert ids, -1: none
  std::vector<float> w;           // [T_max][K] dispatch weights (positive)
  std::vector<float> cw;          // [T_max][K] combine-time weights (positive)
  std::vector<std::uint16_t> x;   // [T_max][H] bf16
};
using Inputs = std::vector<RankInputs>;  // one per rank

RankInputs makeInputs(int rank, int T, int H, std::uint64_t seed) {
  std::mt19937_64 rng(seed * 1000003ull + static_cast<std::uint64_t>(rank));
  RankInputs in;
  in.T = T;
  in.ids = randomRouting(rng);
  in.w = randomWeights(rng, 0.05f, 1.f);
  in.cw = randomWeights(rng, 0.25f, 2.f);
  in.x = randomX(rng(), H);
  return in;
}

// --- Host reference -----------------------------------------------------------------------------

struct RefRow {
  int srcRank = -1;  // -1: no row here (alignment padding, a batched expert's unused rows)
  int srcToken = 0;
  int slot = 0;
};

// What rank d receives.
struct RefLayout {
  std::vector<int> counts;         // [L] rows of each local expert
  std::vector<int> offsets;        // [L + 1] first row of each expert, then the end
  std::vector<int> fromSource;     // [L][R] rows of expert j from rank q
  std::vector<RefRow> rows;        // [capacity]
  std::vector<long long> slotRow;  // [R][T_max][K] the row of (rank, token, slot) here, -1: elsewhere
  long long rowOf(int q, int t, int k) const { return slotRow[(at(q) * kTMax + t) * kTopK + k]; }
};

// Local expert of entry (t, k) of rank q's inputs on rank d, or -1.
int localExpert(const RankInputs& in, int t, int k, int d) {
  const int e = in.ids[at(t) * kTopK + k];
  return e >= 0 && e / kLocal == d ? e % kLocal : -1;
}

RefLayout referenceDispatch(const Inputs& in, int d, const MoeConfig& cfg) {
  RefLayout ref;
  ref.counts.assign(kLocal, 0);
  ref.fromSource.assign(at(kLocal) * kRanks, 0);
  ref.rows.assign(at(referenceCapacity(cfg)), RefRow{});
  ref.slotRow.assign(at(kRanks) * kTMax * kTopK, -1);
  for (int q = 0; q < kRanks; ++q) {
    for (int t = 0; t < in[at(q)].T; ++t) {
      for (int k = 0; k < kTopK; ++k) {
        const int j = localExpert(in[at(q)], t, k, d);
        if (j < 0) continue;
        ++ref.counts[at(j)];
        ++ref.fromSource[at(j) * kRanks + q];
      }
    }
  }
  const int align = cfg.expertAlignment, block = kRanks * kTMax;
  ref.offsets.assign(kLocal + 1, 0);
  for (int j = 0; j < kLocal; ++j) {
    const int aligned = (ref.counts[at(j)] + align - 1) / align * align;
    const bool batched = cfg.receiveLayout == ReceiveLayout::kBatched;
    ref.offsets[at(j) + 1] = batched ? (j + 1) * block : ref.offsets[at(j)] + aligned;
  }
  std::vector<int> next(ref.offsets.begin(), ref.offsets.end() - 1);
  for (int q = 0; q < kRanks; ++q) {  // (source, token, slot) ascending: each expert's row order
    for (int t = 0; t < in[at(q)].T; ++t) {
      for (int k = 0; k < kTopK; ++k) {
        const int j = localExpert(in[at(q)], t, k, d);
        if (j < 0) continue;
        const int row = next[at(j)]++;
        ref.rows[at(row)] = RefRow{q, t, k};
        ref.slotRow[(at(q) * kTMax + t) * kTopK + k] = row;
      }
    }
  }
  return ref;
}

// The top-k weights a combine reduces with.
enum class Weights {
  kOnes,      // an unweighted dispatch, no combine weights
  kDispatch,  // the dispatch's
  kCombine,   // CombineArgs.topkWeights
};

float weightOf(const RankInputs& in, int t, int k, Weights w) {
  if (w == Weights::kOnes) return 1.f;
  return (w == Weights::kDispatch ? in.w : in.cw)[at(t) * kTopK + k];
}

// Rank q's combine output [T][H] (Engine::combine's arithmetic): per destination d, the fp32 fused
// multiply-adds of its slots in ascending order from 0, rounded to bf16; their fp32 sum in ascending
// rank order, rounded once.
std::vector<std::uint16_t> referenceCombine(const Inputs& in, const std::vector<RefLayout>& refs,
                                            const std::vector<std::vector<std::uint16_t>>& y, int q, Weights weights,
                                            int H) {
  const RankInputs& mine = in[at(q)];
  std::vector<std::uint16_t> out(at(mine.T) * H);
  std::vector<float> total(at(H));
  for (int t = 0; t < mine.T; ++t) {
    std::fill(total.begin(), total.end(), 0.f);
    for (int d = 0; d < kRanks; ++d) {
      std::vector<std::pair<const std::uint16_t*, float>> slots;  // (y row, weight), ascending k
      for (int k = 0; k < kTopK; ++k) {
        if (localExpert(mine, t, k, d) < 0) continue;
        slots.emplace_back(&y[at(d)][at(refs[at(d)].rowOf(q, t, k)) * H], weightOf(mine, t, k, weights));
      }
      if (slots.empty()) continue;  // no partial from d
      for (int h = 0; h < H; ++h) {
        float acc = 0.f;
        for (const auto& [row, w] : slots) acc = std::fma(w, bf16Value(row[h]), acc);
        total[at(h)] += bf16Value(bf16Bits(acc));
      }
    }
    for (int h = 0; h < H; ++h) out[at(t) * H + h] = bf16Bits(total[at(h)]);
  }
  return out;
}

// --- Device side ------------------------------------------------------------------------------

template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t n) : n_(n) {
    GRAPHEP_CUDA_CHECK(cudaMalloc(&p_, std::max<std::size_t>(n, 1) * sizeof(T)));
  }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return p_; }
  std::size_t size() const { return n_; }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

template <class T>
void uploadAsync(const DeviceBuffer<T>& dst, const std::vector<T>& v, cudaStream_t s) {
  GRAPHEP_CUDA_CHECK(cudaMemcpyAsync(dst.get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice, s));
}

void poisonAsync(const void* p, std::size_t bytes, cudaStream_t s) {
  if (p != nullptr) GRAPHEP_CUDA_CHECK(cudaMemsetAsync(const_cast<void*>(p), kPoison, bytes, s));
}

// n elements from the device (after the stream that wrote them was synchronised).
template <class T>
std::vector<T> download(const void* p, std::size_t n) {
  std::vector<T> v(n);
  GRAPHEP_CUDA_CHECK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

// One rank's buffers of the caller.
struct RankBuffers {
  RankBuffers(int H, long long capacity)
      : x(at(kTMax) * H), ids(at(kTMax) * kTopK), w(at(kTMax) * kTopK), cw(at(kTMax) * kTopK), numTokens(1),
        y(at(capacity) * H), out(at(kTMax) * H), stats(kLocal), scratch(1 << 20) {}
  DeviceBuffer<std::uint16_t> x;         // [T_max][H]
  DeviceBuffer<int> ids;                 // [T_max][K]
  DeviceBuffer<float> w, cw;             // [T_max][K] dispatch / combine-time weights
  DeviceBuffer<int> numTokens;           // the live T
  DeviceBuffer<std::uint16_t> y;         // [capacity][H] expert outputs: combine's input
  DeviceBuffer<std::uint16_t> out;       // [T_max][H] combine's output
  DeviceBuffer<int> stats;               // [L] DispatchArgs.recvStats
  DeviceBuffer<std::uint8_t> scratch;    // the unrelated work between a send half and its receive
};

struct DispatchOptions {
  bool weighted = true;  // topkWeights (else none: weights 1)
  DispatchInput input = DispatchInput::kConfig;
  Fp8Scales scaleFormat = Fp8Scales::kFloat;
  MoeHalf half = MoeHalf::kWhole;
  bool stats = false;  // recvStats
  bool fp8() const { return input == DispatchInput::kFp8Quantize; }
};

struct CombineOptions {
  bool weighted = false;  // topkWeights: the combine-time weights (else the dispatch's)
  MoeHalf half = MoeHalf::kWhole;
};

// Two latency-path engines (GPUs 0 and 1, one process), a stream and the caller's buffers for each.
class Rig {
 public:
  explicit Rig(const MoeConfig& cfg) : cfg_(cfg), comm_(createLocalGroup({0, 1})) {
    engines_ = Engine::createAll(*comm_, cfg_);
    for (int r = 0; r < kRanks; ++r) {
      select(r);
      cudaStream_t s = nullptr;
      GRAPHEP_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      streams_.push_back(s);
      if (layout(r).capacity != referenceCapacity(cfg_)) {
        throw std::runtime_error("rank " + std::to_string(r) + ": capacity " + std::to_string(layout(r).capacity) +
                                 " rows, documented " + std::to_string(referenceCapacity(cfg_)));
      }
      bufs_.push_back(std::make_unique<RankBuffers>(cfg_.hidden, layout(r).capacity));
    }
  }
  ~Rig() {
    for (int r = 0; r < kRanks; ++r) {
      cudaSetDevice(comm_->device(r));
      cudaStreamSynchronize(stream(r));
      cudaStreamDestroy(stream(r));
    }
  }
  Rig(const Rig&) = delete;
  Rig& operator=(const Rig&) = delete;

  int H() const { return cfg_.hidden; }
  Engine& engine(int r) const { return *engines_[at(r)]; }
  const DispatchLayout& layout(int r) const { return engine(r).layout(); }
  cudaStream_t stream(int r) const { return streams_[at(r)]; }
  const RankBuffers& buf(int r) const { return *bufs_[at(r)]; }
  void select(int r) const { GRAPHEP_CUDA_CHECK(cudaSetDevice(comm_->device(r))); }
  void syncAll() const {
    for (int r = 0; r < kRanks; ++r) {
      select(r);
      GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(stream(r)));
    }
  }

  // Step `step`'s fresh inputs (rank r: kTokenCounts[(step + r) % 3] live tokens), uploaded.
  Inputs newInputs(std::uint64_t seed, int step) const {
    Inputs in;
    for (int r = 0; r < kRanks; ++r) {
      in.push_back(makeInputs(r, kTokenCounts[(step + r) % 3], H(), seed));
      const RankInputs& mine = in.back();
      const std::vector<int> numTokens{mine.T};
      select(r);
      uploadAsync(buf(r).x, mine.x, stream(r));
      uploadAsync(buf(r).ids, mine.ids, stream(r));
      uploadAsync(buf(r).w, mine.w, stream(r));
      uploadAsync(buf(r).cw, mine.cw, stream(r));
      uploadAsync(buf(r).numTokens, numTokens, stream(r));
      GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(stream(r)));  // before the host vectors move or go
    }
    return in;
  }
  std::vector<RefLayout> reference(const Inputs& in) const {
    std::vector<RefLayout> refs;
    for (int d = 0; d < kRanks; ++d) refs.push_back(referenceDispatch(in, d, cfg_));
    return refs;
  }
  // Random expert outputs in every row of every rank's y (rows no expert has too), uploaded.
  std::vector<std::vector<std::uint16_t>> newExpertOutputs(std::uint64_t seed) const {
    std::vector<std::vector<std::uint16_t>> y;
    for (int r = 0; r < kRanks; ++r) {
      Bits bits(seed * 7919ull + static_cast<std::uint64_t>(r));
      y.emplace_back(buf(r).y.size());
      fillBf16(y.back().data(), static_cast<int>(y.back().size()), -3, bits);
      select(r);
      uploadAsync(buf(r).y, y.back(), stream(r));
      GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(stream(r)));
    }
    return y;
  }

  // Everything a dispatch writes: the engine's rows, scales, row metadata and layout views.
  void poisonDispatchOutputs() const {
    const std::size_t L = kLocal, cap = at(layout(0).capacity), H = at(this->H());
    for (int r = 0; r < kRanks; ++r) {
      const DispatchLayout& v = layout(r);
      const cudaStream_t s = stream(r);
      select(r);
      poisonAsync(v.recvX, cap * H * 2, s);
      poisonAsync(v.scalesBuffer, cap * (H / 128) * sizeof(float), s);
      for (const void* p : {static_cast<const void*>(v.rowSrcRank), static_cast<const void*>(v.rowSrcToken),
                            static_cast<const void*>(v.rowTopkSlot), static_cast<const void*>(v.rowWeight)}) {
        poisonAsync(p, cap * 4, s);
      }
      poisonAsync(v.expertOffsets, (L + 1) * 4, s);
      poisonAsync(v.expertCounts, L * 4, s);
      poisonAsync(v.expertDropped, L * 4, s);
      poisonAsync(v.numRecvRows, 4, s);
      poisonAsync(v.expertSourceRanges, L * kRanks * 8, s);
    }
  }
  void poisonCombineOutputs() const {
    for (int r = 0; r < kRanks; ++r) {
      select(r);
      poisonAsync(buf(r).out.get(), buf(r).out.size() * 2, stream(r));
    }
  }

  DispatchArgs dispatchArgs(int r, const DispatchOptions& o) const {
    const RankBuffers& b = buf(r);
    DispatchArgs a;
    a.x = b.x.get();
    a.topkIdx = b.ids.get();
    a.indexType = IndexType::kInt32;
    a.topkWeights = o.weighted ? b.w.get() : nullptr;
    a.numTokens = b.numTokens.get();
    a.input = o.input;
    a.scaleFormat = o.scaleFormat;
    a.half = o.half;
    a.recvStats = o.stats ? b.stats.get() : nullptr;
    return a;
  }
  CombineArgs combineArgs(int r, const CombineOptions& o) const {
    CombineArgs a;
    a.expertOutput = buf(r).y.get();
    a.out = buf(r).out.get();
    a.topkWeights = o.weighted ? buf(r).cw.get() : nullptr;
    a.half = o.half;
    return a;
  }

  // Enqueue rank r's operation on `s`; a send half is followed by unrelated work (a memset: the other
  // micro-batch's GEMMs) and then the receive half.
  void enqueueDispatch(int r, const DispatchOptions& o, cudaStream_t s) const {
    engine(r).dispatch(dispatchArgs(r, o), s);
    if (o.half == MoeHalf::kSend) receiveAfterOtherWork(r, s);
  }
  void enqueueCombine(int r, const CombineOptions& o, cudaStream_t s) const {
    engine(r).combine(combineArgs(r, o), s);
    if (o.half == MoeHalf::kSend) receiveAfterOtherWork(r, s);
  }
  void receiveAfterOtherWork(int r, cudaStream_t s) const {
    select(r);
    GRAPHEP_CUDA_CHECK(cudaMemsetAsync(buf(r).scratch.get(), 0x5A, buf(r).scratch.size(), s));
    engine(r).receive(s);
  }

  // Poisoned outputs, the operation on every rank, and a sync.
  void dispatchAll(const DispatchOptions& o) const {
    poisonDispatchOutputs();
    for (int r = 0; r < kRanks; ++r) enqueueDispatch(r, o, stream(r));
    syncAll();
  }
  void combineAll(const CombineOptions& o) const {
    poisonCombineOutputs();
    for (int r = 0; r < kRanks; ++r) enqueueCombine(r, o, stream(r));
    syncAll();
  }

 private:
  MoeConfig cfg_;
  std::unique_ptr<Communicator> comm_;
  std::vector<std::unique_ptr<Engine>> engines_;
  std::vector<cudaStream_t> streams_;
  std::vector<std::unique_ptr<RankBuffers>> bufs_;
};

// --- Checks -----------------------------------------------------------------------------------

// Counts wrong elements and prints the first few reports.
struct Wrong {
  std::string what;
  long long n = 0;
  int reports = 0;
  void add(long long count, const std::string& msg) {
    n += count;
    if (reports++ < 8) ADD_FAILURE() << what << ": " << msg;
  }
  void operator()(const std::string& msg) { add(1, msg); }
};

std::string hex(unsigned v) {
  char s[16];
  std::snprintf(s, sizeof s, "0x%x", v);
  return s;
}

// got[0, n) against want[0, n) (nullptr: the poison, never written); one report per row.
template <class T>
void compareRow(const T* got, const T* want, std::size_t n, const std::string& where, Wrong& wrong) {
  T poison;
  std::memset(&poison, kPoison, sizeof poison);
  long long bad = 0;
  std::size_t first = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const T expected = want != nullptr ? want[i] : poison;
    if (got[i] != expected && bad++ == 0) first = i;
  }
  if (bad == 0) return;
  const unsigned expected = want != nullptr ? static_cast<unsigned>(want[first]) : static_cast<unsigned>(poison);
  wrong.add(bad, where + ": " + std::to_string(bad) + " of " + std::to_string(n) + " wrong, first [" +
                     std::to_string(first) + "] = " + hex(static_cast<unsigned>(got[first])) + ", reference " +
                     hex(expected) + (want == nullptr ? " (poison: never written)" : ""));
}

// expertCounts, expertOffsets, expertDropped, numRecvRows.
void checkCounts(const DispatchLayout& v, const RefLayout& ref, Wrong& wrong) {
  const auto counts = download<int>(v.expertCounts, kLocal), dropped = download<int>(v.expertDropped, kLocal);
  const auto offsets = download<int>(v.expertOffsets, kLocal + 1);
  const int rows = download<int>(v.numRecvRows, 1)[0];
  auto expect = [&](const std::string& name, long long got, long long want) {
    if (got != want) wrong(name + " = " + std::to_string(got) + ", reference " + std::to_string(want));
  };
  for (int j = 0; j < kLocal; ++j) {
    expect("expertCounts[" + std::to_string(j) + "]", counts[at(j)], ref.counts[at(j)]);
    expect("expertDropped[" + std::to_string(j) + "]", dropped[at(j)], 0);
  }
  for (int j = 0; j <= kLocal; ++j) {
    expect("expertOffsets[" + std::to_string(j) + "]", offsets[at(j)], ref.offsets[at(j)]);
  }
  expect("numRecvRows", rows, std::accumulate(ref.counts.begin(), ref.counts.end(), 0));
}

// expertSourceRanges[j][q] = begin << 32 | count, begin from expert j's first row.
void checkSourceRanges(const DispatchLayout& v, const RefLayout& ref, Wrong& wrong) {
  if (v.expertSourceRanges == nullptr) {
    wrong("expertSourceRanges is null");
    return;
  }
  const auto got = download<long long>(v.expertSourceRanges, at(kLocal) * kRanks);
  for (int j = 0; j < kLocal; ++j) {
    long long begin = 0;
    for (int q = 0; q < kRanks; ++q) {
      const long long count = ref.fromSource[at(j) * kRanks + q], want = (begin << 32) | count;
      const long long g = got[at(j) * kRanks + q];
      if (g != want) {
        wrong("expertSourceRanges[" + std::to_string(j) + "][" + std::to_string(q) + "] = (" +
              std::to_string(g >> 32) + ", " + std::to_string(g & 0xffffffffll) + "), reference (" +
              std::to_string(begin) + ", " + std::to_string(count) + ")");
      }
      begin += count;
    }
  }
}

// Each used row's source rank, token, top-k slot and weight (the dispatch's, or 1).
void checkRowMetadata(const DispatchLayout& v, const Inputs& in, const RefLayout& ref, bool weighted, Wrong& wrong) {
  const std::size_t cap = at(v.capacity);
  const auto rank = download<int>(v.rowSrcRank, cap), token = download<int>(v.rowSrcToken, cap);
  const auto slot = download<int>(v.rowTopkSlot, cap);
  const auto weight = download<float>(v.rowWeight, cap);
  for (std::size_t i = 0; i < cap; ++i) {
    const RefRow& e = ref.rows[i];
    if (e.srcRank < 0) continue;
    const float w = weighted ? in[at(e.srcRank)].w[at(e.srcToken) * kTopK + e.slot] : 1.f;
    if (rank[i] != e.srcRank || token[i] != e.srcToken || slot[i] != e.slot || weight[i] != w) {
      wrong("row " + std::to_string(i) + ": (rank, token, slot, weight) = (" + std::to_string(rank[i]) + ", " +
            std::to_string(token[i]) + ", " + std::to_string(slot[i]) + ", " + std::to_string(weight[i]) +
            "), reference (" + std::to_string(e.srcRank) + ", " + std::to_string(e.srcToken) + ", " +
            std::to_string(e.slot) + ", " + std::to_string(w) + ")");
    }
  }
}

std::string rowName(std::size_t i, const RefRow& e) {
  return "row " + std::to_string(i) +
         (e.srcRank < 0 ? std::string(" (unused)")
                        : " (rank " + std::to_string(e.srcRank) + " token " + std::to_string(e.srcToken) + ")");
}

// bf16 rows: each used row is its source token's x bit for bit; the others keep their poison.
void checkBf16Rows(const DispatchLayout& v, const Inputs& in, const RefLayout& ref, int H, Wrong& wrong) {
  if (v.recvScales != nullptr) wrong("recvScales is set after a bf16 dispatch");
  const auto x = download<std::uint16_t>(v.recvX, at(v.capacity) * H);
  for (std::size_t i = 0; i < at(v.capacity); ++i) {
    const RefRow& e = ref.rows[i];
    const std::uint16_t* want = e.srcRank < 0 ? nullptr : &in[at(e.srcRank)].x[at(e.srcToken) * H];
    compareRow(&x[i * H], want, at(H), "recvX " + rowName(i, e), wrong);
  }
}

// One token's fp8 record: e4m3 bytes [H] and its scales as stored (fp32 bytes, or UE8M0 bytes).
struct Fp8Row {
  std::vector<unsigned char> q, scales;
};

Fp8Row quantizeReference(const std::uint16_t* x, int H, Fp8Scales format) {
  Fp8Row row;
  std::vector<float> scales;
  quantizeRow(x, H, &row.q, &scales, format != Fp8Scales::kFloat);
  for (const float s : scales) {
    std::uint32_t b = 0;
    std::memcpy(&b, &s, 4);
    if (format == Fp8Scales::kUe8m0) {
      row.scales.push_back(static_cast<unsigned char>(b >> 23));  // the power of two's biased exponent
    } else {
      for (int i = 0; i < 4; ++i) row.scales.push_back(static_cast<unsigned char>(b >> (8 * i)));  // little-endian
    }
  }
  return row;
}

// Engine-quantised fp8 rows: e4m3 bytes at row stride H in recvX, the scales [capacity][H / 128] in
// recvScales (== scalesBuffer); unused rows keep their poison.
void checkFp8Rows(const DispatchLayout& v, const Inputs& in, const RefLayout& ref, int H, Fp8Scales format,
                  Wrong& wrong) {
  if (v.recvScales == nullptr || v.recvScales != v.scalesBuffer) {
    wrong("recvScales is not scalesBuffer after an fp8 dispatch");
    return;
  }
  std::vector<std::vector<Fp8Row>> want(kRanks);  // [rank][token]
  for (int q = 0; q < kRanks; ++q) {
    for (int t = 0; t < in[at(q)].T; ++t) {
      want[at(q)].push_back(quantizeReference(&in[at(q)].x[at(t) * H], H, format));
    }
  }
  const std::size_t cap = at(v.capacity), scaleBytes = at(H / 128) * (format == Fp8Scales::kUe8m0 ? 1 : 4);
  const auto bytes = download<unsigned char>(v.recvX, cap * H);
  const auto scales = download<unsigned char>(v.recvScales, cap * scaleBytes);
  for (std::size_t i = 0; i < cap; ++i) {
    const RefRow& e = ref.rows[i];
    const Fp8Row* w = e.srcRank < 0 ? nullptr : &want[at(e.srcRank)][at(e.srcToken)];
    compareRow(&bytes[i * H], w != nullptr ? w->q.data() : nullptr, at(H), "e4m3 " + rowName(i, e), wrong);
    compareRow(&scales[i * scaleBytes], w != nullptr ? w->scales.data() : nullptr, scaleBytes,
               "scales of " + rowName(i, e), wrong);
  }
}

// Every rank's dispatch outputs (the engine's layout views) against the reference; wrong elements.
// `ranks`: only the ranks of this mask.
long long checkDispatch(const Rig& rig, const Inputs& in, const std::vector<RefLayout>& refs,
                        const DispatchOptions& o, const std::string& what, std::uint32_t ranks = ~0u) {
  long long n = 0;
  for (int d = 0; d < kRanks; ++d) {
    if (((ranks >> d) & 1u) == 0) continue;
    rig.select(d);
    Wrong wrong{what + ", rank " + std::to_string(d)};
    const DispatchLayout& v = rig.layout(d);
    const RefLayout& ref = refs[at(d)];
    checkCounts(v, ref, wrong);
    checkSourceRanges(v, ref, wrong);
    checkRowMetadata(v, in, ref, o.weighted, wrong);
    if (o.fp8()) {
      checkFp8Rows(v, in, ref, rig.H(), o.scaleFormat, wrong);
    } else {
      checkBf16Rows(v, in, ref, rig.H(), wrong);
    }
    n += wrong.n;
  }
  return n;
}

// Every rank's combine output: rows [0, T) the reference, the rest keep their poison.
long long checkCombine(const Rig& rig, const Inputs& in, const std::vector<RefLayout>& refs,
                       const std::vector<std::vector<std::uint16_t>>& y, Weights weights, const std::string& what,
                       std::uint32_t ranks = ~0u) {
  long long n = 0;
  const int H = rig.H();
  for (int q = 0; q < kRanks; ++q) {
    if (((ranks >> q) & 1u) == 0) continue;
    Wrong wrong{what + ", rank " + std::to_string(q) + " combine"};
    const std::vector<std::uint16_t> want = referenceCombine(in, refs, y, q, weights, H);
    rig.select(q);
    const auto out = download<std::uint16_t>(rig.buf(q).out.get(), at(kTMax) * H);
    for (int t = 0; t < kTMax; ++t) {
      compareRow(&out[at(t) * H], t < in[at(q)].T ? &want[at(t) * H] : nullptr, at(H), "out row " + std::to_string(t),
                 wrong);
    }
    n += wrong.n;
  }
  return n;
}

void expectStatusOk(const Rig& rig, const std::string& what) {
  for (int r = 0; r < kRanks; ++r) {
    const MoeStatus st = rig.engine(r).status();
    EXPECT_TRUE(st.ok()) << what << ", rank " << r << ": " << st.describe();
  }
}

std::string stepName(int step, const Inputs& in) {
  return "step " + std::to_string(step) + " (T = " + std::to_string(in[0].T) + ", " + std::to_string(in[1].T) + ")";
}

// One captured graph per rank (rank r's operations, from body(r, stream)), launched on every rank
// at once; destroyed with the object.
class RankGraphs {
 public:
  RankGraphs(const Rig& rig, const std::function<void(int, cudaStream_t)>& body) : rig_(rig) {
    for (int r = 0; r < kRanks; ++r) {
      rig.select(r);
      exec_.push_back(captureOnStream(rig.stream(r), [&](cudaStream_t s) { body(r, s); }));
    }
  }
  ~RankGraphs() {
    for (cudaGraphExec_t g : exec_) cudaGraphExecDestroy(g);
  }
  RankGraphs(const RankGraphs&) = delete;
  RankGraphs& operator=(const RankGraphs&) = delete;
  void launch() const {
    for (int r = 0; r < kRanks; ++r) {
      rig_.select(r);
      GRAPHEP_CUDA_CHECK(cudaGraphLaunch(exec_[at(r)], rig_.stream(r)));
    }
  }

 private:
  const Rig& rig_;
  std::vector<cudaGraphExec_t> exec_;
};

// The inputs as an operation under active-rank mask `mask` sees them: every entry whose expert
// lives on a rank outside the mask removed (-1), and every entry of a rank outside it. masked[r]
// counts the live tokens' entries removed for destination r on top of what it held.
Inputs underMask(const Inputs& in, std::uint32_t mask, std::vector<std::vector<unsigned long long>>& masked) {
  Inputs out = in;
  for (int q = 0; q < kRanks; ++q) {
    RankInputs& r = out[at(q)];
    for (int t = 0; t < kTMax; ++t) {
      for (int k = 0; k < kTopK; ++k) {
        int& e = r.ids[at(t) * kTopK + k];
        if (e < 0) continue;
        const int d = e / kLocal;
        if (((mask >> q) & 1u) != 0 && ((mask >> d) & 1u) != 0) continue;
        if (t < r.T) ++masked[at(q)][at(d)];
        e = -1;
      }
    }
  }
  return out;
}

// Step i's fresh inputs (uploaded), what the active-rank `mask` leaves of them (`seen`; every
// input without a mask) and its reference, fresh expert outputs (uploaded), and every output
// poisoned: what a replay or an eager step starts from. `masked` (with a mask) counts the entries
// the mask removes, as underMask does.
struct FreshStep {
  Inputs in, seen;
  std::vector<RefLayout> refs;
  std::vector<std::vector<std::uint16_t>> y;
};
FreshStep freshStep(const Rig& rig, std::uint64_t& seed, int i, std::uint32_t mask = allRanksMask(kRanks),
                    std::vector<std::vector<unsigned long long>>* masked = nullptr) {
  FreshStep f;
  f.in = rig.newInputs(++seed, i);
  f.seen = masked != nullptr ? underMask(f.in, mask, *masked) : f.in;
  f.refs = rig.reference(f.seen);
  f.y = rig.newExpertOutputs(++seed);
  rig.poisonDispatchOutputs();
  rig.poisonCombineOutputs();
  return f;
}

// --- Tests ------------------------------------------------------------------------------------

// Every test here needs GPUs 0 and 1: the fixture skips (or fails) the test without them.
class Gpu2_MoeLatencyCapabilities : public ::testing::Test {
 protected:
  void SetUp() override {
    GRAPHEP_REQUIRE_GPUS(2);
    if (!gpusTakeWholeLines({0, 1})) {
      GTEST_SKIP() << "GPUs 0 and 1 are joined without native P2P atomics (PCIe): the latency path takes no such peer";
    }
  }
};

// Dispatch and combine enqueued as their send halves, a memset on the stream, then Engine::receive:
// the results of the whole operations on the same inputs (each checked exactly against the one
// reference), for live counts 128, 77 and 1.
TEST_F(Gpu2_MoeLatencyCapabilities, SendHalfThenReceive) {
  Rig rig(latencyConfig(2048, ReceiveLayout::kBatched));
  std::uint64_t seed = 100;
  for (int step = 0; step < 6; ++step) {
    const Inputs in = rig.newInputs(++seed, step);
    const std::vector<RefLayout> refs = rig.reference(in);
    const auto y = rig.newExpertOutputs(++seed);
    for (MoeHalf half : {MoeHalf::kWhole, MoeHalf::kSend}) {
      const std::string what = stepName(step, in) + (half == MoeHalf::kSend ? ", halves" : ", whole");
      DispatchOptions d;
      d.half = half;
      rig.dispatchAll(d);
      EXPECT_EQ(checkDispatch(rig, in, refs, d, what), 0);
      CombineOptions c;
      c.half = half;
      rig.combineAll(c);
      EXPECT_EQ(checkCombine(rig, in, refs, y, Weights::kDispatch, what), 0);
      expectStatusOk(rig, what);
    }
  }
}

// While a send half waits for its receive, the engine's other operations are refused by name (and
// enqueue nothing); a receive with no send half waiting is refused too. The halves then complete.
TEST_F(Gpu2_MoeLatencyCapabilities, PendingSendHalfRefusesOtherOperations) {
  Rig rig(latencyConfig(2048, ReceiveLayout::kBatched));
  const Inputs in = rig.newInputs(200, 0);
  const std::vector<RefLayout> refs = rig.reference(in);
  const auto y = rig.newExpertOutputs(201);
  expectError([&] { rig.engine(0).receive(rig.stream(0)); }, Status::kInvalidArgument, "no send half");
  DispatchOptions d;
  d.half = MoeHalf::kSend;
  CombineOptions c;
  c.half = MoeHalf::kSend;
  rig.poisonDispatchOutputs();
  for (int r = 0; r < kRanks; ++r) rig.engine(r).dispatch(rig.dispatchArgs(r, d), rig.stream(r));
  expectError([&] { rig.engine(0).dispatch(rig.dispatchArgs(0, DispatchOptions{}), rig.stream(0)); },
              Status::kInvalidArgument, "receive half");
  expectError([&] { rig.engine(1).combine(rig.combineArgs(1, CombineOptions{}), rig.stream(1)); },
              Status::kInvalidArgument, "receive half");
  for (int r = 0; r < kRanks; ++r) rig.engine(r).receive(rig.stream(r));
  expectError([&] { rig.engine(0).receive(rig.stream(0)); }, Status::kInvalidArgument, "no send half");
  rig.syncAll();
  EXPECT_EQ(checkDispatch(rig, in, refs, d, "after the refused calls"), 0);

  rig.poisonCombineOutputs();
  for (int r = 0; r < kRanks; ++r) rig.engine(r).combine(rig.combineArgs(r, c), rig.stream(r));
  expectError([&] { rig.engine(1).dispatch(rig.dispatchArgs(1, DispatchOptions{}), rig.stream(1)); },
              Status::kInvalidArgument, "receive half");
  for (int r = 0; r < kRanks; ++r) rig.engine(r).receive(rig.stream(r));
  rig.syncAll();
  EXPECT_EQ(checkCombine(rig, in, refs, y, Weights::kDispatch, "after the refused calls"), 0);
  expectStatusOk(rig, "after the refused calls");
}

// Dispatches without weights (weights 1) and with them; per dispatch a combine with combine-time
// weights (used in place of the dispatch's) and one without (the dispatch's, or 1): exact.
void runCombineTimeWeights(const MoeConfig& cfg, std::uint64_t seed) {
  Rig rig(cfg);
  for (int step = 0; step < 6; ++step) {
    const bool weightedDispatch = step % 2 == 1;
    const Inputs in = rig.newInputs(++seed, step);
    const std::vector<RefLayout> refs = rig.reference(in);
    const std::string what = stepName(step, in) + (weightedDispatch ? ", weighted" : ", unweighted") + " dispatch";
    DispatchOptions d;
    d.weighted = weightedDispatch;
    rig.dispatchAll(d);
    EXPECT_EQ(checkDispatch(rig, in, refs, d, what), 0);
    const auto y = rig.newExpertOutputs(++seed);
    CombineOptions c;
    c.weighted = true;
    rig.combineAll(c);
    EXPECT_EQ(checkCombine(rig, in, refs, y, Weights::kCombine, what + ", combine weights"), 0);
    c.weighted = false;
    rig.combineAll(c);
    EXPECT_EQ(checkCombine(rig, in, refs, y, weightedDispatch ? Weights::kDispatch : Weights::kOnes,
                           what + ", no combine weights"),
              0);
    expectStatusOk(rig, what);
  }
}

TEST_F(Gpu2_MoeLatencyCapabilities, CombineTimeWeights) {
  runCombineTimeWeights(latencyConfig(2048, ReceiveLayout::kBatched), 300);
}

TEST_F(Gpu2_MoeLatencyCapabilities, CombineTimeWeightsExpertMajorHidden7168) {
  runCombineTimeWeights(latencyConfig(7168, ReceiveLayout::kExpertMajor), 400);
}

// A stream held by the host: hold(s) closes the gate and enqueues a host function that returns
// only once open() is called (or after 60 s, so that a failed test cannot hang the suite). Declare
// it before the streams' owner, so that their synchronisation on the way out (an exception
// between hold and open) comes before the gate goes.
class HostGate {
 public:
  void hold(cudaStream_t s) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = false;
    }
    GRAPHEP_CUDA_CHECK(cudaLaunchHostFunc(s, &HostGate::wait, this));
  }
  void open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  static void CUDART_CB wait(void* self) {
    auto* g = static_cast<HostGate*>(self);
    std::unique_lock<std::mutex> lock(g->mu_);
    g->cv_.wait_for(lock, std::chrono::seconds(60), [g] { return g->open_; });
  }
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

// True once `e` completed, false if it did not within `ms` milliseconds (the current device's).
bool completesWithin(cudaEvent_t e, int ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  for (;;) {
    const cudaError_t st = cudaEventQuery(e);
    if (st == cudaSuccess) return true;
    if (st != cudaErrorNotReady) GRAPHEP_CUDA_CHECK(st);
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// A combine send half waits for no peer (DeepEP's return_recv_hook): in the even steps rank 1's
// stream is held by the host before its combine send half, so that rank 1's combine-time weights
// are not there while rank 0's send half runs. Rank 0's send half must still finish while rank 1
// is held (it leaves rank 1's records to its receive half), and both receive halves then give the
// exact weighted sums. The odd steps run the halves unheld (either way, as the ranks meet), and
// every step ends with the whole operation on the same inputs, exact too.
TEST_F(Gpu2_MoeLatencyCapabilities, CombineSendHalfWaitsForNoPeer) {
  HostGate gate;
  Rig rig(latencyConfig(2048, ReceiveLayout::kBatched));
  std::uint64_t seed = 1300;
  cudaEvent_t sent = nullptr;
  rig.select(0);
  GRAPHEP_CUDA_CHECK(cudaEventCreateWithFlags(&sent, cudaEventDisableTiming));
  for (int step = 0; step < 6; ++step) {
    const Inputs in = rig.newInputs(++seed, step);
    const std::vector<RefLayout> refs = rig.reference(in);
    const bool held = step % 2 == 0;
    const std::string what = stepName(step, in) + (held ? ", rank 1 held" : ", not held");
    DispatchOptions d;
    d.weighted = step % 3 != 0;
    rig.dispatchAll(d);
    EXPECT_EQ(checkDispatch(rig, in, refs, d, what), 0);
    const auto y = rig.newExpertOutputs(++seed);
    CombineOptions c;
    c.weighted = true;
    c.half = MoeHalf::kSend;
    rig.poisonCombineOutputs();
    rig.select(1);
    if (held) gate.hold(rig.stream(1));
    rig.engine(1).combine(rig.combineArgs(1, c), rig.stream(1));
    rig.select(0);
    rig.engine(0).combine(rig.combineArgs(0, c), rig.stream(0));
    GRAPHEP_CUDA_CHECK(cudaEventRecord(sent, rig.stream(0)));
    if (held) {
      EXPECT_TRUE(completesWithin(sent, 3000))
          << what << ": rank 0's combine send half did not finish in 3 s while rank 1 was held before its own";
    }
    gate.open();
    for (int r = 0; r < kRanks; ++r) rig.receiveAfterOtherWork(r, rig.stream(r));
    rig.syncAll();
    EXPECT_EQ(checkCombine(rig, in, refs, y, Weights::kCombine, what + ", halves"), 0);
    c.half = MoeHalf::kWhole;
    rig.combineAll(c);
    EXPECT_EQ(checkCombine(rig, in, refs, y, Weights::kCombine, what + ", whole"), 0);
    expectStatusOk(rig, what);
  }
  rig.select(0);
  GRAPHEP_CUDA_CHECK(cudaEventDestroy(sent));
}

// Rank 1 is held before its whole combine while rank 0's runs: rank 0's sums must wait for rank
// 1's partials, whose lines carry the step (kernels/moe/lines.cuh), instead of summing the slot as
// it stands (an older step's partials, or nothing yet). Both combines exact once rank 1 goes on;
// the dispatch's weights and combine-time weights in turn.
TEST_F(Gpu2_MoeLatencyCapabilities, CombineSumsWaitForAHeldPeersPartials) {
  HostGate gate;
  Rig rig(latencyConfig(2048, ReceiveLayout::kBatched));
  std::uint64_t seed = 1500;
  for (int step = 0; step < 4; ++step) {
    const Inputs in = rig.newInputs(++seed, step);
    const std::vector<RefLayout> refs = rig.reference(in);
    CombineOptions c;
    c.weighted = step % 2 == 1;
    const std::string what = stepName(step, in) + ", rank 1 held before its combine" + (c.weighted ? ", combine-time weights" : "");
    DispatchOptions d;  // the dispatch's top-k weights (what an unweighted combine applies)
    rig.dispatchAll(d);
    EXPECT_EQ(checkDispatch(rig, in, refs, d, what), 0);
    const auto y = rig.newExpertOutputs(++seed);
    rig.poisonCombineOutputs();
    rig.select(1);
    gate.hold(rig.stream(1));
    rig.engine(1).combine(rig.combineArgs(1, c), rig.stream(1));
    rig.select(0);
    rig.engine(0).combine(rig.combineArgs(0, c), rig.stream(0));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // rank 0's sums reach rank 1's partials
    gate.open();
    rig.syncAll();
    EXPECT_EQ(checkCombine(rig, in, refs, y, c.weighted ? Weights::kCombine : Weights::kDispatch, what), 0);
    expectStatusOk(rig, what);
  }
  rig.select(0);
}

// Two micro-batches in flight, each on an engine and a stream of its own (DeepEP's double buffering
// with return_recv_hook): rank 1 is held before micro-batch A's dispatch send half, so rank 0's
// receive half of A waits for it. Meanwhile rank 0 runs micro-batch B's send half on B's stream: it
// must finish, since a waiting receive half holds no more than its E receivers (its G helpers, which
// find a count word missing, leave) and B's G send CTAs fit beside them. Then rank 1 goes on, and
// both micro-batches' dispatches and combines are exact. G = 64 senders and E = the SMs left
// receivers, so that G + E CTAs of the dispatch kernel (512 threads, one CTA an SM) fill each GPU:
// a receive half whose every CTA waited would leave B's send half no room (mutant 53).
TEST_F(Gpu2_MoeLatencyCapabilities, DispatchReceiveHalfLeavesRoomForAnotherEngine) {
  int sms = 0;
  for (int d = 0; d < kRanks; ++d) {
    cudaDeviceProp prop{};
    GRAPHEP_CUDA_CHECK(cudaGetDeviceProperties(&prop, d));
    sms = d == 0 ? prop.multiProcessorCount : std::min(sms, prop.multiProcessorCount);
  }
  if (sms < 2 * 64) GTEST_SKIP() << sms << " SMs: the test fills a GPU with 64 senders and at least as many receivers";
  MoeConfig cfg = latencyConfig(2048, ReceiveLayout::kBatched);
  cfg.smBudget = 64;
  cfg.epilogueSms = sms - 64;
  HostGate gate;
  Rig a(cfg), b(cfg);
  std::uint64_t seed = 2700;
  cudaEvent_t sent = nullptr;
  b.select(0);
  GRAPHEP_CUDA_CHECK(cudaEventCreateWithFlags(&sent, cudaEventDisableTiming));
  for (int step = 0; step < 3; ++step) {
    const Inputs inA = a.newInputs(++seed, step), inB = b.newInputs(++seed, step + 1);
    const std::vector<RefLayout> refsA = a.reference(inA), refsB = b.reference(inB);
    const std::string what = "step " + std::to_string(step);
    DispatchOptions d;
    d.half = MoeHalf::kSend;
    a.poisonDispatchOutputs();
    b.poisonDispatchOutputs();
    a.select(1);
    gate.hold(a.stream(1));
    a.engine(1).dispatch(a.dispatchArgs(1, d), a.stream(1));
    a.receiveAfterOtherWork(1, a.stream(1));
    a.select(0);
    a.engine(0).dispatch(a.dispatchArgs(0, d), a.stream(0));
    a.receiveAfterOtherWork(0, a.stream(0));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // rank 0's receive half of A waiting
    b.select(0);
    b.engine(0).dispatch(b.dispatchArgs(0, d), b.stream(0));
    GRAPHEP_CUDA_CHECK(cudaEventRecord(sent, b.stream(0)));
    // 1 s: less than any timeout the suites run under (2 s and more), so that a send half left no
    // room fails here, not later as a timed-out receive.
    EXPECT_TRUE(completesWithin(sent, 1000))
        << what << ": rank 0's send half of micro-batch B did not finish in 1 s beside its receive half of A, "
                   "which waits for rank 1";
    gate.open();
    b.receiveAfterOtherWork(0, b.stream(0));
    b.select(1);
    b.engine(1).dispatch(b.dispatchArgs(1, d), b.stream(1));
    b.receiveAfterOtherWork(1, b.stream(1));
    a.syncAll();
    b.syncAll();
    EXPECT_EQ(checkDispatch(a, inA, refsA, d, what + ", micro-batch A"), 0);
    EXPECT_EQ(checkDispatch(b, inB, refsB, d, what + ", micro-batch B"), 0);
    const auto yA = a.newExpertOutputs(++seed), yB = b.newExpertOutputs(++seed);
    a.combineAll(CombineOptions{});
    b.combineAll(CombineOptions{});
    EXPECT_EQ(checkCombine(a, inA, refsA, yA, Weights::kDispatch, what + ", micro-batch A"), 0);
    EXPECT_EQ(checkCombine(b, inB, refsB, yB, Weights::kDispatch, what + ", micro-batch B"), 0);
    expectStatusOk(a, what + ", micro-batch A");
    expectStatusOk(b, what + ", micro-batch B");
  }
  b.select(0);
  GRAPHEP_CUDA_CHECK(cudaEventDestroy(sent));
}

// Shrink on timeout with the combine's halves: after a good step, rank 1 stops before its combine
// send half (it enqueues nothing more, as a dead process would), so its combine-time weights never
// come. Rank 0's send half leaves rank 1's records to its receive half, whose stand-ins wait for
// the weights in vain and mask rank 1 for every receive CTA: rank 0's combine completes without a
// failure, rank 1 in MoeStatus::shrunkRanks, its sums those of rank 0's own experts, exact.
TEST_F(Gpu2_MoeLatencyCapabilities, CombineHalvesShrinkWhenAPeerStopsBeforeItsWeights) {
  const ScopedEnv timeout("GRAPHEP_TIMEOUT_MS", "500");  // read at setup
  MoeConfig cfg = latencyConfig(2048, ReceiveLayout::kBatched);
  cfg.shrinkOnTimeout = true;
  Rig rig(cfg);
  std::uint64_t seed = 1400;
  CombineOptions c;
  c.weighted = true;
  c.half = MoeHalf::kSend;
  for (int step = 0; step < 2; ++step) {
    const Inputs in = rig.newInputs(++seed, step);
    const std::vector<RefLayout> refs = rig.reference(in);
    const std::string what = stepName(step, in) + (step == 0 ? ", every rank" : ", rank 1 stopped");
    const DispatchOptions d;
    rig.dispatchAll(d);
    EXPECT_EQ(checkDispatch(rig, in, refs, d, what), 0);
    const auto y = rig.newExpertOutputs(++seed);
    rig.poisonCombineOutputs();
    const int ranks = step == 0 ? kRanks : 1;
    for (int r = 0; r < ranks; ++r) rig.enqueueCombine(r, c, rig.stream(r));
    rig.syncAll();
    if (step == 0) {
      EXPECT_EQ(checkCombine(rig, in, refs, y, Weights::kCombine, what), 0);
      expectStatusOk(rig, what);
      continue;
    }
    std::vector<std::vector<unsigned long long>> masked(kRanks, std::vector<unsigned long long>(kRanks, 0));
    const Inputs seen = underMask(in, 1u, masked);  // rank 1's experts add nothing
    EXPECT_EQ(checkCombine(rig, seen, refs, y, Weights::kCombine, what, 1u), 0);
    const MoeStatus st = rig.engine(0).status();
    EXPECT_TRUE(st.ok()) << what << ": " << st.describe();
    EXPECT_FALSE(rig.engine(0).failed()) << what;
    EXPECT_EQ(st.shrunkRanks, 2u) << what << ": " << st.describe();
  }
}

// fp8 dispatches of a bf16 engine (the engine quantises x) in each scale format: e4m3 bytes at row
// stride H, the scales (fp32, or UE8M0 bytes) in recvScales == scalesBuffer, bit for bit; then a
// bf16 dispatch on the same engine (recvScales back to nullptr).
TEST_F(Gpu2_MoeLatencyCapabilities, Fp8ScaleFormats) {
  Rig rig(latencyConfig(2048, ReceiveLayout::kBatched));
  ASSERT_NE(rig.layout(0).scalesBuffer, nullptr);
  std::uint64_t seed = 500;
  int step = 0;
  for (Fp8Scales format : {Fp8Scales::kFloat, Fp8Scales::kPow2, Fp8Scales::kUe8m0}) {
    for (int i = 0; i < 2; ++i, ++step) {
      const Inputs in = rig.newInputs(++seed, step);
      const std::string what = stepName(step, in) + ", scaleFormat " + std::to_string(static_cast<int>(format));
      DispatchOptions d;
      d.input = DispatchInput::kFp8Quantize;
      d.scaleFormat = format;
      rig.dispatchAll(d);
      EXPECT_EQ(checkDispatch(rig, in, rig.reference(in), d, what), 0);
      expectStatusOk(rig, what);
    }
  }
  const Inputs in = rig.newInputs(++seed, step);
  rig.dispatchAll(DispatchOptions{});
  EXPECT_EQ(checkDispatch(rig, in, rig.reference(in), DispatchOptions{}, "bf16 after fp8"), 0);
  expectStatusOk(rig, "bf16 after fp8");
}

// Three dispatches with recvStats (pre-filled with random values): each adds its experts' rows;
// expertSourceRanges (checked by every dispatch check) and expertTotals (the rows since creation).
void runSourceRangesAndStats(const MoeConfig& cfg, std::uint64_t seed) {
  Rig rig(cfg);
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int>> stats(kRanks, std::vector<int>(kLocal));
  std::vector<std::vector<unsigned long long>> totals(kRanks, std::vector<unsigned long long>(kLocal, 0));
  for (int r = 0; r < kRanks; ++r) {
    for (int& s : stats[at(r)]) s = static_cast<int>(rng() % (1u << 20));
    rig.select(r);
    uploadAsync(rig.buf(r).stats, stats[at(r)], rig.stream(r));
  }
  rig.syncAll();
  for (int step = 0; step < 3; ++step) {
    const Inputs in = rig.newInputs(++seed, step);
    const std::vector<RefLayout> refs = rig.reference(in);
    DispatchOptions d;
    d.stats = true;
    rig.dispatchAll(d);
    EXPECT_EQ(checkDispatch(rig, in, refs, d, stepName(step, in)), 0);
    for (int r = 0; r < kRanks; ++r) {
      for (int j = 0; j < kLocal; ++j) {
        stats[at(r)][at(j)] += refs[at(r)].counts[at(j)];
        totals[at(r)][at(j)] += static_cast<unsigned long long>(refs[at(r)].counts[at(j)]);
      }
    }
  }
  for (int r = 0; r < kRanks; ++r) {
    rig.select(r);
    EXPECT_EQ(download<int>(rig.buf(r).stats.get(), kLocal), stats[at(r)]) << "recvStats, rank " << r;
    EXPECT_EQ(download<unsigned long long>(rig.layout(r).expertTotals, kLocal), totals[at(r)])
        << "expertTotals, rank " << r;
  }
  expectStatusOk(rig, "source ranges and stats");
}

TEST_F(Gpu2_MoeLatencyCapabilities, SourceRangesAndStats) {
  runSourceRangesAndStats(latencyConfig(2048, ReceiveLayout::kBatched), 600);
}

TEST_F(Gpu2_MoeLatencyCapabilities, SourceRangesAndStatsExpertMajor) {
  runSourceRangesAndStats(latencyConfig(2048, ReceiveLayout::kExpertMajor), 700);
}

// Captured once per rank: dispatch send half (no weights), a memset, receive; combine send half with
// combine-time weights, a memset, receive. Replayed with new inputs, expert outputs and live counts
// written into the same buffers before each replay; every replay checked.
TEST_F(Gpu2_MoeLatencyCapabilities, GraphReplayOfHalves) {
  Rig rig(latencyConfig(2048, ReceiveLayout::kBatched));
  DispatchOptions d;
  d.weighted = false;
  d.half = MoeHalf::kSend;
  CombineOptions c;
  c.weighted = true;
  c.half = MoeHalf::kSend;
  const RankGraphs graphs(rig, [&](int r, cudaStream_t s) {
    rig.enqueueDispatch(r, d, s);
    rig.enqueueCombine(r, c, s);
  });
  const long long replays = replaysFromEnv("GRAPHEP_TEST_REPLAYS", 20);
  std::uint64_t seed = 800;
  for (int i = 0; i < replays; ++i) {
    const FreshStep f = freshStep(rig, seed, i);
    graphs.launch();
    rig.syncAll();
    const std::string what = "replay " + std::to_string(i) + ", " + stepName(i, f.in);
    EXPECT_EQ(checkDispatch(rig, f.in, f.refs, d, what), 0);
    EXPECT_EQ(checkCombine(rig, f.in, f.refs, f.y, Weights::kCombine, what), 0);
  }
  expectStatusOk(rig, "graph replays");
}

// Captured once per rank: four dispatch / combine pairs back to back with no other kernel between
// them, profiled (MoeConfig.profile). Each operation's kernel is launched as a dependent of the one
// before (programmatic dependent launch) and can start before it ends, so its step trace must show
// every operation's wait returning no earlier than the previous operation's advance, the order
// that no trace with the expert's kernel or the host between operations can test. The last pair's
// results are checked on every replay (each pair moves the same inputs).
TEST_F(Gpu2_MoeLatencyCapabilities, StepTraceOfBackToBackOperations) {
  MoeConfig cfg = latencyConfig(2048, ReceiveLayout::kBatched);
  cfg.profile = true;
  Rig rig(cfg);
  const DispatchOptions d;
  const CombineOptions c;
  const RankGraphs graphs(rig, [&](int r, cudaStream_t s) {
    for (int pair = 0; pair < 4; ++pair) {
      rig.enqueueDispatch(r, d, s);
      rig.enqueueCombine(r, c, s);
    }
  });
  std::uint64_t seed = 900;
  for (int i = 0; i < 3; ++i) {
    const FreshStep f = freshStep(rig, seed, i);
    graphs.launch();
    rig.syncAll();
    const std::string what = "replay " + std::to_string(i) + ", " + stepName(i, f.in);
    EXPECT_EQ(checkDispatch(rig, f.in, f.refs, d, what), 0);
    EXPECT_EQ(checkCombine(rig, f.in, f.refs, f.y, Weights::kDispatch, what), 0);
    for (int r = 0; r < kRanks; ++r) expectStepTrace(rig.engine(r).stepTrace(), r);
  }
  expectStatusOk(rig, "back-to-back replays");
}

// The active-rank mask (Engine::setActiveRanks): one captured graph per rank (dispatch, then
// combine), replayed with fresh inputs and live counts under a random mask set on both ranks
// between replays (never empty: a rank alone, the other alone, both), with no recapture. Every
// replay is checked against the reference of the inputs the mask leaves (a rank outside the mask
// is sent nothing; a rank outside its own mask receives nothing and its combine writes zeros), so
// a mask change that left a counter or a parity behind would show as wrong rows or a timeout; and
// each rank's MoeStatus.maskedEntries equals the entries the masks removed, per destination.
// GRAPHEP_MASK_REPLAYS sets the replays (default 60). H is 512: the mask is what is tested, and the
// host's reference and checks, not the GPU, set the time of a replay (about 4x faster than H 2048).
// `combineWeights`: the combine takes its own top-k weights (DeepEP's low-latency combine does),
// whose per-source waits the mask must skip too.
void runActiveRankMaskFlips(bool combineWeights) {
  Rig rig(latencyConfig(512, ReceiveLayout::kBatched));
  const DispatchOptions d;
  CombineOptions c;
  c.weighted = combineWeights;
  const RankGraphs graphs(rig, [&](int r, cudaStream_t s) {
    rig.enqueueDispatch(r, d, s);
    rig.enqueueCombine(r, c, s);
  });
  const long long replays = replaysFromEnv("GRAPHEP_MASK_REPLAYS", 60);
  std::mt19937_64 pick(4242);
  std::vector<std::vector<unsigned long long>> masked(kRanks, std::vector<unsigned long long>(kRanks, 0));
  std::uint64_t seed = 1000;
  long long wrong = 0;
  for (int i = 0; i < replays; ++i) {
    // Both ranks alone, then both together, then random; allRanksMask(2) = 3.
    const std::uint32_t mask = i < 3 ? static_cast<std::uint32_t>(i + 1) : static_cast<std::uint32_t>(1 + pick() % 3);
    const FreshStep f = freshStep(rig, seed, i, mask, &masked);
    for (int r = 0; r < kRanks; ++r) {
      rig.select(r);
      rig.engine(r).setActiveRanks(mask, rig.stream(r));
    }
    graphs.launch();
    rig.syncAll();
    const std::string what = "replay " + std::to_string(i) + ", mask " + std::to_string(mask) + ", " + stepName(i, f.in);
    const long long n = checkDispatch(rig, f.seen, f.refs, d, what) +
                        checkCombine(rig, f.seen, f.refs, f.y, combineWeights ? Weights::kCombine : Weights::kDispatch, what);
    EXPECT_EQ(n, 0) << what;
    wrong += n;
    if (wrong > 0) break;  // the first wrong replay is the one to read
  }
  for (int r = 0; r < kRanks; ++r) {
    const MoeStatus st = rig.engine(r).status();
    EXPECT_TRUE(st.ok()) << "rank " << r << ": " << st.describe();
    for (int q = 0; q < kRanks; ++q) {
      EXPECT_EQ(st.maskedEntries[at(q)], masked[at(r)][at(q)]) << "rank " << r << "'s entries for rank " << q;
    }
  }
}

TEST_F(Gpu2_MoeLatencyCapabilities, ActiveRankMaskFlips) { runActiveRankMaskFlips(false); }

TEST_F(Gpu2_MoeLatencyCapabilities, ActiveRankMaskFlipsCombineWeights) { runActiveRankMaskFlips(true); }

// Recovery (Engine::recover): after two good steps rank 1 stops (it enqueues nothing more, as a
// dead process would); rank 0's next dispatch times out naming it, the engine fails and refuses
// work by name; rank 0 recovers with the mask {0}, and its next replays (dispatch, combine) are
// exact for its own experts, with nothing from or for rank 1, and no recapture or new engine.
TEST_F(Gpu2_MoeLatencyCapabilities, RecoverAfterAPeerStops) {
  const ScopedEnv timeout("GRAPHEP_TIMEOUT_MS", "500");  // read at setup
  Rig rig(latencyConfig(2048, ReceiveLayout::kBatched));
  const DispatchOptions d;
  const CombineOptions c;
  std::uint64_t seed = 3000;
  std::vector<std::vector<unsigned long long>> masked(kRanks, std::vector<unsigned long long>(kRanks, 0));
  auto step = [&](int i, std::uint32_t ranks, bool check) {
    const FreshStep f = freshStep(rig, seed, i, ranks, &masked);
    for (int r = 0; r < kRanks; ++r) {
      if (((ranks >> r) & 1u) == 0) continue;
      rig.select(r);
      rig.enqueueDispatch(r, d, rig.stream(r));
      rig.enqueueCombine(r, c, rig.stream(r));
    }
    rig.syncAll();
    if (!check) return;
    const std::string what = "step " + std::to_string(i) + ", ranks " + std::to_string(ranks);
    EXPECT_EQ(checkDispatch(rig, f.seen, f.refs, d, what, ranks), 0);
    EXPECT_EQ(checkCombine(rig, f.seen, f.refs, f.y, Weights::kDispatch, what, ranks), 0);
  };
  step(0, 3u, true);
  step(1, 3u, true);
  step(2, 1u, false);  // rank 1 has stopped; rank 0 still runs every rank's protocol
  Engine& e = rig.engine(0);
  const MoeStatus st = e.status();
  EXPECT_NE(st.deviceError.find("peer 1"), std::string::npos) << st.deviceError;
  EXPECT_TRUE(e.failed());
  expectError([&] { rig.enqueueDispatch(0, d, rig.stream(0)); }, Status::kRemoteError, "peer 1");
  e.recover(1u, rig.stream(0));
  EXPECT_FALSE(e.failed());
  std::fill(masked[0].begin(), masked[0].end(), 0ull);  // recover cleared rank 0's status
  for (int i = 3; i < 23; ++i) step(i, 1u, true);
  const MoeStatus after = e.status();
  EXPECT_TRUE(after.ok()) << after.describe();
  for (int q = 0; q < kRanks; ++q) {
    EXPECT_EQ(after.maskedEntries[at(q)], masked[0][at(q)]) << "rank 0's entries for rank " << q << " after the recovery";
  }
  EXPECT_GT(masked[0][1], 0ull) << "no entry went to the stopped rank: the recovery's masking is untested";
}

// Bad masks are refused by name before anything is written, and the engine then works.
TEST_F(Gpu2_MoeLatencyCapabilities, ActiveRankMaskBadInput) {
  Rig rig(latencyConfig(2048, ReceiveLayout::kBatched));
  Engine& e = rig.engine(0);
  expectError([&] { e.setActiveRanks(0u, rig.stream(0)); }, Status::kInvalidArgument, "mask 0 leaves no rank");
  expectError([&] { e.setActiveRanks(4u, rig.stream(0)); }, Status::kInvalidArgument,
              "mask 0x4 names ranks past the last (world size 2)");
  expectError([&] { e.recover(2u, rig.stream(0)); }, Status::kInvalidArgument, "mask 0x2 leaves out rank 0 itself");
  ASSERT_NE(e.activeRanksDevice(), nullptr);
  const Inputs in = rig.newInputs(77, 0);
  const std::vector<RefLayout> refs = rig.reference(in);
  const auto y = rig.newExpertOutputs(78);
  rig.poisonDispatchOutputs();
  rig.poisonCombineOutputs();
  for (int r = 0; r < kRanks; ++r) {
    rig.select(r);
    rig.enqueueDispatch(r, DispatchOptions{}, rig.stream(r));
    rig.enqueueCombine(r, CombineOptions{}, rig.stream(r));
  }
  rig.syncAll();
  EXPECT_EQ(checkDispatch(rig, in, refs, DispatchOptions{}, "after the refused masks"), 0);
  EXPECT_EQ(checkCombine(rig, in, refs, y, Weights::kDispatch, "after the refused masks"), 0);
  expectStatusOk(rig, "after the refused masks");
}

// Bad arguments of the latency capabilities: named errors before anything is enqueued (the engine
// then works), and the latency-only ones refused by a throughput engine.
TEST_F(Gpu2_MoeLatencyCapabilities, BadInput) {
  Rig rig(latencyConfig(2048, ReceiveLayout::kBatched));
  const Inputs in = rig.newInputs(900, 0);
  Engine& e = rig.engine(0);
  const cudaStream_t s = rig.stream(0);
  DispatchArgs a = rig.dispatchArgs(0, DispatchOptions{});
  a.input = DispatchInput::kBf16;
  a.scaleFormat = Fp8Scales::kUe8m0;
  expectError([&] { e.dispatch(a, s); }, Status::kInvalidArgument, "scaleFormat=2 applies to an fp8 dispatch");
  a = rig.dispatchArgs(0, DispatchOptions{});
  a.half = static_cast<MoeHalf>(9);
  expectError([&] { e.dispatch(a, s); }, Status::kInvalidArgument, "half=9 is not a MoeHalf");
  CombineArgs ca = rig.combineArgs(0, CombineOptions{});
  ca.half = static_cast<MoeHalf>(9);
  expectError([&] { e.combine(ca, s); }, Status::kInvalidArgument, "half=9 is not a MoeHalf");

  rig.dispatchAll(DispatchOptions{});  // nothing was enqueued by the refused calls
  EXPECT_EQ(checkDispatch(rig, in, rig.reference(in), DispatchOptions{}, "after the refused calls"), 0);
  expectStatusOk(rig, "after the refused calls");

  MoeConfig throughput = latencyConfig(2048, ReceiveLayout::kBatched);
  throughput.path = MoePath::kThroughput;
  Rig other(throughput);
  Engine& t = other.engine(0);
  const cudaStream_t ts = other.stream(0);
  ca = other.combineArgs(0, CombineOptions{true, MoeHalf::kWhole});
  expectError([&] { t.combine(ca, ts); }, Status::kNotSupported, "combine topkWeights applies to the latency path");
  ca = other.combineArgs(0, CombineOptions{false, MoeHalf::kSend});
  expectError([&] { t.combine(ca, ts); }, Status::kNotSupported, "combine half=kSend applies to the latency path");
  a = other.dispatchArgs(0, DispatchOptions{});
  a.half = MoeHalf::kSend;
  expectError([&] { t.dispatch(a, ts); }, Status::kNotSupported, "half=kSend applies to the latency path");
  expectError([&] { t.receive(ts); }, Status::kInvalidArgument, "no send half");
}

}  // namespace
}  // namespace graphep::test
