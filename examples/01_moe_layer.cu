// 01_moe_layer: the main job. A real MoE layer on graphep, captured as one CUDA graph per rank and
// replayed in a decode loop:
//
//   tokens (generated on the GPU from a device step counter: new every step, no host work)
//   -> router scores (x . W_router) -> top-k + softmax weights, on the GPU
//   -> graphep dispatch (recv_x grouped by local expert)
//   -> SwiGLU expert MLP (y = (silu(x W_gate) * (x W_up)) W_down), whose kernels read the
//      per-expert counts and offsets from device memory
//   -> graphep combine (out[t] = sum_k w_k y_k)
//   -> step counter + 1
//
// Every --check-every steps the outputs of every rank are compared with an unsharded single-GPU
// reference of the same layer (all experts on GPU 0, the same device functions for the router, the
// top-k and the expert rows). Prints per-step latency percentiles. Runs on whatever GPUs are
// present: one rank per GPU, or two emulated ranks on one GPU. Exit code 0: every check passed;
// 1: a mismatch; 77: no GPU.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <graphep/graphep.hpp>

namespace {

using bf16 = __nv_bfloat16;

#define CUDA_OK(call)                                                                          \
  do {                                                                                         \
    const cudaError_t e_ = (call);                                                             \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

struct Options {
  int tokens = 64, hidden = 1024, ffn = 512, experts = 16, topk = 4, steps = 200, checkEvery = 50, ranks = 0;
  bool oneGpu = false;  // every rank on GPU 0 (emulated ranks), whatever the GPU count
};

constexpr int kRowTile = 16;   // expert kernels: rows per block
constexpr int kColTile = 64;   // columns per block
constexpr int kThreads = 256;  // (kRowTile / 4) row groups x kColTile columns

// ---- deterministic values --------------------------------------------------------------------

__host__ __device__ inline float hashUniform(std::uint64_t key) {  // in [-1, 1)
  key ^= key >> 33;
  key *= 0xff51afd7ed558ccdull;
  key ^= key >> 33;
  key *= 0xc4ceb9fe1a85ec53ull;
  key ^= key >> 33;
  return static_cast<float>(key >> 40) / static_cast<float>(1ull << 23) - 1.0f;
}
__host__ __device__ inline std::uint64_t key4(std::uint64_t a, std::uint64_t b, std::uint64_t c, std::uint64_t d) {
  return (((a * 1000003ull + b) * 1000033ull + c) * 1000037ull + d) * 0x9e3779b97f4a7c15ull;
}

enum Tensor : std::uint64_t { kRouter = 1, kGate = 2, kUp = 3, kDown = 4, kTokens = 5 };

// w[i] of tensor `t` for global expert e, scaled.
__global__ void fillWeights(bf16* w, std::uint64_t n, Tensor t, int firstExpert, std::uint64_t perExpert, float scale) {
  for (std::uint64_t i = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    const std::uint64_t e = firstExpert + i / perExpert;
    w[i] = __float2bfloat16_rn(scale * hashUniform(key4(t, e, i % perExpert, 0)));
  }
}

// Token t of rank r at step s.
__device__ inline bf16 tokenValue(std::uint32_t s, int r, int t, int h) {
  return __float2bfloat16_rn(hashUniform(key4(kTokens, s, static_cast<std::uint64_t>(r) * 65536 + t, h)));
}

// ---- the layer's device functions, shared by the graph's kernels and the reference ------------

// Router score of (token row x, expert e): sequential fp32 fma over h.
__device__ inline float routerScore(const bf16* x, const bf16* wr, int H, int E, int e) {
  float acc = 0.f;
  for (int h = 0; h < H; ++h) acc = __fmaf_rn(__bfloat162float(x[h]), __bfloat162float(wr[static_cast<std::size_t>(h) * E + e]), acc);
  return acc;
}

// Top-k of E scores (ties: the lower index) and softmax weights over the chosen k.
__device__ inline void topkSoftmax(const float* scores, int E, int K, int* ids, float* w) {
  float chosen[16];
  for (int k = 0; k < K; ++k) {
    int best = -1;
    for (int e = 0; e < E; ++e) {
      bool taken = false;
      for (int j = 0; j < k; ++j) taken |= ids[j] == e;
      if (!taken && (best < 0 || scores[e] > scores[best])) best = e;
    }
    ids[k] = best;
    chosen[k] = scores[best];
  }
  float sum = 0.f;
  for (int k = 0; k < K; ++k) sum += __expf(chosen[k] - chosen[0]);
  for (int k = 0; k < K; ++k) w[k] = __expf(chosen[k] - chosen[0]) / sum;
}

__device__ inline float silu(float v) { return v / (1.0f + __expf(-v)); }

// h[col] = silu(x . Wg[:, col]) * (x . Wu[:, col]), rounded to bf16 (sequential fp32 fma over h).
__device__ inline bf16 gateUp(const bf16* x, const bf16* wg, const bf16* wu, int H, int F, int col) {
  float g = 0.f, u = 0.f;
  for (int h = 0; h < H; ++h) {
    const float xv = __bfloat162float(x[h]);
    g = __fmaf_rn(xv, __bfloat162float(wg[static_cast<std::size_t>(h) * F + col]), g);
    u = __fmaf_rn(xv, __bfloat162float(wu[static_cast<std::size_t>(h) * F + col]), u);
  }
  return __float2bfloat16_rn(silu(g) * u);
}

// y[col] = h . Wd[:, col], rounded to bf16.
__device__ inline bf16 down(const bf16* hrow, const bf16* wd, int F, int H, int col) {
  float acc = 0.f;
  for (int f = 0; f < F; ++f) acc = __fmaf_rn(__bfloat162float(hrow[f]), __bfloat162float(wd[static_cast<std::size_t>(f) * H + col]), acc);
  return __float2bfloat16_rn(acc);
}

// ---- the graph's kernels ---------------------------------------------------------------------

__global__ void genTokens(bf16* x, int T, int H, int rank, const std::uint32_t* step) {
  const std::uint32_t s = *step;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < T * H; i += gridDim.x * blockDim.x) {
    x[i] = tokenValue(s, rank, i / H, i % H);
  }
}

// One thread per token: scores, top-k, weights.
__global__ void route(const bf16* x, const bf16* wr, int T, int H, int E, int K, float* scores, int* ids, float* w) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= T) return;
  float* sc = scores + static_cast<std::size_t>(t) * E;
  for (int e = 0; e < E; ++e) sc[e] = routerScore(x + static_cast<std::size_t>(t) * H, wr, H, E, e);
  topkSoftmax(sc, E, K, ids + static_cast<std::size_t>(t) * K, w + static_cast<std::size_t>(t) * K);
}

