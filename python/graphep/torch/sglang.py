"""GraphepDispatcher: graphep with the shape of SGLang's token dispatcher (BaseDispatcher in
sglang/srt/layers/moe/token_dispatcher/base.py), written from that contract, without importing
SGLang.

    out = dispatcher.dispatch(hidden_states, topk_output)   # topk_output.topk_ids / .topk_weights
    ...experts on out.hidden_states by out.expert_offsets / expert_counts, write combine input...
    y = dispatcher.combine(combine_input)                   # combine_input.hidden_states, or a tensor

GraphepDispatchOutput carries what DeepEP's normal-mode output carries (hidden_states,
hidden_states_scale, per-expert counts) with the counts and offsets on the device instead of a
host list, so nothing syncs and the pair captures in a CUDA graph. Its format is the string
"graphep_expert_major"; an SGLang integration maps it onto its DispatchOutputFormat. combine
returns a view of a buffer the dispatcher owns ([max_tokens_per_rank, H], rows [0, M)): copy it
before the next combine if it must live on.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from graphep.engine import Engine
from graphep.torch import ops


@dataclass
class GraphepDispatchOutput:
    hidden_states: torch.Tensor  # [capacity, H]: recv_x, expert-major
    hidden_states_scale: Optional[torch.Tensor]  # fp8: [capacity, H / 128] float32
    expert_counts: torch.Tensor  # [E_local] int32, device
    expert_offsets: torch.Tensor  # [E_local + 1] int32, device
    num_recv_rows: torch.Tensor  # [1] int32, device
    layout: ops.TorchLayout  # every view (row sources, weights, the engine's expert_output)
    # "graphep_expert_major": rows packed by expert; "graphep_batched": expert j's rows at
    # j x rows_per_expert (hidden_states [E_local x rows_per_expert, H]); "graphep_rank_major": one
    # row per (source token, this rank), its slots in layout.row_experts (graphep.RankMajorLayout)
    format: str = "graphep_expert_major"
    rows_per_expert: int = 0


class GraphepDispatcher:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.layout = ops.torch_layout(engine)
        device = torch.device("cuda", engine.device)
        self._num_tokens = ops.token_count(device)
        cfg = engine.config
        self._out = torch.empty(cfg.max_tokens_per_rank, cfg.hidden, dtype=torch.bfloat16, device=device)
        self._rows = 0

    def dispatch(self, hidden_states: torch.Tensor, topk_output, **kwargs) -> GraphepDispatchOutput:
        self._rows = hidden_states.shape[0]
        self._num_tokens.fill_(self._rows)
        weights = topk_output.topk_weights
        ops.dispatch(self.engine, hidden_states, topk_output.topk_ids,
                     weights if weights.dtype == torch.float32 else weights.float(), self._num_tokens)
        v = self.layout
        rows = getattr(self.engine.layout, "rows_per_expert", 0)
        fmt = {"BATCHED": "graphep_batched", "RANK_MAJOR": "graphep_rank_major"}.get(
            self.engine.config.receive_layout.name, "graphep_expert_major")
        return GraphepDispatchOutput(v.recv_x, v.recv_scales, v.expert_counts, v.expert_offsets, v.num_recv_rows, v,
                                     fmt, rows)

    def combine(self, combine_input, **kwargs) -> torch.Tensor:
        y = combine_input if isinstance(combine_input, torch.Tensor) else combine_input.hidden_states
        ops.combine(self.engine, self._out, y)
        return self._out[: self._rows]
