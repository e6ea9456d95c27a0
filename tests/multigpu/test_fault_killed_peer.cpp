// A process killed mid-replay: two processes (this one forks before touching CUDA), one GPU each,
// bootstrapped over NCCL from a unique id passed through a pipe. Both build a MoeGraph and replay
// it, each replay with new inputs into poisoned outputs, every output checked. The expert slot
// holds a host node that stalls when asked to; for its last replay the child asks, so it is killed
// (SIGKILL) between its dispatch and its combine, with the replay in flight. The survivor's replay
// must end within the device timeout: it finds the error naming the dead peer, and the engine
// refuses new work. Then it recovers among the survivors (Engine::recover with the mask {0}, the
// same graph, nothing recaptured) and replays 1,000 times, each replay exact: the tokens' expert
// on rank 0 alone (expert 2 lived on the dead rank: nothing from it), and every entry routed to
// the dead rank counted in MoeStatus.maskedEntries. Then it tears down and exits 0. No mpirun:
// mpirun would take the whole job down with the dead process.
//
// Exit code 0: as described; 1: a check failed, or fewer than 2 GPUs where GRAPHEP_EXPECT_GPUS says
// there are 2 or more (common/gpu_env.hpp); 77: fewer than 2 GPUs otherwise (skipped).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <graphep/graphep.hpp>

#include "common/gpu_env.hpp"

