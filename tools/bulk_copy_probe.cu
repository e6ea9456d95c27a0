// graphep-bulk-probe: what one GPU's CTAs push into a peer GPU's memory with 16-byte vector stores
// (the engine's copy loop) against the Hopper bulk-copy engine (TMA: cp.async.bulk global ->
// shared, then shared -> the peer's global memory), at several CTA counts, both GPUs pushing at
// once as in a dispatch. The figures decide whether the direct dispatch's send should use bulk
// stores (docs/DESIGN.md §5.5). Every copy is checked byte for byte.
//
//   graphep-bulk-probe [MiB per GPU, default 256]
//
// Needs 2 GPUs with peer access (exit 77 otherwise). Prints one line per (method, CTAs):
//   bulk-probe method=vector ctas=24 GBps=...  wrong=0
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/common/copy.cuh"

namespace {

constexpr int kThreads = 512;
constexpr unsigned kChunk = 32u << 10;  // bytes per bulk copy
constexpr int kStages = 3;              // chunks in flight per CTA (3 x 32 KiB of shared memory)

#define CHECK(call)                                                                                     \
  do {                                                                                                  \
    const cudaError_t e_ = (call);                                                                      \
    if (e_ != cudaSuccess) {                                                                            \
      std::fprintf(stderr, "graphep-bulk-probe: %s: %s (line %d)\n", #call, cudaGetErrorString(e_), __LINE__); \
      std::exit(1);                                                                                     \
    }                                                                                                   \
  } while (0)

// CTA c copies an equal contiguous share with the engine's 16-byte copy loop.
__global__ void __launch_bounds__(kThreads) vectorPush(char* dst, const char* src, std::uint64_t bytes) {
  const std::uint64_t share = bytes / gridDim.x / 16 * 16, first = share * blockIdx.x;
  const std::uint64_t n = blockIdx.x + 1 == gridDim.x ? bytes - first : share;
  graphep::copyBytes<graphep::LoadKind::kDefault>(dst + first, src + first, n, static_cast<int>(threadIdx.x), kThreads);
}

__device__ __forceinline__ std::uint32_t smemAddr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// CTA c moves its share chunk by chunk: thread 0 loads a chunk into shared memory with one bulk
// copy (completion on the stage's mbarrier), waits for it, and stores it to the peer with one bulk
// copy; kStages chunks in flight, a stage reused once its store has read it.
__global__ void __launch_bounds__(32) bulkPush(char* dst, const char* src, std::uint64_t bytes) {
  extern __shared__ __align__(128) unsigned char stage[];
  __shared__ __align__(8) std::uint64_t full[kStages];
  if (threadIdx.x != 0) return;
  const std::uint64_t chunks = bytes / kChunk;
  const std::uint64_t per = (chunks + gridDim.x - 1) / gridDim.x;
  const std::uint64_t c0 = per * blockIdx.x, c1 = c0 + per < chunks ? c0 + per : chunks;
  for (int s = 0; s < kStages; ++s) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smemAddr(&full[s])) : "memory");
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  std::uint32_t phase[kStages] = {0, 0, 0};
  auto load = [&](std::uint64_t c, int s) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smemAddr(&full[s])), "r"(kChunk)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            smemAddr(stage + s * kChunk)),
        "l"(src + c * kChunk), "r"(kChunk), "r"(smemAddr(&full[s]))
        : "memory");
  };
  for (std::uint64_t c = c0; c < c1 && c < c0 + kStages; ++c) load(c, static_cast<int>(c - c0));
  for (std::uint64_t c = c0; c < c1; ++c) {
    const int s = static_cast<int>((c - c0) % kStages);
    std::uint32_t done = 0;
    while (!done) {
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(smemAddr(&full[s])), "r"(phase[s])
          : "memory");
    }
    phase[s] ^= 1u;
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + c * kChunk),
                 "r"(smemAddr(stage + s * kChunk)), "r"(kChunk)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (c + kStages < c1) {
      // The stage is reloaded once the store just issued has read it.
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      load(c + kStages, s);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // every store complete
}

__global__ void fill(unsigned* p, std::uint64_t words, unsigned seed) {
  for (std::uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < words; i += gridDim.x * blockDim.x) {
    p[i] = static_cast<unsigned>(i * 2654435761u) ^ seed;
  }
}

