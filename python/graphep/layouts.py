"""Receive layouts: how dispatch lays out the rows a rank receives.

EXPERT_MAJOR (the one this build has): recv_x rows grouped by local expert. Expert j's rows are
[expert_offsets[j], expert_offsets[j] + expert_counts[j]), in (source rank, source token, top-k
slot) order, each expert's first row a multiple of expert_alignment; row i came from token
row_src_token[i] of rank row_src_rank[i], its slot row_topk_slot[i], weight row_weight[i].
num_recv_rows is the rows received (padding excluded). Rows whose place would be at or past the
capacity are dropped (the last rows of the last experts): offsets and counts describe only the
kept rows, expert_dropped[j] counts expert j's dropped rows (Engine.status() counts them all).
All of it lives on the device, written by dispatch: reading it needs no host sync and a captured
graph reads the live values.

Planned, not built: BATCHED ([E_local, max rows per expert, H], vLLM's batched-experts format) and
RANK_MAJOR (rows grouped by source rank); they will be new members here and new view classes.
"""

import enum
from dataclasses import dataclass
from typing import Optional

from graphep.arrays import DeviceArray
from graphep.errors import not_supported


class ReceiveLayout(enum.Enum):
    EXPERT_MAJOR = "expert_major"


def receive_layout(value) -> ReceiveLayout:
    """A ReceiveLayout from itself or its name; graphep.Error NOT_SUPPORTED naming anything else."""
    try:
        return ReceiveLayout(value.value if isinstance(value, ReceiveLayout) else value)
    except ValueError:
        built = ", ".join(repr(m.value) for m in ReceiveLayout)
        raise not_supported(f"layout={value!r} is not a receive layout of this build ({built})") from None


@dataclass(frozen=True)
class ExpertMajorLayout:
    """Zero-copy views of one rank's dispatch output (engine-owned, fixed for the engine's life)."""

    recv_x: DeviceArray  # [capacity, H] bfloat16; fp8 engines: uint8 holding e4m3fn
    recv_scales: Optional[DeviceArray]  # fp8: [capacity, H / 128] float32; bf16: None
    expert_offsets: DeviceArray  # [E_local + 1] int32
    expert_counts: DeviceArray  # [E_local] int32: rows of each expert kept
    expert_dropped: DeviceArray  # [E_local] int32: rows of each expert this dispatch dropped (past capacity)
    row_src_rank: DeviceArray  # [capacity] int32
    row_src_token: DeviceArray  # [capacity] int32
    row_topk_slot: DeviceArray  # [capacity] int32
    row_weight: DeviceArray  # [capacity] float32
    num_recv_rows: DeviceArray  # [1] int32
    expert_totals: DeviceArray  # [E_local] int64: rows received per expert since creation
    expert_output: DeviceArray  # [capacity, H] bfloat16: where experts may write for combine
    capacity: int
    hidden: int
    num_local_experts: int
    first_local_expert: int  # global id of local expert 0
    layout: ReceiveLayout = ReceiveLayout.EXPERT_MAJOR

    @staticmethod
    def from_core(core) -> "ExpertMajorLayout":
        views = {name: (None if nd is None else DeviceArray(nd)) for name, nd in core.views().items()}
        return ExpertMajorLayout(**views, capacity=core.capacity, hidden=core.config.hidden,
                                 num_local_experts=core.num_local_experts,
                                 first_local_expert=core.first_local_expert)
