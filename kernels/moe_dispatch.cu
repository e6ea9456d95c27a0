// MoE dispatch layout kernel family (see kernels/moe.h): pack (records and count messages), offsets
// (expert offsets and per-source bases from the received count messages) and expand (records into
// recv_x grouped by local expert); launchers below.
#include "kernels/common/copy.cuh"
#include "kernels/common/hooks.cuh"
#include "kernels/common/moe.cuh"

namespace graphep {
namespace {

constexpr int kThreads = 128;  // pack / expand: one CTA per record
constexpr int kOffsetsThreads = 256;

__device__ __forceinline__ const MoeRecordHeader* recordHeader(const MoeParams& p, const char* rec) {
  return reinterpret_cast<const MoeRecordHeader*>(rec + p.payloadBytes);
}
__device__ __forceinline__ const MoeRecordSlot* recordSlots(const MoeParams& p, const char* rec) {
  return reinterpret_cast<const MoeRecordSlot*>(rec + p.payloadBytes + sizeof(MoeRecordHeader));
}

// Grid: maxTokens + 1 CTAs. CTA t < T writes token t's record for every rank it goes to; the last
// CTA writes the count messages and the movers' send counts (it runs whatever T is).
__global__ void __launch_bounds__(kThreads) moePackKernel(const __grid_constant__ MoeParams p) {
  const int tid = static_cast<int>(threadIdx.x);
  const std::uint64_t rowBytes = static_cast<std::uint64_t>(p.hidden) * 2;
  if (blockIdx.x == gridDim.x - 1) {
    for (int r = tid; r < p.numRanks; r += kThreads) {
      const std::uint64_t rows = p.rankCount[r];
      p.dispSendCounts[r] = rows * p.recBytes;
      p.combRecvCounts[r] = rows * rowBytes;
      auto* msg = reinterpret_cast<std::uint64_t*>(p.cntSend + static_cast<std::uint64_t>(r) * p.cntMsgBytes);
      msg[0] = rows;
      for (int j = 0; j < p.localExperts; ++j) msg[1 + j] = p.expertCount[r * p.localExperts + j];
    }
    return;
  }
  const int t = static_cast<int>(blockIdx.x);
  if (t >= *p.liveTokens) return;
  const char* row = static_cast<const char*>(p.x) + static_cast<std::uint64_t>(t) * rowBytes;
  for (int r = 0; r < p.numRanks; ++r) {
    const int i = p.tokRankIdx[static_cast<std::uint64_t>(t) * p.numRanks + r];
    if (i < 0) continue;
    char* rec = p.recSend + (static_cast<std::uint64_t>(r) * p.maxTokens + i) * p.recBytes;
    if (p.fp8) {
      // The produce hook: each aligned half-warp quantises one 128-value tile at a time.
      constexpr int kLanes = ProduceFp8E4m3::kThreads;
      const int tiles = p.hidden / static_cast<int>(kFp8TileValues);
      HookCtx ctx{r, blockIdx.x, 0, 0, tid % kLanes, row, nullptr};
      for (int tile = tid / kLanes; tile < tiles; tile += kThreads / kLanes) {
        ctx.tile = static_cast<std::uint64_t>(tile);
        ProduceFp8E4m3::emit(rec + static_cast<std::uint64_t>(tile) * kFp8TileWireBytes, ctx.lane,
                             ProduceFp8E4m3::produce(ctx));
      }
    } else {
      copyBytes<LoadKind::kDefault>(rec, row, rowBytes, tid, kThreads);
    }
    if (tid == 0) {
      auto* hdr = reinterpret_cast<MoeRecordHeader*>(rec + p.payloadBytes);
      auto* slots = reinterpret_cast<MoeRecordSlot*>(rec + p.payloadBytes + sizeof(MoeRecordHeader));
      int n = 0;
      for (int k = 0; k < p.topK; ++k) {
        const std::uint64_t e = static_cast<std::uint64_t>(t) * p.topK + k;
        const long long id = moeReadId(p, e);
        if (!moeValidId(p, id) || id / p.localExperts != r) continue;
        slots[n++] = MoeRecordSlot{static_cast<std::int32_t>(id % p.localExperts), p.entryIdx[e],
                                   p.topkWeights[e], k};
      }
      *hdr = MoeRecordHeader{t, n, {0, 0}};
    }
  }
}

// One CTA: from the received count messages, the rows per source (the movers' receive counts and
// the combine's send counts), expert counts and offsets (aligned), per-(source, expert) bases and
// the cumulative per-expert totals.
__global__ void __launch_bounds__(kOffsetsThreads) moeOffsetsKernel(const __grid_constant__ MoeParams p) {
  const int tid = static_cast<int>(threadIdx.x);
  const int L = p.localExperts;
  const std::uint64_t rowBytes = static_cast<std::uint64_t>(p.hidden) * 2;
  auto msg = [&](int s) {
    return reinterpret_cast<const std::uint64_t*>(p.cntRecv + static_cast<std::uint64_t>(s) * p.cntMsgBytes);
  };
  for (int s = tid; s < p.numRanks; s += kOffsetsThreads) {
    // A source sends at most maxTokens records (one per token); its count is trusted to that bound.
    std::uint64_t rows = msg(s)[0];
    if (rows > static_cast<std::uint64_t>(p.maxTokens)) rows = static_cast<std::uint64_t>(p.maxTokens);
    p.recvRows[s] = static_cast<std::int32_t>(rows);
    p.dispRecvCounts[s] = rows * p.recBytes;
    p.combSendCounts[s] = rows * rowBytes;
  }
  for (int j = tid; j < L; j += kOffsetsThreads) {
    std::uint64_t total = 0;
    for (int s = 0; s < p.numRanks; ++s) total += msg(s)[1 + j];
    p.expertCounts[j] = static_cast<std::int32_t>(total);
    p.expertTotals[j] += total;
  }
  __syncthreads();
  if (tid == 0) {
    long long off = 0, rows = 0;
    for (int j = 0; j < L; ++j) {
      p.expertOffsets[j] = static_cast<std::int32_t>(off);
      const long long c = p.expertCounts[j];
      rows += c;
      off += (c + p.alignment - 1) / p.alignment * p.alignment;
    }
    p.expertOffsets[L] = static_cast<std::int32_t>(off);
    *p.numRecvRows = static_cast<std::int32_t>(rows);
  }
  __syncthreads();
  for (int j = tid; j < L; j += kOffsetsThreads) {
    long long base = p.expertOffsets[j];
    for (int s = 0; s < p.numRanks; ++s) {
      p.srcBase[s * L + j] = static_cast<std::int32_t>(base);
      base += static_cast<long long>(msg(s)[1 + j]);
    }
  }
}

// Grid: R * maxTokens CTAs, one per (source, record); records past the source's count exit. Each
// slot of a record puts a copy of its row at srcBase[source][expert] + index (dropped and counted
// past the capacity).
__global__ void __launch_bounds__(kThreads) moeExpandKernel(const __grid_constant__ MoeParams p) {
  const int tid = static_cast<int>(threadIdx.x);
  const int s = static_cast<int>(blockIdx.x / static_cast<unsigned>(p.maxTokens));
  const int i = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.maxTokens));
  if (s >= p.numRanks || i >= p.recvRows[s]) return;
  const char* rec = p.recRecv + (static_cast<std::uint64_t>(s) * p.maxTokens + i) * p.recBytes;
  const MoeRecordHeader* hdr = recordHeader(p, rec);
  const MoeRecordSlot* slots = recordSlots(p, rec);
  const int nslots = hdr->nslots < p.topK ? hdr->nslots : p.topK;
  const std::uint64_t H = static_cast<std::uint64_t>(p.hidden);
  for (int sl = 0; sl < nslots; ++sl) {
    const MoeRecordSlot slot = slots[sl];
    if (slot.localExpert < 0 || slot.localExpert >= p.localExperts) continue;  // not from graphep
    const long long pos = static_cast<long long>(p.srcBase[s * p.localExperts + slot.localExpert]) + slot.index;
    if (pos < 0 || pos >= p.capacity) {
      if (tid == 0) moeReportDroppedRow(p, pos);
      continue;
    }
    const std::uint64_t row = static_cast<std::uint64_t>(pos);
    if (p.fp8) {
      // Unpack the wire tiles: 128 e4m3 bytes into recv_x, the scale into recv_scales.
      constexpr int kLanes = ProduceFp8E4m3::kThreads;
      const int tiles = p.hidden / static_cast<int>(kFp8TileValues);
      const int lane = tid % kLanes;
      for (int tile = tid / kLanes; tile < tiles; tile += kThreads / kLanes) {
        const Fp8WireRegs w = loadFp8Wire(rec + static_cast<std::uint64_t>(tile) * kFp8TileWireBytes, lane);
        *reinterpret_cast<uint2*>(p.recvX + row * H + static_cast<std::uint64_t>(tile) * kFp8TileValues + lane * 8) = w.q;
        if (lane == 0) p.recvScales[row * (H / kFp8TileValues) + tile] = w.scale;
      }
    } else {
      copyBytes<LoadKind::kDefault>(p.recvX + row * H * 2, rec, H * 2, tid, kThreads);
    }
    if (tid == 0) {
      p.rowSrcRank[row] = s;
      p.rowSrcToken[row] = hdr->token;
      p.rowTopkSlot[row] = slot.k;
      p.rowWeight[row] = slot.weight;
    }
  }
}

}  // namespace

cudaError_t launchMoePack(const MoeParams& p, cudaStream_t stream) {
  moePackKernel<<<static_cast<unsigned>(p.maxTokens) + 1, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launchMoeOffsets(const MoeParams& p, cudaStream_t stream) {
  moeOffsetsKernel<<<1, kOffsetsThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launchMoeExpand(const MoeParams& p, cudaStream_t stream) {
  const unsigned long long blocks = static_cast<unsigned long long>(p.numRanks) * p.maxTokens;
  if (blocks == 0 || blocks > 0x7fffffffull) return cudaErrorInvalidValue;
  moeExpandKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t preloadMoeDispatchKernels() {
  cudaFuncAttributes a{};
  for (const void* f : {reinterpret_cast<const void*>(moePackKernel),
                        reinterpret_cast<const void*>(moeOffsetsKernel),
                        reinterpret_cast<const void*>(moeExpandKernel)}) {
    const cudaError_t e = cudaFuncGetAttributes(&a, f);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace graphep
