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
graphep.deep_ep. Needs PyTorch and a GPU per process (bench/deep_ep_common.py: NCCL_NVLS_ENABLE=0 is set).
"""

import torch

from deep_ep_common import back_to_back, decode_batch, finish, low_latency_buffer, parser, spawn, start

WARMUP, STEPS = 10, 50


def run(local_rank: int, args) -> None:
    deep_ep, rank, R = start(local_rank, args)
    T, H, E, K = args.num_tokens, args.hidden, args.num_experts, args.num_topk
    torch.manual_seed(rank)
    dev = "cuda"
    mb = [decode_batch(deep_ep, T, H, E, K, R) for _ in range(2)]  # (x, ids, weights, experts' outputs)
    g = args.gemm
    mats = [(torch.randn((g, g), dtype=torch.bfloat16, device=dev), torch.randn((g, g), dtype=torch.bfloat16,
                                                                                 device=dev)) for _ in mb] if g else []
    buffer = low_latency_buffer(deep_ep, T, H, R, E)

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
        us = back_to_back(step, STEPS, WARMUP, together=True)
        print(f"[rank {rank}] {who} T={T} H={H} E={E} K={K} gemm={g} {name}: {us:.1f} us a step", flush=True)
        torch.distributed.barrier()
    finish(buffer)


if __name__ == "__main__":
    p = parser(__doc__, tokens=128, experts=288, port=8373)
    p.add_argument("--gemm", type=int, default=4096, help="the side of each micro-batch's bf16 GEMM (0: none)")
    spawn(run, p.parse_args())
