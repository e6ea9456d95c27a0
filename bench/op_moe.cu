// moe: Engine dispatch and combine, graph-replayed, for -b .. -e tokens per rank (the size column
// is tokens here), --hidden, --experts, --topk, --dtype bf16|fp8|both. Routing is uniform (K
// distinct experts per token) and regenerated per size; the count exchange runs inside every
// operation (nothing cached).
//   dispatch   Engine::dispatch alone
//   combine    (dispatch + combine) - dispatch, from two graphs timed the same way
// algbw = logical bandwidth: all received token bytes, the rank's own included (DeepEP's figure:
// one row per (token, destination rank); bf16 H * 2 bytes, fp8 H + H / 128 * 4), / time.
// busbw = NVLink bandwidth: the bytes of the records that crossed to other ranks (payload and
// metadata) / time. Both are rank averages. #wrong: ranks whose expert counts differ from the
// host's or whose status reports a drop.
//   baseline   NCCL's all-to-all-v (grouped ncclSend/ncclRecv, nccl-tests' alltoall, in a graph)
//              moving the operation's payload: rank s sends rank d one row per (token of s,
//              destination d) of the dispatch's row bytes (its own share included), and combine
//              the same counts of bf16 rows back; exact counts known on the host, so no count
//              exchange. Printed where every rank has an NCCL communicator (a GPU of its own, or
//              mpirun).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <graphep/graph.hpp>
#include <graphep/moe.hpp>

#include "bench/harness.hpp"
#include "engine/error.hpp"
#include "kernels/moe/moe.h"

namespace graphep::bench {

namespace {

// Uniform top-K routing of every rank (every process builds all ranks' routing, so the expected
// counts are known everywhere).
std::vector<std::vector<std::int32_t>> routing(int R, int T, int E, int K, std::uint64_t seed) {
  std::vector<std::vector<std::int32_t>> all(static_cast<std::size_t>(R));
  for (int q = 0; q < R; ++q) {
    std::mt19937_64 rng(seed + static_cast<std::uint64_t>(q) * 7919u);
    auto& idx = all[static_cast<std::size_t>(q)];
    idx.resize(static_cast<std::size_t>(T) * K);
    std::vector<std::int32_t> pool(static_cast<std::size_t>(E));
    for (int e = 0; e < E; ++e) pool[static_cast<std::size_t>(e)] = e;
    for (int t = 0; t < T; ++t) {
      for (int k = 0; k < K; ++k) {  // partial Fisher-Yates: K distinct experts
        const std::size_t j = static_cast<std::size_t>(k) + rng() % static_cast<std::size_t>(E - k);
        std::swap(pool[static_cast<std::size_t>(k)], pool[j]);
        idx[static_cast<std::size_t>(t) * K + k] = pool[static_cast<std::size_t>(k)];
      }
    }
  }
  return all;
}

// --profile: one eager dispatch + combine at a time, five times, and the median span of every
// engine kernel on this process's first rank (microseconds from the first kernel's start; the
// gaps between kernels hold the launches and the movers' exchanges).
template <class Dispatch, class Combine>
void printTimeline(Ranks& r, std::vector<std::unique_ptr<Engine>>& engines, Dispatch dispatch,
                   Combine combine, std::size_t tokens, bool fp8) {
  constexpr int kRuns = 5;
  std::vector<std::vector<MoeKernelSpan>> runs;
  for (int run = 0; run < kRuns; ++run) {
    for (auto& e : engines) e->resetTimeline();
    r.comm->barrier();
    for (int i = 0; i < r.numLocal(); ++i) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[static_cast<std::size_t>(i)]));
      dispatch(i, r.streams[static_cast<std::size_t>(i)]);
      combine(i, r.streams[static_cast<std::size_t>(i)]);
    }
    runs.push_back(engines[0]->timeline());
    for (int i = 1; i < r.numLocal(); ++i) engines[static_cast<std::size_t>(i)]->timeline();  // sync
    r.comm->barrier();
  }
  if (!isPrinter() || runs.empty()) return;
  std::printf("# timeline %zu tokens %s (rank 0, eager, median of %d; us from the first kernel):",
              tokens, fp8 ? "fp8" : "bf16", kRuns);
  for (std::size_t k = 0; k < runs[0].size(); ++k) {
    std::vector<double> start, end;
    for (const auto& run : runs) {
      if (k < run.size()) {
        start.push_back(run[k].startUs);
        end.push_back(run[k].endUs);
      }
    }
    std::sort(start.begin(), start.end());
    std::sort(end.begin(), end.end());
    std::printf(" %s %.1f-%.1f;", runs[0][k].kernel, start[start.size() / 2], end[end.size() / 2]);
  }
  std::printf("\n");
}

