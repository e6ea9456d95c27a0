"""A graphep Group from a torch.distributed process group (one rank per process: torchrun).

Default: bootstrap. Group rank 0 makes an ncclUniqueId, the process group broadcasts it, and every
rank creates its own NCCL communicator from it (graphep owns it). Works with any backend
(NCCL, Gloo) and any PyTorch version.

adopt=True: graphep uses the NCCL communicator the process group already has
(ProcessGroupNCCL._comm_ptr(), where this PyTorch exposes it), so no second communicator is made.
The communicator stays PyTorch's: keep the process group alive as long as the engines.
"""

from typing import Optional

import torch
import torch.distributed as dist

from graphep._graphep import Group
from graphep.errors import invalid_argument, not_supported


def _device(device) -> int:
    if isinstance(device, int):
        return device
    index = None if device is None else torch.device(device).index
    return torch.cuda.current_device() if index is None else index  # None or "cuda": the current device


def _bootstrap(pg, rank: int, world: int, device: int) -> Group:
    uid = [Group.nccl_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(uid, src=dist.get_global_rank(pg, 0) if pg is not None else 0, group=pg)
    return Group.from_nccl_unique_id(uid[0], world, rank, device)


def _adopt(pg, device: int) -> Group:
    pg = pg if pg is not None else dist.group.WORLD
    try:
        backend = pg._get_backend(torch.device("cuda", device))
    except (AttributeError, RuntimeError) as e:
        raise not_supported(f"adopt=True: the process group has no NCCL backend for cuda:{device} ({e})") from None
    comm_ptr = getattr(backend, "_comm_ptr", None)
    if comm_ptr is None:
        raise not_supported(f"adopt=True: torch {torch.__version__} does not expose ProcessGroupNCCL._comm_ptr(); "
                            "use the default bootstrap")
    # PyTorch creates its communicator lazily, at the first collective on the device.
    probe = torch.zeros(1, device=f"cuda:{device}")
    dist.all_reduce(probe, group=pg)
    torch.cuda.synchronize(device)
    with torch.cuda.device(device):  # ProcessGroupNCCL looks its communicator up by the current device
        ptr = comm_ptr()
    if not ptr:
        raise not_supported(f"adopt=True: the process group's NCCL communicator for cuda:{device} is not created")
    return Group.adopt_nccl([ptr])


def group_from_process_group(pg: Optional["dist.ProcessGroup"] = None, *, device=None, adopt: bool = False) -> Group:
    """Collective over `pg` (default: the world group): the graphep Group of this process's rank,
    on `device` (default: torch.cuda.current_device())."""
    if not dist.is_initialized():
        raise invalid_argument("torch.distributed is not initialised (call dist.init_process_group first)")
    dev = _device(device)
    if adopt:
        return _adopt(pg, dev)
    return _bootstrap(pg, dist.get_rank(pg), dist.get_world_size(pg), dev)
