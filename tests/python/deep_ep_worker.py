"""The start and the end of a graphep.deep_ep torchrun worker (test_deep_ep.py,
test_deep_ep_low_latency.py): torch.distributed over NCCL on this process's GPU; then the Buffer's
status counted, the wrong counts summed over the ranks, one verdict line on rank 0."""

import os


def start():
    """Joins the torchrun group on GPU LOCAL_RANK: (its torch.device, rank, world size)."""
    import torch  # the worker's (this module is imported where PyTorch may be missing)
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    return device, dist.get_rank(), dist.get_world_size()


def finish(name: str, buffer, wrong: dict, status_ok: bool, rank: int, ranks: int, device) -> int:
    """Destroys the Buffer, prints each rank's wrong checks and rank 0's PASS / FAIL; the exit code."""
    import torch  # the worker's (this module is imported where PyTorch may be missing)
    import torch.distributed as dist

    status = buffer.status()
    wrong["status"] = wrong.get("status", 0) + (0 if status_ok else 1)
    if not status.ok:
        print(f"rank {rank}: {status.describe()}", flush=True)
    buffer.destroy()
    bad = {k: v for k, v in wrong.items() if v}
    if bad:
        print(f"rank {rank}: wrong {bad}", flush=True)
    total = torch.tensor([sum(bad.values())], device=device)
    dist.all_reduce(total)
    if rank == 0:
        print(f"{name} worker: {ranks} ranks, {len(wrong)} checks each: {int(total)} wrong", flush=True)
        print("PASS" if int(total) == 0 else "FAIL", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if int(total) == 0 else 1


def counting_mode():
    """A Python function mode that records each torch call reaching it. DeepEP's tests run under
    one (torch.set_default_device('cuda') installs a mode); graphep.deep_ep's calls should reach
    none of theirs (they run as DeepEP's C++ extension does)."""
    from torch.overrides import TorchFunctionMode  # the worker's (PyTorch may be missing here)

    class Counting(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    return Counting()
