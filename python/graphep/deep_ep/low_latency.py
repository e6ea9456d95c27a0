"""DeepEP V1's low-latency mode (Buffer.low_latency_*) on graphep's latency path.

    buffer = Buffer(group, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(T, H, R, E),
                    low_latency_mode=True, num_qps_per_rank=E // R)
    recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(x, topk_idx, T, E)
    ...experts: recv_x[j, :recv_count[j]] -> y[j, :recv_count[j]] ([E_local, R x T, H])...
    combined_x, event, hook = buffer.low_latency_combine(y, topk_idx, topk_weights, handle)

How it maps (DeepEP's argument -> graphep):

- An engine per (num_max_dispatch_tokens_per_rank T, hidden, num_experts), and a second one for
  two operations in flight (below): the latency path,
  batched receive layout with R x T rows per local expert, bf16 records
  (graphep.deep_ep.config.low_latency_engine_config). DeepEP's [E_local, R x T, H] receive tensor
  is that layout's recv_x. Where DeepEP allocates its RDMA buffer, in the Buffer's constructor,
  graphep makes the engines of the shapes get_low_latency_rdma_size_hint was asked for in this
  process (for the group's rank count, each hint within num_rdma_bytes; the shapes of every rank,
  gathered, so that the ranks make the same engines), in shrink mode both engines of each: so a
  rank that stops before its first dispatch leaves no collective waiting, and the first dispatch
  can be captured. A shape no hint named gets its engine (in shrink mode both) on its first
  low_latency_dispatch (collective: every rank makes the same calls in the same order, as DeepEP
  requires).
- recv_x, recv_count, the handle's src_info / layout_range and get_next_low_latency_combine_buffer
  are views of the engine's own buffers (no copy, nothing allocated per call): each dispatch on
  that engine rewrites them, as DeepEP's buffers are reused. recv_count is the engine's expert_counts,
  src_info its row_src_token (the source token of each row), layout_range its
  expert_source_ranges (begin << 32 | count per expert and source rank).
- Capturable (torch.cuda.graph); the first low_latency_dispatch of a shape whose engine the
  constructor did not make makes it (setup: host syncs, collective), and so must run eagerly, as
  serving stacks' warm-up runs do.
  The live token count is a device scalar made at engine creation: nothing is copied per call.
- use_fp8: the engine quantises (input FP8_QUANTIZE), e4m3 rows into recv_x's memory (viewed as
  float8_e4m3fn [E_local, R x T, H]) and scales: float32 [E_local, R x T, H / 128] (round_scale:
  powers of two), or with use_ue8m0 their exponent bytes as int32 [E_local, R x T, H / 512].
  DeepEP's scales are column-major in their last two dims; graphep's are row-major (the same
  values; .contiguous() of DeepEP's gives graphep's layout).
- The dispatch sends no weights (graphep's latency path then takes weight 1); combine sends the
  caller's topk_weights ahead of the sums (CombineArgs.topk_weights) and reduces with them.
  combine's topk_idx is checked, not read: graphep combines the routing of the dispatch.
- Streams: as DeepEP, the current stream runs the work unless async_finish, which runs it on the
  Buffer's comm stream (after the current stream) and returns an EventOverlap recorded there.
  return_recv_hook: the call enqueues its send half (MoeHalf.SEND) and returns a hook that
  enqueues the receive half (Engine.receive) on the stream of the call.
- Two operations in flight (DeepEP's two low-latency buffers; vLLM's dual-batch overlap, SGLang's
  two-batch overlap; graphep/deep_ep/in_flight.py): a shape has up to two engines. A dispatch
  runs on the first free one (its last dispatch combined, or none yet, and no receive hook
  waiting). When none is free and the shape has one engine, the dispatch makes the second
  (setup: collective, and refused during a CUDA graph capture, so a stack's eager warm-up step
  makes it; a capture refused so leaves its send halves' hooks uncalled, and the Buffer must be
  made again); with two, it reuses the one whose dispatch is older and has no hook waiting (that
  dispatch's handle goes stale and is refused by name, as DeepEP's older buffer is
  overwritten); when both hold a send half waiting for its hook, it is refused. A handle names
  its engine: combine, the hook and get_next_low_latency_combine_buffer act on that engine
  alone (a stale handle refused by name), so micro-batch A's combine may come while B's dispatch
  hook waits.
- clean_low_latency_buffer zeroes nothing: graphep's counters only grow. In shrink mode it is
  DeepEP's barrier (Engine.barrier on that shape's first engine, a rank that does not come
  masked, the second engine's word then cleared of it too); otherwise it does nothing.
- Shrink mode (enable_shrink=True): the low-latency engines are made with
  MoeConfig.shrink_on_timeout, so that, as DeepEP's, their kernels mask a rank whose count message,
  combine weights or partials do not come within GRAPHEP_TIMEOUT_MS, and the operation completes
  among the others. low_latency_update_mask_buffer and low_latency_clean_mask_buffer set and clear
  the bits of the ranks they name in every engine's active-rank mask word (Engine.active_ranks) on
  the current stream, leaving the bits the kernels cleared; low_latency_query_mask_buffer reads
  the words (a rank out of any engine's word is masked). A shape's two engines share what their
  kernels masked: each dispatch first clears, in its engine's word, the ranks the other engine's
  word has cleared (on the dispatch's stream: one small device op; it only removes ranks), so a
  dead rank costs one timeout, not one per engine (a combine already pending on the other engine
  uses its dispatch's mask and may still wait one timeout for it). A rank whose records came in part still fails the engine, naming it
  (Engine.recover on each of the shape's engines brings the survivors back).
  Across a mask change each low_latency_dispatch is followed by its low_latency_combine before the
  next dispatch (the engine's rule, graphep::Engine::setActiveRanks).
- Not supported (graphep.Error NOT_SUPPORTED, naming it): use_logfmt, dispatch_wait_recv_cost_stats
  and combine_wait_recv_cost_stats.
"""