namespace {

constexpr int kTokens = 32, kHidden = 256, kTopK = 2, kReplaysBeforeKill = 5, kReplaysAfterRecovery = 1000;
constexpr unsigned char kPoison = 0xff;  // 0xffff: a bf16 NaN, which no correct output is

// bf16 of a small integer (exact): the high half of its float.
unsigned short bf16(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return static_cast<unsigned short>(u >> 16);
}

// Read by the expert slot's host node: when set, the replay stalls there (after dispatch, before
// combine) long enough for the process to be killed inside it.
std::atomic<bool> gStallInExpert{false};

void CUDART_CB expertHostNode(void*) {
  if (gStallInExpert.load()) std::this_thread::sleep_for(std::chrono::seconds(30));
}

int fail(const char* who, const std::string& what) {
  std::fprintf(stderr, "%s: FAILED: %s\n", who, what.c_str());
  return 1;
}

// One rank's life: returns the process exit code (the child never returns from its last replay).
int run(int rank, const ncclUniqueId& id) {
  const char* who = rank == 0 ? "survivor" : "victim";
  try {
    auto comm = graphep::createNcclComm(id, 2, rank, rank);
    graphep::MoeConfig cfg;
    cfg.maxTokensPerRank = kTokens;
    cfg.hidden = kHidden;
    cfg.numExperts = 4;
    cfg.topK = kTopK;
    auto engine = graphep::Engine::create(*comm, cfg);
    // Inputs: every token to experts 0 and 2 (one on each rank), weights 1 and 1; x = i + 1 in
    // replay i (set before each replay).
    std::vector<unsigned short> x(static_cast<std::size_t>(kTokens) * kHidden);
    std::vector<int> ids(static_cast<std::size_t>(kTokens) * kTopK);
    std::vector<float> w(ids.size(), 1.0f);
    for (int t = 0; t < kTokens; ++t) {
      ids[static_cast<std::size_t>(t) * kTopK] = 0;
      ids[static_cast<std::size_t>(t) * kTopK + 1] = 2;
    }
    void *dx, *dids, *dw, *dn, *dout;
    cudaMalloc(&dx, x.size() * 2);
    cudaMalloc(&dids, ids.size() * 4);
    cudaMalloc(&dw, w.size() * 4);
    cudaMalloc(&dn, 4);
    cudaMalloc(&dout, x.size() * 2);
    cudaMemcpy(dids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(dw, w.data(), w.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(dn, &kTokens, 4, cudaMemcpyHostToDevice);
    cudaDeviceSynchronize();  // landed: the non-blocking stream below is not ordered after these copies
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    graphep::MoeGraphArgs args;
    args.dispatch.x = dx;
    args.dispatch.topkIdx = dids;
    args.dispatch.topkWeights = static_cast<const float*>(dw);
    args.dispatch.numTokens = static_cast<const int*>(dn);
    args.out = dout;
    // The identity expert: out[t] = (1 + 1) * x[t] = 2 (i + 1) everywhere; then the host node.
    auto graph = graphep::MoeGraph::capture(*engine, args, [](const graphep::DispatchLayout& v, cudaStream_t st) {
      cudaMemcpyAsync(v.expertOutput, v.recvX, static_cast<std::size_t>(v.capacity) * v.hidden * 2,
                      cudaMemcpyDeviceToDevice, st);
      cudaLaunchHostFunc(st, expertHostNode, nullptr);
    });
    // Every replay: new inputs, outputs poisoned (stream-ordered before the replay).
    auto prepare = [&](int i) {
      std::fill(x.begin(), x.end(), bf16(static_cast<float>(i + 1)));
      cudaMemcpyAsync(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice, s);
      cudaMemsetAsync(dout, kPoison, x.size() * 2, s);
    };
    std::vector<unsigned short> out(x.size());
    // Every output of the replay equal to `want`; the error names the first one that is not.
    auto check = [&](const std::string& replay, unsigned short want) -> std::string {
      if (cudaStreamSynchronize(s) != cudaSuccess) return replay + " failed";
      cudaMemcpy(out.data(), dout, out.size() * 2, cudaMemcpyDeviceToHost);
      long long wrong = 0, first = -1;
      for (std::size_t e = 0; e < out.size(); ++e) {
        if (out[e] != want && wrong++ == 0) first = static_cast<long long>(e);
      }
      if (wrong == 0) return {};
      char what[160];
      std::snprintf(what, sizeof(what), "%s: %lld of %zu outputs wrong (first [%lld] = 0x%04x, want 0x%04x)",
                    replay.c_str(), wrong, out.size(), first, out[static_cast<std::size_t>(first)], want);
      return what;
    };
    for (int i = 0; i < kReplaysBeforeKill; ++i) {
      prepare(i);
      graph->launch(s);
      const std::string bad = check("replay " + std::to_string(i), bf16(2.0f * static_cast<float>(i + 1)));
      if (!bad.empty()) return fail(who, bad);
    }
    if (rank == 1) {  // the victim: one more replay, killed inside its expert slot
      gStallInExpert.store(true);
      prepare(kReplaysBeforeKill);
      graph->launch(s);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // dispatch done, stalled
      ::kill(::getpid(), SIGKILL);
    }
    prepare(kReplaysBeforeKill);  // the outputs of this replay are not checked: it ends in an error
    const auto t0 = std::chrono::steady_clock::now();
    graph->launch(s);
    const cudaError_t e = cudaStreamSynchronize(s);  // bounded: every device wait is
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (e != cudaSuccess) return fail(who, std::string("the replay ended with a CUDA error: ") + cudaGetErrorString(e));
    const graphep::MoeStatus st = engine->status();
    std::printf("survivor: the replay ended after %.0f ms; status: %s\n", ms, st.describe().c_str());
    if (st.deviceError.find("peer 1") == std::string::npos) return fail(who, "the error does not name peer 1");
    if (!engine->failed()) return fail(who, "the engine is not in its failed state");
    try {
      engine->dispatch(args.dispatch, s);  // refused before anything is enqueued
      return fail(who, "a failed engine accepted a dispatch");
    } catch (const graphep::Error& err) {
      if (err.status() != graphep::Status::kRemoteError) return fail(who, err.what());
    }
    // Back to service without the dead rank: the same graph, replayed.
    engine->recover(1u, s);
    if (engine->failed()) return fail(who, "the engine is still failed after recover");
    for (int i = 0; i < kReplaysAfterRecovery; ++i) {
      const int v = i % 250 + 1;  // exact in bf16, and never the previous replay's
      std::fill(x.begin(), x.end(), bf16(static_cast<float>(v)));
      cudaMemcpyAsync(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice, s);
      cudaMemsetAsync(dout, kPoison, x.size() * 2, s);
      graph->launch(s);
      // Expert 0 (rank 0) alone, weight 1: out = x; expert 2 (the dead rank) adds nothing.
      const std::string bad = check("replay " + std::to_string(i) + " after recovery", bf16(static_cast<float>(v)));
      if (!bad.empty()) return fail(who, bad);
    }
    const graphep::MoeStatus after = engine->status();
    if (!after.ok()) return fail(who, "status after the replays: " + after.describe());
    const unsigned long long masked = static_cast<unsigned long long>(kTokens) * kReplaysAfterRecovery;
    if (after.maskedEntries[1] != masked || after.maskedEntries[0] != 0) {
      return fail(who, "maskedEntries " + std::to_string(after.maskedEntries[0]) + ", " +
                           std::to_string(after.maskedEntries[1]) + " (want 0, " + std::to_string(masked) + ")");
    }
    std::printf("survivor: recovered with the mask {0}: %d replays exact, %llu entries to the dead rank masked\n",
                kReplaysAfterRecovery, masked);
    graph.reset();
    cudaStreamDestroy(s);
    for (void* p : {dx, dids, dw, dn, dout}) cudaFree(p);
    engine.reset();  // must not wait on the dead peer
    std::printf("survivor: torn down after the peer died and the recovery: PASS\n");
    return 0;
  } catch (const graphep::Error& err) {
    return fail(who, err.what());
  }
}

}  // namespace

int main() {
  int fds[2];
  if (::pipe(fds) != 0) return 1;
  const pid_t child = ::fork();  // before any CUDA call in either process
  if (child < 0) return 1;
  if (child == 0) {
    ::close(fds[1]);
    ncclUniqueId id;
    if (::read(fds[0], &id, sizeof(id)) != static_cast<ssize_t>(sizeof(id))) ::_exit(77);  // parent skipped
    ::_exit(run(1, id));
  }
  ::close(fds[0]);
  const graphep::test::GpuRequirement req = graphep::test::gpuRequirement(2);
  if (req.verdict != graphep::test::GpuVerdict::kRun) {
    ::close(fds[1]);  // the child reads nothing and exits 77
    ::waitpid(child, nullptr, 0);
    if (req.verdict == graphep::test::GpuVerdict::kFail) return fail("killed-peer test", req.reason);
    std::printf("SKIP: the killed-peer test %s\n", req.reason.c_str());
    return 77;
  }
  ncclUniqueId id;
  if (ncclGetUniqueId(&id) != ncclSuccess || ::write(fds[1], &id, sizeof(id)) != static_cast<ssize_t>(sizeof(id))) {
    return 1;
  }
  ::close(fds[1]);
  const int rc = run(0, id);
  int status = 0;
  ::waitpid(child, &status, 0);
  if (!(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)) {
    std::fprintf(stderr, "the victim did not die by SIGKILL (status %d)\n", status);
    return 1;
  }
  return rc;
}