// Grid (local experts, F / kColTile, row tiles): rows of expert j come from the layout's device
// counts and offsets; tiles past the expert's count exit.
__global__ void __launch_bounds__(kThreads) expertGateUp(graphep::DispatchLayout v, const bf16* wg, const bf16* wu,
                                                         int F, bf16* hbuf) {
  extern __shared__ bf16 xs[];  // [kRowTile][H]
  const int j = blockIdx.x, H = v.hidden;
  const int count = v.expertCounts[j], first = v.expertOffsets[j];
  const int row0 = blockIdx.z * kRowTile;
  if (row0 >= count) return;
  const int rows = min(kRowTile, count - row0);
  const auto* recv = static_cast<const bf16*>(v.recvX);
  for (int i = threadIdx.x; i < rows * H; i += blockDim.x) {
    xs[i] = recv[static_cast<std::size_t>(first + row0 + i / H) * H + i % H];
  }
  __syncthreads();
  const int col = blockIdx.y * kColTile + threadIdx.x % kColTile;
  const std::size_t we = static_cast<std::size_t>(j) * H * F;
  for (int r = threadIdx.x / kColTile; r < rows; r += kThreads / kColTile) {
    hbuf[static_cast<std::size_t>(first + row0 + r) * F + col] = gateUp(xs + r * H, wg + we, wu + we, H, F, col);
  }
}