import operator
import os
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from graphep._graphep import DispatchInput, Fp8Scales, MoeHalf, MoeStatus, validate
from graphep.deep_ep.config import (LOW_LATENCY_SMS_ENV, low_latency_engine_config, low_latency_rdma_size_hint,
                                    low_latency_sm_budget)
from graphep.deep_ep.events import EventOverlap
from graphep.deep_ep.in_flight import InFlight, engine_for_dispatch, statuses
from graphep.deep_ep.tensors import ID_TYPES, as_extension, check_tensor, refuse_during_capture
from graphep.engine import Engine, create_engine
from graphep.errors import Error, invalid_argument, not_supported

# The shapes get_low_latency_rdma_size_hint was asked for in this process, in the order asked:
# (T, hidden, num_ranks, num_experts) -> the bytes it answered. A Buffer makes their engines when it
# is constructed (hinted_shapes, hinted_by_any_rank).
HINTED: Dict[Tuple[int, int, int, int], int] = {}


def hinted_shapes(hinted: Dict[Tuple[int, int, int, int], int], ranks: int,
                  num_rdma_bytes: int) -> List[Tuple[int, int, int]]:
    """(T, hidden, num_experts) of each hinted shape of `ranks` ranks whose hint fits num_rdma_bytes
    (the RDMA buffer DeepEP would allocate for it), in the order asked."""
    return [(t, h, e) for (t, h, r, e), size in hinted.items() if r == ranks and size <= num_rdma_bytes]


def hinted_by_any_rank(per_rank: List[List[Tuple[int, int, int]]]) -> List[Tuple[int, int, int]]:
    """The shapes any rank hinted (each rank's hinted_shapes, gathered), rank 0's first, each once:
    every rank computes the same list from the same gathered lists, so their collective engine
    creations match even where only some ranks asked for the hint (a stack that sizes the buffer
    on one rank and broadcasts the number)."""
    shapes: List[Tuple[int, int, int]] = []
    for rank_shapes in per_rank:
        shapes += [tuple(s) for s in rank_shapes if tuple(s) not in shapes]
    return shapes


def _signed32(bits: int) -> int:
    """`bits` (a 32-bit mask) as the int32 value with the same bits (what an int32 tensor holds)."""
    bits &= 0xFFFFFFFF
    return bits - (1 << 32) if bits >= (1 << 31) else bits


def _masked_by_words(states, out) -> None:
    """out[r] = 1 where rank r is out of any engine's mask word (states' `active`), else 0, on the
    current stream, through the first state's scratch word and rank numbers (no allocation)."""
    first = states[0]
    first.live.copy_(first.active)
    for st in states[1:]:
        first.live.bitwise_and_(st.active)
    torch.bitwise_right_shift(first.live, first.rank_ids, out=out)  # int32: bit 31 shifts in ones, & 1 drops them
    out.bitwise_and_(1).bitwise_xor_(1)


