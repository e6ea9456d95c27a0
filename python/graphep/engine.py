"""Engine: one rank's MoE dispatch / combine (graphep::Engine), for arrays of any framework.

    engines = graphep.create_engines(group, config)        # setup, collective
    layout = engine.dispatch(x, topk_idx, topk_weights, num_tokens, stream)
    ...experts read layout.recv_x by layout.expert_offsets / expert_counts, write layout.expert_output...
    engine.combine(out, stream)                            # out[t] = sum_k w[t, k] * y(t, k)

dispatch and combine only enqueue kernels on `stream`: no host sync, no allocation, so they
capture inside a CUDA graph (torch.cuda.graph, cudaStreamBeginCapture); every rank of the group
must call each one, every dispatch followed by its combine. The live token count is a device
int32 scalar the caller owns and rewrites between replays: at most the rows of x (the engine
clamps it to max_tokens_per_rank; with x of max_tokens_per_rank rows any value is safe).
Several ranks driven by one thread need one stream per rank.
"""

from typing import List, Optional

from graphep import _graphep
from graphep.arrays import describe, require_matrix, require_scalar, stream_handle
from graphep.errors import invalid_argument
from graphep.layouts import ExpertMajorLayout, receive_layout

_INDEX_TYPES = {"int32": _graphep.IndexType.INT32, "int64": _graphep.IndexType.INT64}


class Engine:
    """One rank's engine; make them with create_engines. Holds its group and GPU buffers."""

    __slots__ = ("_core", "_layout", "_config", "_rows", "__weakref__")

    def __init__(self, core: _graphep.EngineCore):
        self._core = core
        self._config = core.config
        self._layout = ExpertMajorLayout.from_core(core)  # a BatchedLayout for config.receive_layout BATCHED
        self._rows = 0  # rows of the last dispatch's x: combine's out must hold them

    # ---- facts ------------------------------------------------------------------------------
    rank = property(lambda self: self._core.rank)
    world_size = property(lambda self: self._core.world_size)
    device = property(lambda self: self._core.device)
    path = property(lambda self: self._core.path, doc="the path chosen at setup (never AUTO)")
    config = property(lambda self: self._config)
    symmetric_heap_bytes = property(lambda self: self._core.symmetric_heap_bytes)
    private_bytes = property(lambda self: self._core.private_bytes)
    layout = property(lambda self: self._layout, doc="the dispatch output views (fixed for the engine's life)")

    # ---- run path (capturable) ---------------------------------------------------------------
    def dispatch(self, x, topk_idx, topk_weights, num_tokens, stream) -> ExpertMajorLayout:
        """Sends each token to the ranks of its top-k experts; returns the layout views.

        x [T, H] bfloat16, topk_idx [T, K] int32 or int64 (global expert ids, -1: none),
        topk_weights [T, K] float32, num_tokens int32 device scalar (live rows, <= T), T <= T_max.
        """
        c, dev = self._config, self._core.device
        xi = describe(x, "x")
        rows = require_matrix(xi, "x", cols=c.hidden, dtypes=("bfloat16",), device=dev,
                              max_rows=c.max_tokens_per_rank)
        ii = describe(topk_idx, "topk_idx")
        require_matrix(ii, "topk_idx", cols=c.top_k, dtypes=("int32", "int64"), device=dev, rows=rows)
        wi = describe(topk_weights, "topk_weights")
        require_matrix(wi, "topk_weights", cols=c.top_k, dtypes=("float32",), device=dev, rows=rows)
        ni = describe(num_tokens, "num_tokens")
        require_scalar(ni, "num_tokens", dtype="int32", device=dev)
        self._core.dispatch(xi.ptr, ii.ptr, _INDEX_TYPES[ii.dtype], wi.ptr, ni.ptr, stream_handle(stream))
        self._rows = rows
        return self._layout

    def combine(self, out, stream, expert_output=None):
        """Brings the expert outputs of the last dispatch home: out[t] = sum_k w[t, k] * y(t, k).

        out [T', H] bfloat16 with T' >= the rows of the last dispatch's x (rows [0, live) are
        written); expert_output [capacity, H] bfloat16 in the layout's row order, or None for the
        engine's own layout.expert_output. Returns out.
        """
        c, dev = self._config, self._core.device
        oi = describe(out, "out")
        rows = require_matrix(oi, "out", cols=c.hidden, dtypes=("bfloat16",), device=dev)
        if rows < self._rows:
            raise invalid_argument(f"out has {rows} rows, fewer than the {self._rows} rows of the last dispatch's x")
        y = 0
        if expert_output is not None:
            ei = describe(expert_output, "expert_output")
            require_matrix(ei, "expert_output", cols=c.hidden, dtypes=("bfloat16",), device=dev,
                           rows=self._layout.capacity)
            y = ei.ptr
        self._core.combine(y, oi.ptr, stream_handle(stream))
        return out

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


