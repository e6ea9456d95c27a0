// The MoE case suites' harness (harness.cuh): the stand-in expert kernels and the reference.
#include "common/moe/harness.cuh"

#include "engine/env.hpp"

namespace graphep::test::moe {
namespace {

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

}  // namespace

void launchFakeExpert(const DispatchLayout& v, void* y, float scale, int topK, unsigned long long* violations,
                      bool guard, cudaStream_t s) {
  if (v.receiveLayout == ReceiveLayout::kRankMajor) {
    fakeRankMajorExpertKernel<<<64, 128, 0, s>>>(v, y, scale, topK, violations);
  } else {
    const dim3 grid(64, static_cast<unsigned>(v.numLocalExperts));
    fakeExpertKernel<<<grid, 128, 0, s>>>(v, y, scale, violations, guard);
  }
  GRAPHEP_CUDA_CHECK(cudaGetLastError());
}

void preloadFakeExperts() {
  cudaFuncAttributes attr{};
  GRAPHEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, fakeExpertKernel));
  GRAPHEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, fakeRankMajorExpertKernel));
}

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

std::vector<Inputs> underMask(const MoeCase& c, const std::vector<Inputs>& all, std::uint32_t mask,
                              std::vector<std::vector<unsigned long long>>& masked) {
  std::vector<Inputs> out = all;
  const int R = static_cast<int>(all.size()), K = c.cfg.topK, E = c.cfg.numExperts, L = E / R;
  for (int q = 0; q < R; ++q) {
    Inputs& in = out[static_cast<std::size_t>(q)];
    const int live = liveCount(c.cfg, in.T);
    for (std::size_t n = 0; n < in.idx.size(); ++n) {
      long long& e = in.idx[n];
      if (e < 0 || e >= E) continue;  // none, or invalid (counted as invalid, mask or not)
      const int d = static_cast<int>(e / L);
      if (((mask >> q) & 1u) != 0 && ((mask >> d) & 1u) != 0) continue;
      if (static_cast<int>(n) / K < live) ++masked[static_cast<std::size_t>(q)][static_cast<std::size_t>(d)];
      e = -1;
    }
  }
  return out;
}

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

int nodeAwareSize(int R) {
  const int nodes = static_cast<int>(env::kEmulatedNodes.get());
  return nodes > 1 && R / nodes > 1 && env::kNodeAware.get() != "off" ? R / nodes : 0;
}

CombineRef combineRef(const MoeConfig& g, const Inputs& mine, const std::vector<RefLayout>& refs, int r, int t,
                      int h, float yScale, int nodeSize) {
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
  auto bf16Of = [](float v) { return bf16Value(bf16Bits(v)); };
  for (int d = 0; d < R; ++d) {
    const bool remote = nodeSize > 0 && d / nodeSize != r / nodeSize;
    if (remote && d % nodeSize == r % nodeSize) {  // the landing rank: its node's partials, summed there
      float node = 0.f;
      bool any = false;
      for (int e = d / nodeSize * nodeSize; e < (d / nodeSize + 1) * nodeSize; ++e) {
        if (!goes[static_cast<std::size_t>(e)]) continue;
        node += bf16Of(partial[static_cast<std::size_t>(e)]);
        any = true;
      }
      if (any) home += bf16Of(node);
    }
    if (!goes[static_cast<std::size_t>(d)]) continue;
    if (!remote) home += bf16Of(partial[static_cast<std::size_t>(d)]);
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

std::string layoutName(const MoeConfig& g) {
  const std::string n = name(g.receiveLayout);
  return g.receiveLayout == ReceiveLayout::kBatched ? n + " rows/expert=" + std::to_string(g.rowsPerExpert) : n;
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
         " path=" + name(g.path);
}

int rankTokens(const MoeCase& c, int run, int q) {
  return c.tokens[static_cast<std::size_t>(run + q) % c.tokens.size()];
}

bool isInvalidEntry(const MoeConfig& g, const Inputs& in, long long id, int token, int slot) {
  const int T = liveCount(g, in.T);
  if (token < 0 || token >= T || slot < 0 || slot >= g.topK) return false;
  const long long e = in.idx[static_cast<std::size_t>(token) * g.topK + slot];
  return e == id && (e < -1 || e >= g.numExperts);
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

}  // namespace graphep::test::moe