// --profile on the latency path: each local rank's step trace of the graph replays just timed
// (Engine::stepTrace), medians over its last operations of each kind, in us: the kernel boundary
// (the previous operation's last CTA to this one's first send CTA in, and its wait for the stream's
// last kernel), then each later event after that wait. The GPUs' timers are not synchronised, so
// no rank's events are set against another's.
void printStepTrace(Ranks& r, std::vector<std::unique_ptr<Engine>>& engines, std::size_t tokens, bool fp8) {
  std::vector<std::vector<MoeStepTrace>> all;
  for (auto& e : engines) all.push_back(e->stepTrace());
  if (!isPrinter()) return;
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? -1.0 : v[v.size() / 2];
  };
  auto us = [](unsigned long long to, unsigned long long from) {
    return (static_cast<double>(to) - static_cast<double>(from)) / 1e3;
  };
  constexpr int kEvents = static_cast<int>(MoeTraceEvent::kCount), kFirstAfter = static_cast<int>(MoeTraceEvent::kPosted);
  static const char* const names[kEvents] = {"enter", "ready", "posted", "sent", "layout", "arrived", "received", "done",
                                             "own arrived (first CTA)", "own done (first CTA)", "arrived (first CTA)"};
  for (std::size_t i = 0; i < all.size(); ++i) {
    for (int op = 0; op < 2; ++op) {
      std::vector<double> after[kEvents], boundary, wait;
      for (std::size_t k = 1; k < all[i].size(); ++k) {
        const MoeStepTrace& t = all[i][k];
        if (t.combine != (op == 1)) continue;
        const unsigned long long ready = t.at(MoeTraceEvent::kReady);
        boundary.push_back(us(t.at(MoeTraceEvent::kEnter), all[i][k - 1].at(MoeTraceEvent::kDone)));
        wait.push_back(us(ready, t.at(MoeTraceEvent::kEnter)));
        for (int e = kFirstAfter; e < kEvents; ++e) {
          if (t.ns[e] != 0) after[e].push_back(us(t.ns[e], ready));
        }
      }
      if (boundary.empty()) continue;
      std::printf("# trace %s %zu tokens %s, rank %d (graph replay, median of %zu, us): last CTA -> enter %.2f, "
                  "enter -> ready %.2f; after ready:",
                  op == 0 ? "dispatch" : "combine", tokens, fp8 ? "fp8" : "bf16", r.rank(static_cast<int>(i)),
                  boundary.size(), median(boundary), median(wait));
      for (int e = kFirstAfter; e < kEvents; ++e) {
        if (!after[e].empty()) std::printf(" %s %.2f;", names[e], median(after[e]));
      }
      std::printf("\n");
    }
  }
}

