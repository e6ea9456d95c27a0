"""Receive layouts: how dispatch lays out the rows a rank receives.

EXPERT_MAJOR (the default): recv_x rows grouped by local expert. Expert j's rows are
[expert_offsets[j], expert_offsets[j] + expert_counts[j]), in (source rank, source token, top-k
slot) order, each expert's first row a multiple of expert_alignment; row i came from token
row_src_token[i] of rank row_src_rank[i], its slot row_topk_slot[i], weight row_weight[i].
num_recv_rows is the rows received (padding excluded). Rows whose place would be at or past the
capacity are dropped (the last rows of the last experts): offsets and counts describe only the
kept rows, expert_dropped[j] counts expert j's dropped rows (Engine.status() counts them all).
All of it lives on the device, written by dispatch: reading it needs no host sync and a captured
graph reads the live values.

BATCHED (MoeConfig.receive_layout): the same views, with expert j's rows in a block of
rows_per_expert rows starting at j x rows_per_expert (expert_offsets[j] is that, whatever
arrives): recv_x is [E_local x rows_per_expert, H], viewed as [E_local, rows_per_expert, H] by the
masked / batched GEMMs that take vLLM's batched-experts format; an expert keeps its first
rows_per_expert rows and drops (and counts) the rest.

RANK_MAJOR: one row per (source token, this rank), sources one after another (rank_offsets
[world + 1]), each row's top-k local experts and weights (row_experts / row_expert_weights
[capacity, K], -1 / 0 where a slot's expert lives elsewhere): DeepEP's default layout, the fewest
bytes, for grouped GEMMs that gather rows. The experts write one row per received row, the
weighted sum over its slots, and combine sums those over the ranks. expert_counts / expert_offsets
count (row, slot) entries per expert; row_topk_slot is -1 and row_weight 0.
"""

from dataclasses import dataclass
from typing import Optional

from graphep import _graphep
from graphep.arrays import DeviceArray
from graphep.errors import not_supported

ReceiveLayout = _graphep.ReceiveLayout  # EXPERT_MAJOR, BATCHED, RANK_MAJOR (graphep::ReceiveLayout)


def receive_layout(value) -> ReceiveLayout:
    """A ReceiveLayout from itself or its name ("expert_major", "batched", "rank_major"); graphep.Error
    NOT_SUPPORTED naming anything else."""
    if isinstance(value, ReceiveLayout):
        return value
    for member in ReceiveLayout:
        if isinstance(value, str) and value.lower() == member.name.lower():
            return member
    built = ", ".join(repr(m.name.lower()) for m in ReceiveLayout)
    raise not_supported(f"layout={value!r} is not a receive layout of this build ({built})")


@dataclass(frozen=True)
class ExpertMajorLayout:
    """Zero-copy views of one rank's dispatch output (engine-owned, fixed for the engine's life)."""

    recv_x: DeviceArray  # [capacity, H] bfloat16; fp8 engines: uint8 holding e4m3fn
    # [capacity, H / 128] float32: the scales of an fp8 dispatch. fp8 engines, and bf16 engines whose
    # hidden is a multiple of 128 (the latency path's input=FP8_QUANTIZE); None otherwise. Whether
    # dispatch sends fp8 by default is config.dispatch_type, not this field.
    recv_scales: Optional[DeviceArray]
    expert_offsets: DeviceArray  # [E_local + 1] int32
    expert_counts: DeviceArray  # [E_local] int32: rows of each expert kept
    expert_dropped: DeviceArray  # [E_local] int32: rows of each expert this dispatch dropped (past capacity)
    row_src_rank: DeviceArray  # [capacity] int32
    row_src_token: DeviceArray  # [capacity] int32
    row_topk_slot: DeviceArray  # [capacity] int32
    row_weight: DeviceArray  # [capacity] float32
    num_recv_rows: DeviceArray  # [1] int32
    expert_totals: DeviceArray  # [E_local] int64: rows routed to each expert (kept or dropped) since creation
    expert_output: DeviceArray  # [capacity, H] bfloat16: where experts may write for combine
    capacity: int
    hidden: int
    num_local_experts: int
    first_local_expert: int  # global id of local expert 0
    layout: ReceiveLayout = ReceiveLayout.EXPERT_MAJOR
    # [capacity, H] uint8 over recv_x's first capacity x H bytes, where recv_scales exists: the e4m3
    # rows of an engine-quantised fp8 dispatch on a bf16 engine (row stride H bytes).
    recv_x_fp8: Optional[DeviceArray] = None
    # [E_local, world] int64, expert-major and batched: expert j's rows from rank q are
    # [begin, begin + count) counted from the expert's first row, as begin << 32 | count (kept rows).
    expert_source_ranges: Optional[DeviceArray] = None

    @staticmethod
    def from_core(core) -> "ExpertMajorLayout":
        views = {name: (None if nd is None else DeviceArray(nd)) for name, nd in core.views().items()}
        common = dict(capacity=core.capacity, hidden=core.config.hidden, num_local_experts=core.num_local_experts,
                      first_local_expert=core.first_local_expert)
        if core.config.receive_layout == ReceiveLayout.BATCHED:
            return BatchedLayout(**views, **common, rows_per_expert=core.rows_per_expert)
        if core.config.receive_layout == ReceiveLayout.RANK_MAJOR:
            extra = {name: DeviceArray(nd) for name, nd in core.rank_major_views().items()}
            return RankMajorLayout(**views, **common, **extra)
        return ExpertMajorLayout(**views, **common)


@dataclass(frozen=True)
class BatchedLayout(ExpertMajorLayout):
    """The batched layout's views: ExpertMajorLayout's, expert j's block of rows_per_expert rows at
    j x rows_per_expert (capacity = num_local_experts x rows_per_expert)."""

    rows_per_expert: int = 0
    layout: ReceiveLayout = ReceiveLayout.BATCHED


@dataclass(frozen=True)
class RankMajorLayout(ExpertMajorLayout):
    """The rank-major layout's views: ExpertMajorLayout's (rows are records, see the module's
    text), and the source offsets and each row's top-k local experts and weights."""

    rank_offsets: Optional[DeviceArray] = None  # [world + 1] int32
    row_experts: Optional[DeviceArray] = None  # [capacity, K] int32, -1: not here
    row_expert_weights: Optional[DeviceArray] = None  # [capacity, K] float32
    layout: ReceiveLayout = ReceiveLayout.RANK_MAJOR
