// Pipelined point-to-point roles shared by the data movers (sendrecv, alltoallv): one channel of
// one link, run by the warps of one role, which synchronise only among themselves (named barrier
// `barrierId`, never a CTA-wide barrier).
//
//   sender:   wait tail >= s + 1 - slots | put chunk s into slot s % slots | signal head = s + 1
//   receiver: wait head >= s + 1 | consume slot into dst | signal tail = s + 1
//   zero-copy sender:   wait ready >= s0 + 1 | put the whole range into the peer's dst |
//                       signal head = s0 + n
//   zero-copy receiver: signal ready = s0 + 1 | wait head >= s0 + n | signal tail = s0 + n
//   (a receiver that chooses where the bytes land, alltoallv, writes {offset, bytes} into the
//   sender's mailbox before ready; the sender checks the bytes against its own count)
// s counts chunks on this (peer, channel) across launches and lives in device memory; n >= 1 for
// zero-copy so every zero-copy launch has its own ready value. Both ends must derive the same n.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common/copy.cuh"
#include "kernels/common/hooks.cuh"
#include "kernels/common/pipe.h"
#include "kernels/common/sync_handle.h"
#include "kernels/common/transport.cuh"

namespace graphep {

__device__ __forceinline__ void roleBarrier(int id, int nthreads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(nthreads) : "memory");
}

// Phase clock of the optional staged-transfer profile (ProfileCounters in pipe.h): thread 0 of a
// role marks phase boundaries; add() flushes once per launch.
struct PhaseClock {
  unsigned long long* out;  // nullptr: profiling off (no timer reads)
  unsigned long long last = 0, ns[3] = {0, 0, 0};
  __device__ explicit PhaseClock(unsigned long long* o) : out(o) {
    if (out) last = ptx::globalTimerNs();
  }
  __device__ __forceinline__ void mark(int phase) {
    if (!out) return;
    const unsigned long long now = ptx::globalTimerNs();
    ns[phase] += now - last;
    last = now;
  }
  __device__ void flush(unsigned long long chunks) {
    if (!out) return;
    for (int i = 0; i < 3; ++i) atomicAdd(out + i, ns[i]);
    atomicAdd(out + 3, chunks);
  }
};

// The consume hook for one chunk (slot -> dst + off).
template <Consume kConsume>
__device__ __forceinline__ void consumeChunk(const RecvLink& l, const char* slot,
                                             std::uint64_t off, std::uint64_t len, int tid,
                                             int nthreads) {
  if constexpr (kConsume == Consume::kCopy) {
    copyBytes<LoadKind::kCacheGlobal>(l.dst + off, slot, len, tid, nthreads);
  } else if constexpr (kConsume == Consume::kAddF32) {
    reduceElems<float, false>(l.dst + off, slot, l.addend + off, len, tid, nthreads);
  } else if constexpr (kConsume == Consume::kAddBf16) {
    reduceElems<__nv_bfloat16, false>(l.dst + off, slot, l.addend + off, len, tid, nthreads);
  } else if constexpr (kConsume == Consume::kWeightedAddF32) {
    reduceElems<float, true>(l.dst + off, slot, l.addend + off, len, tid, nthreads, l.weights,
                             l.rowBytes, l.rowBase + off);
  } else {
    static_assert(kConsume == Consume::kWeightedAddBf16, "not a byte-format consume hook");
    reduceElems<__nv_bfloat16, true>(l.dst + off, slot, l.addend + off, len, tid, nthreads,
                                     l.weights, l.rowBytes, l.rowBase + off);
  }
}