// --host-cost: the host's time to enqueue one dispatch + combine on every local rank, and the GPU
// time of that operation (rank 0's stream, events), eagerly (the engine's calls) and as one MoeGraph
// per rank (one cudaGraphLaunch each; the expert slot empty). Medians of o.iters operations after
// o.warmup.
template <class Args, class Dispatch, class Combine>
void printHostCost(const Options& o, Ranks& r, std::vector<std::unique_ptr<Engine>>& engines, Args argsOf,
                   Dispatch dispatch, Combine combine, const std::vector<void*>& out, std::size_t tokens, bool fp8) {
  const int L = r.numLocal();
  std::vector<std::unique_ptr<MoeGraph>> graphs;
  for (int i = 0; i < L; ++i) {
    const std::size_t li = static_cast<std::size_t>(i);
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[li]));
    cudaGraph_t none = nullptr;
    GRAPHEP_CUDA_CHECK(cudaGraphCreate(&none, 0));  // an empty expert slot
    MoeGraphArgs a;
    a.dispatch = argsOf(i);  // the eager path's buffers
    a.out = out[li];
    graphs.push_back(MoeGraph::withExpertGraph(*engines[li], a, none));
    GRAPHEP_CUDA_CHECK(cudaGraphDestroy(none));
  }
  auto measure = [&](auto enqueueAll) {
    std::vector<double> host, gpu;
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[0]));
    cudaEvent_t b = nullptr, e = nullptr;
    GRAPHEP_CUDA_CHECK(cudaEventCreate(&b));
    GRAPHEP_CUDA_CHECK(cudaEventCreate(&e));
    for (int it = 0; it < o.warmup + o.iters; ++it) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[0]));
      GRAPHEP_CUDA_CHECK(cudaEventRecord(b, r.streams[0]));
      const auto t0 = std::chrono::steady_clock::now();
      enqueueAll();
      const auto t1 = std::chrono::steady_clock::now();
      GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[0]));
      GRAPHEP_CUDA_CHECK(cudaEventRecord(e, r.streams[0]));
      for (int i = 0; i < L; ++i) {
        GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[static_cast<std::size_t>(i)]));
        GRAPHEP_CUDA_CHECK(cudaStreamSynchronize(r.streams[static_cast<std::size_t>(i)]));
      }
      r.comm->barrier();
      float ms = 0;
      GRAPHEP_CUDA_CHECK(cudaEventElapsedTime(&ms, b, e));
      if (it >= o.warmup) {
        host.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / L);
        gpu.push_back(ms * 1e3);
      }
    }
    cudaEventDestroy(b);
    cudaEventDestroy(e);
    std::sort(host.begin(), host.end());
    std::sort(gpu.begin(), gpu.end());
    return std::pair<double, double>(host[host.size() / 2], gpu[gpu.size() / 2]);
  };
  const auto eager = measure([&] {
    for (int i = 0; i < L; ++i) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[static_cast<std::size_t>(i)]));
      dispatch(i, r.streams[static_cast<std::size_t>(i)]);
      combine(i, r.streams[static_cast<std::size_t>(i)]);
    }
  });
  const auto graph = measure([&] {
    for (int i = 0; i < L; ++i) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[static_cast<std::size_t>(i)]));
      graphs[static_cast<std::size_t>(i)]->launch(r.streams[static_cast<std::size_t>(i)]);
    }
  });
  if (isPrinter()) {
    std::printf("# host cost %zu tokens %s (median of %d, one operation = dispatch + combine on every local rank): "
                "eager: host %.2f us per rank, GPU %.2f us; MoeGraph: host %.2f us per rank (one cudaGraphLaunch), "
                "GPU %.2f us\n",
                tokens, fp8 ? "fp8" : "bf16", o.iters, eager.first, eager.second, graph.first, graph.second);
  }
}

// NCCL's all-to-all-v of `rowBytes` rows, rows[s][d] from rank s to rank d (forward) or from d to s
// (reverse), in buffers of this function's (ncclAllToAllvUs; 0 without NCCL). The bytes are not
// checked (NCCL's own result is not graphep's to count).
double ncclRowsUs(const Options& o, Ranks& r, const std::vector<std::vector<long long>>& rows, std::size_t rowBytes,
                  bool reverse) {
  if (!r.hasNccl()) return 0;
  const int R = r.worldSize(), L = r.numLocal();
  auto count = [&](int from, int to) {
    const long long n = reverse ? rows[static_cast<std::size_t>(to)][static_cast<std::size_t>(from)]
                                : rows[static_cast<std::size_t>(from)][static_cast<std::size_t>(to)];
    return static_cast<std::size_t>(n) * rowBytes;
  };
  std::vector<char*> src(static_cast<std::size_t>(L)), dst(src.size());
  for (int i = 0; i < L; ++i) {
    std::size_t out = 0, in = 0;
    for (int q = 0; q < R; ++q) {
      out += count(r.rank(i), q);
      in += count(q, r.rank(i));
    }
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[static_cast<std::size_t>(i)]));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&src[static_cast<std::size_t>(i)], std::max<std::size_t>(out, 1)));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&dst[static_cast<std::size_t>(i)], std::max<std::size_t>(in, 1)));
    GRAPHEP_CUDA_CHECK(cudaMemset(src[static_cast<std::size_t>(i)], 0x3c, std::max<std::size_t>(out, 1)));
  }
  for (int i = 0; i < L; ++i) {  // the fills landed before NCCL's streams read them
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[static_cast<std::size_t>(i)]));
    GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
  }
  const double us = ncclAllToAllvUs(o, r, src, dst, count);
  freeEach(r, src, dst);
  return us;
}

// A stand-in for expert compute: `ctas` CTAs spin for `ns`; the first and last timer readings go to
// stamps[0] (min) and stamps[1] (max) unless stamps is null (--halves: the idle work between an
// operation's send and receive halves).
__global__ void busyExpert(unsigned long long ns, unsigned long long* stamps) {
  unsigned long long t0 = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  if (stamps != nullptr && threadIdx.x == 0) atomicMin(stamps, t0);
  unsigned long long t = t0;
  while (t - t0 < ns) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  if (stamps != nullptr && threadIdx.x == 0) atomicMax(stamps + 1, t);
}

