"""Buffer: DeepEP V1's Buffer (deep_ep/buffer.py) on one node, on graphep engines: the normal mode
here, the low-latency mode in graphep/deep_ep/low_latency.py (its mapping is told there).

    buffer = Buffer(group, num_nvl_bytes)                      # collective: the graphep group
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = \
        buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_topk_idx, recv_topk_weights, per_expert, handle, event = buffer.dispatch(
        x, num_tokens_per_rank=..., is_token_in_rank=..., num_tokens_per_expert=...,
        topk_idx=topk_idx, topk_weights=topk_weights)
    ...experts: one output row per received row, its slots' weighted sum...
    combined_x, combined_topk_weights, event = buffer.combine(y, handle, topk_weights=recv_topk_weights)

How it maps (docs: README "Serving stacks: DeepEP's API on graphep"):

- A graphep engine per (hidden, num_experts) (and a second for two dispatches in flight, below),
  made on the first dispatch that needs it (a
  collective setup: every rank makes the same calls in the same order, as DeepEP requires):
  rank-major receive layout (DeepEP's receive order: sources in rank order, each source's tokens
  in order), throughput path, bf16 records; fp8 dispatches send the caller's e4m3 rows and
  scales. Its T_max and SM budget: graphep.deep_ep.config.
- Streams: with async_finish the work runs on the Buffer's comm stream, which first waits for
  previous_event (or the current stream); without it, on the current stream (after
  previous_event), which is the order DeepEP's comm stream and its wait give the caller.
  Outputs are fresh torch tensors each call (never engine memory). A non-cached dispatch without
  num_worst_tokens reads its row count and per-expert counts back: one host sync, as DeepEP's.
  With num_worst_tokens or a handle (cached), nothing syncs.
- combine is DeepEP's: an unweighted sum over the ranks (the experts applied the weights), bias
  added after it (on the comm stream, not fused). graphep combines an engine's last dispatch: a
  handle is accepted when its dispatch is that one, or routed the same tokens (the same
  is_token_in_rank tensor and token count).
- Two dispatches in flight (SGLang's two-batch overlap and vLLM's dual-batch overlap in prefill;
  graphep/deep_ep/in_flight.py): a dispatch while the shape's engine holds one not yet combined
  that routed other tokens runs on the shape's second engine, made then (collective; refused
  during a CUDA graph capture; it doubles the shape's memory); with both held, on the older
  one's (its handle goes stale). A handle carries its engine: its combine and cached dispatches
  run there, unless that engine now holds another micro-batch's dispatch, when a cached
  dispatch moves the handle to the engine the policy gives.
- Not in this version (graphep.Error NOT_SUPPORTED, naming it): internode (RDMA) groups, shrink
  mode without low_latency_mode, mpi4py communicators, packed int32 fp8 scales in the normal mode.
"""

import contextlib
import os
import socket
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from graphep._graphep import DispatchInput, MoeStatus, Status, token_layout
from graphep.deep_ep.config import (MAX_TOKENS_ENV, TOKENS_CAP, TOKENS_STEP, Config, combine_config, dispatch_config,
                                    engine_config, heap_bytes_for, max_tokens_per_rank, sm_budget)
from graphep.deep_ep.events import EventOverlap
from graphep.deep_ep.in_flight import InFlight, engine_for_dispatch, statuses
from graphep.deep_ep.low_latency import HINTED, LowLatencyMode, _LowLatencyState, hinted_by_any_rank, hinted_shapes
from graphep.deep_ep.tensors import ID_TYPES as _ID_TYPES
from graphep.deep_ep.tensors import as_extension, current_raw_stream, refuse_during_capture
from graphep.deep_ep.tensors import check_tensor as _check_tensor
from graphep.engine import _INDEX_TYPES, DispatchOutputs, Engine, create_engine, memory_requirements
from graphep.errors import Error, invalid_argument, not_supported
from graphep.torch.distributed import group_from_process_group

topk_idx_t = torch.int64  # DeepEP's expert-id dtype (int32 ids are accepted too)

_INTERNODE = ("graphep.deep_ep runs on one node in this version (DeepEP's internode RDMA path comes in a later "
              "change)")


class SendHead:
    """The last element of a handle (DeepEP's send_head): which engine and dispatch made it."""

    __slots__ = ("buffer", "state", "seq", "num_tokens", "num_recv_tokens", "top_k", "is_token_in_rank")

    def __init__(self, buffer, state, seq, num_tokens, num_recv_tokens, top_k, is_token_in_rank):
        self.buffer, self.state, self.seq = buffer, state, seq
        self.num_tokens, self.num_recv_tokens, self.top_k = num_tokens, num_recv_tokens, top_k
        self.is_token_in_rank = is_token_in_rank  # the routing mask the dispatch used (the object)

    def __repr__(self) -> str:
        return (f"graphep.deep_ep.SendHead(dispatch {self.seq} of hidden={self.state.hidden}, "
                f"num_experts={self.state.num_experts}: {self.num_tokens} tokens, {self.num_recv_tokens} rows)")


