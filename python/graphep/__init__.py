"""graphep: CUDA-graph-native Mixture-of-Experts expert parallelism, for Python serving stacks.

    import graphep
    need = graphep.memory_requirements(config, world_size)     # before allocating: size the KV cache
    group = graphep.Group.local([0, 1])                          # or torch.distributed, MPI, NCCL id
    engines = graphep.create_engines(group, config)
    layout = engines[r].dispatch(x, topk_idx, topk_weights, num_tokens, stream)
    engines[r].combine(out, stream)

Arrays come from any framework (DLPack, __cuda_array_interface__) and the extension links none of
them: one wheel serves every PyTorch version. graphep.torch adds torch.library ops that capture in
torch.cuda.graph and adapters shaped like vLLM's prepare/finalize and SGLang's dispatcher.
"""

from graphep._nccl_preload import preload_wheel_nccl as _preload_wheel_nccl

_preload_wheel_nccl()

from graphep._graphep import (  # noqa: E402
    DispatchInput,
    DType,
    Fp8Scales,
    Group,
    HealthReport,
    IndexType,
    MemoryRequirements,
    MoeConfig,
    MoeHalf,
    MoePath,
    MoeStatus,
    Status,
    __version__,
    nccl_runtime_version,
    validate,
    worst_case_capacity,
)
from graphep.arrays import DeviceArray  # noqa: E402
from graphep.engine import DispatchOutputs, Engine, create_engine, create_engines, memory_requirements  # noqa: E402
from graphep.errors import Error  # noqa: E402
from graphep.layouts import BatchedLayout, ExpertMajorLayout, RankMajorLayout, ReceiveLayout  # noqa: E402


def cuda_device_count() -> int:
    """Usable CUDA devices; 0 without a GPU or driver (never raises)."""
    from graphep._graphep import cuda_device_count as count

    return count()[0]


__all__ = [
    "BatchedLayout", "DType", "DeviceArray", "DispatchInput", "DispatchOutputs", "Engine", "Error", "ExpertMajorLayout",
    "Fp8Scales", "Group", "HealthReport", "IndexType", "MemoryRequirements", "MoeConfig", "MoeHalf", "MoePath",
    "MoeStatus", "RankMajorLayout", "ReceiveLayout", "Status", "__version__", "create_engine", "create_engines",
    "cuda_device_count", "memory_requirements", "nccl_runtime_version", "validate", "worst_case_capacity",
]