__global__ void __launch_bounds__(kThreads) expertDown(graphep::DispatchLayout v, const bf16* hbuf, const bf16* wd, int F) {
  const int j = blockIdx.x, H = v.hidden;
  const int count = v.expertCounts[j], first = v.expertOffsets[j];
  const int row0 = blockIdx.z * kRowTile;
  if (row0 >= count) return;
  const int rows = min(kRowTile, count - row0);
  const int col = blockIdx.y * kColTile + threadIdx.x % kColTile;
  auto* y = static_cast<bf16*>(v.expertOutput);
  const std::size_t we = static_cast<std::size_t>(j) * F * H;
  for (int r = threadIdx.x / kColTile; r < rows; r += kThreads / kColTile) {
    const std::size_t row = static_cast<std::size_t>(first + row0 + r);
    y[row * H + col] = down(hbuf + row * F, wd + we, F, H, col);
  }
}

__global__ void advance(std::uint32_t* step) { *step += 1; }

// ---- the reference: one block per (rank, token), every expert's weights on this GPU -----------

__global__ void reference(int R, int T, int H, int F, int E, int K, std::uint32_t s, const bf16* wr, const bf16* wg,
                          const bf16* wu, const bf16* wd, float* out, float* mag) {
  extern __shared__ float smem[];
  float* scores = smem;                                   // [E]
  bf16* x = reinterpret_cast<bf16*>(scores + E);           // [H]
  bf16* hrow = x + H;                                      // [F]
  __shared__ int ids[16];
  __shared__ float w[16];
  const int r = blockIdx.x / T, t = blockIdx.x % T;
  for (int h = threadIdx.x; h < H; h += blockDim.x) x[h] = tokenValue(s, r, t, h);
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) scores[e] = routerScore(x, wr, H, E, e);
  __syncthreads();
  if (threadIdx.x == 0) topkSoftmax(scores, E, K, ids, w);
  __syncthreads();
  float* o = out + static_cast<std::size_t>(blockIdx.x) * H;
  float* m = mag + static_cast<std::size_t>(blockIdx.x) * H;
  for (int h = threadIdx.x; h < H; h += blockDim.x) o[h] = m[h] = 0.f;
  for (int k = 0; k < K; ++k) {
    const std::size_t e = static_cast<std::size_t>(ids[k]);
    __syncthreads();
    for (int f = threadIdx.x; f < F; f += blockDim.x) hrow[f] = gateUp(x, wg + e * H * F, wu + e * H * F, H, F, f);
    __syncthreads();
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
      const float term = w[k] * __bfloat162float(down(hrow, wd + e * F * H, F, H, h));
      o[h] += term;
      m[h] += fabsf(term);
    }
  }
}

// ---- host ------------------------------------------------------------------------------------

unsigned gridFor(std::size_t n) { return static_cast<unsigned>(std::min<std::size_t>((n + 255) / 256, 4096)); }