__global__ void countWrong(const unsigned* p, std::uint64_t words, unsigned seed, unsigned long long* wrong) {
  for (std::uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < words; i += gridDim.x * blockDim.x) {
    if (p[i] != (static_cast<unsigned>(i * 2654435761u) ^ seed)) atomicAdd(wrong, 1ull);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) {
    std::printf("SKIP: graphep-bulk-probe needs 2 GPUs, found %d\n", n);
    return 77;
  }
  int can01 = 0, can10 = 0;
  CHECK(cudaDeviceCanAccessPeer(&can01, 0, 1));
  CHECK(cudaDeviceCanAccessPeer(&can10, 1, 0));
  if (!can01 || !can10) {
    std::printf("SKIP: GPUs 0 and 1 have no peer access\n");
    return 77;
  }
  const std::uint64_t bytes = (argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 256) << 20;
  char *src[2], *dst[2];
  cudaStream_t stream[2];
  cudaEvent_t ev[2][2];
  unsigned long long* wrong[2];
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    CHECK(cudaDeviceEnablePeerAccess(1 - d, 0));
    CHECK(cudaMalloc(&src[d], bytes));
    CHECK(cudaMalloc(&dst[d], bytes));
    CHECK(cudaMalloc(&wrong[d], sizeof(unsigned long long)));
    CHECK(cudaStreamCreateWithFlags(&stream[d], cudaStreamNonBlocking));
    CHECK(cudaEventCreate(&ev[d][0]));
    CHECK(cudaEventCreate(&ev[d][1]));
    fill<<<264, 256>>>(reinterpret_cast<unsigned*>(src[d]), bytes / 4, 0x5eed0000u + d);
    CHECK(cudaFuncSetAttribute(bulkPush, cudaFuncAttributeMaxDynamicSharedMemorySize, kStages * kChunk));
    CHECK(cudaDeviceSynchronize());
  }
  for (const char* method : {"vector", "bulk"}) {
    for (int ctas : {1, 4, 8, 16, 24, 32, 64}) {
      for (int d = 0; d < 2; ++d) {  // each GPU pushes into the other's dst
        CHECK(cudaSetDevice(d));
        CHECK(cudaMemsetAsync(dst[1 - d], 0, bytes, stream[d]));
        CHECK(cudaMemsetAsync(wrong[d], 0, sizeof(unsigned long long), stream[d]));
      }
      for (int d = 0; d < 2; ++d) {
        CHECK(cudaSetDevice(d));
        CHECK(cudaStreamSynchronize(stream[d]));
      }
      for (int d = 0; d < 2; ++d) {
        CHECK(cudaSetDevice(d));
        CHECK(cudaEventRecord(ev[d][0], stream[d]));
        if (method[0] == 'v') {
          vectorPush<<<ctas, kThreads, 0, stream[d]>>>(dst[1 - d], src[d], bytes);
        } else {
          bulkPush<<<ctas, 32, kStages * kChunk, stream[d]>>>(dst[1 - d], src[d], bytes);
        }
        CHECK(cudaGetLastError());
        CHECK(cudaEventRecord(ev[d][1], stream[d]));
      }
      for (int d = 0; d < 2; ++d) {
        CHECK(cudaSetDevice(d));
        CHECK(cudaStreamSynchronize(stream[d]));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, ev[d][0], ev[d][1]));
        // The bytes GPU d pushed landed in GPU 1 - d's dst: checked there.
        CHECK(cudaSetDevice(1 - d));
        countWrong<<<264, 256>>>(reinterpret_cast<const unsigned*>(dst[1 - d]), bytes / 4, 0x5eed0000u + d, wrong[1 - d]);
        unsigned long long w = 0;
        CHECK(cudaMemcpy(&w, wrong[1 - d], sizeof(w), cudaMemcpyDeviceToHost));
        std::printf("bulk-probe gpu=%d method=%s ctas=%d GBps=%.1f wrong=%llu\n", d, method, ctas,
                    static_cast<double>(bytes) / (ms * 1e6), w);
      }
    }
  }
  return 0;
}