// The staged protocol of one channel, shared by every wire format and both roles: n chunks from
// step l.step[c]; for chunk s the role waits until waitFlag reaches target(s), works on slot
// s % numSlots (every thread of the role takes part), and posts s + 1 to postFlag. Only the role's
// own warps synchronise (named barrier barrierId).
template <class Transport, class Slot, class Target, class Work>
__device__ void stagedLoop(const SyncHandle& sync, const PipeShape& shape, Slot* channelSlots,
                           const std::uint32_t* waitFlag, Target target, WaitSite site,
                           std::uint32_t* postFlag, std::int32_t peer, std::uint32_t* stepWord,
                           unsigned long long* profile, std::uint32_t n, int barrierId, int tid,
                           int nthreads, int* abortFlag, Work work) {
  const std::uint32_t step0 = *stepWord;
  PhaseClock clock(tid == 0 ? profile : nullptr);
  for (std::uint32_t k = 0; k < n; ++k) {
    const std::uint32_t s = step0 + k;
    if (tid == 0) *abortFlag = Transport::wait(sync, waitFlag, target(s), peer, site) ? 0 : 1;
    roleBarrier(barrierId, nthreads);
    if (*abortFlag) return;
    clock.mark(0);
    work(k, channelSlots + static_cast<std::uint64_t>(slotOf(s, shape.numSlots)) * shape.slotBytes);
    // Every thread's accesses to the slot precede the barrier; thread 0's fence + release (in
    // signal) publish them to the peer.
    roleBarrier(barrierId, nthreads);
    clock.mark(1);
    if (tid == 0) Transport::signal(postFlag, s + 1u);
    clock.mark(2);
  }
  clock.flush(n);
  if (tid == 0) *stepWord = step0 + n;
}

// Sender: fill(k, slot) writes chunk k into the peer's slot once the receiver consumed the chunk
// that used it numSlots steps before (tail), then posts head.
template <class Transport, class Fill>
__device__ void stagedSend(const SyncHandle& sync, const PipeShape& shape, const SendLink& l,
                           std::uint32_t c, std::uint32_t n, int barrierId, int tid, int nthreads,
                           int* abortFlag, Fill fill) {
  stagedLoop<Transport>(
      sync, shape, l.staging + static_cast<std::uint64_t>(c) * shape.numSlots * shape.slotBytes,
      l.tail + c, [&](std::uint32_t s) { return slotFreeTarget(s, shape.numSlots); },
      WaitSite::kMoverSlotFree, l.head + c, l.peer, l.step + c, l.profile, n, barrierId, tid,
      nthreads, abortFlag, fill);
}

// Receiver: drain(k, slot) consumes chunk k once the sender posted it (head), then posts tail.
template <class Transport, class Drain>
__device__ void stagedRecv(const SyncHandle& sync, const PipeShape& shape, const RecvLink& l,
                           std::uint32_t c, std::uint32_t n, int barrierId, int tid, int nthreads,
                           int* abortFlag, Drain drain) {
  stagedLoop<Transport>(
      sync, shape, l.staging + static_cast<std::uint64_t>(c) * shape.numSlots * shape.slotBytes,
      l.head + c, [](std::uint32_t s) { return s + 1u; }, WaitSite::kMoverData, l.tail + c,
      l.peer, l.step + c, l.profile, n, barrierId, tid, nthreads, abortFlag, drain);
}

