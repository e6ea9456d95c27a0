"""graphep for PyTorch: custom ops that capture in torch.cuda.graph, a torch.distributed bootstrap,
and adapters shaped like the serving stacks' MoE interfaces.

    import torch, graphep, graphep.torch as gt
    group = gt.group_from_process_group()              # torchrun: one rank per process
    engine = graphep.create_engine(group, config)
    layout = gt.dispatch(engine, x, topk_idx, topk_weights, num_tokens)   # torch.ops.graphep.dispatch
    ... experts read layout.recv_x by layout.expert_offsets / expert_counts (device tensors) ...
    gt.combine(engine, out, layout.expert_output)                         # torch.ops.graphep.combine

Nothing here is compiled against PyTorch: the ops are registered with torch.library from Python
and call the framework-free extension with data pointers, so one graphep wheel serves every
PyTorch version.
"""

try:
    import torch  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised where PyTorch is missing
    raise ImportError("graphep.torch needs PyTorch (graphep itself does not): pip install torch") from e

from graphep.torch.distributed import group_from_process_group
from graphep.torch.ops import TorchLayout, combine, dispatch, token_count, torch_layout
from graphep.torch.sglang import GraphepDispatcher, GraphepDispatchOutput
from graphep.torch.vllm import ExpertTokensMetadata, GraphepPrepareAndFinalize

__all__ = [
    "ExpertTokensMetadata", "GraphepDispatchOutput", "GraphepDispatcher", "GraphepPrepareAndFinalize",
    "TorchLayout", "combine", "dispatch", "group_from_process_group", "token_count", "torch_layout",
]
