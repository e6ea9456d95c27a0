// Calibrates compute-sanitizer racecheck on the shared-memory patterns that it reported in the
// latency MoE kernels (moe_latency.cu: lastBlock's `last`, the expand loop's `failed`,
// blockExclusiveScan's total). In each, warp 0 (or thread 0, after an atomic or a poll) writes a
// shared word, the CTA passes __syncthreads(), and every thread reads it: correct CUDA. Features,
// added one at a time, reproduce what else those kernels do, to find what the tool reacts to:
//   named   : the CTA's 128-thread groups also synchronise on named barriers (bar.sync 1+g, 128)
//   uneven  : with named, group g passes its barrier g + 1 times a round (as groups take
//             different numbers of records)
//   lowfirst: with uneven, group g passes it 4 - g times instead (group 0, thread 0's, the most)
//   spin    : thread 0 polls a global word for a while before it writes (as flagWait), the rest
//             of its warp already at the barrier; every thread fences at system scope first
//   scan    : the word is the last of a warp-0 scan's sums, read after a loop of uneven length
//   streams : 4 streams at once (as emulated ranks share one GPU)
//   reuse   : 8 launches of 2 CTAs per SM each, so CTAs replace finished ones on every SM
// Finding (CUDA 13.0, H200; docs/VALIDATION.md run 49): racecheck reports a RAW hazard across a
// __syncthreads() exactly when the writer's group has passed its named barrier more often than
// the reader's ("lowfirst", "uneven,scan"); equal counts ("named,scan"), polls, streams and CTA
// reuse report nothing, and every thread reads the right value in every variant.
// Usage: graphep-racecheck-probe FEATURE[,FEATURE...] | plain | all
//   (under compute-sanitizer --tool racecheck; exit 0 = every thread read its CTA's values)
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int kThreads = 512, kWarps = kThreads / 32, kRounds = 4;
enum Feature : unsigned { kNamed = 1, kUneven = 2, kSpin = 4, kScan = 8, kStreams = 16, kReuse = 32, kLowFirst = 64 };

__device__ unsigned long long globalNs() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void __launch_bounds__(kThreads) probe(unsigned features, unsigned* counter, int* out) {
  __shared__ bool last;
  __shared__ int groupWord[kThreads / 128];
  __shared__ int sums[kWarps];
  __shared__ int scratch[kThreads];
  const int tid = static_cast<int>(threadIdx.x), group = tid / 128, lane = tid & 31, warp = tid >> 5;
  int acc = 0;
  for (int round = 0; round < kRounds; ++round) {
    if (features & kNamed) {  // a group-private exchange on the group's named barrier
      const int passes = !(features & kUneven) ? 1 : features & kLowFirst ? kThreads / 128 - group : group + 1;
      for (int i = 0; i < passes; ++i) {
        asm volatile("bar.sync %0, %1;" ::"r"(1 + group), "r"(128) : "memory");
        if (tid % 128 == 0) groupWord[group] = round + group + i;
        asm volatile("bar.sync %0, %1;" ::"r"(1 + group), "r"(128) : "memory");
        if (groupWord[group] != round + group + i) acc += 1 << 20;  // a wrong read shows
      }
    }
    if (features & kSpin) __threadfence_system();
    __syncthreads();
    if (tid == 0) {
      if (features & kSpin) {  // a poll of varying length, as a peer's flag arrives late
        const unsigned long long until = globalNs() + 2000ull * (blockIdx.x % 7 + 1);
        while (globalNs() < until && atomicAdd(counter + 1, 0u) != 0xffffffffu) {
        }
      }
      last = atomicAdd(counter, 1u) % 2u == 0u;  // as lastBlock
    }
    __syncthreads();
    acc += last ? 1 : 2;
    __syncthreads();  // every thread has read it before thread 0 rewrites it
    if (features & kScan) {  // as blockExclusiveScan: warp 0 scans the warps' sums, all read the total
      if (lane == 31) sums[warp] = warp + round;
      __syncthreads();
      if (warp == 0) {
        int s = lane < kWarps ? sums[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
          const int y = __shfl_up_sync(0xffffffffu, s, o);
          if (lane >= o) s += y;
        }
        if (lane < kWarps) sums[lane] = s;
      }
      __syncthreads();
      for (int i = 0; i <= tid % 5; ++i) scratch[tid] = acc + i;  // uneven work before the read
      acc += sums[kWarps - 1] + (scratch[tid] < 0 ? 1 : 0);     // (acc >= 0: adds nothing)
      __syncthreads();
    }
  }
  out[blockIdx.x * kThreads + static_cast<int>(threadIdx.x)] = acc;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string arg = argc > 1 ? argv[1] : "plain";
  const struct { const char* name; unsigned bit; } names[] = {
      {"named", kNamed}, {"uneven", kUneven | kNamed}, {"spin", kSpin},
      {"scan", kScan},   {"streams", kStreams},        {"reuse", kReuse},
      {"lowfirst", kLowFirst | kUneven | kNamed}};
  unsigned features = 0;
  for (std::size_t b = 0; b <= arg.size();) {
    const std::size_t e = arg.find(',', b) == std::string::npos ? arg.size() : arg.find(',', b);
    const std::string f = arg.substr(b, e - b);
    bool known = f == "plain";
    if (f == "all") features = ~0u, known = true;
    for (const auto& n : names) {
      if (f == n.name) features |= n.bit, known = true;
    }
    if (!known) {
      std::fprintf(stderr, "unknown feature '%s' (plain, named, uneven, lowfirst, spin, scan, streams, reuse, all)\n", f.c_str());
      return 2;
    }
    b = e + 1;
  }
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int streams = features & kStreams ? 4 : 1, launches = features & kReuse ? 8 : 1;
  const int ctas = features & kReuse ? 2 * sms : 8;
  std::vector<unsigned*> counter(streams);
  std::vector<int*> out(streams);
  std::vector<cudaStream_t> s(streams);
  for (int i = 0; i < streams; ++i) {
    cudaMalloc(&counter[i], 2 * sizeof(unsigned));
    cudaMemset(counter[i], 0, 2 * sizeof(unsigned));
    cudaMalloc(&out[i], static_cast<std::size_t>(ctas) * kThreads * sizeof(int));
    cudaStreamCreateWithFlags(&s[i], cudaStreamNonBlocking);
  }
  for (int l = 0; l < launches; ++l) {
    for (int i = 0; i < streams; ++i) probe<<<ctas, kThreads, 0, s[i]>>>(features, counter[i], out[i]);
  }
  cudaError_t e = cudaDeviceSynchronize();
  if (e == cudaSuccess) e = cudaGetLastError();
  // Every thread saw its CTA's value of each word each round: the sum per CTA is uniform.
  long bad = 0;
  std::vector<int> h(static_cast<std::size_t>(ctas) * kThreads);
  for (int i = 0; i < streams && e == cudaSuccess; ++i) {
    cudaMemcpy(h.data(), out[i], h.size() * sizeof(int), cudaMemcpyDeviceToHost);
    for (int c = 0; c < ctas; ++c) {
      for (int t = 0; t < kThreads; ++t) bad += h[c * kThreads + t] != h[c * kThreads];
    }
  }
  std::printf("%s (features 0x%x): %s, %ld threads disagree with their CTA\n", arg.c_str(), features,
              cudaGetErrorString(e), bad);
  return e == cudaSuccess && bad == 0 ? 0 : 1;
}