// Sender role for channel c. `abortFlag` is a shared word owned by this role.
template <class Transport>
__device__ void pipeSend(const SyncHandle& sync, const PipeShape& shape, const SendLink& l,
                         std::uint32_t c, int barrierId, int tid, int nthreads, int* abortFlag) {
  std::uint64_t begin, end;
  channelRange(l.bytes, shape.numChannels, c, &begin, &end);
  const std::uint32_t step0 = l.step[c];
  if (l.direct != nullptr) {
    std::uint32_t n = zeroCopySteps(end - begin, shape.slotBytes);  // used by thread 0
    __shared__ char* dstShared;  // this role's destination (from the mailbox when there is one)
    if (tid == 0) {
      bool ok = Transport::wait(sync, l.ready + c, readyValue(step0), l.peer, WaitSite::kMoverReady);
      char* dst = l.direct + begin;
      if (ok && l.mailbox != nullptr) {
        // Written before the ready flag this thread just acquired.
        const volatile std::uint64_t* box = l.mailbox + 2u * c;
        const std::uint64_t off = box[0], len = box[1];
        if (len != end - begin) {
          reportDeviceError(sync.error, DeviceErrorKind::kCountMismatch, sync.rank, l.peer,
                            WaitSite::kZeroCopyExtent, static_cast<std::uint32_t>(len),
                            static_cast<std::uint32_t>(end - begin), 0, l.mailbox + 2u * c);
          // Send nothing, but signal the steps the receiver counts: it must not hang, and both
          // ends' steps stay in lockstep.
          dst = nullptr;
          n = zeroCopySteps(len, shape.slotBytes);
        } else {
          dst = l.direct + off;
        }
      }
      dstShared = dst;
      *abortFlag = ok ? 0 : 1;
    }
    roleBarrier(barrierId, nthreads);
    if (*abortFlag) return;
    if (dstShared != nullptr) Transport::put(dstShared, l.src + begin, end - begin, tid, nthreads);
    roleBarrier(barrierId, nthreads);
    if (tid == 0) {
      Transport::signal(l.head + c, step0 + n);
      l.step[c] = step0 + n;
    }
    return;
  }
  stagedSend<Transport>(sync, shape, l, c, pipeChunks(end - begin, shape.slotBytes), barrierId, tid,
                        nthreads, abortFlag, [&](std::uint32_t k, char* slot) {
                          const std::uint64_t off = begin + static_cast<std::uint64_t>(k) * shape.slotBytes;
                          const std::uint64_t len = end - off < shape.slotBytes ? end - off : shape.slotBytes;
                          Transport::put(slot, l.src + off, len, tid, nthreads);
                        });
}

// Receiver role for channel c.
template <class Transport, Consume kConsume>
__device__ void pipeRecv(const SyncHandle& sync, const PipeShape& shape, const RecvLink& l,
                         std::uint32_t c, int barrierId, int tid, int nthreads, int* abortFlag) {
  std::uint64_t begin, end;
  channelRange(l.bytes, shape.numChannels, c, &begin, &end);
  const std::uint32_t step0 = l.step[c];
  if (l.direct) {
    const std::uint32_t n = zeroCopySteps(end - begin, shape.slotBytes);
    if (tid == 0) {
      // Where this channel's bytes land, for a sender that does not know (ordered before ready
      // by the fence in signal).
      if (l.mailbox != nullptr) {
        l.mailbox[2u * c] = l.mailboxBase + begin;
        l.mailbox[2u * c + 1u] = end - begin;
      }
      // Everything this stream ran before is done with dst: the sender may overwrite it.
      Transport::signal(l.ready + c, readyValue(step0));
      const bool ok = Transport::wait(sync, l.head + c, step0 + n, l.peer, WaitSite::kMoverData);
      // No slot was used: keep the tail in step for later staged launches on this channel.
      if (ok) Transport::signal(l.tail + c, step0 + n);
      l.step[c] = step0 + n;
    }
    return;
  }
  stagedRecv<Transport>(sync, shape, l, c, pipeChunks(end - begin, shape.slotBytes), barrierId, tid,
                        nthreads, abortFlag, [&](std::uint32_t k, const char* slot) {
                          const std::uint64_t off = begin + static_cast<std::uint64_t>(k) * shape.slotBytes;
                          const std::uint64_t len = end - off < shape.slotBytes ? end - off : shape.slotBytes;
                          consumeChunk<kConsume>(l, slot, off, len, tid, nthreads);
                        });
}

// --- Copy-engine zero-copy (CePhase in pipe.h): one step on channel 0, run by thread 0 ----------

template <class Transport>
__device__ void pipeSendCe(const SyncHandle& sync, const SendLink& l) {
  const std::uint32_t step0 = l.step[0];
  if (l.ce == CePhase::kBefore) {
    // The receiver is done with its destination: the copy that follows this launch may write it.
    // On a timeout the error is recorded (the copy still runs, as in-stream work cannot be skipped).
    Transport::wait(sync, l.ready, readyValue(step0), l.peer, WaitSite::kMoverReady);
  } else {
    // The copy completed in stream order before this launch began: publish it.
    Transport::signal(l.head, step0 + 1u);
    l.step[0] = step0 + 1u;
  }
}

