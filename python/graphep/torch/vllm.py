"""GraphepPrepareAndFinalize: graphep with the shape of vLLM's modular-kernel prepare/finalize
contract (FusedMoEPrepareAndFinalizeModular in vllm/model_executor/layers/fused_moe/modular_kernel.py),
written from that contract as documented, without importing vLLM.

    prepare(a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
            quant_config, defer_input_quant=False)
        -> (a1q, a1q_scale, ExpertTokensMetadata(expert_num_tokens=<device counts>), None, None)
    finalize(output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
             weight_and_reduce_impl)   # writes output [M, H] in place: weighted and reduced

a1q is the engine's receive buffer in the expert-major layout ([capacity, H]; expert j's rows
start at layout.expert_offsets[j]), bf16 or, for an fp8 engine, e4m3 with [capacity, H / 128]
fp32 scales (block scales over groups of 128 values). The per-expert counts stay on the device
(expert_num_tokens_cpu is None: nothing syncs). The experts write fused_expert_output in the same
row order and finalize's combine applies the top-k weights and reduces (vLLM's
TopKWeightAndReduceDelegate contract: the experts apply no weights). Everything is capturable:
prepare writes the live row count M = a1.shape[0] into a device scalar it owns (a fill kernel).
A vLLM integration wraps this object in its own FusedMoEPrepareAndFinalizeModular subclass,
mapping activation_format "standard" to FusedMoEActivationFormat.Standard.

An engine with the batched receive layout (MoeConfig.receive_layout BATCHED) gives
activation_format "batched" (FusedMoEActivationFormat.BatchedExperts): a1q is recv_x viewed as
[E_local, rows_per_expert, H] (scales [E_local, rows_per_expert, H / 128]), expert j's valid rows
its first expert_num_tokens[j]; fused_expert_output comes back in the same shape.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from graphep.engine import Engine
from graphep.errors import invalid_argument, not_supported
from graphep.layouts import ReceiveLayout
from graphep.torch import ops


@dataclass
class ExpertTokensMetadata:
    """vLLM's ExpertTokensMetadata fields: per-local-expert row counts on the device."""

    expert_num_tokens: Optional[torch.Tensor]
    expert_num_tokens_cpu: Optional[torch.Tensor] = None


class GraphepPrepareAndFinalize:
    activation_format = "standard"  # rows [capacity, H] with per-expert counts, not [E, max, H] batches

    def __init__(self, engine: Engine):
        self.engine = engine
        self.layout = ops.torch_layout(engine)
        if engine.config.receive_layout == ReceiveLayout.RANK_MAJOR:
            raise not_supported("GraphepPrepareAndFinalize: a rank-major engine has no vLLM activation format "
                                "(use receive_layout EXPERT_MAJOR or BATCHED)")
        self._rows_per_expert = getattr(engine.layout, "rows_per_expert", 0)
        if self._rows_per_expert > 0:
            self.activation_format = "batched"
        self._num_tokens = ops.token_count(torch.device("cuda", engine.device))
        self._meta = ExpertTokensMetadata(expert_num_tokens=self.layout.expert_counts)

    # ---- the contract's queries ----------------------------------------------------------------
    def topk_indices_dtype(self) -> Optional[torch.dtype]:
        return None  # int32 and int64 both accepted

    def max_num_tokens_per_rank(self) -> int:
        return self.engine.config.max_tokens_per_rank

    def num_dispatchers(self) -> int:
        return self.engine.world_size

    def output_is_reduced(self) -> bool:
        return True  # finalize leaves every token's full sum over its experts on its own rank

    def supports_async(self) -> bool:
        return False

    # ---- prepare / finalize ----------------------------------------------------------------------
    def prepare(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                expert_map: Optional[torch.Tensor], apply_router_weight_on_input: bool, quant_config=None,
                defer_input_quant: bool = False) -> Tuple:
        cfg = self.engine.config
        if num_experts != cfg.num_experts:
            raise invalid_argument(f"prepare: num_experts={num_experts}, but the engine has {cfg.num_experts}")
        if expert_map is not None:
            raise not_supported("prepare: expert_map is not supported (graphep places experts contiguously: "
                                "expert e on rank e // (num_experts // world_size))")
        if apply_router_weight_on_input:
            raise not_supported("prepare: apply_router_weight_on_input=True is not supported (combine applies "
                                "the weights)")
        fp8 = self.layout.recv_scales is not None
        if defer_input_quant and fp8:
            raise not_supported("prepare: defer_input_quant=True with an fp8 engine (dispatch quantises); use a "
                                "bf16 engine")
        self._num_tokens.fill_(a1.shape[0])
        ops.dispatch(self.engine, a1, topk_ids, topk_weights.float(), self._num_tokens)
        x, scales = self.layout.recv_x, self.layout.recv_scales
        if self._rows_per_expert > 0:  # [E_local, rows_per_expert, ...]: views, no copy
            x = x.view(-1, self._rows_per_expert, x.shape[-1])
            scales = None if scales is None else scales.view(-1, self._rows_per_expert, scales.shape[-1])
        return x, scales, self._meta, None, None

    def finalize(self, output: torch.Tensor, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, apply_router_weight_on_input: bool, weight_and_reduce_impl=None) -> None:
        if self._rows_per_expert > 0 and fused_expert_output.dim() == 3:
            fused_expert_output = fused_expert_output.reshape(-1, fused_expert_output.shape[-1])
        ops.combine(self.engine, output, fused_expert_output)
