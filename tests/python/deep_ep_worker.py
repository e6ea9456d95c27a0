"""The end of a graphep.deep_ep torchrun worker (test_deep_ep.py, test_deep_ep_low_latency.py): the
Buffer's status counted, the wrong counts summed over the ranks, one verdict line on rank 0."""


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