// --microbatches US: two micro-batches, each its own engine (buffer set), with an expert of US
// microseconds on half the SMs. Sequential: A then B on one stream. In flight: B's dispatch starts
// when A's dispatch ends, on its own stream, so it runs during A's expert (and A's combine during
// B's expert). Prints both times and, from one eager run with the engines' timelines, how long B's
// dispatch ran while A's expert did (rank 0).
void runMicroBatches(const Options& o, Ranks& r, std::size_t tokens) {
  const int R = r.worldSize(), L = r.numLocal(), T = static_cast<int>(tokens);
  const int H = o.moeHidden, E = o.moeExperts, K = o.moeTopK;
  MoeConfig cfg;
  cfg.maxTokensPerRank = T;
  cfg.hidden = H;
  cfg.numExperts = E;
  cfg.topK = K;
  cfg.smBudget = o.sms;
  cfg.epilogueSms = o.epilogueSms;
  cfg.profile = true;
  auto engA = Engine::createAll(*r.comm, cfg);
  auto engB = Engine::createAll(*r.comm, cfg);
  const auto idx = routing(R, T, E, K, 777 + tokens);
  struct Buf {
    void *x, *ids, *w, *n, *out;
    cudaStream_t sb;
    cudaEvent_t dispatched, done;
    unsigned long long* stamps;  // [2] for A's expert, [2] for B's
  };
  std::vector<Buf> b(static_cast<std::size_t>(L));
  for (int i = 0; i < L; ++i) {
    Buf& q = b[static_cast<std::size_t>(i)];
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[static_cast<std::size_t>(i)]));
    cudaFuncAttributes attr{};
    GRAPHEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, busyExpert));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&q.x, static_cast<std::size_t>(T) * H * 2));
    GRAPHEP_CUDA_CHECK(cudaMemset(q.x, 0x3c, static_cast<std::size_t>(T) * H * 2));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&q.ids, static_cast<std::size_t>(T) * K * 4));
    const auto& mine = idx[static_cast<std::size_t>(r.rank(i))];
    GRAPHEP_CUDA_CHECK(cudaMemcpy(q.ids, mine.data(), mine.size() * 4, cudaMemcpyHostToDevice));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&q.w, static_cast<std::size_t>(T) * K * 4));
    std::vector<float> ws(mine.size(), 1.0f / static_cast<float>(K));
    GRAPHEP_CUDA_CHECK(cudaMemcpy(q.w, ws.data(), ws.size() * 4, cudaMemcpyHostToDevice));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&q.n, 4));
    GRAPHEP_CUDA_CHECK(cudaMemcpy(q.n, &T, 4, cudaMemcpyHostToDevice));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&q.out, static_cast<std::size_t>(T) * H * 2));
    GRAPHEP_CUDA_CHECK(cudaMalloc(&q.stamps, 4 * 8));
    GRAPHEP_CUDA_CHECK(cudaStreamCreateWithFlags(&q.sb, cudaStreamNonBlocking));
    GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());  // the inputs above landed before the non-blocking streams run
    GRAPHEP_CUDA_CHECK(cudaEventCreateWithFlags(&q.dispatched, cudaEventDisableTiming));
    GRAPHEP_CUDA_CHECK(cudaEventCreateWithFlags(&q.done, cudaEventDisableTiming));
  }
  int sms = 0;
  GRAPHEP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, r.devices[0]));
  const unsigned busyCtas = static_cast<unsigned>(std::max(1, sms / 2));
  const unsigned long long busyNs = static_cast<unsigned long long>(o.busyUs) * 1000ull;
  auto op = [&](std::vector<std::unique_ptr<Engine>>& eng, int i, cudaStream_t s, unsigned long long* stamps,
                bool combineToo) {
    Buf& q = b[static_cast<std::size_t>(i)];
    DispatchArgs a;
    a.x = q.x;
    a.topkIdx = q.ids;
    a.topkWeights = static_cast<const float*>(q.w);
    a.numTokens = static_cast<const int*>(q.n);
    eng[static_cast<std::size_t>(i)]->dispatch(a, s);
    if (&eng == &engA) GRAPHEP_CUDA_CHECK(cudaEventRecord(q.dispatched, s));
    busyExpert<<<busyCtas, 128, 0, s>>>(busyNs, stamps);
    if (combineToo) {
      CombineArgs c;
      c.out = q.out;
      eng[static_cast<std::size_t>(i)]->combine(c, s);
    }
  };
  auto sequential = [&] {
    for (int i = 0; i < L; ++i) {
      Buf& q = b[static_cast<std::size_t>(i)];
      GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[static_cast<std::size_t>(i)]));
      op(engA, i, r.streams[static_cast<std::size_t>(i)], q.stamps, true);
      op(engB, i, r.streams[static_cast<std::size_t>(i)], q.stamps + 2, true);
    }
  };
  auto inFlight = [&] {
    for (int i = 0; i < L; ++i) {
      Buf& q = b[static_cast<std::size_t>(i)];
      cudaStream_t sa = r.streams[static_cast<std::size_t>(i)];
      GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[static_cast<std::size_t>(i)]));
      op(engA, i, sa, q.stamps, true);
      GRAPHEP_CUDA_CHECK(cudaStreamWaitEvent(q.sb, q.dispatched, 0));  // B's dispatch after A's
      op(engB, i, q.sb, q.stamps + 2, true);
      GRAPHEP_CUDA_CHECK(cudaEventRecord(q.done, q.sb));
      GRAPHEP_CUDA_CHECK(cudaStreamWaitEvent(sa, q.done, 0));  // the iteration ends when both did
    }
  };
  auto timeIt = [&](auto enqueue) {
    std::vector<double> t;
    for (int it = 0; it < o.warmup + o.iters; ++it) {
      GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[0]));
      cudaEvent_t e0, e1;
      GRAPHEP_CUDA_CHECK(cudaEventCreate(&e0));
      GRAPHEP_CUDA_CHECK(cudaEventCreate(&e1));
      GRAPHEP_CUDA_CHECK(cudaEventRecord(e0, r.streams[0]));
      enqueue();
      GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[0]));
      GRAPHEP_CUDA_CHECK(cudaEventRecord(e1, r.streams[0]));
      for (int i = 0; i < L; ++i) {
        GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[static_cast<std::size_t>(i)]));
        GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
      }
      r.comm->barrier();
      float ms = 0;
      GRAPHEP_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (it >= o.warmup) t.push_back(ms * 1e3);
      cudaEventDestroy(e0);
      cudaEventDestroy(e1);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  const double seqUs = timeIt(sequential);
  const double flightUs = timeIt(inFlight);
  // One more in-flight run with fresh timelines: B's dispatch against A's expert on rank 0.
  for (auto& e : engA) e->resetTimeline();
  for (auto& e : engB) e->resetTimeline();
  for (int i = 0; i < L; ++i) {
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[static_cast<std::size_t>(i)]));
    const unsigned long long init[4] = {~0ull, 0ull, ~0ull, 0ull};
    GRAPHEP_CUDA_CHECK(cudaMemcpy(b[static_cast<std::size_t>(i)].stamps, init, sizeof(init), cudaMemcpyHostToDevice));
    GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());  // landed before the busy expert's stream stamps it
  }
  r.comm->barrier();
  inFlight();
  const std::vector<MoeKernelSpan> spansB = engB[0]->timeline();
  for (std::size_t i = 1; i < engB.size(); ++i) engB[i]->timeline();  // sync
  unsigned long long st[4];
  GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[0]));
  GRAPHEP_CUDA_CHECK(cudaMemcpy(st, b[0].stamps, sizeof(st), cudaMemcpyDeviceToHost));
  // B's dispatch: its kernels before its combine's.
  unsigned long long d0 = ~0ull, d1 = 0;
  for (const MoeKernelSpan& sp : spansB) {
    const std::string k = sp.kernel;
    if (k.find("combine") != std::string::npos) continue;
    d0 = std::min(d0, sp.startNs);
    d1 = std::max(d1, sp.endNs);
  }
  const double overlapUs = d1 > d0 ? static_cast<double>(std::max<long long>(
                                          0, static_cast<long long>(std::min(d1, st[1])) -
                                                 static_cast<long long>(std::max(d0, st[0])))) / 1e3
                                    : 0.0;
  if (isPrinter()) {
    std::printf("# microbatches %zu tokens (expert %d us on %u CTAs, rank 0): sequential A then B %.2f us; two in "
                "flight %.2f us (%.2fx); B's dispatch ran %.2f us [%.1f, %.1f] during A's expert [%.1f, %.1f] "
                "(us from A's expert start)\n",
                tokens, o.busyUs, busyCtas, seqUs, flightUs, seqUs / flightUs, overlapUs,
                (static_cast<double>(d0) - static_cast<double>(st[0])) / 1e3,
                (static_cast<double>(d1) - static_cast<double>(st[0])) / 1e3, 0.0,
                (static_cast<double>(st[1]) - static_cast<double>(st[0])) / 1e3);
  }
  for (int i = 0; i < L; ++i) {
    Buf& q = b[static_cast<std::size_t>(i)];
    GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[static_cast<std::size_t>(i)]));
    for (void* p : {q.x, q.ids, q.w, q.n, q.out, static_cast<void*>(q.stamps)}) cudaFree(p);
    cudaStreamDestroy(q.sb);
    cudaEventDestroy(q.dispatched);
    cudaEventDestroy(q.done);
  }
}

}  // namespace