template <class Transport>
__device__ void pipeRecvCe(const SyncHandle& sync, const RecvLink& l) {
  const std::uint32_t step0 = l.step[0];
  if (l.ce == CePhase::kBefore) {
    Transport::signal(l.ready, readyValue(step0));
  } else {
    if (Transport::wait(sync, l.head, step0 + 1u, l.peer, WaitSite::kMoverData)) {
      Transport::signal(l.tail, step0 + 1u);  // keeps the tail in step for later staged launches
    }
    l.step[0] = step0 + 1u;
  }
}

// --- LL mode (small transfers; see llFlag in pipe.h) ---------------------------------------------

// The 8 data bytes of line i of a `bytes`-long buffer (zero-padded past the end).
__device__ __forceinline__ uint2 llGather(const char* src, std::uint64_t bytes, std::uint64_t i) {
  const std::uint64_t off = i * 8;
  if (off + 8 <= bytes && (reinterpret_cast<std::uintptr_t>(src + off) & 7u) == 0) {
    return *reinterpret_cast<const uint2*>(src + off);
  }
  std::uint64_t v = 0;
  for (int k = 0; k < 8 && off + k < bytes; ++k) {
    v |= static_cast<std::uint64_t>(static_cast<unsigned char>(src[off + k])) << (8 * k);
  }
  return make_uint2(static_cast<std::uint32_t>(v), static_cast<std::uint32_t>(v >> 32));
}

// Consumes the 8 data bytes of line i into dst (with the reduction when asked). Reductions read
// and write whole elements (byte counts are element multiples).
template <Consume kConsume>
__device__ __forceinline__ void llScatter(const RecvLink& l, std::uint64_t i, uint2 data) {
  const std::uint64_t off = i * 8;
  const std::uint64_t n = l.bytes - off < 8 ? l.bytes - off : 8;
  const std::uint64_t v = static_cast<std::uint64_t>(data.x) | (static_cast<std::uint64_t>(data.y) << 32);
  if constexpr (kConsume == Consume::kAddF32 || kConsume == Consume::kWeightedAddF32) {
    for (std::uint64_t k = 0; k < n / 4; ++k) {
      const float a = __uint_as_float(static_cast<std::uint32_t>(v >> (32 * k)));
      const float b = reinterpret_cast<const float*>(l.addend + off)[k];
      float r;
      if constexpr (kConsume == Consume::kWeightedAddF32) {
        r = __fmaf_rn(l.weights[rowOf(l.rowBase + off + 4 * k, l.rowBytes)], a, b);
      } else {
        r = a + b;
      }
      reinterpret_cast<float*>(l.dst + off)[k] = r;
    }
  } else if constexpr (kConsume == Consume::kAddBf16 || kConsume == Consume::kWeightedAddBf16) {
    for (std::uint64_t k = 0; k < n / 2; ++k) {
      const __nv_bfloat16 a = __ushort_as_bfloat16(static_cast<unsigned short>(v >> (16 * k)));
      const __nv_bfloat16 b = reinterpret_cast<const __nv_bfloat16*>(l.addend + off)[k];
      float r;
      if constexpr (kConsume == Consume::kWeightedAddBf16) {
        r = __fmaf_rn(l.weights[rowOf(l.rowBase + off + 2 * k, l.rowBytes)], __bfloat162float(a),
                      __bfloat162float(b));
      } else {
        r = __bfloat162float(a) + __bfloat162float(b);
      }
      reinterpret_cast<__nv_bfloat16*>(l.dst + off)[k] = __float2bfloat16(r);
    }
  } else {
    if (n == 8 && (reinterpret_cast<std::uintptr_t>(l.dst + off) & 7u) == 0) {
      *reinterpret_cast<uint2*>(l.dst + off) = data;
    } else {
      for (std::uint64_t k = 0; k < n; ++k) l.dst[off + k] = static_cast<char>(v >> (8 * k));
    }
  }
}

