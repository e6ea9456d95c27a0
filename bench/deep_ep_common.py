"""What the scripts that time DeepEP's API (bench/deep_ep_*.py) share: their shape arguments, one
process per GPU over a local NCCL process group, the Buffer module they drive (graphep.deep_ep, or
DeepEP's own deep_ep with --deepep), and the teardown. Needs PyTorch."""

import argparse
import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def parser(doc: str, tokens: int, experts: int, port: int, deepep: bool = True) -> argparse.ArgumentParser:
    """The shared arguments (2 processes, --num-tokens, --hidden 7168, --num-experts, top-8, the
    rendezvous port, and --deepep unless `deepep` is False), described by doc's first paragraph."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--num-processes", type=int, default=2)
    p.add_argument("--num-tokens", type=int, default=tokens)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--num-experts", type=int, default=experts)
    p.add_argument("--num-topk", type=int, default=8)
    p.add_argument("--port", type=int, default=port)
    if deepep:
        p.add_argument("--deepep", action="store_true", help="DeepEP's deep_ep instead of graphep.deep_ep")
    return p


def start(local_rank: int, args):
    """This process's rank of the group (its GPU: local_rank) and the Buffer module:
    (deep_ep module, rank, ranks)."""
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", world_size=args.num_processes,
                            rank=local_rank, device_id=torch.device("cuda", local_rank))
    torch.cuda.set_device(local_rank)
    if getattr(args, "deepep", False):
        import deep_ep
    else:
        import graphep.deep_ep as deep_ep
    return deep_ep, dist.get_rank(), dist.get_world_size()


def decode_batch(deep_ep, T: int, H: int, E: int, K: int, R: int):
    """One rank's low-latency inputs, as DeepEP's test makes them: x bf16 [T, H], topk_idx [T, K] of
    distinct experts (deep_ep.topk_idx_t), weights float32 [T, K], and the experts' outputs bf16
    [E / R, R x T, H] that a combine sends."""
    x = torch.randn((T, H), dtype=torch.bfloat16, device="cuda") * 0.1
    scores = torch.randn((T, E), dtype=torch.float32, device="cuda").abs() + 1
    topk_idx = torch.topk(scores, K, dim=-1, largest=True, sorted=True)[1].to(deep_ep.topk_idx_t)
    weights = torch.randn((T, K), dtype=torch.float32, device="cuda").abs()
    expert_out = torch.randn((E // R, R * T, H), dtype=torch.bfloat16, device="cuda") * 0.1
    return x, topk_idx, weights, expert_out


def low_latency_buffer(deep_ep, T: int, H: int, R: int, E: int):
    """A low-latency Buffer sized by the module's own hint, as DeepEP's test makes it."""
    return deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E),
                          low_latency_mode=True, num_qps_per_rank=E // R, allow_nvlink_for_low_latency_mode=True,
                          explicitly_destroy=True)


def back_to_back(fn, calls: int, warmup: int = 5, together: bool = False) -> float:
    """fn() `warmup` times, then `calls` times back to back between two events: the device time
    per call, in us. `together`: every rank starts the timed calls after the same barrier."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if together:
        dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def finish(buffer) -> None:
    """Destroys the Buffer, then the process group, every rank together."""
    buffer.destroy()
    dist.barrier()
    dist.destroy_process_group()


def spawn(run, args) -> None:
    """run(local_rank, args) in one process per GPU."""
    torch.multiprocessing.spawn(run, args=(args,), nprocs=args.num_processes)
