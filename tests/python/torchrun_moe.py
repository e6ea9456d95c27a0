"""One rank per process under torchrun, over a torch.distributed NCCL process group:

    torchrun --nproc_per_node 2 tests/python/torchrun_moe.py [--adopt] [--replays N]

Builds the graphep group from the process group (an NCCL unique id broadcast over it, or with
--adopt the process group's own communicator), checks eager dispatch / combine against the
reference (every process builds every rank's inputs from per-rank seeds), then captures
dispatch -> experts -> combine with torch.cuda.graph and replays it with new inputs each time,
checking every replay. Prints PASS on rank 0 and exits 0 when every rank saw 0 wrong."""

import argparse
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import graphep  # noqa: E402
import graphep.torch as gt  # noqa: E402
from moe_check import check_combine, check_dispatch, expert_rows, make_inputs  # noqa: E402

T, H, E, K = 64, 1024, 16, 4


def all_inputs(world, routing, index_dtype, lives, step, device):
    return [make_inputs(device, T, H, E, K, routing, index_dtype, lives[src],
                        torch.Generator(device=device).manual_seed(1000 * step + src)) for src in range(world)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--adopt", action="store_true", help="adopt the process group's NCCL communicator")
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    args = p.parse_args()

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    fp8 = args.dtype == "fp8"
    cfg = graphep.MoeConfig(max_tokens_per_rank=T, hidden=H, num_experts=E, top_k=K,
                            dispatch_type=graphep.DType.FP8_E4M3 if fp8 else graphep.DType.BF16)
    group = gt.group_from_process_group(device=local, adopt=args.adopt)
    engine = graphep.create_engine(group, cfg)
    layout = gt.torch_layout(engine)
    L = E // world
    wrong = 0

    # Eager, each routing, a live count below the maximum on every other rank.
    for step, routing in enumerate(("uniform", "masked", "duplicates")):
        lives = [T - 9 * (src % 2) for src in range(world)]
        inputs = all_inputs(world, routing, torch.int64 if step % 2 else torch.int32, lives, step, device)
        me = inputs[rank]
        gt.dispatch(engine, me.x, me.ids, me.weights, me.num_tokens)
        torch.cuda.synchronize()
        wrong += check_dispatch(layout, inputs, rank, L, fp8)
        out = torch.full((T, H), -3.0e38, dtype=torch.bfloat16, device=device)
        gt.combine(engine, out, expert_rows(layout, L, fp8).contiguous())
        torch.cuda.synchronize()
        wrong += check_combine(out, inputs, rank, L, fp8)

    # Captured: static inputs rewritten in place before each replay.
    static = all_inputs(world, "masked", torch.int32, [T] * world, 99, device)[rank]
    out = torch.empty(T, H, dtype=torch.bfloat16, device=device)
    expert_rows(layout, L, fp8)  # load the experts' kernels before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gt.dispatch(engine, static.x, static.ids, static.weights, static.num_tokens)
        gt.combine(engine, out, expert_rows(layout, L, fp8).contiguous())
    for step in range(args.replays):
        lives = [1 + (7 * step + 13 * src) % T for src in range(world)]
        inputs = all_inputs(world, ("uniform", "masked", "duplicates")[step % 3], torch.int32, lives, 100 + step,
                            device)
        me = inputs[rank]
        static.x.copy_(me.x), static.ids.copy_(me.ids), static.weights.copy_(me.weights)
        static.num_tokens.copy_(me.num_tokens)
        out.fill_(-3.0e38)
        graph.replay()
        torch.cuda.synchronize()
        wrong += check_combine(out, inputs, rank, L, fp8)

    status = engine.status()
    if not status.ok:
        print(f"rank {rank}: {status.describe()}", flush=True)
        wrong += 1
    total = torch.tensor([wrong], device=device)
    dist.all_reduce(total)
    if rank == 0:
        how = "adopted ProcessGroupNCCL communicator" if args.adopt else "NCCL id broadcast over the process group"
        print(f"torchrun_moe: {world} processes, {how}, {engine.path.name} path, {args.dtype}, 3 eager rounds + "
              f"{args.replays} graph replays checked: {int(total)} wrong")
        print("PASS" if int(total) == 0 else "FAIL")
    del engine, layout
    dist.destroy_process_group()
    return 0 if int(total) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
