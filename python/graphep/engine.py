"""Engine: one rank's MoE dispatch / combine (graphep::Engine), for arrays of any framework.

    engines = graphep.create_engines(group, config)        # setup, collective
    layout = engine.dispatch(x, topk_idx, topk_weights, num_tokens, stream)
    ...experts read layout.recv_x by layout.expert_offsets / expert_counts, write layout.expert_output...
    engine.combine(out, stream)                            # out[t] = sum_k w[t, k] * y(t, k)

dispatch and combine only enqueue kernels on `stream`: no host sync, no allocation, so they
capture inside a CUDA graph (torch.cuda.graph, cudaStreamBeginCapture); every rank of the group
must call each one. A combine serves the last dispatch; dispatch -> dispatch (the second replaces
the first) and combine -> combine (the same dispatch combined again) are defined. The live token
count is a device int32 scalar the caller owns and rewrites between replays: at most the rows of
x (the engine clamps it to max_tokens_per_rank; with x of max_tokens_per_rank rows any value is
safe). Several ranks driven by one thread need one stream per rank.

Keywords of the rank-major layout on the throughput path where every peer is reached by
load/store (the direct dispatch; elsewhere the engine raises NOT_SUPPORTED
naming the argument), what DeepEP's normal mode needs (graphep.deep_ep):

    engine.dispatch(x, None, None, num_tokens, stream, token_in_rank=mask,     # route by [T, R] bool
                    x_scales=scales, input=DispatchInput.FP8,                  # x already e4m3
                    outputs=DispatchOutputs(recv_x=..., row_src_token=..., rank_prefix_matrix=...))
    engine.combine(out, stream, y, row_values=w, out_values=w_out)             # y of any row count

top_k (any call) takes the first top_k <= config.top_k columns of topk_idx / topk_weights.

Keywords of the latency path (expert-major and batched layouts), what DeepEP's low-latency mode
needs (graphep.deep_ep): the weights may come at combine instead of dispatch, an engine-quantised
fp8 dispatch on a bf16 engine (its e4m3 rows in layout.recv_x_fp8, scales in layout.recv_scales),
and each operation split into its send and receive halves:

    engine.dispatch(x, ids, None, num_tokens, stream, input=DispatchInput.FP8_QUANTIZE,
                    scale_format=Fp8Scales.UE8M0, recv_stats=stats, half=MoeHalf.SEND)
    ...other work on the stream...
    engine.receive(stream)                                                     # the receive half
    engine.combine(out, stream, y, topk_weights=w)                             # weights [T, K] here
"""

import operator
from dataclasses import dataclass
from typing import Any, List, Optional

from graphep import _graphep
from graphep._graphep import DispatchInput, Fp8Scales, MoeHalf, MoePath
from graphep.arrays import ArrayInfo, DeviceArray, _require_on, describe, require_matrix, require_scalar, stream_handle
from graphep.errors import invalid_argument
from graphep.layouts import ExpertMajorLayout, receive_layout

_INDEX_TYPES = {"int32": _graphep.IndexType.INT32, "int64": _graphep.IndexType.INT64}
_FP8_DTYPES = ("float8_e4m3fn", "uint8")  # e4m3 bytes: torch's float8 dtype, or raw bytes (DLPack)
_BOOL_DTYPES = ("bool", "bool8", "uint8")  # one byte per entry: torch, __cuda_array_interface__, raw
_MAX_VALUES = 16  # combine's row_values columns at most (graphep::CombineArgs)


