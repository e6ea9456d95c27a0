// The MoE case suites' harness (tests/common/moe/): random inputs, the host reference of the
// layout and the combine, the fixture that drives one engine per local rank with poisoned outputs,
// and the checks the suites share. Definitions in harness.cu.
#pragma once

#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>

#include "common/bf16.hpp"
#include "common/fp8_reference.hpp"
#include "common/graph_util.hpp"
#include "common/nccl_comms.hpp"
#include "common/moe_suite.hpp"
#include "engine/error.hpp"

namespace graphep::test::moe {

constexpr unsigned char kPoison = 0xff;      // payloads and outputs: 0xffff is a bf16 NaN
constexpr unsigned char kMetaPoison = 0x5a;  // metadata and layout words: 0x5a5a5a5a, not -1 or 0
constexpr std::uint32_t kMetaPoisonWord = 0x5a5a5a5au;

// The expert's output for the row of (source rank, token, top-k slot): exact in bf16.
__host__ __device__ inline float yValue(int s, int t, int k, int h) {
  const int n = (s * 131 + t * 31 + k * 7 + h * 3) % 61 - 30;
  return static_cast<float>(n) / 16.0f;
}

struct Inputs {
  int T = 0;                      // live count as passed (may exceed the maximum)
  std::vector<std::uint16_t> x;   // [T_max, H] bf16 bits
  std::vector<long long> idx;     // [T_max, K]
  std::vector<float> w;           // [T_max, K]
};

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

Inputs makeInputs(const MoeCase& c, int R, int rank, int T, std::uint64_t seed);

int liveCount(const MoeConfig& g, int T);
// The inputs as an operation under the active-rank `mask` sees them: the entries whose expert
// lives on a rank outside the mask become -1, and every valid entry of a rank outside it;
// masked[q][d] counts the live tokens' entries so removed (q's status counts them by destination d).
std::vector<Inputs> underMask(const MoeCase& c, const std::vector<Inputs>& all, std::uint32_t mask,
                              std::vector<std::vector<unsigned long long>>& masked);

// The batched layout's rows per expert as documented (MoeConfig.rowsPerExpert, 0: R x T_max); 0
// for expert-major.
long long batchedRows(const MoeConfig& g, int R);

RefLayout refLayout(const MoeCase& c, const std::vector<Inputs>& all, int r, long long cap);

unsigned long long invalidCount(const MoeConfig& g, const Inputs& in);

// The combine's bit-exact output for rank r's token t, value h: each destination's partial (fp32
// in slot order, bf16), summed in rank order (fp32, bf16 out). Node-aware (nodeSize ranks per
// emulated node, consecutive; 0: flat), a remote node's partials are first summed by its landing
// rank (the one whose index in that node is r's: fp32 in rank order, bf16) and that sum stands at
// the landing rank's place.
CombineRef combineRef(const MoeConfig& g, const Inputs& mine, const std::vector<RefLayout>& refs, int r, int t,
                      int h, float yScale, int nodeSize = 0);

// Ranks per emulated node where R ranks run the node-aware dispatch and combine
// (GRAPHEP_EMULATED_NODES of several ranks each, GRAPHEP_NODE_AWARE not off), else 0.
int nodeAwareSize(int R);

const char* routingName(Routing r);

// The receive layout in words (batched: with its rows per expert as configured, 0: the default).
std::string layoutName(const MoeConfig& g);

std::string describeCase(const MoeCase& c);

// Rank q's live count in run `run`: the case's counts rotate over the ranks, so ranks differ in a
// run (one may send nothing while its peers send).
int rankTokens(const MoeCase& c, int run, int q);

// The first invalid entry the device may have recorded: any invalid (token, slot) of the first
// dispatch that had one (which of them is a race between device threads).
bool isInvalidEntry(const MoeConfig& g, const Inputs& in, long long id, int token, int slot);

// The case in each receive layout, one after the other: as written (expert-major), batched, then
// rank-major. Alignment is the expert-major layout's, so a case that only tests it runs once; a
// capacity that overflows becomes 9 rows per expert (a batched expert overflows on its own) and
// the rank-major layout's full R x T_max rows (it cannot overflow). A case written in another
// layout runs as written only.
std::vector<MoeCase> inEveryLayout(const MoeCase& c);

// What a rank's layout views `v` say of their layout: its kind; batched, E_local x rowsPerExpert
// rows; rank-major, one row per (source token, this rank) and the source offsets.
void expectLayoutShape(const MoeCase& c, const DispatchLayout& v, int R);

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

// The small shape of the misuse, micro-batch, overflow and graph suites: H = 256, 4 experts per rank,
// top-2.
MoeCase smallCase(const Communicator& comm, int maxTokens, MoePath path);

// The stand-in experts, launched on `s`: y = yValue x scale for every documented row (rank-major:
// each row's slots' weighted sum), documented rows outside the capacity counted in *violations
// (and, with `guard`, skipped; the rank-major expert always skips them).
void launchFakeExpert(const DispatchLayout& v, void* y, float scale, int topK, unsigned long long* violations,
                      bool guard, cudaStream_t s);
// Loads the stand-in experts now: a lazy load at their first launch would wait for the device,
// where this rank's dispatch already spins on peers that this thread has not enqueued yet.
void preloadFakeExperts();

class MoeFixture {
 public:
  MoeFixture(Communicator& comm, const MoeCase& c) : comm_(comm), c_(c) {
    engines_ = Engine::createAll(comm, c.cfg);
    for (const auto& e : engines_) {
      layouts_.push_back(e->layout());
      paths_.push_back(e->path());  // kept for checks after dropEngines
    }
    const MoeConfig& g = c.cfg;
    const std::size_t Tm = static_cast<std::size_t>(g.maxTokensPerRank);
    for (int l = 0; l < comm.numLocalRanks(); ++l) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(comm.device(l)));
      // Load the test's kernel now: a lazy load at its first launch would wait for the device,
      // where this rank's dispatch already spins on peers that this thread has not enqueued yet.
      preloadFakeExperts();
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

  // Every rank's inputs of `tokens` live tokens from `seed` (each process builds them all, for the
  // references), this process's ranks prepared.
  std::vector<Inputs> prepareEvery(int tokens, std::uint64_t seed) {
    const int R = comm_.worldSize();
    std::vector<Inputs> in;
    for (int q = 0; q < R; ++q) in.push_back(makeInputs(c_, R, q, tokens, seed));
    for (int l = 0; l < L(); ++l) prepare(l, in[static_cast<std::size_t>(comm_.globalRank(l))]);
    return in;
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
    launchFakeExpert(v, y != nullptr ? y : v.expertOutput, scale, c_.cfg.topK, buf(l).violations, guard, s);
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
    // Node-aware sums on the throughput path over the movers only (the latency path's are flat).
    const int nodeSize = paths_[static_cast<std::size_t>(l)] == MoePath::kThroughput ? nodeAwareSize(comm_.worldSize()) : 0;
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
        const CombineRef ref = combineRef(g, mine, refs, r, t, h, yScale_, nodeSize);
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
  std::vector<MoePath> paths_;
  std::vector<DispatchLayout> layouts_;
  std::vector<RankBuffers> bufs_;
  float yScale_ = 1.0f;
  std::set<int> nonFinite_;
};

}  // namespace graphep::test::moe