// LL sender for channel c of shape.numChannels: wait until the channel's half is free, then write
// every line of the channel's byte range with the step's flag.
template <class Transport>
__device__ void pipeSendLL(const SyncHandle& sync, const PipeShape& shape, const SendLink& l,
                           std::uint32_t c, int barrierId, int tid, int nthreads, int* abortFlag) {
  std::uint64_t begin, end;
  channelRange(l.bytes, shape.numChannels, c, &begin, &end);
  const std::uint32_t s = l.step[c];
  if (tid == 0) {
    *abortFlag = Transport::wait(sync, l.tail + c, slotFreeTarget(s, 2), l.peer,
                                 WaitSite::kMoverSlotFree)
                     ? 0
                     : 1;
  }
  roleBarrier(barrierId, nthreads);
  if (*abortFlag) return;
  const std::uint32_t flag = llFlag(s);
  auto* lines = reinterpret_cast<uint4*>(l.llRegion + (2u * c + slotOf(s, 2)) * l.llHalf);
  const char* src = l.src + begin;
  const std::uint64_t bytes = end - begin;
  const std::uint64_t n = llLines(bytes);
  for (std::uint64_t i = static_cast<std::uint64_t>(tid); i < n; i += static_cast<std::uint64_t>(nthreads)) {
    const uint2 d = llGather(src, bytes, i);
    ptx::stVolatileV4(lines + i, make_uint4(d.x, flag, d.y, flag));
  }
  roleBarrier(barrierId, nthreads);  // every thread read the step before it moves on
  if (tid == 0) l.step[c] = s + 1u;
}

// LL receiver for channel c: poll each line of the channel's range until it carries this step's
// flag, consume it, then hand the half back with the channel's tail flag.
template <class Transport, Consume kConsume>
__device__ void pipeRecvLL(const SyncHandle& sync, const PipeShape& shape, const RecvLink& link,
                           std::uint32_t c, int barrierId, int tid, int nthreads, int* abortFlag) {
  std::uint64_t begin, end;
  channelRange(link.bytes, shape.numChannels, c, &begin, &end);
  RecvLink l = link;  // this channel's sub-range
  l.dst += begin;
  if (l.addend != nullptr) l.addend += begin;
  l.rowBase += begin;
  l.bytes = end - begin;
  const std::uint32_t s = l.step[c];
  const std::uint32_t flag = llFlag(s);
  const auto* lines = reinterpret_cast<const uint4*>(l.llRegion + (2u * c + slotOf(s, 2)) * l.llHalf);
  const std::uint64_t n = llLines(l.bytes);
  if (tid == 0) *abortFlag = 0;
  roleBarrier(barrierId, nthreads);
  for (std::uint64_t i = static_cast<std::uint64_t>(tid); i < n; i += static_cast<std::uint64_t>(nthreads)) {
    uint4 v{};
    const bool ok = boundedPoll(
        sync,
        [&](std::uint32_t* seen) {
          v = ptx::ldVolatileV4(lines + i);
          *seen = v.y;
          return v.y == flag && v.w == flag;
        },
        flag, l.peer, WaitSite::kMoverData, lines + i);
    if (!ok) {
      *abortFlag = 1;
      break;
    }
    llScatter<kConsume>(l, i, make_uint2(v.x, v.z));
  }
  roleBarrier(barrierId, nthreads);
  if (tid == 0) {
    // All lines of this half were read: the sender may reuse it two steps later.
    if (!*abortFlag) Transport::signal(l.tail + c, s + 1u);
    l.step[c] = s + 1u;
  }
}

// --- Tiled wire formats (hooks.cuh): staged, a chunk is a whole number of wire tiles ------------
// l.bytes counts source bytes (whole tiles of kSrcTile bytes); both ends derive the same tiles per
// channel and per chunk from it and the slot size.