class _EngineState(InFlight):
    """One engine of a Buffer and what its last dispatch routed (InFlight: whether it was combined)."""

    def __init__(self, engine: Engine, hidden: int, num_experts: int, max_tokens: int):
        super().__init__()
        self.engine, self.hidden, self.num_experts, self.max_tokens = engine, hidden, num_experts, max_tokens
        # Views of the engine's layout counts (each dispatch writes them), read back by a
        # synchronous dispatch.
        self.num_recv_rows = torch.from_dlpack(engine.layout.num_recv_rows)
        self.expert_counts = torch.from_dlpack(engine.layout.expert_counts)
        # The live token counts 0 .. max_tokens as a device table, made here (setup, never during a
        # capture): a dispatch of T tokens passes the address of entry T.
        device = self.num_recv_rows.device
        self.counts = torch.arange(max_tokens + 1, dtype=torch.int32, device=device)
        torch.cuda.current_stream(device).synchronize()
        self.last_tokens: Optional[int] = None
        self.last_mask = None

    def count_ptr(self, num_tokens: int) -> int:
        """The device address of the live count num_tokens (at most max_tokens: _check_tokens)."""
        return self.counts.data_ptr() + 4 * num_tokens


@dataclass(frozen=True)
class BufferStatus:
    """Buffer.status(): each engine's MoeStatus, by (hidden, num_experts); a shape's second engine
    (two operations in flight) by (hidden, num_experts, 1)."""

    engines: Dict[Tuple[int, ...], MoeStatus]
    # The low-latency mode's engines, by (num_max_dispatch_tokens_per_rank, hidden, num_experts); a
    # shape's second engine (two operations in flight) by (..., num_experts, 1).
    low_latency: Dict[Tuple[int, ...], MoeStatus] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.engines.values()) and all(s.ok for s in self.low_latency.values())

    def describe(self) -> str:
        if not self.engines and not self.low_latency:
            return "ok (no engine yet)"
        return "; ".join([f"hidden={k[0]}, num_experts={k[1]}{' (second engine)' if len(k) > 2 else ''}: "
                          f"{s.describe()}" for k, s in self.engines.items()] +
                         [f"low-latency num_max_dispatch_tokens_per_rank={k[0]}, hidden={k[1]}, num_experts={k[2]}"
                          f"{' (second engine)' if len(k) > 3 else ''}: {s.describe()}"
                          for k, s in self.low_latency.items()])


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