struct Rank {
  int device = 0, rank = 0;
  std::unique_ptr<graphep::Engine> engine;
  std::unique_ptr<graphep::MoeGraph> graph;
  cudaStream_t stream = nullptr;
  bf16 *x = nullptr, *wr = nullptr, *wg = nullptr, *wu = nullptr, *wd = nullptr, *hbuf = nullptr, *out = nullptr;
  float *scores = nullptr, *w = nullptr;
  int *ids = nullptr, *numTokens = nullptr;
  std::uint32_t* step = nullptr;
  cudaGraphExec_t layer = nullptr;  // tokens -> router -> MoeGraph -> step + 1
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return std::atoi(argv[++i]);
    };
    if (a == "--tokens") o.tokens = value();
    else if (a == "--hidden") o.hidden = value();
    else if (a == "--ffn") o.ffn = value();
    else if (a == "--experts") o.experts = value();
    else if (a == "--topk") o.topk = value();
    else if (a == "--steps") o.steps = value();
    else if (a == "--check-every") o.checkEvery = value();
    else if (a == "--ranks") o.ranks = value();
    else if (a == "--one-gpu") o.oneGpu = true;
    else {
      std::printf("usage: %s [--tokens N] [--hidden H] [--ffn F] [--experts E] [--topk K] [--steps S] "
                  "[--check-every C] [--ranks R] [--one-gpu]\n", argv[0]);
      std::exit(a == "--help" ? 0 : 2);
    }
  }
  if (o.hidden % kColTile != 0 || o.ffn % kColTile != 0 || o.topk < 1 || o.topk > 16 || o.topk > o.experts ||
      o.tokens < 1 || o.steps < 1 || o.checkEvery < 1) {
    std::fprintf(stderr, "hidden and ffn must be multiples of %d, 1 <= topk <= min(16, experts), tokens/steps >= 1\n",
                 kColTile);
    std::exit(2);
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const char* why = nullptr;
  const int gpus = graphep::cudaDeviceCountOrZero(&why);
  if (gpus == 0) {
    std::printf("01_moe_layer: no GPU (%s): nothing to run\n", why != nullptr ? why : "none found");
    return 77;
  }
  const int R = o.ranks > 0 ? o.ranks : (gpus >= 2 && !o.oneGpu ? gpus : 2);
  if (o.experts % R != 0) {
    std::fprintf(stderr, "experts=%d is not divisible by %d ranks\n", o.experts, R);
    return 2;
  }
  std::vector<int> devices;
  for (int r = 0; r < R; ++r) devices.push_back(o.oneGpu ? 0 : (gpus >= R ? r : r % gpus));
  const int T = o.tokens, H = o.hidden, F = o.ffn, E = o.experts, K = o.topk, L = E / R;
  std::printf("01_moe_layer: %d ranks on %d GPU(s), %d tokens/rank, H=%d, FFN=%d, %d experts, top-%d, %d steps\n",
              R, o.oneGpu ? 1 : std::min(gpus, R), T, H, F, E, K, o.steps);
  try {
    auto comm = graphep::createLocalGroup(devices);
    graphep::MoeConfig cfg;
    cfg.maxTokensPerRank = T;
    cfg.hidden = H;
    cfg.numExperts = E;
    cfg.topK = K;
    auto engines = graphep::Engine::createAll(*comm, cfg);
    std::vector<Rank> ranks(static_cast<std::size_t>(R));
    const std::size_t smemX = static_cast<std::size_t>(kRowTile) * H * sizeof(bf16);
    for (int r = 0; r < R; ++r) {
      Rank& k = ranks[static_cast<std::size_t>(r)];
      k.device = devices[static_cast<std::size_t>(r)];
      k.rank = r;
      k.engine = std::move(engines[static_cast<std::size_t>(r)]);
      CUDA_OK(cudaSetDevice(k.device));
      CUDA_OK(cudaFuncSetAttribute(expertGateUp, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smemX)));
      CUDA_OK(cudaStreamCreateWithFlags(&k.stream, cudaStreamNonBlocking));
      const std::size_t cap = static_cast<std::size_t>(k.engine->layout().capacity);
      CUDA_OK(cudaMalloc(&k.x, static_cast<std::size_t>(T) * H * 2));
      CUDA_OK(cudaMalloc(&k.wr, static_cast<std::size_t>(H) * E * 2));
      CUDA_OK(cudaMalloc(&k.wg, static_cast<std::size_t>(L) * H * F * 2));
      CUDA_OK(cudaMalloc(&k.wu, static_cast<std::size_t>(L) * H * F * 2));
      CUDA_OK(cudaMalloc(&k.wd, static_cast<std::size_t>(L) * F * H * 2));
      CUDA_OK(cudaMalloc(&k.hbuf, cap * F * 2));
      CUDA_OK(cudaMalloc(&k.out, static_cast<std::size_t>(T) * H * 2));
      CUDA_OK(cudaMalloc(&k.scores, static_cast<std::size_t>(T) * E * 4));
      CUDA_OK(cudaMalloc(&k.w, static_cast<std::size_t>(T) * K * 4));
      CUDA_OK(cudaMalloc(&k.ids, static_cast<std::size_t>(T) * K * 4));
      CUDA_OK(cudaMalloc(&k.numTokens, 4));
      CUDA_OK(cudaMalloc(&k.step, 4));
      CUDA_OK(cudaMemcpy(k.numTokens, &T, 4, cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemset(k.step, 0, 4));
      const float sh = 1.0f / std::sqrt(static_cast<float>(H)), sf = 1.0f / std::sqrt(static_cast<float>(F));
      fillWeights<<<gridFor(static_cast<std::size_t>(H) * E), 256>>>(k.wr, static_cast<std::uint64_t>(H) * E, kRouter, 0,
                                                                     static_cast<std::uint64_t>(H) * E, 4 * sh);
      const std::uint64_t hf = static_cast<std::uint64_t>(H) * F;
      fillWeights<<<gridFor(L * hf), 256>>>(k.wg, L * hf, kGate, r * L, hf, sh);
      fillWeights<<<gridFor(L * hf), 256>>>(k.wu, L * hf, kUp, r * L, hf, sh);
      fillWeights<<<gridFor(L * hf), 256>>>(k.wd, L * hf, kDown, r * L, hf, sf);
      CUDA_OK(cudaGetLastError());
      CUDA_OK(cudaDeviceSynchronize());
      // Load every kernel the graph runs now (a lazy load inside the first replay would wait for
      // the device while this rank's dispatch spins on ranks not launched yet).
      cudaFuncAttributes attr{};
      for (const void* f : {reinterpret_cast<const void*>(genTokens), reinterpret_cast<const void*>(route),
                            reinterpret_cast<const void*>(expertGateUp), reinterpret_cast<const void*>(expertDown),
                            reinterpret_cast<const void*>(advance)}) {
        CUDA_OK(cudaFuncGetAttributes(&attr, f));
      }
      // The layer graph: tokens -> router -> [MoeGraph: dispatch -> experts -> combine] -> step + 1.
      graphep::MoeGraphArgs args;
      args.dispatch.x = k.x;
      args.dispatch.topkIdx = k.ids;
      args.dispatch.indexType = graphep::IndexType::kInt32;
      args.dispatch.topkWeights = k.w;
      args.dispatch.numTokens = k.numTokens;
      args.out = k.out;
      k.graph = graphep::MoeGraph::capture(*k.engine, args, [&](const graphep::DispatchLayout& v, cudaStream_t s) {
        const dim3 tilesUp(static_cast<unsigned>(L), static_cast<unsigned>(F / kColTile),
                           static_cast<unsigned>((v.capacity + kRowTile - 1) / kRowTile));
        expertGateUp<<<tilesUp, kThreads, smemX, s>>>(v, k.wg, k.wu, F, k.hbuf);
        const dim3 tilesDown(static_cast<unsigned>(L), static_cast<unsigned>(H / kColTile), tilesUp.z);
        expertDown<<<tilesDown, kThreads, 0, s>>>(v, k.hbuf, k.wd, F);
      });
      cudaGraph_t layer = nullptr;
      CUDA_OK(cudaGraphCreate(&layer, 0));
      auto kernelNode = [&](void* func, dim3 grid, dim3 block, void** params, const cudaGraphNode_t* dep) {
        cudaKernelNodeParams kp{};
        kp.func = func;
        kp.gridDim = grid;
        kp.blockDim = block;
        kp.kernelParams = params;
        cudaGraphNode_t node = nullptr;
        CUDA_OK(cudaGraphAddKernelNode(&node, layer, dep, dep != nullptr ? 1 : 0, &kp));
        return node;
      };
      int Ti = T, Hi = H, Ei = E, Ki = K, ri = r;
      void* genArgs[] = {&k.x, &Ti, &Hi, &ri, &k.step};
      const cudaGraphNode_t gen = kernelNode(reinterpret_cast<void*>(genTokens),
                                             dim3(gridFor(static_cast<std::size_t>(T) * H)), dim3(256), genArgs, nullptr);
      void* routeArgs[] = {&k.x, &k.wr, &Ti, &Hi, &Ei, &Ki, &k.scores, &k.ids, &k.w};
      const cudaGraphNode_t rt = kernelNode(reinterpret_cast<void*>(route), dim3((T + 127) / 128), dim3(128), routeArgs, &gen);
      cudaGraphNode_t moe = nullptr;
      CUDA_OK(cudaGraphAddChildGraphNode(&moe, layer, &rt, 1, k.graph->graph()));
      void* advArgs[] = {&k.step};
      kernelNode(reinterpret_cast<void*>(advance), dim3(1), dim3(1), advArgs, &moe);
      CUDA_OK(cudaGraphInstantiate(&k.layer, layer, 0));
      CUDA_OK(cudaGraphDestroy(layer));
    }

    // The unsharded reference on GPU 0: every expert's weights, generated the same way.
    const int refDevice = devices[0];
    CUDA_OK(cudaSetDevice(refDevice));
    bf16 *rwr = nullptr, *rwg = nullptr, *rwu = nullptr, *rwd = nullptr;
    float *rout = nullptr, *rmag = nullptr;
    const std::uint64_t hf = static_cast<std::uint64_t>(H) * F;
    CUDA_OK(cudaMalloc(&rwr, static_cast<std::size_t>(H) * E * 2));
    CUDA_OK(cudaMalloc(&rwg, E * hf * 2));
    CUDA_OK(cudaMalloc(&rwu, E * hf * 2));
    CUDA_OK(cudaMalloc(&rwd, E * hf * 2));
    CUDA_OK(cudaMalloc(&rout, static_cast<std::size_t>(R) * T * H * 4));
    CUDA_OK(cudaMalloc(&rmag, static_cast<std::size_t>(R) * T * H * 4));
    {
      const float sh = 1.0f / std::sqrt(static_cast<float>(H)), sf = 1.0f / std::sqrt(static_cast<float>(F));
      fillWeights<<<gridFor(static_cast<std::size_t>(H) * E), 256>>>(rwr, static_cast<std::uint64_t>(H) * E, kRouter, 0,
                                                                     static_cast<std::uint64_t>(H) * E, 4 * sh);
      fillWeights<<<gridFor(E * hf), 256>>>(rwg, E * hf, kGate, 0, hf, sh);
      fillWeights<<<gridFor(E * hf), 256>>>(rwu, E * hf, kUp, 0, hf, sh);
      fillWeights<<<gridFor(E * hf), 256>>>(rwd, E * hf, kDown, 0, hf, sf);
      CUDA_OK(cudaGetLastError());
      CUDA_OK(cudaDeviceSynchronize());
    }
    const std::size_t refSmem = static_cast<std::size_t>(E) * 4 + static_cast<std::size_t>(H + F) * 2;
    CUDA_OK(cudaFuncSetAttribute(reference, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(refSmem)));
    long long checked = 0, wrong = 0;
    double worst = 0;  // largest |error| / (2^-7 x magnitude)
    auto check = [&](std::uint32_t s) {
      CUDA_OK(cudaSetDevice(refDevice));
      reference<<<static_cast<unsigned>(R * T), 256, refSmem>>>(R, T, H, F, E, K, s, rwr, rwg, rwu, rwd, rout, rmag);
      CUDA_OK(cudaGetLastError());
      std::vector<float> ro(static_cast<std::size_t>(R) * T * H), rm(ro.size());
      CUDA_OK(cudaMemcpy(ro.data(), rout, ro.size() * 4, cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(rm.data(), rmag, rm.size() * 4, cudaMemcpyDeviceToHost));
      std::vector<bf16> got(static_cast<std::size_t>(T) * H);
      for (const Rank& k : ranks) {
        CUDA_OK(cudaSetDevice(k.device));
        CUDA_OK(cudaMemcpy(got.data(), k.out, got.size() * 2, cudaMemcpyDeviceToHost));
        for (std::size_t i = 0; i < got.size(); ++i) {
          const std::size_t ri2 = static_cast<std::size_t>(k.rank) * T * H + i;
          const double g = static_cast<double>(__bfloat162float(got[i]));
          const double bound = rm[ri2] / 128.0 + 1e-6;  // two bf16 roundings: partials, then the sum
          const double err = std::fabs(g - ro[ri2]);
          worst = std::max(worst, err / bound);
          if (!(err <= bound)) {
            if (wrong < 5) {
              std::fprintf(stderr, "step %u rank %d out[%zu][%zu] = %f, reference %f\n", s, k.rank, i / H, i % H, g,
                           static_cast<double>(ro[ri2]));
            }
            ++wrong;
          }
          ++checked;
        }
      }
    };

    // The decode loop: one graph launch per rank per step, nothing else.
    CUDA_OK(cudaSetDevice(ranks[0].device));
    std::vector<cudaEvent_t> begin(static_cast<std::size_t>(o.steps)), end(begin.size());
    for (std::size_t i = 0; i < begin.size(); ++i) {
      CUDA_OK(cudaEventCreate(&begin[i]));
      CUDA_OK(cudaEventCreate(&end[i]));
    }
    int checks = 0;
    for (int s = 0; s < o.steps; ++s) {
      CUDA_OK(cudaSetDevice(ranks[0].device));
      CUDA_OK(cudaEventRecord(begin[static_cast<std::size_t>(s)], ranks[0].stream));
      for (const Rank& k : ranks) {
        CUDA_OK(cudaSetDevice(k.device));
        CUDA_OK(cudaGraphLaunch(k.layer, k.stream));
      }
      CUDA_OK(cudaSetDevice(ranks[0].device));
      CUDA_OK(cudaEventRecord(end[static_cast<std::size_t>(s)], ranks[0].stream));
      if ((s + 1) % o.checkEvery == 0 || s == o.steps - 1) {  // the harness's check, off the run path
        for (const Rank& k : ranks) {
          CUDA_OK(cudaSetDevice(k.device));
          CUDA_OK(cudaStreamSynchronize(k.stream));
        }
        check(static_cast<std::uint32_t>(s));
        ++checks;
      }
    }
    std::vector<double> us;
    for (std::size_t i = 0; i < begin.size(); ++i) {
      float ms = 0;
      CUDA_OK(cudaEventElapsedTime(&ms, begin[i], end[i]));
      us.push_back(ms * 1e3);
      cudaEventDestroy(begin[i]);
      cudaEventDestroy(end[i]);
    }
    std::sort(us.begin(), us.end());
    auto pct = [&](double p) { return us[std::min(us.size() - 1, static_cast<std::size_t>(p * static_cast<double>(us.size())))]; };
    std::printf("step latency (rank 0's stream, us): p50 %.1f  p90 %.1f  p99 %.1f  max %.1f  (%d steps, graph replay)\n",
                pct(0.5), pct(0.9), pct(0.99), us.back(), o.steps);
    bool ok = wrong == 0;
    for (const Rank& k : ranks) {
      const graphep::MoeStatus st = k.engine->status();
      if (!st.ok()) {
        std::fprintf(stderr, "rank %d: %s\n", k.rank, st.describe().c_str());
        ok = false;
      }
    }
    std::printf("checked %d steps against the unsharded reference: %lld values, %lld wrong, worst error %.2f of "
                "the bf16 bound\n", checks, checked, wrong, worst);
    for (Rank& k : ranks) {
      CUDA_OK(cudaSetDevice(k.device));
      cudaGraphExecDestroy(k.layer);
      for (void* p : {static_cast<void*>(k.x), static_cast<void*>(k.wr), static_cast<void*>(k.wg),
                      static_cast<void*>(k.wu), static_cast<void*>(k.wd), static_cast<void*>(k.hbuf),
                      static_cast<void*>(k.out), static_cast<void*>(k.scores), static_cast<void*>(k.w),
                      static_cast<void*>(k.ids), static_cast<void*>(k.numTokens), static_cast<void*>(k.step)}) {
        cudaFree(p);
      }
      cudaStreamDestroy(k.stream);
    }
    CUDA_OK(cudaSetDevice(refDevice));
    for (void* p : {static_cast<void*>(rwr), static_cast<void*>(rwg), static_cast<void*>(rwu), static_cast<void*>(rwd),
                    static_cast<void*>(rout), static_cast<void*>(rmag)}) {
      cudaFree(p);
    }
    std::printf("%s\n", ok ? "PASS" : "FAIL");
    return ok ? 0 : 1;
  } catch (const graphep::Error& e) {
    std::fprintf(stderr, "01_moe_layer: %s: %s\n", graphep::statusName(e.status()), e.what());
    return 1;
  }
}
