#!/usr/bin/env python3
"""The first low-latency calls of a profiled window: what DeepEP's harness (bench_kineto) averages.

    python3 bench/deep_ep_first_call.py [--num-processes 2] [--num-tokens 128] [--hidden 7168]
                                        [--num-experts 288] [--num-topk 8] [--port 8373] [--deepep]

DeepEP's bench_kineto opens a profiler, runs its 8192 x 8192 fp32 GEMM and an all-reduce, then 30
periods (low_latency_dispatch fp8, low_latency_combine), and prints each kernel's mean time over
the 30. This script runs 5 unprofiled warm-up periods, then four windows (gemm, sleep, none, gemm:
WINDOWS), each under a profiler of its own, each 2 rounds (ROUNDS) of: the lead-in work, an
all-reduce, 4 periods (PERIODS). Lead-ins:

    gemm    the harness's fp32 GEMM (about 21 ms on an H200)
    sleep   a spin kernel of about the GEMM's length (torch.cuda._sleep): the device idle, caches kept
    none    nothing: the host paces the periods (its calls take longer than the kernels)

Every rank prints, per window and round, the kernel times in us of the periods' dispatches (D) and
combines (C) in order:

    [rank R] graphep|deepep H=<hidden> window <w> <lead-in> round <n>: D<us> C<us> D<us> C<us> ...

A cost of the first call in a window shows as a first D far above the others in round 1 only; one
of the lead-in shows in every round (run 290 of docs/VALIDATION.md: only round 1 of the first
window, on both systems). --deepep runs DeepEP's own
`deep_ep` (on PYTHONPATH, built with NVSHMEM) instead of graphep.deep_ep. Needs PyTorch and a GPU
per process; NCCL_NVLS_ENABLE=0 is set.
"""

import json
import tempfile

import torch
import torch.distributed as dist

from deep_ep_common import decode_batch, finish, low_latency_buffer, parser, spawn, start

WINDOWS = ("gemm", "sleep", "none", "gemm")
ROUNDS, PERIODS, WARMUP = 2, 4, 5


def kernel_events(prof) -> list:
    """The kernel events of a finished profile, in order of their start."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = [e for e in json.load(open(f.name))["traceEvents"] if e.get("cat") == "kernel"]
    return sorted(events, key=lambda e: e["ts"])


def rounds_of(events: list) -> list:
    """Per all-reduce (one a round), the periods' kernels after it: [(kind, us), ...]."""
    out = []
    for i, e in enumerate(events):
        if "AllReduce" not in e["name"]:
            continue
        ops = []
        for k in events[i + 1:]:
            if "AllReduce" in k["name"]:
                break
            if "::dispatch" in k["name"] or "::combine" in k["name"]:
                ops.append(("D" if "::dispatch" in k["name"] else "C", k["dur"]))
        out.append(ops)
    return out


def run(local_rank: int, args) -> None:
    deep_ep, rank, R = start(local_rank, args)
    T, H, E, K = args.num_tokens, args.hidden, args.num_experts, args.num_topk
    torch.manual_seed(rank)
    x, topk_idx, topk_w, expert_out = decode_batch(deep_ep, T, H, E, K, R)
    buffer = low_latency_buffer(deep_ep, T, H, R, E)
    a = torch.randn((8192, 8192), dtype=torch.float, device="cuda")
    b = torch.randn((8192, 8192), dtype=torch.float, device="cuda")

    def lead_in(kind: str) -> None:
        if kind == "gemm":
            a @ b
        elif kind == "sleep":
            torch.cuda._sleep(40_000_000)  # cycles: about the GEMM's 21 ms

    def period() -> None:
        _, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True)
        buffer.low_latency_combine(expert_out, topk_idx, topk_w, handle)

    for _ in range(WARMUP):
        period()
    torch.cuda.synchronize()
    who = "deepep" if args.deepep else "graphep"
    for w, kind in enumerate(WINDOWS):
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(ROUNDS):
                lead_in(kind)
                dist.all_reduce(torch.ones(1, dtype=torch.float, device="cuda"))
                for _ in range(PERIODS):
                    period()
            torch.cuda.synchronize()
        for r, ops in enumerate(rounds_of(kernel_events(prof))):
            print(f"[rank {rank}] {who} H={H} window {w} {kind:5s} round {r + 1}: " +
                  " ".join(f"{kind_}{us:.1f}" for kind_, us in ops), flush=True)
    finish(buffer)


if __name__ == "__main__":
    spawn(run, parser(__doc__, tokens=128, experts=288, port=8373).parse_args())