@dataclass
class DispatchOutputs:
    """Caller-owned dispatch outputs (rank-major, direct dispatch): the engine writes the received
    rows here instead of its own buffers. Rows: recv_x's; rows past them are dropped and counted
    (Engine.status()). Every field but recv_x may be None (not written).

    recv_x              [rows, H] bfloat16, or e4m3 bytes (float8_e4m3fn / uint8) when the call sends fp8
    recv_scales         [rows, H / 128] float32: fp8 calls only (required there)
    row_experts         [rows, top_k] topk_idx's int type: each slot's local expert, -1 where not here
    row_expert_weights  [rows, top_k] float32: each slot's weight, 0 where row_experts is -1
    row_src_rank        [rows] int32: the rank each row came from
    row_src_token       [rows] int32: the token (row of that rank's x) each row is
    rank_prefix_matrix  [R, R] int32: [i][j] = rows ranks 0..i send to rank j
    """

    recv_x: Any
    recv_scales: Any = None
    row_experts: Any = None
    row_expert_weights: Any = None
    row_src_rank: Any = None
    row_src_token: Any = None
    rank_prefix_matrix: Any = None


def _require_vector(info: ArrayInfo, name: str, *, rows: int, dtype: str, device: int) -> None:
    """Checks a contiguous [rows] array."""
    _require_on(info, name, device)
    if info.dtype != dtype:
        raise invalid_argument(f"{name} has dtype {info.dtype}, expected {dtype}")
    if info.shape != (rows,):
        raise invalid_argument(f"{name} has shape {list(info.shape)}, expected [{rows}]")
    if rows > 1 and info.strides[0] != 1:
        raise invalid_argument(f"{name} has strides {list(info.strides)}, expected [1] (pass a contiguous array)")


def _require_strided(info: ArrayInfo, name: str, *, rows: int, cols: int, dtypes, device: int) -> None:
    """Checks a [rows, cols] array of any non-negative element strides (fp8 scales: row- or
    column-major)."""
    _require_on(info, name, device)
    if info.dtype not in dtypes:
        raise invalid_argument(f"{name} has dtype {info.dtype}, expected {' or '.join(dtypes)}")
    if info.shape != (rows, cols):
        raise invalid_argument(f"{name} has shape {list(info.shape)}, expected [{rows}, {cols}]")
    if any(s < 0 for s in info.strides):
        raise invalid_argument(f"{name} has strides {list(info.strides)}; negative strides are not supported")
    if rows * cols > 1 and tuple(info.strides) == (0, 0):  # (0, 0) tells the engine "row-major"
        raise invalid_argument(f"{name} has strides [0, 0] (one broadcast value); pass a materialised array")