class LowLatencyHandle(tuple):
    """DeepEP's low-latency handle, (src_info, layout_range, num_max_dispatch_tokens_per_rank,
    hidden, num_experts): a 5-tuple indexed and unpacked as DeepEP's, which also knows the Buffer,
    engine and dispatch that made it (what combine checks)."""

    def __new__(cls, items, buffer, state: "_LowLatencyState", seq: int, num_tokens: int, top_k: int):
        handle = super().__new__(cls, items)
        handle.buffer, handle.state, handle.seq = buffer, state, seq
        handle.num_tokens, handle.top_k = num_tokens, top_k
        return handle

    def __repr__(self) -> str:
        st = self.state
        return (f"graphep.deep_ep.LowLatencyHandle(low_latency_dispatch {self.seq} of num_max_dispatch_tokens_per_rank="
                f"{st.max_tokens}, hidden={st.hidden}, num_experts={st.num_experts}: {self.num_tokens} tokens, "
                f"top-{self.top_k})")


class _LowLatencyState(InFlight):
    """One low-latency engine of a Buffer, its views as DeepEP shapes them, and what its last
    dispatch was (InFlight). Everything a call needs besides its own tensors is made here, at
    engine creation (setup, outside any CUDA graph capture): a call allocates nothing."""

    def __init__(self, engine: Engine, max_tokens: int, hidden: int, num_experts: int, world: int):
        super().__init__()
        T, H, L = max_tokens, hidden, num_experts // world
        rows = world * T  # DeepEP's R x T rows per local expert: the batched layout's rows_per_expert
        self.engine, self.core = engine, engine._core
        self.max_tokens, self.hidden, self.num_experts, self.num_local = T, H, num_experts, L
        self.top_k = engine.config.top_k  # the most columns a call's topk_idx may have
        v = engine.layout
        self.recv_x = torch.from_dlpack(v.recv_x).view(L, rows, H)
        self.expert_output = torch.from_dlpack(v.expert_output).view(L, rows, H)
        self.expert_output_shape, self.expert_output_rows = (L, rows, H), L * rows
        self.recv_count = torch.from_dlpack(v.expert_counts)
        self.src_info = torch.from_dlpack(v.row_src_token).view(L, rows)
        self.layout_range = torch.from_dlpack(v.expert_source_ranges)  # [L, R] int64
        self.recv_x_fp8 = self.scales = self.scales_ue8m0 = None
        if v.recv_scales is not None:  # hidden % 128 == 0
            self.recv_x_fp8 = torch.from_dlpack(v.recv_x_fp8).view(torch.float8_e4m3fn).view(L, rows, H)
            scales = torch.from_dlpack(v.recv_scales)  # [L x rows, H / 128] float32
            self.scales = scales.view(L, rows, H // 128)
            if H % 512 == 0:  # UE8M0: [rows][H / 128] bytes at the buffer's start, four per int32
                self.scales_ue8m0 = scales.view(torch.int32).view(-1)[: L * rows * (H // 512)].view(L, rows, H // 512)
        device = self.recv_x.device
        # The live token count n is the device int32 at counts[n] (no per-call copy to the device).
        self.counts = torch.arange(T + 1, dtype=torch.int32, device=device)
        self.counts_ptr = self.counts.data_ptr()
        # Stand-ins for a call with no tokens: the engine takes non-empty arrays, and with a live
        # count of 0 reads none of them (the combine writes none of idle_out).
        self.idle_x = torch.zeros((1, H), dtype=torch.bfloat16, device=device)
        self.idle_ids = torch.full((1, self.top_k), -1, dtype=torch.int64, device=device)
        self.idle_weights = torch.zeros((1, self.top_k), dtype=torch.float32, device=device)
        self.idle_out = torch.empty((1, H), dtype=torch.bfloat16, device=device)
        # The engine's active-rank mask word (int32 [1], bit r: rank r takes part), which shrink mode's
        # kernels clear bits of; the rank numbers the query shifts it by, and its scratch word.
        self.active = torch.from_dlpack(engine.active_ranks)
        self.rank_ids = torch.arange(world, dtype=torch.int32, device=device)
        self.live = torch.empty(1, dtype=torch.int32, device=device)
        self.shape = (T, H, num_experts)
        self.handle_items = (self.src_info, self.layout_range, T, H, num_experts)  # a handle's tuple


class LowLatencyMode:
    """Buffer's low-latency methods (mixed into graphep.deep_ep.Buffer, whose constructor sets
    low_latency_mode, _ll_engines and the rest these read)."""

    _dispatch_seq = 0  # dispatches of this Buffer so far, both modes' (a handle's and an engine's seq)

    # ---- checks and engines --------------------------------------------------------------------
    def _require_low_latency(self, what: str) -> None:
        self._require_alive()
        if not self.low_latency_mode:
            raise invalid_argument(f"{what} needs Buffer(low_latency_mode=True), as in DeepEP")

    def _check_low_latency_shape(self, what: str, max_tokens, hidden, num_experts) -> Tuple[int, int, int]:
        """(T, hidden, num_experts) as ints, each positive, num_experts a multiple of the ranks."""
        if type(max_tokens) is int and type(hidden) is int and type(num_experts) is int and max_tokens > 0 \
                and hidden > 0 and num_experts > 0 and num_experts % self.group_size == 0:
            return max_tokens, hidden, num_experts  # the common case, in one look
        values = []
        for name, value in (("num_max_dispatch_tokens_per_rank", max_tokens), ("hidden", hidden),
                            ("num_experts", num_experts)):
            try:
                v = operator.index(value)
            except TypeError:
                v = 0
            if isinstance(value, bool) or v < 1:
                raise invalid_argument(f"{what}: {name}={value!r} is not a positive integer")
            values.append(v)
        if values[2] % self.group_size != 0:
            raise invalid_argument(f"{what}: num_experts={values[2]} is not a multiple of the {self.group_size} "
                                   "ranks")
        return values[0], values[1], values[2]

    def _ll_states(self) -> List[_LowLatencyState]:
        """Every low-latency engine of this Buffer, the shapes' second engines too."""
        return [s for st in self._ll_engines.values() for s in st.engines()]

    def _low_latency_engine(self, max_tokens: int, hidden: int, num_experts: int) -> _LowLatencyState:
        """The first engine of (T, hidden, num_experts): made by the constructor when hinted, else
        here on first use (collective); in shrink mode its second with it."""
        key = (max_tokens, hidden, num_experts)
        st = self._ll_engines.get(key)
        if st is None:
            st = self._ll_engines[key] = self._make_low_latency_engine(key, "low_latency_dispatch")
            if self.enable_shrink:  # both now: a lazy, collective second could wait for a dead rank
                st.second = self._make_low_latency_engine(key, "low_latency_dispatch (the shape's second engine)")
        return st

    def _make_low_latency_engine(self, key: Tuple[int, int, int], what: str) -> _LowLatencyState:
        """A new engine of shape `key` (setup: collective, host syncs; refused during a CUDA graph
        capture), with the active-rank mask the Buffer's other engines have in shrink mode."""
        max_tokens, hidden, num_experts = key
        cfg = low_latency_engine_config(max_tokens, hidden, num_experts, self.group_size,
                                        low_latency_sm_budget(os.environ.get(LOW_LATENCY_SMS_ENV)),
                                        shrink=self.enable_shrink)
        try:  # every rank refuses the same config here, before the collective creation
            validate(cfg, self.group_size)
        except Error as e:
            raise Error(e.status, f"{what}: num_max_dispatch_tokens_per_rank={max_tokens}, hidden={hidden}, "
                                  f"num_experts={num_experts} over {self.group_size} ranks: {e.message}") from None
        refuse_during_capture(what, f"low-latency engine (num_max_dispatch_tokens_per_rank={max_tokens}, hidden="
                                    f"{hidden}, num_experts={num_experts})", "; a send half captured before this call "
                                    "waits for a hook the failed capture lost, so make the Buffer again")
        others = self._ll_states()
        st = _LowLatencyState(create_engine(self._group, cfg), max_tokens, hidden, num_experts, self.group_size)
        if getattr(self, "_masked_ranks", None):  # shrink mode: the ranks masked so far
            st.engine.set_active_ranks(self._active_ranks(), torch.cuda.current_stream())
        for other in others if self.enable_shrink else ():  # and those the other engines' kernels masked
            st.active.bitwise_and_(other.active)
        return st

    def _take_masked(self, first: _LowLatencyState, st: _LowLatencyState, stream) -> None:
        """Shrink mode: clears in st's mask word the ranks the shape's other engine's word has
        cleared (what its kernels masked after a timeout), on `stream` (None: the current one), so
        that a dead rank costs one timeout, not one per engine. It only removes ranks (the engine's
        rule on mask changes concerns ranks put back). Otherwise nothing, not even a stream switch."""
        if self.enable_shrink and first.second is not None:
            with self._on(stream):
                st.active.bitwise_and_((first.second if st is first else first).active)

    def _ll_dispatch_engine(self, first: _LowLatencyState, what: str) -> _LowLatencyState:
        """The engine of first's shape this dispatch runs on (pick_engine), the shape's second made
        when the first is held and there is none yet."""
        st = engine_for_dispatch(first, lambda: self._make_low_latency_engine(first.shape,
                                                                             f"{what} while an earlier one is in flight"))
        if st is not None:
            return st
        T, H, E = first.shape
        raise invalid_argument(f"{what}: two operations of num_max_dispatch_tokens_per_rank={T}, hidden={H}, "
                               f"num_experts={E} are in flight ({first.pending[0]} and {first.second.pending[0]} "
                               "have not been called); graphep holds at most two per shape, as DeepEP's two "
                               "low-latency buffers: call a hook first")

    def _low_latency_head(self, handle, what: str) -> LowLatencyHandle:
        if not isinstance(handle, LowLatencyHandle) or handle.buffer is not self:
            raise invalid_argument(f"{what}: the handle is not one of this graphep.deep_ep.Buffer's "
                                   "low_latency_dispatch (pass the handle it returned, as it is)")
        return handle

    @staticmethod
    def _check_pending(st: _LowLatencyState, what: str) -> None:
        if st.pending is not None:
            raise invalid_argument(f"{what}: {st.pending[0]} has not been called; graphep's engine takes no other "
                                   "operation between a send (return_recv_hook=True) and its receive hook")

    @staticmethod
    def _check_stream_args(async_finish: bool, return_recv_hook: bool, what: str) -> None:
        if async_finish and return_recv_hook:
            raise invalid_argument(f"{what}: async_finish=True and return_recv_hook=True together; pass one, as "
                                   "in DeepEP")

    def _launch_stream(self, async_finish: bool, return_recv_hook: bool, what: str):
        """The stream the work runs on, as the normal mode's (Buffer._begin, no previous event):
        for async_finish the comm stream, after the current one; else None, the current stream."""
        self._check_stream_args(async_finish, return_recv_hook, what)
        return self._begin(None, async_finish)

    @staticmethod
    def _receive_hook(st: _LowLatencyState, what: str, stream: int, inputs: tuple) -> Callable[[], None]:
        """The hook of a send half: enqueues its receive half on `stream`, a cudaStream_t (once).
        It holds `inputs`, the tensors the receive half reads, until then: a caller that drops
        them after the send half cannot have their memory taken by other tensors first (after the
        hook, the stream orders any new use after the receive half)."""
        token = object()
        st.pending = (f"the receive hook of {what}", token)
        held = list(inputs)

        def hook() -> None:
            if st.pending is None or st.pending[1] is not token:
                raise invalid_argument(f"the receive hook of {what} was called already")
            st.pending = None
            try:
                st.core.receive(stream)
            finally:
                held.clear()

        return hook

    @staticmethod
    def _low_latency_event(stream, async_finish: bool, tensors) -> EventOverlap:
        if not async_finish:
            return EventOverlap()
        event = torch.cuda.Event()
        event.record(stream)
        return EventOverlap(event, tensors)  # the tensors live until the caller waits, as DeepEP's

    # ---- DeepEP's low-latency API ----------------------------------------------------------------
    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """The symmetric heap bytes per rank of the low-latency engine for these values (no GPU
        needed; each engine also has private buffers: graphep.memory_requirements says both).
        The shape is remembered: a Buffer constructed after it, with low_latency_mode, this many
        ranks and num_rdma_bytes at least this, makes its engine then (the module's docstring)."""
        size = low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
        HINTED.setdefault((num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts), size)
        return size

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """DeepEP zeroes the flags of its RDMA buffer here (after the normal mode used it), between
        two barriers; graphep's engines are separate and their counters only grow (each operation
        waits for the next value), so nothing is ever stale, and without shrink mode this checks
        the arguments and does nothing. In shrink mode it is the barrier, as DeepEP's: the
        engine of this shape (when made) enqueues Engine.barrier on the current stream, and a
        rank that does not come within GRAPHEP_TIMEOUT_MS is masked (the query then names it).
        Every rank makes the same calls."""
        what = "clean_low_latency_buffer"
        self._require_low_latency(what)
        key = self._check_low_latency_shape(what, num_max_dispatch_tokens_per_rank, hidden, num_experts)
        st = self._ll_engines.get(tuple(key)) if self.enable_shrink else None
        if st is not None:
            for each in st.engines():
                self._check_pending(each, what)
            st.engine.barrier(torch.cuda.current_stream())  # one barrier among the ranks: the first engine's
            if st.second is not None:  # a rank it masked, masked in the second engine's word too
                st.second.active.bitwise_and_(st.active)

    @as_extension
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False) -> \
            Tuple[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], torch.Tensor, LowLatencyHandle, EventOverlap,
                  Optional[Callable[[], None]]]:
        """DeepEP's low_latency_dispatch: (recv_x, recv_count, handle, event, hook).

        x bfloat16 [num_tokens, hidden] with num_tokens <= num_max_dispatch_tokens_per_rank (T);
        topk_idx int64 (deep_ep.topk_idx_t) or int32 [num_tokens, k], -1: none. recv_x: bfloat16
        [E_local, R x T, hidden], or with use_fp8 (float8_e4m3fn [E_local, R x T, hidden], float32
        scales [E_local, R x T, hidden / 128], or int32 [E_local, R x T, hidden / 512] with
        use_ue8m0); recv_count int32 [E_local]: rows of each local expert (the rest of its block is
        not written). cumulative_local_expert_recv_stats int32 [E_local]: each expert's rows are
        added on the device. hook: None, or with return_recv_hook the receive half to call."""
        what = "low_latency_dispatch"
        self._require_low_latency(what)
        if dispatch_wait_recv_cost_stats is not None:
            raise not_supported(f"{what}: dispatch_wait_recv_cost_stats is not supported (graphep does not time "
                                "its waits per rank); pass None")
        if use_ue8m0 and not round_scale:
            raise invalid_argument(f"{what}: use_ue8m0=True needs round_scale=True (UE8M0 holds powers of two), as "
                                   "in DeepEP")
        # Each tensor property is read once here: this is host time ahead of the launch (an eager
        # caller whose host is slower than the kernel waits for it).
        dev = self._device
        xs = x.shape if isinstance(x, torch.Tensor) else None
        if xs is None or len(xs) != 2:
            raise invalid_argument(f"{what}: x is {type(x).__name__ if xs is None else list(xs)}, expected a "
                                   "[num_tokens, hidden] torch.bfloat16 tensor")
        n, H = xs
        T, H, E = self._check_low_latency_shape(what, num_max_dispatch_tokens_per_rank, H, num_experts)
        if n > T:
            raise invalid_argument(f"{what}: x has {n} rows (num_tokens), more than "
                                   f"num_max_dispatch_tokens_per_rank={T}")
        check_tensor(x, "low_latency_dispatch: x", (torch.bfloat16,), xs, dev)
        ks = topk_idx.shape if isinstance(topk_idx, torch.Tensor) else None
        if ks is None or len(ks) != 2:
            raise invalid_argument(f"{what}: topk_idx is {type(topk_idx).__name__ if ks is None else list(ks)}, "
                                   "expected a [num_tokens, num_topk] tensor")
        k = ks[1]
        check_tensor(topk_idx, "low_latency_dispatch: topk_idx", (torch.int64, torch.int32), (n, k), dev)
        scale_format = Fp8Scales.FLOAT
        if use_fp8:
            if H % 128 != 0:
                raise invalid_argument(f"{what}: use_fp8=True needs hidden a multiple of 128 (a scale per 128 "
                                       f"values); hidden={H}")
            if use_ue8m0 and H % 512 != 0:
                raise invalid_argument(f"{what}: use_ue8m0=True needs hidden a multiple of 512 (four exponent "
                                       f"bytes per int32 scale); hidden={H}")
            scale_format = Fp8Scales.UE8M0 if use_ue8m0 else (Fp8Scales.POW2 if round_scale else Fp8Scales.FLOAT)
        first = self._low_latency_engine(T, H, E)
        if not 1 <= k <= first.top_k:
            raise invalid_argument(f"{what}: topk_idx has {k} columns (num_topk); graphep's latency path takes 1 to "
                                   f"{first.top_k} with num_max_dispatch_tokens_per_rank={T} and num_experts={E}")
        stats = cumulative_local_expert_recv_stats
        if stats is not None:
            check_tensor(stats, f"{what}: cumulative_local_expert_recv_stats", (torch.int32,), (first.num_local,), dev)
        self._check_stream_args(async_finish, return_recv_hook, what)  # before a second engine is made for it
        st = self._ll_dispatch_engine(first, what)
        stream = self._begin(None, async_finish)  # the stream arguments were checked above
        self._take_masked(first, st, stream)  # in order with the dispatch, on its stream
        raw = self._raw(stream)
        xs, ids = (x, topk_idx) if n > 0 else (st.idle_x, st.idle_ids)
        kwargs = {"top_k": k, "input": DispatchInput.FP8_QUANTIZE if use_fp8 else DispatchInput.BF16}
        if scale_format != Fp8Scales.FLOAT:
            kwargs["scale_format"] = scale_format
        if stats is not None:
            kwargs["recv_stats"] = stats.data_ptr()
        if return_recv_hook:
            kwargs["half"] = MoeHalf.SEND
        # No weights: the latency path takes weight 1 here; combine brings the caller's.
        st.core.dispatch(xs.data_ptr(), ids.data_ptr(), ID_TYPES[ids.dtype], 0, st.counts_ptr + 4 * n,
                         raw, **kwargs)
        self._dispatch_seq += 1
        st.seq, st.combined = self._dispatch_seq, False
        handle = LowLatencyHandle(st.handle_items, self, st, st.seq, n, k)
        # The receive half reads this rank's own rows from x and adds to the stats.
        hook = self._receive_hook(st, f"low_latency_dispatch {st.seq}", raw, (xs, ids, stats)) \
            if return_recv_hook else None
        event = self._low_latency_event(stream, async_finish, (x, topk_idx, stats))
        if use_fp8:
            recv = (st.recv_x_fp8, st.scales_ue8m0 if use_ue8m0 else st.scales)
        else:
            recv = st.recv_x
        return recv, st.recv_count, handle, event, hook

    @as_extension
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None) -> \
            Tuple[torch.Tensor, EventOverlap, Optional[Callable[[], None]]]:
        """DeepEP's low_latency_combine: (combined_x, event, hook). combined_x bfloat16
        [num_tokens, hidden] (out when given): combined_x[t] = sum over its slots k of
        topk_weights[t, k] x (the expert's row of (t, k) in x). x bfloat16 [E_local, R x T,
        hidden], rows as the handle's dispatch laid them out; zero_copy: the rows are in
        get_next_low_latency_combine_buffer(handle) already (x is checked, not read). topk_idx
        [num_tokens, k] is checked, not read (graphep combines the dispatch's routing);
        topk_weights float32 [num_tokens, k]. With return_recv_hook the send half waits for no
        peer (a peer's records whose weights are late are reduced by the receive half); the hook
        holds x and topk_weights until it is called."""
        what = "low_latency_combine"
        self._require_low_latency(what)
        if use_logfmt:
            raise not_supported(f"{what}: use_logfmt=True (DeepEP's 10-bit LogFMT combine) is not supported; "
                                "graphep's combine sends bf16: pass use_logfmt=False")
        if combine_wait_recv_cost_stats is not None:
            raise not_supported(f"{what}: combine_wait_recv_cost_stats is not supported (graphep does not time its "
                                "waits per rank); pass None")
        head = self._low_latency_head(handle, what)
        st, dev = head.state, self._device
        if head.seq != st.seq:
            raise invalid_argument(f"{what}: the handle is of low_latency_dispatch {head.seq}, but graphep combines "
                                   f"the engine's last dispatch ({st.seq}) of num_max_dispatch_tokens_per_rank="
                                   f"{st.max_tokens}, hidden={st.hidden}, num_experts={st.num_experts}: a later "
                                   "dispatch of that shape reused the engine (a shape holds its last two dispatches "
                                   "not yet combined, as DeepEP's two low-latency buffers, and reuses an engine whose "
                                   "dispatch was combined); combine before that")
        n, k, H = head.num_tokens, head.top_k, st.hidden
        check_tensor(x, "low_latency_combine: x", (torch.bfloat16,), st.expert_output_shape, dev)
        check_tensor(topk_idx, "low_latency_combine: topk_idx", (torch.int64, torch.int32), (n, k), dev)
        check_tensor(topk_weights, "low_latency_combine: topk_weights", (torch.float32,), (n, k), dev)
        if out is not None:
            check_tensor(out, "low_latency_combine: out", (torch.bfloat16,), (n, H), dev)
        self._check_pending(st, what)
        stream = self._launch_stream(async_finish, return_recv_hook, what)
        raw = self._raw(stream)
        combined = out if out is not None else torch.empty((n, H), dtype=torch.bfloat16, device=x.device)
        target, weights = (combined, topk_weights) if n > 0 else (st.idle_out, st.idle_weights)
        kwargs = {"topk_weights": weights.data_ptr()}
        if not zero_copy:
            kwargs["expert_output_rows"] = st.expert_output_rows
        if return_recv_hook:
            kwargs["half"] = MoeHalf.SEND
        st.core.combine(0 if zero_copy else x.data_ptr(), target.data_ptr(), raw, **kwargs)
        st.combined = True  # free for the next dispatch (once the hook, if any, is called)
        # The receive half reads x (a peer's records whose weights came after the send half's look)
        # and this rank's weights.
        hook = self._receive_hook(st, f"low_latency_combine of dispatch {head.seq}", raw, (x, weights, combined)) \
            if return_recv_hook else None
        event = self._low_latency_event(stream, async_finish, (x, topk_idx, topk_weights, combined))
        return combined, event, hook

    @as_extension
    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The engine's expert-output buffer as bfloat16 [E_local, R x T, hidden] (a view): rows
        written here are what low_latency_combine(..., zero_copy=True) sends."""
        what = "get_next_low_latency_combine_buffer"
        self._require_low_latency(what)
        head = self._low_latency_head(handle, what)
        if head.seq != head.state.seq:
            raise invalid_argument(f"{what}: the handle is of low_latency_dispatch {head.seq}, but its engine's last "
                                   f"dispatch is {head.state.seq}: its combine buffer now belongs to that dispatch")
        return head.state.expert_output

    # ---- shrink mode: DeepEP's mask buffer as the engines' active-rank mask ----------------------
    def _require_shrink(self, what: str) -> None:
        self._require_low_latency(what)
        if not self.enable_shrink:
            raise invalid_argument(f"{what}: shrink mode is off (create the Buffer with enable_shrink=True)")

    def _active_ranks(self) -> int:
        return sum(1 << r for r in range(self.group_size) if r not in self._masked_ranks)

    def _set_masked(self, masked: set, what: str, unmask: frozenset = frozenset()) -> None:
        """Makes `masked` the masked ranks: in every low-latency engine's active-rank mask word, the
        bits of the ranks this call masks are cleared and of those it unmasks set, on the current
        stream (in order with the calls around it; captured when a capture is running). The other
        bits stay: a rank the kernels masked after a timeout stays masked, unless in `unmask` (the
        ranks unmasked by name: their bits set in every engine). On a refusal (a send half
        waiting) no engine changes."""
        for st in self._ll_states():
            self._check_pending(st, what)
        clear = _signed32(sum(1 << r for r in masked - self._masked_ranks))
        set_ = _signed32(sum(1 << r for r in (self._masked_ranks | unmask) - masked))
        self._masked_ranks = masked
        for st in self._ll_states():
            st.active.bitwise_and_(~clear).bitwise_or_(set_)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False):
        """Masks (mask=True) or unmasks a rank from the next low-latency dispatch on: it is sent
        nothing and waited for by no one, and the entries routed to its experts are dropped (and
        counted); every rank must make the same calls. As DeepEP's, the kernels also mask a rank
        whose count message, combine weights or partials do not come within GRAPHEP_TIMEOUT_MS
        (MoeConfig.shrink_on_timeout); the operation completes among the others."""
        self._require_shrink("low_latency_update_mask_buffer")
        try:
            rank = operator.index(rank_to_mask)  # an int, a numpy integer, a 0-d integer tensor
        except TypeError:
            rank = -1
        if not 0 <= rank < self.group_size:
            raise invalid_argument(f"low_latency_update_mask_buffer: rank_to_mask={rank_to_mask!r} is not a rank "
                                   f"in [0, {self.group_size})")
        masked = set(self._masked_ranks)
        (masked.add if mask else masked.discard)(rank)
        if len(masked) == self.group_size:
            raise invalid_argument(f"low_latency_update_mask_buffer: masking rank {rank} would leave no rank")
        self._set_masked(masked, "low_latency_update_mask_buffer", frozenset() if mask else frozenset({rank}))

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor):
        """Writes 1 for every masked rank and 0 for the others into mask_status (int32
        [num_ranks], on this rank's GPU), on the current stream (capturable: no copy to or from the
        host): the ranks masked through this Buffer and those its engines' kernels masked after a
        timeout (a rank out of any engine's mask word)."""
        self._require_shrink("low_latency_query_mask_buffer")
        if (not isinstance(mask_status, torch.Tensor) or mask_status.dtype != torch.int32
                or tuple(mask_status.shape) != (self.group_size,) or mask_status.device.type != "cuda"
                or mask_status.device.index != self._device):
            raise invalid_argument(f"low_latency_query_mask_buffer: mask_status must be an int32 CUDA tensor of "
                                   f"[{self.group_size}] (num_ranks) on cuda:{self._device}")
        if not self._ll_engines:  # no engine yet: the masks set through this Buffer
            mask_status.zero_()
            for r in sorted(self._masked_ranks):
                mask_status[r] = 1
            return
        _masked_by_words(self._ll_states(), mask_status)

    def low_latency_clean_mask_buffer(self):
        """Unmasks every rank, those the kernels masked after a timeout too (as DeepEP's)."""
        self._require_shrink("low_latency_clean_mask_buffer")
        self._set_masked(set(), "low_latency_clean_mask_buffer", frozenset(range(self.group_size)))

    def _low_latency_status(self) -> Dict[Tuple[int, int, int], MoeStatus]:
        """Each engine's status by its shape (T, hidden, num_experts); a shape's second engine by
        (T, hidden, num_experts, 1)."""
        return statuses(self._ll_engines, lambda st: st.engine.status())