class Buffer(LowLatencyMode):
    """DeepEP's Buffer on graphep, on one node: the normal (intranode) mode, and with
    low_latency_mode=True the low-latency mode too (graphep/deep_ep/low_latency.py). Collective
    to create, like DeepEP's.

    Arguments as DeepEP's. num_nvl_bytes sizes the normal mode's engines' T_max
    (graphep.deep_ep.config). With low_latency_mode=True the constructor makes the low-latency
    engines of the shapes get_low_latency_rdma_size_hint was asked for (each hint within
    num_rdma_bytes; the engines size themselves); graphep/deep_ep/low_latency.py says more.
    num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl and use_fabric are accepted
    and not read. enable_shrink=True (with low_latency_mode) maps DeepEP's mask buffer onto
    the low-latency engines' active-rank mask (graphep/deep_ep/low_latency.py). num_rdma_bytes > 0
    without low_latency_mode (internode), enable_shrink without low_latency_mode, comm (mpi4py),
    groups that span nodes, and low_latency_mode on GPUs joined by PCIe alone (the low-latency
    engines need every peer on the same GPU or over NVLink: their payload crosses as 128-byte
    lines that must land whole) raise graphep.Error NOT_SUPPORTED.
    """

    num_sms: int = 20

    def __init__(self, group: Optional["dist.ProcessGroup"], num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False, use_fabric: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None) -> None:
        self._destroyed = True  # until set up
        if comm is not None:
            raise not_supported("Buffer(comm=...): mpi4py communicators are not supported; pass the torch.distributed "
                                "process group as `group`")
        if group is None:
            raise invalid_argument("Buffer(group=None): pass the torch.distributed process group of the expert-"
                                   "parallel ranks")
        if num_rdma_bytes > 0 and not low_latency_mode:
            raise not_supported(f"Buffer(num_rdma_bytes={num_rdma_bytes}) without low_latency_mode: there is no RDMA "
                                f"buffer; {_INTERNODE}: pass num_rdma_bytes=0, or low_latency_mode=True")
        if enable_shrink and not low_latency_mode:
            raise not_supported("Buffer(enable_shrink=True) without low_latency_mode: shrink mode masks ranks of "
                                "the low-latency engines (their active-rank mask)")
        if not torch.cuda.is_available():
            raise Error(Status.NO_DEVICE, "Buffer: PyTorch sees no CUDA device")
        self.rank, self.group, self.group_size = group.rank(), group, group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.enable_shrink = bool(low_latency_mode), bool(enable_shrink)
        self._masked_ranks: set = set()  # shrink mode: the ranks left out (low_latency_update_mask_buffer)
        self.explicitly_destroy = explicitly_destroy
        self._device = torch.cuda.current_device()
        # Each rank's host, and the low-latency shapes it hinted (whose engines are made below).
        hinted = hinted_shapes(HINTED, self.group_size, num_rdma_bytes) if self.low_latency_mode else []
        facts: List[Optional[Tuple[str, list]]] = [None] * self.group_size
        dist.all_gather_object(facts, (socket.gethostname(), hinted), group=group)
        hosts = [f[0] for f in facts]
        if len(set(hosts)) > 1:
            raise not_supported(f"Buffer: the group spans {len(set(hosts))} nodes ({', '.join(sorted(set(hosts)))}); "
                                f"{_INTERNODE}")
        shapes = hinted_by_any_rank([f[1] for f in facts])  # the same list on every rank
        self._group = group_from_process_group(group, device=self._device)  # collective
        self._comm_stream = torch.cuda.Stream(device=self._device)
        self._engines: Dict[Tuple[int, int], _EngineState] = {}
        # (T, hidden, num_experts) -> the shape's first low-latency engine (its second: .second)
        self._ll_engines: Dict[Tuple[int, int, int], _LowLatencyState] = {}
        self._sm_budget: Optional[int] = None
        self._warned_sms = False
        self._destroyed = False
        for shape in shapes:  # as DeepEP allocates its RDMA buffer here
            self._low_latency_engine(*shape)

    # ---- lifetime ----------------------------------------------------------------------------
    def destroy(self) -> None:
        """Releases the engines and the graphep group (Buffer(explicitly_destroy=True) only, as in
        DeepEP). Waits for this rank's device first. Unlike DeepEP's destroy, nothing is left
        dangling: a tensor this Buffer returned that views an engine's buffers (the recv_x,
        recv_count and handle of low_latency_dispatch, get_next_low_latency_combine_buffer's)
        keeps that engine, and the group's NCCL communicator, alive until it is released. Release
        them before destroy(): a peer's destroy() waits in NCCL's teardown until this rank's
        communicator is gone too."""
        if not self.explicitly_destroy:
            raise invalid_argument("Buffer.destroy() needs Buffer(explicitly_destroy=True), as in DeepEP (otherwise "
                                   "the Buffer's resources go with it)")
        self._require_alive()
        torch.cuda.synchronize(self._device)
        self._engines.clear()
        self._ll_engines.clear()
        self._group = None
        self._destroyed = True

    def _require_alive(self) -> None:
        if self._destroyed:
            raise invalid_argument("this graphep.deep_ep.Buffer was destroyed")

    # ---- DeepEP's static helpers -------------------------------------------------------------
    @staticmethod
    def is_sm90_compiled() -> bool:
        """True when this process's GPU is sm_90 (Hopper): graphep's kernels are built for it."""
        return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """The num_sms of get_dispatch_config / get_combine_config's Configs (even, as in DeepEP)."""
        if new_num_sms % 2 != 0:
            raise invalid_argument(f"set_num_sms({new_num_sms}): the SM count must be even")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on torch.cuda.current_stream() (previous_event of a later call)."""
        event = torch.cuda.Event()
        event.record()
        return EventOverlap(event)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's recommended dispatch Config for num_ranks, with Buffer.num_sms (graphep reads num_sms only)."""
        return dispatch_config(num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's recommended combine Config for num_ranks, with Buffer.num_sms (graphep reads num_sms only)."""
        return combine_config(num_ranks, Buffer.num_sms)

    def get_comm_stream(self) -> torch.cuda.Stream:
        """The stream the Buffer's work runs on."""
        return self._comm_stream

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        raise not_supported("get_local_buffer_tensor: graphep exposes no raw communication buffer (its engines own "
                            "their symmetric heaps; dispatch outputs are fresh tensors)")

    def status(self) -> BufferStatus:
        """graphep extra: each engine's MoeStatus (what the device counted); synchronises the device."""
        return BufferStatus(statuses(self._engines, lambda st: st.engine.status()), self._low_latency_status())

    # ---- engines -----------------------------------------------------------------------------
    def _budget(self, config: Config) -> int:
        """The SM budget of this Buffer's engines: the first call's Config decides."""
        budget = sm_budget(config.num_sms)
        if self._sm_budget is None:
            self._sm_budget = budget
        elif budget != self._sm_budget and not self._warned_sms:
            self._warned_sms = True
            warnings.warn(f"graphep.deep_ep: Config.num_sms={config.num_sms} is ignored: this Buffer's engines run "
                          f"with sm_budget={self._sm_budget}, set by its first call's Config (graphep tunes itself; "
                          "of a Config it honours num_sms only, once per Buffer)", stacklevel=3)
        return self._sm_budget

    def _engine(self, hidden: int, num_experts: int, config: Config) -> _EngineState:
        """The first engine for (hidden, num_experts), made on first use (collective)."""
        budget = self._budget(config)
        st = self._engines.get((hidden, num_experts))
        if st is None:
            st = self._engines[(hidden, num_experts)] = self._make_engine(hidden, num_experts, budget, "dispatch")
        return st

    def _make_engine(self, hidden: int, num_experts: int, budget: int, what: str) -> _EngineState:
        """A new engine for (hidden, num_experts) (setup: collective, host syncs; refused during a
        CUDA graph capture)."""
        refuse_during_capture(what, f"engine (hidden={hidden}, num_experts={num_experts})")
        heap = heap_bytes_for(hidden, num_experts, self.group_size, budget)
        tokens = max_tokens_per_rank(self.num_nvl_bytes, heap, os.environ.get(MAX_TOKENS_ENV))
        engine = create_engine(self._group, engine_config(tokens, hidden, num_experts, budget))
        return _EngineState(engine, hidden, num_experts, tokens)

    def _dispatch_engine(self, first: _EngineState, num_tokens: int, mask) -> _EngineState:
        """The engine of first's shape a dispatch of `mask` over num_tokens tokens runs on
        (graphep/deep_ep/in_flight.py): the first free one; else one whose last dispatch routed the
        same tokens (the same mask tensor and count: its handle stays served, as a re-dispatch such
        as num_worst_tokens' needs no second engine); else the shape's second, made now, while the
        first holds a dispatch not yet combined; with two held, the older dispatch's (its handle
        goes stale)."""
        return engine_for_dispatch(  # never None: the normal mode has no hooks
            first, lambda: self._make_engine(first.hidden, first.num_experts, self._sm_budget,
                                             "dispatch while an earlier one is not yet combined"),
            lambda e: e.last_mask is mask and e.last_tokens == num_tokens)

    def _check_tokens(self, st: _EngineState, num_tokens: int) -> None:
        if num_tokens <= st.max_tokens:
            return
        want = _align(num_tokens, TOKENS_STEP)
        how = f"set {MAX_TOKENS_ENV}={want} before the Buffer's first dispatch"
        if want <= TOKENS_CAP:
            need = memory_requirements(engine_config(want, st.hidden, st.num_experts, self._sm_budget),
                                       self.group_size).symmetric_heap_bytes
            how = f"create the Buffer with num_nvl_bytes >= {need}, or {how}"
        raise invalid_argument(f"dispatch: num_tokens={num_tokens} (rows of x) exceeds this Buffer's limit of "
                               f"{st.max_tokens} tokens per rank (hidden={st.hidden}, num_experts={st.num_experts}, "
                               f"from num_nvl_bytes={self.num_nvl_bytes}); {how}")

    def _head(self, handle) -> SendHead:
        if (not isinstance(handle, (tuple, list)) or len(handle) != 6 or not isinstance(handle[5], SendHead)
                or handle[5].buffer is not self):
            raise invalid_argument("handle is not a handle of this graphep.deep_ep.Buffer's dispatch (the 6-tuple its "
                                   "dispatch returned)")
        return handle[5]

    # ---- streams (DeepEP's conventions) -------------------------------------------------------
    @staticmethod
    def _check_streams(previous_event, async_finish: bool, allocate_on_comm_stream: bool) -> None:
        if allocate_on_comm_stream and (getattr(previous_event, "event", None) is None or not async_finish):
            raise invalid_argument("allocate_on_comm_stream=True needs previous_event and async_finish=True, as in "
                                   "DeepEP")

    def _begin(self, previous_event, async_finish: bool):
        """The stream the work runs on. None: the current stream (a call without async_finish,
        after previous_event when given). DeepEP runs such a call on its comm stream and makes
        the current stream wait for it: the caller sees the same order, and graphep saves the
        two stream switches and their events. With async_finish: the comm stream, after
        previous_event, or else after the current stream."""
        event = getattr(previous_event, "event", None)
        if not async_finish:
            if event is not None:
                torch.cuda.current_stream(self._device).wait_event(event)
            return None
        comm = self._comm_stream
        if event is not None:
            comm.wait_event(event)
        else:
            comm.wait_stream(torch.cuda.current_stream(self._device))
        return comm

    @staticmethod
    def _on(stream):
        """A context that makes `stream` current (None: the current stream already is)."""
        return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)

    def _raw(self, stream) -> int:
        """The cudaStream_t of `stream` (None: the current stream)."""
        return current_raw_stream(self._device) if stream is None else stream.cuda_stream

    def _finish(self, work, allocate_on_comm_stream: bool, tensors) -> EventOverlap:
        """async_finish (work is the comm stream): an event on it, the tensors recorded on the
        streams that use them. Otherwise the work ran on the current stream: nothing to wait."""
        if work is None:
            return EventOverlap()
        event = torch.cuda.Event()
        event.record(work)
        compute = torch.cuda.current_stream(self._device) if allocate_on_comm_stream else None
        for t in tensors:
            if isinstance(t, torch.Tensor):
                t.record_stream(work)
                if compute is not None:
                    t.record_stream(compute)
        return EventOverlap(event)

    # ---- layout ------------------------------------------------------------------------------
    @as_extension
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        """(num_tokens_per_rank int32 [R], None, num_tokens_per_expert int32 [E], is_token_in_rank
        bool [T, R], event) of topk_idx [T, K] (int64 or int32, -1: none): one kernel, no sync."""
        self._require_alive()
        self._check_streams(previous_event, async_finish, allocate_on_comm_stream)
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or not topk_idx.is_contiguous():
            raise invalid_argument("get_dispatch_layout: topk_idx must be a contiguous [num_tokens, num_topk] tensor")
        index = _INDEX_TYPES.get(str(topk_idx.dtype)[6:])
        if index is None:
            raise invalid_argument(f"get_dispatch_layout: topk_idx has dtype {topk_idx.dtype}, expected torch.int64 "
                                   "(deep_ep.topk_idx_t) or torch.int32")
        if topk_idx.device != torch.device("cuda", self._device):
            raise invalid_argument(f"get_dispatch_layout: topk_idx is on {topk_idx.device}, expected "
                                   f"cuda:{self._device}")
        T, k, R = topk_idx.shape[0], topk_idx.shape[1], self.group_size
        work = self._begin(previous_event, async_finish)
        device = topk_idx.device
        with self._on(work if allocate_on_comm_stream else None):
            per_rank = torch.empty((R,), dtype=torch.int32, device=device)
            per_expert = torch.empty((num_experts,), dtype=torch.int32, device=device)
            in_rank = torch.empty((T, R), dtype=torch.bool, device=device)
        if T == 0:
            with self._on(work):
                per_rank.zero_()
                per_expert.zero_()
        else:
            token_layout(topk_idx.data_ptr(), index, T, k, num_experts, R, per_rank.data_ptr(),
                         per_expert.data_ptr(), in_rank.data_ptr(), self._raw(work))
        event = self._finish(work, allocate_on_comm_stream, (topk_idx, per_rank, per_expert, in_rank))
        return per_rank, None, per_expert, in_rank, event

    # ---- dispatch ----------------------------------------------------------------------------
    @as_extension
    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], handle: Optional[Tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> \
            Tuple[Union[Tuple[torch.Tensor, torch.Tensor], torch.Tensor], Optional[torch.Tensor],
                  Optional[torch.Tensor], Optional[List[int]], Optional[Tuple], EventOverlap]:
        """DeepEP's dispatch: (recv_x or (recv_x, recv_x_scales), recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, event). A cached dispatch (handle given) returns
        recv_x and Nones, as DeepEP's. num_tokens_per_rank and num_tokens_per_rdma_rank are not
        read (graphep counts on the device)."""
        self._require_alive()
        config = self.get_dispatch_config(self.group_size) if config is None else config
        self._check_streams(previous_event, async_finish, allocate_on_comm_stream)
        if isinstance(x, tuple):
            if len(x) != 2:
                raise invalid_argument(f"dispatch: x is a tuple of {len(x)}; fp8 x is (e4m3 [T, H], float32 scales "
                                       "[T, H / 128])")
            x, x_scales = x
        else:
            x_scales = None
        fp8 = x_scales is not None
        if fp8 and x_scales.dtype == torch.int32:
            raise not_supported("dispatch: x_scales has dtype torch.int32 (packed UE8M0 scales); graphep.deep_ep "
                                "takes float32 scales [T, H / 128]")
        if fp8 and x.dtype != torch.float8_e4m3fn:
            raise invalid_argument(f"dispatch: x has dtype {x.dtype} with scales; fp8 x is (torch.float8_e4m3fn "
                                   "[T, H], float32 scales [T, H / 128])")
        if x.dim() != 2:
            raise invalid_argument(f"dispatch: x has shape {list(x.shape)}, expected [num_tokens, hidden]")
        if expert_alignment < 1:
            raise invalid_argument(f"dispatch: expert_alignment={expert_alignment} is below 1")
        if num_worst_tokens < 0:
            raise invalid_argument(f"dispatch: num_worst_tokens={num_worst_tokens} is negative")
        T, H, R = x.shape[0], x.shape[1], self.group_size
        dev = self._device
        _check_tensor(x, "dispatch: x", (torch.float8_e4m3fn,) if fp8 else (torch.bfloat16,), (T, H), dev)
        if fp8:
            if H % 128 != 0:
                raise invalid_argument(f"dispatch: hidden={H} is not a multiple of 128 (fp8 has a scale per 128 values)")
            _check_tensor(x_scales, "dispatch: x_scales", (torch.float32,), (T, H // 128), dev, contiguous=False)
        if topk_idx is not None:
            _check_tensor(topk_idx, "dispatch: topk_idx", (torch.int64, torch.int32), (T, topk_idx.shape[-1]), dev)
            _check_tensor(topk_weights, "dispatch: topk_weights", (torch.float32,), (T, topk_idx.shape[1]), dev)
        cached = handle is not None
        if cached:
            if topk_idx is not None or topk_weights is not None:
                raise invalid_argument("dispatch: a cached dispatch (handle given) takes no topk_idx / topk_weights, "
                                       "as in DeepEP")
            head = self._head(handle)
            mask, n = head.is_token_in_rank, head.num_recv_tokens
            if T != head.num_tokens:
                raise invalid_argument(f"dispatch: x has {T} rows, but the handle's dispatch had {head.num_tokens} "
                                       "tokens")
            self._budget(config)
            st = head.state
            if not st.combined and (st.last_mask is not mask or st.last_tokens != T):
                # Its engine holds another dispatch not yet combined (another micro-batch's): the
                # handle's routing moves to the engine the policy gives, and the handle with it.
                st = head.state = self._dispatch_engine(self._engines[(st.hidden, st.num_experts)], T, mask)
        else:
            if is_token_in_rank is None or num_tokens_per_expert is None:
                missing = "is_token_in_rank" if is_token_in_rank is None else "num_tokens_per_expert"
                raise invalid_argument(f"dispatch: {missing} is None; a non-cached dispatch needs it (from "
                                       "get_dispatch_layout), as in DeepEP")
            if (topk_idx is None) != (topk_weights is None):
                raise invalid_argument("dispatch: pass topk_idx and topk_weights together, or neither")
            if num_worst_tokens > 0 and topk_idx is None:
                raise invalid_argument("dispatch: num_worst_tokens needs topk_idx and topk_weights, as in DeepEP")
            if topk_idx is not None and topk_idx.dim() != 2:
                raise invalid_argument(f"dispatch: topk_idx has shape {list(topk_idx.shape)}, expected "
                                       "[num_tokens, num_topk]")
            _check_tensor(is_token_in_rank, "dispatch: is_token_in_rank", (torch.bool,), (T, R), dev)
            first = self._engine(H, num_tokens_per_expert.numel(), config)
            self._check_tokens(first, T)  # before a second engine is made for it
            st, mask, n = self._dispatch_engine(first, T, is_token_in_rank), is_token_in_rank, None
        self._check_tokens(st, T)
        k = 0 if topk_idx is None else topk_idx.shape[1]
        sync = not cached and num_worst_tokens == 0
        rows = n if cached else (num_worst_tokens if num_worst_tokens > 0 else R * st.max_tokens)

        work = self._begin(previous_event, async_finish)
        device = x.device
        with self._on(work if allocate_on_comm_stream else None):
            shape = (max(rows, 1), H)  # the engine takes at least one row: [:0] views of it when none come
            recv_x = torch.empty(shape, dtype=x.dtype, device=device)
            recv_scales = torch.empty((shape[0], H // 128), dtype=torch.float32, device=device) if fp8 else None
            recv_topk_idx = torch.empty((shape[0], k), dtype=topk_idx.dtype, device=device) if k else None
            recv_topk_weights = torch.empty((shape[0], k), dtype=torch.float32, device=device) if k else None
            recv_src_idx = None if cached else torch.empty((shape[0],), dtype=torch.int32, device=device)
            rank_prefix_matrix = None if cached else torch.empty((R, R), dtype=torch.int32, device=device)
            channel_prefix_matrices = None if cached else (torch.empty((R, 0), dtype=torch.int32, device=device),
                                                           torch.empty((R, 0), dtype=torch.int32, device=device))
        outputs = DispatchOutputs(recv_x=recv_x, recv_scales=recv_scales, row_experts=recv_topk_idx,
                                  row_expert_weights=recv_topk_weights, row_src_token=recv_src_idx,
                                  rank_prefix_matrix=rank_prefix_matrix)
        per_expert: Optional[List[int]] = None if cached else []
        if T == 0 or (recv_topk_idx is not None and num_worst_tokens > 0):
            with self._on(work):
                if recv_topk_idx is not None and num_worst_tokens > 0:
                    recv_topk_idx.fill_(-1)  # the rows past the received ones read -1, as DeepEP's
                xs, ss, ms, ids, ws = (x, x_scales, mask, topk_idx, topk_weights) if T > 0 else \
                    self._stand_ins(x, fp8, k, topk_idx)
        else:
            xs, ss, ms, ids, ws = x, x_scales, mask, topk_idx, topk_weights
        self._engine_dispatch(st, xs, ss, ms, ids, ws, st.count_ptr(T),
                              self._raw(work), k, outputs)
        self._dispatch_seq += 1
        st.seq, st.combined, st.last_tokens, st.last_mask = self._dispatch_seq, False, T, mask
        if sync:
            with self._on(work):
                n, counts = self._read_counts(st, k > 0, num_tokens_per_expert)
            per_expert = [_align(c, expert_alignment) for c in counts]
        event = self._finish(work, allocate_on_comm_stream,
                             (x, x_scales, mask, topk_idx, topk_weights, num_tokens_per_expert, recv_x, recv_scales,
                              recv_topk_idx, recv_topk_weights, recv_src_idx, rank_prefix_matrix))
        if rows == 0 or sync:
            keep = 0 if rows == 0 else n
            recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx = (
                None if t is None else t[:keep] for t in (recv_x, recv_scales, recv_topk_idx, recv_topk_weights,
                                                           recv_src_idx))
        received = (recv_x, recv_scales) if fp8 else recv_x
        if cached:
            return received, None, None, None, None, event
        head = SendHead(self, st, st.seq, T, recv_src_idx.shape[0], k, mask)
        handle = (rank_prefix_matrix, channel_prefix_matrices[0], channel_prefix_matrices[1], recv_src_idx, mask, head)
        return received, recv_topk_idx, recv_topk_weights, per_expert, handle, event

    @staticmethod
    def _engine_dispatch(st: _EngineState, x, x_scales, mask, topk_idx, topk_weights, count: int, stream: int,
                         k: int, o: DispatchOutputs) -> None:
        """The engine's dispatch with the arrays' pointers: graphep's own call, nothing checked twice
        (dispatch above checked every tensor; the engine checks the pointers and alignment)."""
        ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
        kw = {}
        if x_scales is not None:
            kw.update(input=DispatchInput.FP8, x_scales=x_scales.data_ptr(), scale_token_stride=x_scales.stride(0),
                      scale_hidden_stride=x_scales.stride(1))
        else:
            kw["input"] = DispatchInput.BF16
        st.engine._core.dispatch(
            x.data_ptr(), ptr(topk_idx), _ID_TYPES[topk_idx.dtype] if topk_idx is not None else _ID_TYPES[torch.int64],
            ptr(topk_weights), count, stream, top_k=k, token_in_rank=mask.data_ptr(),
            out_recv_x=o.recv_x.data_ptr(), out_recv_scales=ptr(o.recv_scales), out_row_experts=ptr(o.row_experts),
            out_row_expert_weights=ptr(o.row_expert_weights), out_row_src_token=ptr(o.row_src_token),
            out_rank_prefix_matrix=ptr(o.rank_prefix_matrix), out_rows=o.recv_x.shape[0], **kw)

    def _stand_ins(self, x: torch.Tensor, fp8: bool, k: int, topk_idx: Optional[torch.Tensor]):
        """One-row inputs for a dispatch of no tokens (the engine takes x of 1 to T_max rows; the
        live count is 0, so nothing of them is read). Made on the current stream (the caller's
        `with` says which)."""
        device, H, R = x.device, x.shape[1], self.group_size
        xs = torch.zeros((1, H), dtype=torch.uint8 if fp8 else x.dtype, device=device)
        xs = xs.view(torch.float8_e4m3fn) if fp8 else xs
        ss = torch.ones((1, H // 128), dtype=torch.float32, device=device) if fp8 else None
        ms = torch.zeros((1, R), dtype=torch.bool, device=device)
        ids = None if k == 0 else torch.full((1, k), -1, dtype=topk_idx.dtype, device=device)
        ws = None if k == 0 else torch.zeros((1, k), dtype=torch.float32, device=device)
        return xs, ss, ms, ids, ws

    def _read_counts(self, st: _EngineState, has_topk: bool, num_tokens_per_expert: torch.Tensor):
        """(rows received, per-local-expert counts): the one host sync of a non-cached dispatch.
        With top-k, the engine's per-expert counts; without, DeepEP's definition: the sum over the
        ranks of num_tokens_per_expert (one all_reduce over the group)."""
        if has_topk:
            per_expert = st.expert_counts
        else:
            total = num_tokens_per_expert.to(dtype=torch.int32, copy=True)
            dist.all_reduce(total, group=self.group)
            local = st.num_experts // self.group_size
            per_expert = total[self.rank * local:(self.rank + 1) * local]
        host = torch.cat([st.num_recv_rows, per_expert]).tolist()
        return host[0], host[1:]

    # ---- combine -----------------------------------------------------------------------------
    @as_extension
    def combine(self, x: torch.Tensor, handle: Tuple, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """DeepEP's combine: (combined_x bf16 [T, H], combined_topk_weights float32 [T, k] or None,
        event). combined_x[t] = the sum over the ranks token t went to of their rows of x (no
        weights: the experts applied them), plus bias; topk_weights [n, k] sum the same way."""
        self._require_alive()
        config = self.get_combine_config(self.group_size) if config is None else config
        self._check_streams(previous_event, async_finish, allocate_on_comm_stream)
        head = self._head(handle)
        st = head.state
        self._budget(config)
        if head.seq != st.seq and (head.num_tokens != st.last_tokens or head.is_token_in_rank is not st.last_mask):
            raise invalid_argument(f"combine: the handle is of dispatch {head.seq}, but graphep combines the last "
                                   f"dispatch of the engine (dispatch {st.seq}), which routed other tokens: a later "
                                   "dispatch reused the engine (a shape holds its last two dispatches not yet "
                                   "combined, and reuses an engine whose dispatch was combined); combine before "
                                   "that, or dispatch again with this handle")
        n, H, T = head.num_recv_tokens, st.hidden, head.num_tokens
        _check_tensor(x, "combine: x (a row per row the handle's dispatch received)", (torch.bfloat16,), (n, H),
                      self._device)
        k = 0
        if topk_weights is not None:
            if topk_weights.dtype != torch.float32 or topk_weights.dim() != 2 or topk_weights.shape[0] != n:
                raise invalid_argument(f"combine: topk_weights has dtype {topk_weights.dtype}, shape "
                                       f"{list(topk_weights.shape)}, expected torch.float32 [{n}, num_topk]")
            k = topk_weights.shape[1]
            _check_tensor(topk_weights, "combine: topk_weights", (torch.float32,), (n, k), self._device)
        biases = (bias, None) if isinstance(bias, torch.Tensor) else (tuple(bias) if bias is not None else (None, None))
        if len(biases) != 2:
            raise invalid_argument(f"combine: bias is a sequence of {len(biases)}, expected a tensor or a pair")
        for b in biases:
            if b is not None and (b.dtype != torch.bfloat16 or tuple(b.shape) != (T, H)):
                raise invalid_argument(f"combine: bias has dtype {b.dtype}, shape {list(b.shape)}, expected "
                                       f"torch.bfloat16 [{T}, {H}]")

        work = self._begin(previous_event, async_finish)
        device = x.device
        with self._on(work if allocate_on_comm_stream else None):
            combined_x = torch.empty((max(T, 1), H), dtype=torch.bfloat16, device=device)
            combined_w = torch.empty((max(T, 1), k), dtype=torch.float32, device=device) if k else None
        y, w = x, topk_weights
        if n == 0:  # the engine reads at least one row: nothing of it counts
            with self._on(work):
                y = torch.zeros((1, H), dtype=torch.bfloat16, device=device)
                w = None if k == 0 else torch.zeros((1, k), dtype=torch.float32, device=device)
        # graphep's own call with the pointers (every tensor checked above; the engine checks them
        # as pointers and their alignment).
        st.engine._core.combine(y.data_ptr(), combined_x.data_ptr(), self._raw(work), expert_output_rows=y.shape[0],
                                row_values=0 if w is None else w.data_ptr(),
                                out_values=0 if combined_w is None else combined_w.data_ptr(), num_values=k)
        st.combined = True  # free for the next dispatch
        if T > 0 and any(b is not None for b in biases):
            with self._on(work):
                total = combined_x.float()
                for b in biases:
                    if b is not None:
                        total += b.float()
                combined_x.copy_(total)  # one more bf16 rounding: the bias is not fused
        event = self._finish(work, allocate_on_comm_stream,
                             (x, topk_weights, combined_x, combined_w) + biases)
        if T == 0:
            combined_x, combined_w = combined_x[:0], None if combined_w is None else combined_w[:0]
        return combined_x, combined_w, event

    # ---- internode (not in this version) -----------------------------------------------------
    def internode_dispatch(self, *args, **kwargs):
        raise not_supported(f"internode_dispatch: {_INTERNODE}")

    def internode_combine(self, *args, **kwargs):
        raise not_supported(f"internode_combine: {_INTERNODE}")