// The tiles of channel c (of `tiles` split over the link's channels) in chunks of one slot's worth
// of wire tiles: both ends derive the same split from the same byte count.
struct TiledChannel {
  std::uint64_t t0, t1, perChunk;
  std::uint32_t n;  // chunks
  __device__ TiledChannel(std::uint64_t tiles, const PipeShape& shape, std::uint32_t c,
                          std::uint64_t wireTile) {
    const std::uint64_t per = (tiles + shape.numChannels - 1) / shape.numChannels;
    const std::uint64_t lo = static_cast<std::uint64_t>(c) * per;
    t0 = lo < tiles ? lo : tiles;
    t1 = t0 + per < tiles ? t0 + per : tiles;
    perChunk = shape.slotBytes / wireTile;
    n = static_cast<std::uint32_t>((t1 - t0 + perChunk - 1) / perChunk);
  }
  // f(tile, index within the chunk) for the tiles of chunk k that thread group `group` of `groups`
  // handles.
  template <class F>
  __device__ void forEach(std::uint32_t k, int group, int groups, F f) const {
    const std::uint64_t first = t0 + static_cast<std::uint64_t>(k) * perChunk;
    const std::uint64_t last = first + perChunk < t1 ? first + perChunk : t1;
    if (group >= groups) return;
    for (std::uint64_t t = first + group; t < last; t += groups) f(t, t - first);
  }
};

// Sender: `Produce` (e.g. ProduceFp8E4m3) turns each source tile into a wire tile in the slot.
template <class Transport, class Produce, std::uint64_t kSrcTile, std::uint64_t kWireTile>
__device__ void pipeSendTiled(const SyncHandle& sync, const PipeShape& shape, const SendLink& l,
                              std::uint32_t c, int barrierId, int tid, int nthreads,
                              int* abortFlag) {
  const TiledChannel ch(l.bytes / kSrcTile, shape, c, kWireTile);
  const std::uint32_t step0 = l.step[c];
  const int groups = nthreads / Produce::kThreads;
  const int group = tid / Produce::kThreads;
  HookCtx ctx{l.peer, c, 0, 0, tid % Produce::kThreads, l.src, nullptr};
  stagedSend<Transport>(sync, shape, l, c, ch.n, barrierId, tid, nthreads, abortFlag,
                        [&](std::uint32_t k, char* slot) {
                          ctx.step = step0 + k;
                          ch.forEach(k, group, groups, [&](std::uint64_t t, std::uint64_t i) {
                            ctx.tile = t;
                            Produce::emit(slot + i * kWireTile, ctx.lane, Produce::produce(ctx));
                          });
                        });
}

// Receiver: `ConsumeHook` (ConsumeWire, ConsumeFp8ToBf16) takes each wire tile to the destination.
template <class Transport, class ConsumeHook, class WireRegs, WireRegs (*kLoad)(const char*, int),
          std::uint64_t kSrcTile, std::uint64_t kWireTile>
__device__ void pipeRecvTiled(const SyncHandle& sync, const PipeShape& shape, const RecvLink& l,
                              std::uint32_t c, int barrierId, int tid, int nthreads,
                              int* abortFlag) {
  const TiledChannel ch(l.bytes / kSrcTile, shape, c, kWireTile);
  const std::uint32_t step0 = l.step[c];
  const int groups = nthreads / ConsumeHook::kThreads;
  const int group = tid / ConsumeHook::kThreads;
  HookCtx ctx{l.peer, c, 0, 0, tid % ConsumeHook::kThreads, nullptr, l.dst};
  stagedRecv<Transport>(sync, shape, l, c, ch.n, barrierId, tid, nthreads, abortFlag,
                        [&](std::uint32_t k, const char* slot) {
                          ctx.step = step0 + k;
                          ch.forEach(k, group, groups, [&](std::uint64_t t, std::uint64_t i) {
                            ctx.tile = t;
                            ConsumeHook::consume(ctx, kLoad(slot + i * kWireTile, ctx.lane));
                          });
                        });
}

}  // namespace graphep
