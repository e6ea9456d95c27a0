#!/usr/bin/env python3
"""The low-latency halves apart: DeepEP's low_latency_dispatch and low_latency_combine with
return_recv_hook=True, their send and receive kernels timed by the profiler (kineto, as DeepEP's
harness times kernels), with other work between each send half and its hook:

    python3 bench/deep_ep_halves.py [--num-processes 2] [--num-tokens 128] [--hidden 7168]
                                    [--num-experts 288] [--num-topk 8] [--deepep]

    idle    a 100 us spin kernel (torch.cuda._sleep): the caches stay warm
    flush   a 256 MB zero_: L2 evicted (the kernels' code and data come from memory)
    gemm    DeepEP's test's 8192 x 8192 fp32 GEMM (as its large_gemm_with_hook)

Each mode runs 5 warm-up and 30 profiled periods (dispatch send, work, hook; combine send, work,
hook); every rank prints, per mode, the median kernel time of each half in us. The first idle
pass is repeated at the end (idle again) as a check that nothing drifted. --deepep times DeepEP's
own `deep_ep` (on PYTHONPATH, built with NVSHMEM) instead of graphep.deep_ep. The profiler tells a
send kernel from a receive kernel by order: the names hold `::dispatch` or `::combine` (graphep's
`moe_latency::...::dispatchKernel`, DeepEP's `internode_ll::dispatch<...>`), two of each per
period. Needs PyTorch and a GPU per process; NCCL_NVLS_ENABLE=0 is set.
"""

import json
import statistics
import tempfile

import torch
import torch.distributed as dist

from deep_ep_common import decode_batch, finish, low_latency_buffer, parser, spawn, start

MODES = ("idle", "flush", "gemm", "idle")
WARMUP, PERIODS = 5, 30


def kernel_events(prof) -> list:
    """The kernel events of a finished profile (its trace can be exported once only)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        return [e for e in json.load(open(f.name))["traceEvents"] if e.get("cat") == "kernel"]


def kernel_halves(events: list, key: str):
    """The median durations (us) of the send and the receive kernels whose names hold `key`."""
    kernels = sorted((e for e in events if key in e["name"]), key=lambda e: e["ts"])
    if len(kernels) != 2 * PERIODS:
        raise RuntimeError(f"{len(kernels)} kernels named {key!r} in {PERIODS} periods (expected 2 a period)")
    return statistics.median(e["dur"] for e in kernels[0::2]), statistics.median(e["dur"] for e in kernels[1::2])


def run(local_rank: int, args) -> None:
    deep_ep, rank, R = start(local_rank, args)
    T, H, E, K = args.num_tokens, args.hidden, args.num_experts, args.num_topk
    torch.manual_seed(rank)
    dev = "cuda"
    x, topk_idx, topk_w, expert_out = decode_batch(deep_ep, T, H, E, K, R)
    buffer = low_latency_buffer(deep_ep, T, H, R, E)
    cache = torch.empty(int(256e6 // 4), dtype=torch.int, device=dev)
    a = torch.randn((8192, 8192), dtype=torch.float, device=dev)
    b = torch.randn((8192, 8192), dtype=torch.float, device=dev)

    def work(mode: str) -> None:
        if mode == "gemm":
            a @ b
        elif mode == "flush":
            cache.zero_()
        else:
            torch.cuda._sleep(200000)  # cycles: about 100 us

    def period(mode: str) -> None:
        _, _, handle, _, hook = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True, async_finish=False,
                                                            return_recv_hook=True)
        work(mode)
        hook()
        _, _, hook = buffer.low_latency_combine(expert_out, topk_idx, topk_w, handle, return_recv_hook=True)
        work(mode)
        hook()

    who = "deepep" if args.deepep else "graphep"
    for mode in MODES:
        for _ in range(WARMUP):
            period(mode)
        torch.cuda.synchronize()
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(PERIODS):
                period(mode)
            torch.cuda.synchronize()
        events = kernel_events(prof)
        d_send, d_recv = kernel_halves(events, "::dispatch")
        c_send, c_recv = kernel_halves(events, "::combine")
        print(f"[rank {rank}] {who} T={T} H={H} E={E} K={K} {mode}: dispatch send {d_send:.1f} recv {d_recv:.1f} | "
              f"combine send {c_send:.1f} recv {c_recv:.1f}", flush=True)
        dist.barrier()
    finish(buffer)


if __name__ == "__main__":
    spawn(run, parser(__doc__, tokens=128, experts=288, port=8372).parse_args())