def _index(value) -> Optional[int]:
    """value as an int (ints, NumPy integers, integer 0-d tensors: anything with __index__), or None
    (a bool is not taken for a number here)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _rank_mask(ranks, world_size: int) -> int:
    """An active-rank mask from an int mask (bit r: rank r) or an iterable of int ranks, each in
    [0, world_size); anything else is a graphep.Error naming it."""
    if isinstance(ranks, bool):
        raise invalid_argument(f"ranks={ranks!r}: pass an int mask or the ranks, not a bool")
    mask = _index(ranks)
    if mask is not None:
        if not 0 <= mask < 1 << 32:
            raise invalid_argument(f"ranks={mask:#x} is not a 32-bit mask")
        return mask
    try:
        members = list(ranks)
    except TypeError:
        raise invalid_argument(f"ranks is a {type(ranks).__name__}: pass an int mask or an iterable of ranks") from None
    mask = 0
    for r in members:
        rank = _index(r)
        if rank is None:
            raise invalid_argument(f"rank {r!r} is a {type(r).__name__}, not an int")
        if not 0 <= rank < world_size:
            raise invalid_argument(f"rank {rank} is outside [0, {world_size})")
        mask |= 1 << rank
    return mask


class Engine:
    """One rank's engine; make them with create_engines. Holds its group and GPU buffers."""

    __slots__ = ("_core", "_layout", "_config", "_rows", "_k", "__weakref__")

    def __init__(self, core: _graphep.EngineCore):
        self._core = core
        self._config = core.config
        self._layout = ExpertMajorLayout.from_core(core)  # a BatchedLayout for config.receive_layout BATCHED
        self._rows = 0  # rows of the last dispatch's x: combine's out must hold them
        self._k = 0  # top-k columns of the last dispatch: combine's topk_weights has them

    # ---- facts ------------------------------------------------------------------------------
    rank = property(lambda self: self._core.rank)
    world_size = property(lambda self: self._core.world_size)
    device = property(lambda self: self._core.device)
    path = property(lambda self: self._core.path, doc="the path chosen at setup (never AUTO)")
    config = property(lambda self: self._config)
    symmetric_heap_bytes = property(lambda self: self._core.symmetric_heap_bytes)
    private_bytes = property(lambda self: self._core.private_bytes)
    layout = property(lambda self: self._layout,
                      doc="the dispatch output views: fixed for the engine's life; what they hold is the last "
                          "dispatch's output, from that dispatch until the next")

    # ---- run path (capturable) ---------------------------------------------------------------
    def dispatch(self, x, topk_idx, topk_weights, num_tokens, stream, *, top_k: Optional[int] = None,
                 token_in_rank=None, x_scales=None, input: Optional[DispatchInput] = None,
                 outputs: Optional[DispatchOutputs] = None, scale_format: Optional[Fp8Scales] = None,
                 recv_stats=None, half: Optional[MoeHalf] = None) -> ExpertMajorLayout:
        """Sends each token to the ranks of its top-k experts; returns the layout views.

        x [T, H] bfloat16, topk_idx [T, K] int32 or int64 (global expert ids, -1: none),
        topk_weights [T, K] float32, num_tokens int32 device scalar (live rows, <= T), T <= T_max.
        K is config.top_k, or top_k (1 to config.top_k) when given.

        token_in_rank [T, R] bool: send token t to rank r where [t][r] is set (DeepEP's
        is_token_in_rank); topk_idx / topk_weights may then be None (rows without slots).
        input: what x holds and what crosses the link. None: FP8 when x_scales is given, else
        CONFIG (bf16 x, sent as config.dispatch_type); BF16 and FP8_QUANTIZE name the wire type;
        FP8: x is e4m3 already ([T, H] float8_e4m3fn or uint8) with x_scales [T, H / 128]
        float32 of any strides (DeepEP passes them column-major).
        outputs: caller-owned outputs (DispatchOutputs) instead of the engine's buffers.

        Latency path: topk_weights may be None (the weights then come at combine, topk_weights).
        scale_format (Fp8Scales) of an engine-quantised fp8 dispatch: FLOAT (default), POW2 or
        UE8M0 (recv_scales then holds [rows, H / 128] exponent bytes). recv_stats [E_local] int32:
        each local expert's rows of this dispatch are added to it on the device. half: WHOLE
        (default) or SEND, whose receive half Engine.receive enqueues.
        """
        c, dev = self._config, self._core.device
        if input is None:
            input = DispatchInput.FP8 if x_scales is not None else DispatchInput.CONFIG
        if not isinstance(input, DispatchInput):
            raise invalid_argument(f"input={input!r} is not a graphep.DispatchInput "
                                   f"({', '.join(m.name for m in DispatchInput)})")
        fp8_in = input == DispatchInput.FP8
        xi = describe(x, "x")
        rows = require_matrix(xi, "x", cols=c.hidden, dtypes=_FP8_DTYPES if fp8_in else ("bfloat16",), device=dev,
                              max_rows=c.max_tokens_per_rank)
        kwargs = {}
        if top_k is not None:
            if topk_idx is None:
                raise invalid_argument(f"top_k={top_k} is given, but topk_idx is None")
            if not 1 <= top_k <= c.top_k:
                raise invalid_argument(f"top_k={top_k} is out of range [1, {c.top_k}] (config.top_k)")
            kwargs["top_k"] = top_k
        k = c.top_k if top_k is None else top_k
        index_type, index_dtype, ii_ptr, wi_ptr = _graphep.IndexType.INT32, None, 0, 0
        if topk_idx is None:
            if token_in_rank is None:
                raise invalid_argument("topk_idx is None: pass topk_idx [T, K] or token_in_rank [T, R]")
            if topk_weights is not None:
                raise invalid_argument("topk_weights is given, but topk_idx is None (pass both or neither)")
            k = 0
        else:
            ii = describe(topk_idx, "topk_idx")
            require_matrix(ii, "topk_idx", cols=k, dtypes=("int32", "int64"), device=dev, rows=rows)
            index_type, index_dtype, ii_ptr = _INDEX_TYPES[ii.dtype], ii.dtype, ii.ptr
            if topk_weights is not None:
                wi = describe(topk_weights, "topk_weights")
                require_matrix(wi, "topk_weights", cols=k, dtypes=("float32",), device=dev, rows=rows)
                wi_ptr = wi.ptr
            elif self._core.path != MoePath.LATENCY:
                # Only the latency path can take the weights at combine (CombineArgs.topkWeights).
                raise invalid_argument("topk_weights is None, but topk_idx is given (pass both or neither; None is "
                                       f"for the latency path, and this engine's path is {self._core.path.name})")
        ni = describe(num_tokens, "num_tokens")
        require_scalar(ni, "num_tokens", dtype="int32", device=dev)
        if token_in_rank is not None:
            ti = describe(token_in_rank, "token_in_rank")
            require_matrix(ti, "token_in_rank", cols=self._core.world_size, dtypes=_BOOL_DTYPES, device=dev,
                           rows=rows)
            kwargs["token_in_rank"] = ti.ptr
        if x_scales is not None:
            if not fp8_in:
                raise invalid_argument(f"x_scales is given, but input={input.name}: x_scales go with "
                                       "input=DispatchInput.FP8 (x already e4m3)")
            if c.hidden % 128 != 0:
                raise invalid_argument(f"input=FP8 needs hidden a multiple of 128; this engine has hidden={c.hidden}")
            si = describe(x_scales, "x_scales")
            _require_strided(si, "x_scales", rows=rows, cols=c.hidden // 128, dtypes=("float32",), device=dev)
            kwargs.update(x_scales=si.ptr, scale_token_stride=si.strides[0], scale_hidden_stride=si.strides[1])
        elif fp8_in:
            raise invalid_argument("input=FP8 (x already e4m3) needs x_scales [T, H / 128] float32")
        if input != DispatchInput.CONFIG:
            kwargs["input"] = input
        if outputs is not None:
            wire_fp8 = input in (DispatchInput.FP8, DispatchInput.FP8_QUANTIZE) or (
                input == DispatchInput.CONFIG and c.dispatch_type == _graphep.DType.FP8_E4M3)
            kwargs.update(self._outputs(outputs, k, index_dtype, wire_fp8))
        if scale_format is not None:
            if not isinstance(scale_format, Fp8Scales):
                raise invalid_argument(f"scale_format={scale_format!r} is not a graphep.Fp8Scales "
                                       f"({', '.join(m.name for m in Fp8Scales)})")
            quantised = input == DispatchInput.FP8_QUANTIZE or (
                input == DispatchInput.CONFIG and c.dispatch_type == _graphep.DType.FP8_E4M3)
            if scale_format != Fp8Scales.FLOAT and not quantised:
                raise invalid_argument(f"scale_format={scale_format.name} is the form of the scales the engine "
                                       f"makes; this dispatch (input={input.name}, dispatch_type="
                                       f"{c.dispatch_type.name}) quantises nothing: pass input=FP8_QUANTIZE")
            if scale_format != Fp8Scales.FLOAT:
                kwargs["scale_format"] = scale_format
        if recv_stats is not None:
            local = c.num_experts // self._core.world_size
            si = describe(recv_stats, "recv_stats")
            _require_vector(si, "recv_stats", rows=local, dtype="int32", device=dev)
            kwargs["recv_stats"] = si.ptr
        if half is not None:
            kwargs.update(self._half(half))
        self._core.dispatch(xi.ptr, ii_ptr, index_type, wi_ptr, ni.ptr, stream_handle(stream), **kwargs)
        self._rows, self._k = rows, k
        return self._layout

    @staticmethod
    def _half(half) -> dict:
        if not isinstance(half, MoeHalf):
            raise invalid_argument(f"half={half!r} is not a graphep.MoeHalf ({', '.join(m.name for m in MoeHalf)})")
        return {} if half == MoeHalf.WHOLE else {"half": half}

    def _outputs(self, o: DispatchOutputs, k: int, index_dtype: Optional[str], wire_fp8: bool) -> dict:
        """The core's out_* keywords from `o`, each array checked against the call."""
        if not isinstance(o, DispatchOutputs):
            raise invalid_argument(f"outputs is a {type(o).__name__}, not a graphep.DispatchOutputs")
        c, dev, R = self._config, self._core.device, self._core.world_size
        if o.recv_x is None:
            raise invalid_argument("outputs.recv_x is None: it is required (its rows are the outputs' rows)")
        ri = describe(o.recv_x, "outputs.recv_x")
        rows = require_matrix(ri, "outputs.recv_x", cols=c.hidden, dtypes=_FP8_DTYPES if wire_fp8 else ("bfloat16",),
                              device=dev)
        if rows < 1:
            raise invalid_argument("outputs.recv_x has 0 rows, expected at least 1")
        kw = {"out_recv_x": ri.ptr, "out_rows": rows}
        if wire_fp8:
            if o.recv_scales is None:
                raise invalid_argument("outputs.recv_scales is None, but this dispatch sends fp8: pass "
                                       f"[{rows}, {c.hidden // 128}] float32")
            si = describe(o.recv_scales, "outputs.recv_scales")
            require_matrix(si, "outputs.recv_scales", cols=c.hidden // 128, dtypes=("float32",), device=dev, rows=rows)
            kw["out_recv_scales"] = si.ptr
        elif o.recv_scales is not None:
            raise invalid_argument("outputs.recv_scales is given, but this dispatch sends bf16 (no scales)")
        for name in ("row_experts", "row_expert_weights"):
            a = getattr(o, name)
            if a is None:
                continue
            if k == 0:
                raise invalid_argument(f"outputs.{name} is given, but the dispatch has no top-k slots "
                                       "(topk_idx is None)")
            ai = describe(a, f"outputs.{name}")
            dtype = index_dtype if name == "row_experts" else "float32"
            require_matrix(ai, f"outputs.{name}", cols=k, dtypes=(dtype,), device=dev, rows=rows)
            kw[f"out_{name}"] = ai.ptr
        for name in ("row_src_rank", "row_src_token"):
            a = getattr(o, name)
            if a is not None:
                ai = describe(a, f"outputs.{name}")
                _require_vector(ai, f"outputs.{name}", rows=rows, dtype="int32", device=dev)
                kw[f"out_{name}"] = ai.ptr
        if o.rank_prefix_matrix is not None:
            pi = describe(o.rank_prefix_matrix, "outputs.rank_prefix_matrix")
            require_matrix(pi, "outputs.rank_prefix_matrix", cols=R, dtypes=("int32",), device=dev, rows=R)
            kw["out_rank_prefix_matrix"] = pi.ptr
        return kw

    def combine(self, out, stream, expert_output=None, *, row_values=None, out_values=None, topk_weights=None,
                half: Optional[MoeHalf] = None):
        """Brings the expert outputs of the last dispatch home: out[t] = sum_k w[t, k] * y(t, k)
        (rank-major: the sum over ranks of the token's rows, the experts having applied the weights).

        out [T', H] bfloat16 with T' >= the rows of the last dispatch's x (rows [0, live) are
        written); expert_output [rows, H] bfloat16 in the layout's row order (rows read: those the
        last dispatch received), or None for the engine's own layout.expert_output.
        row_values [rows, V] float32 (V <= 16): values per received row, summed over the ranks
        into out_values [T', V] float32 like the rows (fp32, rank order). Returns out.

        Latency path: topk_weights [T, K] float32 (T, K: the last dispatch's rows of x and top-k
        columns) are the weights to reduce with, in place of the dispatch's. half: WHOLE (default)
        or SEND, whose receive half Engine.receive enqueues.
        """
        c, dev = self._config, self._core.device
        oi = describe(out, "out")
        rows = require_matrix(oi, "out", cols=c.hidden, dtypes=("bfloat16",), device=dev)
        if rows < self._rows:
            raise invalid_argument(f"out has {rows} rows, fewer than the {self._rows} rows of the last dispatch's x")
        y, y_rows, kwargs = 0, self._layout.capacity, {}
        if expert_output is not None:
            ei = describe(expert_output, "expert_output")
            y_rows = require_matrix(ei, "expert_output", cols=c.hidden, dtypes=("bfloat16",), device=dev)
            if y_rows < 1:
                raise invalid_argument("expert_output has 0 rows, expected at least 1")
            y = ei.ptr
            kwargs["expert_output_rows"] = y_rows
        if (row_values is None) != (out_values is None):
            raise invalid_argument("row_values and out_values go together (pass both or neither)")
        if row_values is not None:
            vi = describe(row_values, "row_values")
            if len(vi.shape) != 2 or not 1 <= vi.shape[1] <= _MAX_VALUES:
                raise invalid_argument(f"row_values has shape {list(vi.shape)}, expected [{y_rows}, V] with V from 1 "
                                       f"to {_MAX_VALUES}")
            v = vi.shape[1]
            require_matrix(vi, "row_values", cols=v, dtypes=("float32",), device=dev, rows=y_rows)
            wi = describe(out_values, "out_values")
            w_rows = require_matrix(wi, "out_values", cols=v, dtypes=("float32",), device=dev)
            if w_rows < self._rows:
                raise invalid_argument(f"out_values has {w_rows} rows, fewer than the {self._rows} rows of the last "
                                       "dispatch's x")
            kwargs.update(row_values=vi.ptr, out_values=wi.ptr, num_values=v)
        if topk_weights is not None:
            if self._k == 0:
                raise invalid_argument("topk_weights is given, but the last dispatch had no top-k slots (or there "
                                       "was none)")
            ti = describe(topk_weights, "topk_weights")
            require_matrix(ti, "topk_weights", cols=self._k, dtypes=("float32",), device=dev, rows=self._rows)
            kwargs["topk_weights"] = ti.ptr
        if half is not None:
            kwargs.update(self._half(half))
        self._core.combine(y, oi.ptr, stream_handle(stream), **kwargs)
        return out

    def receive(self, stream) -> None:
        """Capturable, collective: enqueues on `stream` the receive half of the last dispatch or
        combine called with half=SEND (the same stream, or one ordered after the send). No other
        dispatch or combine of this engine may come between the two halves."""
        self._core.receive(stream_handle(stream))

    # ---- the active-rank mask (latency path) -------------------------------------------------
    def set_active_ranks(self, ranks, stream) -> None:
        """Capturable: the ranks that take part from the next dispatch on (an int bit mask, bit r
        for rank r, or an iterable of ranks), written on `stream` in stream order. Every rank gives
        the same ranks for a dispatch and its combine; a rank left out is sent nothing and waited
        for by no one, and the entries routed to its experts are dropped and counted
        (status().masked_entries). Latency path (graphep::Engine::setActiveRanks)."""
        self._core.set_active_ranks(_rank_mask(ranks, self._core.world_size), stream_handle(stream))

    def recover(self, ranks, stream) -> None:
        """After a wait named a dead peer (failed is True): back to service among `ranks` (this
        rank in them, the dead one out), with no graph recaptured. Synchronises this rank's device;
        every survivor calls it with the same ranks (graphep::Engine::recover)."""
        self._core.recover(_rank_mask(ranks, self._core.world_size), stream_handle(stream))

    def barrier(self, stream) -> None:
        """Capturable, collective: a device barrier on `stream` among the ranks of the active-rank
        mask (every rank of the mask makes the same barrier calls between the same operations).
        A rank that does not come within GRAPHEP_TIMEOUT_MS is named and the engine fails, or with
        MoeConfig.shrink_on_timeout it is masked and the barrier completes among the others
        (status().shrunk_ranks). The latency path and the direct throughput path
        (graphep::Engine::barrier)."""
        self._core.barrier(stream_handle(stream))

    @property
    def active_ranks(self):
        """The active-rank mask's device word as an int32 [1] DeviceArray (bit r: rank r takes
        part; with MoeConfig.shrink_on_timeout the kernels clear the bits of the ranks they mask),
        fixed for the engine's life; None on the throughput path over the movers."""
        nd = self._core.active_ranks_view()
        return None if nd is None else DeviceArray(nd)

    @property
    def active_ranks_device(self) -> int:
        """The mask's device word (a uint32 pointer) for a kernel that changes it in stream order;
        0 on the throughput path."""
        return self._core.active_ranks_device

    # ---- diagnostics (not capturable) ------------------------------------------------------
    def status(self) -> _graphep.MoeStatus:
        """Bad input the device counted (invalid ids, dropped rows, clamped counts, device errors).
        Synchronises this rank's device."""
        return self._core.status()

    def check_health(self, stream, timeout_ms: int = 1000) -> _graphep.HealthReport:
        """Waits up to timeout_ms for the work enqueued on `stream`; on a stall, says which peer this
        rank waits for and puts the engine in its failed state. Never synchronises the device."""
        return self._core.check_health(stream_handle(stream), timeout_ms)

    @property
    def failed(self) -> bool:
        return self._core.failed

    def clear_status(self) -> None:
        self._core.clear_status()

    def __repr__(self) -> str:
        return (f"graphep.Engine(rank={self.rank}/{self.world_size}, device={self.device}, "
                f"path={self.path.name}, {self._config!r})")


def create_engines(group: _graphep.Group, config: _graphep.MoeConfig, layout=None) -> List[Engine]:
    """Collective over `group`: one Engine per rank this process drives, in local-rank order.
    Setup work (allocates the symmetric heap and buffers, loads kernels); never capturable. The
    receive layout is config.receive_layout; `layout` (a ReceiveLayout or its name), when given,
    must agree with it."""
    if layout is not None and receive_layout(layout) != config.receive_layout:
        raise invalid_argument(f"layout={layout!r} differs from config.receive_layout="
                               f"{config.receive_layout.name}: set config.receive_layout")
    return [Engine(core) for core in _graphep.create_engines(group, config)]


def create_engine(group: _graphep.Group, config: _graphep.MoeConfig, layout=None) -> Engine:
    """Collective, for a process that drives exactly one rank (torchrun, mpirun)."""
    if group.num_local_ranks != 1:
        raise invalid_argument(f"create_engine: this process drives {group.num_local_ranks} ranks; "
                               "use create_engines")
    return create_engines(group, config, layout)[0]


def memory_requirements(config: _graphep.MoeConfig, world_size: int) -> _graphep.MemoryRequirements:
    """Device bytes per rank of an engine with `config` (symmetric heap, private buffers, NCCL
    staging when a peer is NCCL-only), before anything is allocated: no GPU needed. Validates the
    config first (graphep.Error naming the bad field)."""
    return _graphep.memory_requirements(config, world_size)