std::vector<Row> runMoe(const Options& o, Ranks& r) {
  const int R = r.worldSize();
  const int H = o.moeHidden, E = o.moeExperts, K = o.moeTopK;
  std::vector<Row> rows;
  std::vector<bool> types;
  if (o.moeDtype != "fp8") types.push_back(false);
  if (o.moeDtype != "bf16") types.push_back(true);
  for (std::size_t tokens = o.minBytes; tokens <= o.maxBytes;
       tokens = std::max<std::size_t>(tokens + 1, static_cast<std::size_t>(tokens * o.factor))) {
    if (o.busyUs > 0) {
      runMicroBatches(o, r, tokens);
      continue;
    }
    const int T = static_cast<int>(tokens);
    const auto idx = routing(R, T, E, K, 424242 + tokens);
    const int L = E / R;
    // Expected per-destination records and per-expert rows of every rank.
    std::vector<std::vector<long long>> records(static_cast<std::size_t>(R), std::vector<long long>(static_cast<std::size_t>(R), 0));
    std::vector<std::vector<int>> expertRows(static_cast<std::size_t>(R), std::vector<int>(static_cast<std::size_t>(L), 0));
    for (int s = 0; s < R; ++s) {
      for (int t = 0; t < T; ++t) {
        std::vector<bool> hit(static_cast<std::size_t>(R), false);
        for (int k = 0; k < K; ++k) {
          const int e = idx[static_cast<std::size_t>(s)][static_cast<std::size_t>(t) * K + k];
          hit[static_cast<std::size_t>(e / L)] = true;
          ++expertRows[static_cast<std::size_t>(e / L)][static_cast<std::size_t>(e % L)];
        }
        for (int d = 0; d < R; ++d) records[static_cast<std::size_t>(s)][static_cast<std::size_t>(d)] += hit[static_cast<std::size_t>(d)] ? 1 : 0;
      }
    }
    long long allRecords = 0, remoteRecords = 0;
    for (int s = 0; s < R; ++s) {
      for (int d = 0; d < R; ++d) {
        allRecords += records[static_cast<std::size_t>(s)][static_cast<std::size_t>(d)];
        if (s != d) remoteRecords += records[static_cast<std::size_t>(s)][static_cast<std::size_t>(d)];
      }
    }
    for (bool fp8 : types) {
      progress(("moe " + std::to_string(T) + (fp8 ? " fp8" : " bf16")).c_str());
      MoeConfig cfg;
      cfg.maxTokensPerRank = T;
      cfg.hidden = H;
      cfg.numExperts = E;
      cfg.topK = K;
      cfg.dispatchType = fp8 ? DType::kFp8E4m3 : DType::kBf16;
      cfg.smBudget = o.sms;
      cfg.epilogueSms = o.epilogueSms;
      cfg.receiveLayout = o.moeLayout == "batched"      ? ReceiveLayout::kBatched
                          : o.moeLayout == "rank-major" ? ReceiveLayout::kRankMajor
                                                        : ReceiveLayout::kExpertMajor;
      cfg.profile = o.profile;
      cfg.path = o.moePath == "latency"      ? MoePath::kLatency
                 : o.moePath == "throughput" ? MoePath::kThroughput
                                             : MoePath::kAuto;
      auto engines = Engine::createAll(*r.comm, cfg);
      std::vector<void*> x(static_cast<std::size_t>(r.numLocal())), ids(x.size()), w(x.size()), n(x.size()), out(x.size());
      for (int i = 0; i < r.numLocal(); ++i) {
        const std::size_t li = static_cast<std::size_t>(i);
        GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[li]));
        GRAPHEP_CUDA_CHECK(cudaMalloc(&x[li], static_cast<std::size_t>(T) * H * 2));
        GRAPHEP_CUDA_CHECK(cudaMalloc(&ids[li], static_cast<std::size_t>(T) * K * 4));
        GRAPHEP_CUDA_CHECK(cudaMalloc(&w[li], static_cast<std::size_t>(T) * K * 4));
        GRAPHEP_CUDA_CHECK(cudaMalloc(&n[li], 4));
        GRAPHEP_CUDA_CHECK(cudaMalloc(&out[li], static_cast<std::size_t>(T) * H * 2));
        // Rows of small finite bf16 values (bit patterns 0x3c00-0x3fff: 2^-7 .. ~2).
        std::vector<std::uint16_t> xs(static_cast<std::size_t>(T) * H);
        std::mt19937 rng(static_cast<unsigned>(r.rank(i)) * 31u + 7u);
        for (auto& v : xs) v = static_cast<std::uint16_t>(0x3c00u + (rng() & 0x3ffu));
        GRAPHEP_CUDA_CHECK(cudaMemcpy(x[li], xs.data(), xs.size() * 2, cudaMemcpyHostToDevice));
        const auto& mine = idx[static_cast<std::size_t>(r.rank(i))];
        GRAPHEP_CUDA_CHECK(cudaMemcpy(ids[li], mine.data(), mine.size() * 4, cudaMemcpyHostToDevice));
        std::vector<float> ws(mine.size(), 1.0f / static_cast<float>(K));
        GRAPHEP_CUDA_CHECK(cudaMemcpy(w[li], ws.data(), ws.size() * 4, cudaMemcpyHostToDevice));
        GRAPHEP_CUDA_CHECK(cudaMemcpy(n[li], &T, 4, cudaMemcpyHostToDevice));
        GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());  // landed before the engine's (non-blocking) streams read it
      }
      auto argsOf = [&](int i) {
        const std::size_t li = static_cast<std::size_t>(i);
        DispatchArgs a;
        a.x = x[li];
        a.topkIdx = ids[li];
        // --combine-weights: the weights go with each combine (CombineArgs.topkWeights, as DeepEP's
        // low_latency_combine passes them), not with the dispatch.
        a.topkWeights = o.combineWeights ? nullptr : static_cast<const float*>(w[li]);
        a.numTokens = static_cast<const int*>(n[li]);
        return a;
      };
      // --halves: each operation as its send half, an idle kernel of halvesUs, then its receive half
      // (DeepEP's return_recv_hook with other work between); the rows subtract the idle time.
      const bool halves = o.halvesUs > 0;
      GRAPHEP_REQUIRE(!halves || engines[0]->path() == MoePath::kLatency, Status::kInvalidArgument,
                      "--halves %d: the engines are on the %s path; halves are the latency path's (--path latency)",
                      o.halvesUs, name(engines[0]->path()));
      GRAPHEP_REQUIRE(!o.combineWeights || (engines[0]->path() == MoePath::kLatency && o.moeLayout != "rank-major"),
                      Status::kInvalidArgument,
                      "--combine-weights: the engines are on the %s path with the %s layout; combine-time weights are "
                      "the latency path's, not rank-major's",
                      name(engines[0]->path()), o.moeLayout.c_str());
      auto split = [&](int i, cudaStream_t s) {
        busyExpert<<<1, 32, 0, s>>>(static_cast<unsigned long long>(o.halvesUs) * 1000ull, nullptr);
        GRAPHEP_CUDA_CHECK(cudaGetLastError());
        engines[static_cast<std::size_t>(i)]->receive(s);
      };
      auto dispatch = [&](int i, cudaStream_t s) {
        DispatchArgs a = argsOf(i);
        a.half = halves ? MoeHalf::kSend : MoeHalf::kWhole;
        engines[static_cast<std::size_t>(i)]->dispatch(a, s);
        if (halves) split(i, s);
      };
      auto combine = [&](int i, cudaStream_t s) {
        CombineArgs c;
        c.out = out[static_cast<std::size_t>(i)];
        c.half = halves ? MoeHalf::kSend : MoeHalf::kWhole;
        if (o.combineWeights) c.topkWeights = static_cast<const float*>(w[static_cast<std::size_t>(i)]);
        engines[static_cast<std::size_t>(i)]->combine(c, s);
        if (halves) split(i, s);
      };
      auto execs = captureOps(o, r, dispatch);
      const double dUs = timeOps(o, r, execs) - o.halvesUs;
      // Dispatch alone ran back to back (defined: each replaces the last): combine the last one, then
      // start the checked phase from a clean status.
      for (int i = 0; i < r.numLocal(); ++i) {
        GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[static_cast<std::size_t>(i)]));
        combine(i, r.streams[static_cast<std::size_t>(i)]);
      }
      for (auto& e : engines) e->clearStatus();
      execs = captureOps(o, r, [&](int i, cudaStream_t s) {
        dispatch(i, s);
        combine(i, s);
      });
      if (o.profile) {  // every phase's mean time per CTA over the graph replays of dispatch + combine
        for (auto& e : engines) e->resetTimeline();
      }
      const double dcUs = timeOps(o, r, execs) - 2.0 * o.halvesUs;
      if (o.profile) {
        const std::vector<MoeKernelSpan> spans = engines[0]->timeline();
        for (int i = 1; i < r.numLocal(); ++i) engines[static_cast<std::size_t>(i)]->timeline();  // sync
        if (isPrinter()) {
          std::printf("# phases %zu tokens %s (rank 0, graph replay, mean us per CTA, waits included):", tokens,
                      fp8 ? "fp8" : "bf16");
          for (const MoeKernelSpan& sp : spans) std::printf(" %s %.2f;", sp.kernel, sp.meanCtaUs);
          std::printf("\n");
        }
        printStepTrace(r, engines, tokens, fp8);
      }
      const double cUs = std::max(dcUs - dUs, 0.0);
      // Check: expert counts of the last dispatch and a clean status on every local rank.
      long long wrong = 0;
      for (int i = 0; i < r.numLocal(); ++i) {
        const std::size_t li = static_cast<std::size_t>(i);
        GRAPHEP_CUDA_CHECK(cudaSetDevice(r.devices[li]));
        GRAPHEP_CUDA_CHECK(cudaDeviceSynchronize());
        std::vector<int> counts(static_cast<std::size_t>(L));
        GRAPHEP_CUDA_CHECK(cudaMemcpy(counts.data(), engines[li]->layout().expertCounts, counts.size() * 4,
                                      cudaMemcpyDeviceToHost));
        if (counts != expertRows[static_cast<std::size_t>(r.rank(i))]) ++wrong;
        if (!engines[li]->status().ok()) ++wrong;
      }
      wrong = totalOverRanks(r, wrong);
      const double payload = fp8 ? H + H / 128.0 * 4 : H * 2.0;
      const std::uint64_t recBytes = (moePayloadBytes(H, fp8) + moeMetaBytes(K) + 15) / 16 * 16;
      const double logical = static_cast<double>(allRecords) / R * payload;
      const double nvlink = static_cast<double>(remoteRecords) / R * static_cast<double>(recBytes);
      const std::string heap = "heap " + std::to_string(engines[0]->symmetricHeapBytes() >> 20) + " MiB";
      auto bw = [](double bytes, double us) { return us > 0 ? bytes / (us * 1e3) : 0.0; };
      const std::string path = std::string(" ") + name(engines[0]->path()) +
                               (o.moeLayout == "expert-major" ? "" : " " + o.moeLayout) + (halves ? " halves" : "") +
                               (o.combineWeights ? " cw" : "");
      const double ncclDispatchUs = ncclRowsUs(o, r, records, static_cast<std::size_t>(payload), false);
      Row d{"moe", std::string("dispatch ") + (fp8 ? "fp8" : "bf16") + path, tokens, dUs, bw(logical, dUs),
            bw(nvlink, dUs), wrong, ncclDispatchUs, heap};
      printRow(d);
      rows.push_back(d);
      if (!fp8) {  // combine moves bf16 partials whatever the dispatch type
        const double cLogical = static_cast<double>(allRecords) / R * H * 2.0;
        const double cNvlink = static_cast<double>(remoteRecords) / R * H * 2.0;
        const double ncclCombineUs = ncclRowsUs(o, r, records, static_cast<std::size_t>(H) * 2, true);
        Row c{"moe", "combine bf16" + path, tokens, cUs, bw(cLogical, cUs), bw(cNvlink, cUs), wrong, ncclCombineUs,
              heap};
        printRow(c);
        rows.push_back(c);
      }
      if (o.profile) printTimeline(r, engines, dispatch, combine, tokens, fp8);
      if (o.hostCost) printHostCost(o, r, engines, argsOf, dispatch, combine, out, tokens, fp8);
      for (int i = 0; i < r.numLocal(); ++i) {
        const std::size_t li = static_cast<std::size_t>(i);
        cudaSetDevice(r.devices[li]);
        for (void* p : {x[li], ids[li], w[li], n[li], out[li]}) cudaFree(p);
      }
    }
  }
  return rows;
}

}  // namespace graphep::bench
