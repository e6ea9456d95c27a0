#!/usr/bin/env python3
"""Two micro-batches through DeepEP's low-latency API (vLLM's dual-batch overlap, SGLang's
two-batch overlap), timed as a decode step would run them:

    python3 bench/deep_ep_two_batches.py [--num-processes 2] [--num-tokens 128] [--hidden 7168]
                                         [--num-experts 288] [--num-topk 8] [--gemm 4096] [--deepep]

A step is two micro-batches A and B of --num-tokens tokens each, fp8 dispatch and bf16 combine,
and per micro-batch one bf16 GEMM of --gemm x --gemm x --gemm standing in for its experts (0: none):

    sequential  A: dispatch, GEMM, combine; then B the same (whole calls, no hook)
    overlapped  A send, B send, A hook, A's GEMM, B hook, A combine send, B's GEMM, B combine send,
                A combine hook, B combine hook: two operations in flight, each micro-batch's GEMM
                run while the other's send half travels

Every rank prints the mean step time in us of each schedule over 50 steps (CUDA events on its
stream, after 10 warm-up steps, the ranks started together by a barrier), eagerly and captured
once in a CUDA graph and replayed (as serving stacks run decode), and the GEMMs alone; the eager
sequential schedule runs again last, a check that nothing drifted.
--deepep runs DeepEP's own `deep_ep` (on PYTHONPATH, built with NVSHMEM) instead of
graphep.deep_ep. Needs PyTorch and a GPU per process; NCCL_NVLS_ENABLE=0 is set.
"""

import argparse
import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

WARMUP, STEPS = 10, 50


def run(local_rank: int, args) -> None:
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", world_size=args.num_processes,
                            rank=local_rank, device_id=torch.device("cuda", local_rank))
    torch.cuda.set_device(local_rank)
    if args.deepep:
        import deep_ep
    else:
        import graphep.deep_ep as deep_ep
    rank, R = dist.get_rank(), dist.get_world_size()
    T, H, E, K = args.num_tokens, args.hidden, args.num_experts, args.num_topk
    L = E // R
    torch.manual_seed(rank)
    dev = "cuda"

    def batch():
        x = torch.randn((T, H), dtype=torch.bfloat16, device=dev) * 0.1
        scores = torch.randn((T, E), dtype=torch.float32, device=dev).abs() + 1
        ids = torch.topk(scores, K, dim=-1, largest=True, sorted=True)[1].to(deep_ep.topk_idx_t)
        w = torch.rand((T, K), dtype=torch.float32, device=dev)
        y = torch.randn((L, R * T, H), dtype=torch.bfloat16, device=dev) * 0.1  # the experts' outputs
        return x, ids, w, y

    mb = [batch(), batch()]
    g = args.gemm
    mats = [(torch.randn((g, g), dtype=torch.bfloat16, device=dev), torch.randn((g, g), dtype=torch.bfloat16,
                                                                                 device=dev)) for _ in mb] if g else []
    buffer = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E),
                            low_latency_mode=True, num_qps_per_rank=L, allow_nvlink_for_low_latency_mode=True,
                            explicitly_destroy=True)

    def experts(m: int) -> None:
        if g:
            mats[m][0] @ mats[m][1]

    def dispatch(m: int, hook: bool):
        x, ids, _, _ = mb[m]
        return buffer.low_latency_dispatch(x, ids, T, E, use_fp8=True, async_finish=False, return_recv_hook=hook)

    def combine(m: int, handle, hook: bool):
        _, ids, w, y = mb[m]
        return buffer.low_latency_combine(y, ids, w, handle, return_recv_hook=hook)

    def sequential() -> None:
        for m in range(2):
            handle = dispatch(m, False)[2]
            experts(m)
            combine(m, handle, False)

    def overlapped() -> None:
        d = [dispatch(m, True) for m in range(2)]
        d[0][4]()
        experts(0)
        d[1][4]()
        c0 = combine(0, d[0][2], True)[2]
        experts(1)
        c1 = combine(1, d[1][2], True)[2]
        c0()
        c1()

    def gemms() -> None:
        experts(0)
        experts(1)

    def captured(step):
        """The step captured once in a CUDA graph (after its eager warm-up), replayed."""
        for _ in range(WARMUP):
            step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return graph.replay

    who = "deepep" if args.deepep else "graphep"
    for name, step in (("sequential", sequential), ("overlapped", overlapped), ("gemm alone", gemms),
                       ("sequential, graph", captured(sequential)), ("overlapped, graph", captured(overlapped)),
                       ("sequential", sequential)):
        for _ in range(WARMUP):
            step()
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(STEPS):
            step()
        end.record()
        torch.cuda.synchronize()
        print(f"[rank {rank}] {who} T={T} H={H} E={E} K={K} gemm={g} {name}: "
              f"{start.elapsed_time(end) * 1e3 / STEPS:.1f} us a step", flush=True)
        dist.barrier()
    buffer.destroy()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-processes", type=int, default=2)
    p.add_argument("--num-tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--num-experts", type=int, default=288)
    p.add_argument("--num-topk", type=int, default=8)
    p.add_argument("--gemm", type=int, default=4096, help="the side of each micro-batch's bf16 GEMM (0: none)")
    p.add_argument("--port", type=int, default=8373)
    p.add_argument("--deepep", action="store_true", help="DeepEP's deep_ep instead of graphep.deep_ep")
    args = p.parse_args()
    torch.multiprocessing.spawn(run, args=(args,), nprocs=args.num_processes)
