"""torch.ops.graphep.dispatch and torch.ops.graphep.combine: torch.library custom ops.

Both return nothing and declare every tensor they write as mutated (the engine's layout buffers,
combine's out), so torch.compile keeps them opaque and ordered, and their fake implementations
are trivial. Where torch.compile hands dispatch clones of the layout buffers (functionalization
without re-inplacing), dispatch copies its results into them. The engine is named by an int (its
registry key). Each call enqueues the engine's kernels on PyTorch's current stream of the
tensors' device: no host sync, no allocation, so both capture inside torch.cuda.graph.
"""

import weakref
from typing import NamedTuple, Optional

import torch

from graphep._graphep import DType
from graphep.engine import Engine

_lib = torch.library.Library("graphep", "DEF")
_lib.define("dispatch(int engine, Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor num_tokens, "
            "Tensor(a!)[] layout) -> ()")
_lib.define("combine(int engine, Tensor expert_output, Tensor[] layout, Tensor(a!) out) -> ()")

_engines: "weakref.WeakValueDictionary[int, Engine]" = weakref.WeakValueDictionary()


class TorchLayout(NamedTuple):
    """The engine's layout views as torch tensors (made once per engine; see graphep.layouts)."""

    recv_x: torch.Tensor  # [capacity, H] bfloat16, or float8_e4m3fn for fp8 engines
    recv_scales: Optional[torch.Tensor]  # fp8: [capacity, H / 128] float32
    expert_offsets: torch.Tensor  # [E_local + 1] int32
    expert_counts: torch.Tensor  # [E_local] int32
    expert_dropped: torch.Tensor  # [E_local] int32: rows past the capacity, per expert (last dispatch)
    row_src_rank: torch.Tensor  # [capacity] int32
    row_src_token: torch.Tensor  # [capacity] int32
    row_topk_slot: torch.Tensor  # [capacity] int32
    row_weight: torch.Tensor  # [capacity] float32
    num_recv_rows: torch.Tensor  # [1] int32
    expert_totals: torch.Tensor  # [E_local] int64
    expert_output: torch.Tensor  # [capacity, H] bfloat16
    # Rank-major engines only (None otherwise): [world + 1] int32, [capacity, K] int32 / float32.
    rank_offsets: Optional[torch.Tensor] = None
    row_experts: Optional[torch.Tensor] = None
    row_expert_weights: Optional[torch.Tensor] = None

    def written(self):
        """The tensors dispatch writes (what torch.ops.graphep.dispatch declares mutated), in this
        order: every field but expert_output, recv_scales only for fp8, the rank-major tables only
        for rank-major engines. Plain attribute reads, so torch.compile traces it."""
        return [t for t in (self.recv_x, self.recv_scales, self.expert_offsets, self.expert_counts,
                            self.expert_dropped, self.row_src_rank, self.row_src_token, self.row_topk_slot,
                            self.row_weight, self.num_recv_rows, self.expert_totals, self.rank_offsets,
                            self.row_experts, self.row_expert_weights) if t is not None]


_layouts: "weakref.WeakKeyDictionary[Engine, TorchLayout]" = weakref.WeakKeyDictionary()


def torch_layout(engine: Engine) -> TorchLayout:
    """The engine's layout as torch tensors sharing its memory (cached; they keep the engine alive)."""
    cached = _layouts.get(engine)
    if cached is None:
        views = engine.layout
        tensors = {}
        for name in TorchLayout._fields:
            v = getattr(views, name, None)  # the rank-major tables exist on rank-major layouts only
            tensors[name] = None if v is None else torch.from_dlpack(v)
        if engine.config.dispatch_type != DType.FP8_E4M3:
            # A bf16 engine has scales too (for the latency path's fp8 dispatch); these ops send the
            # config's type, so recv_scales stays None here, the adapters' sign of a bf16 engine.
            tensors["recv_scales"] = None
        if tensors["recv_x"].dtype == torch.uint8:
            tensors["recv_x"] = tensors["recv_x"].view(torch.float8_e4m3fn)
        cached = TorchLayout(**tensors)
        _layouts[engine] = cached
        _engines[id(engine)] = engine
    return cached


def _engine(key: int) -> Engine:
    engine = _engines.get(key)
    if engine is None:
        raise KeyError(f"graphep engine {key} is gone (it was destroyed, or never passed through torch_layout)")
    return engine


@torch.library.impl(_lib, "dispatch", "CUDA")
def _dispatch_cuda(engine, x, topk_idx, topk_weights, num_tokens, layout):
    e = _engine(engine)
    stream = torch.cuda.current_stream(x.device)
    e.dispatch(x, topk_idx, topk_weights, num_tokens, stream.cuda_stream)
    # The engine writes its own buffers. Under torch.compile without re-inplacing (aot_eager),
    # functionalization passes clones of them here and copies the clones back afterwards: the
    # clones must then receive what dispatch wrote, or the copy-back would undo it.
    own = torch_layout(e).written()
    if len(layout) != len(own):
        raise ValueError(f"graphep::dispatch: layout has {len(layout)} tensors; pass TorchLayout.written() "
                         f"({len(own)} tensors)")
    for given, mine in zip(layout, own):
        if given.data_ptr() != mine.data_ptr():
            given.copy_(mine)


@torch.library.impl(_lib, "combine", "CUDA")
def _combine_cuda(engine, expert_output, layout, out):
    e = _engine(engine)
    own = expert_output.data_ptr() == torch_layout(e).expert_output.data_ptr()
    e.combine(out, torch.cuda.current_stream(out.device).cuda_stream, None if own else expert_output)


@torch.library.register_fake("graphep::dispatch", lib=_lib)
def _dispatch_fake(engine, x, topk_idx, topk_weights, num_tokens, layout):
    return None


@torch.library.register_fake("graphep::combine", lib=_lib)
def _combine_fake(engine, expert_output, layout, out):
    return None


def dispatch(engine: Engine, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
             num_tokens: torch.Tensor) -> TorchLayout:
    """torch.ops.graphep.dispatch on the current stream; returns the layout tensors (the same
    tensors every call: their contents are the last dispatch's)."""
    layout = torch_layout(engine)
    torch.ops.graphep.dispatch(id(engine), x, topk_idx, topk_weights, num_tokens, layout.written())
    return layout


def combine(engine: Engine, out: torch.Tensor, expert_output: Optional[torch.Tensor] = None) -> torch.Tensor:
    """torch.ops.graphep.combine on the current stream: out[t] = sum_k w[t, k] * y(t, k), written
    in place. expert_output: [capacity, H] bfloat16, default the layout's own buffer."""
    layout = torch_layout(engine)
    y = layout.expert_output if expert_output is None else expert_output
    torch.ops.graphep.combine(id(engine), y, layout.written(), out)
    return out


def token_count(device, value: int = 0) -> torch.Tensor:
    """A device int32 scalar for the live token count (dispatch's num_tokens): rewrite it in place
    (count.fill_(n), count.copy_(...)) between graph replays."""
    return torch.full((1,), value, dtype=torch.int32, device=device)
