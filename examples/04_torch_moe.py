#!/usr/bin/env python3
"""04_torch_moe: a PyTorch MoE layer on graphep, captured with torch.cuda.graph, replayed in a
decode loop.

    tokens x (new every step, written in place)
    -> router logits (x . W_router) -> softmax -> top-k ids and weights (renormalised)
    -> graphep dispatch (torch.ops.graphep.dispatch): recv_x grouped by local expert
    -> SwiGLU experts, y = (silu(x W_gate) * (x W_up)) W_down, as grouped matmuls over the
       per-expert offsets on the device (torch._grouped_mm; masked batched matmuls where it is
       missing) -- fp8 engines dequantise recv_x with its per-128 scales first
    -> graphep combine (torch.ops.graphep.combine): out[t] = sum_k w[t, k] y(t, k)

One graph per rank, captured once; every step writes new tokens and a new live token count into
the captured input buffers and replays (one stream per rank). Every --check-every steps each
rank's output is compared with an unsharded reference of the same layer on one GPU (all experts,
the routing each rank computed). Prints latency percentiles of a step and PASS, or FAIL with the
wrong-element count. Runs on every visible GPU (one rank each), or 2 emulated ranks on one GPU.

    python3 examples/04_torch_moe.py [--steps 200] [--one-gpu] [--dtype fp8] [--index int64]

Exit code 0: PASS; 1: a mismatch; 77: no GPU or no PyTorch.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

try:
    import torch
except ImportError:
    print("04_torch_moe: PyTorch is not installed; skipped")
    sys.exit(77)

import graphep
import graphep.torch as gt


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=64, help="max tokens per rank (T_max)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--check-every", type=int, default=10)
    p.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16", help="what dispatch moves")
    p.add_argument("--index", choices=("int32", "int64"), default="int32", help="topk id type")
    p.add_argument("--path", choices=("auto", "latency", "throughput"), default="auto")
    p.add_argument("--one-gpu", action="store_true", help="2 emulated ranks on GPU 0 whatever the GPU count")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


# ---- the layer's pieces (used by the captured graphs and by the reference alike) ---------------

def route(x, w_router, top_k, index_dtype):
    """Top-k experts of each token and their softmax weights, renormalised over the k."""
    probs = torch.softmax((x @ w_router).float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return ids.to(index_dtype), weights / weights.sum(dim=-1, keepdim=True)


def fp8_dequant(q, scales):
    """e4m3 rows and one fp32 scale per 128 values -> bf16."""
    rows, h = q.shape
    return (q.float().view(rows, h // 128, 128) * scales.unsqueeze(-1)).view(rows, h).to(torch.bfloat16)


def fp8_round_trip(x):
    """What an fp8 dispatch does to bf16 rows (scale = amax / 448 per 128 values), dequantised."""
    rows, h = x.shape
    tiles = x.float().view(rows, h // 128, 128)
    amax = tiles.abs().amax(dim=-1)
    # True divisions, as the engine's: PyTorch turns a division by a Python scalar into a
    # multiplication by its rounded reciprocal, which differs in the last bit.
    floor = torch.full_like(amax, 448.0 * 2.0 ** -126)  # the engine's floor (bf16 subnormal tiles)
    scales = torch.where(amax > 0, torch.maximum(amax, floor) / torch.full_like(amax, 448.0),
                         torch.ones_like(amax))
    q = (tiles * (torch.ones_like(scales) / scales).unsqueeze(-1)).to(torch.float8_e4m3fn)
    return fp8_dequant(q.view(rows, h), scales)


def swiglu(x, w_gate, w_up, w_down):
    return (torch.nn.functional.silu(x @ w_gate) * (x @ w_up)) @ w_down


class GroupedExperts:
    """SwiGLU over the expert-major rows: expert j owns rows [offsets[j], offsets[j + 1])."""

    def __init__(self, w_gate, w_up, w_down):  # [L, H, F], [L, H, F], [L, F, H]
        self.w = (w_gate, w_up, w_down)

    def __call__(self, x, offsets):
        ends = offsets[1:]
        g, u, d = self.w
        h = torch.nn.functional.silu(torch._grouped_mm(x, g, offs=ends)) * torch._grouped_mm(x, u, offs=ends)
        return torch._grouped_mm(h, d, offs=ends)


class MaskedExperts:
    """The same as GroupedExperts with one batched matmul per expert over every row, masked."""

    def __init__(self, w_gate, w_up, w_down):
        self.w = (w_gate, w_up, w_down)

    def __call__(self, x, offsets):
        g, u, d = self.w
        rows = torch.arange(x.shape[0], device=x.device)
        y = torch.zeros(x.shape[0], d.shape[-1], dtype=torch.bfloat16, device=x.device)
        for j in range(g.shape[0]):
            mine = ((rows >= offsets[j]) & (rows < offsets[j + 1])).unsqueeze(-1)
            y = torch.where(mine, swiglu(x, g[j], u[j], d[j]), y)
        return y


def pick_experts(w_gate, w_up, w_down):
    """Grouped matmuls where torch has them and they agree with the masked form on a probe."""
    masked = MaskedExperts(w_gate, w_up, w_down)
    if not hasattr(torch, "_grouped_mm"):
        return masked, "masked batched matmuls (torch._grouped_mm missing)"
    grouped = GroupedExperts(w_gate, w_up, w_down)
    L, dev = w_gate.shape[0], w_gate.device
    x = torch.randn(16 * L, w_gate.shape[1], device=dev).to(torch.bfloat16)
    offsets = torch.arange(0, 16 * L + 1, 16, dtype=torch.int32, device=dev)
    try:
        close = torch.allclose(grouped(x, offsets).float(), masked(x, offsets).float(), rtol=2e-2, atol=2e-2)
    except RuntimeError as e:
        return masked, f"masked batched matmuls (torch._grouped_mm failed: {str(e).splitlines()[0]})"
    return (grouped, "torch._grouped_mm") if close else (masked, "masked batched matmuls (grouped mm disagreed)")


# ---- one rank -------------------------------------------------------------------------------------

class Rank:
    """One rank's engine, stream, captured graph and the graph's static buffers."""

    def __init__(self, engine, weights, args):
        self.engine, self.args = engine, args
        self.device = torch.device("cuda", engine.device)
        L = args.experts // engine.world_size
        first = engine.rank * L
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream()
            self.w_router = weights["router"].to(self.device)
            local = [weights[n][first:first + L].to(self.device) for n in ("gate", "up", "down")]
            self.experts, self.experts_kind = pick_experts(*local)
            T, H = args.tokens, args.hidden
            self.x = torch.zeros(T, H, dtype=torch.bfloat16, device=self.device)
            self.num_tokens = gt.token_count(self.device, T)
            self.out = torch.zeros(T, H, dtype=torch.bfloat16, device=self.device)
            self.index_dtype = torch.int32 if args.index == "int32" else torch.int64
            self.graph = torch.cuda.CUDAGraph()
        gt.torch_layout(engine)  # the engine's views as tensors, made (once) outside the capture

    def layer(self):
        """The layer on this rank's static buffers (what the graph captures)."""
        self.ids, self.weights = route(self.x, self.w_router, self.args.topk, self.index_dtype)
        v = gt.dispatch(self.engine, self.x, self.ids, self.weights, self.num_tokens)
        xr = fp8_dequant(v.recv_x, v.recv_scales) if v.recv_scales is not None else v.recv_x
        gt.combine(self.engine, self.out, self.experts(xr, v.expert_offsets))

    def capture(self):
        with torch.cuda.device(self.device):
            with torch.cuda.graph(self.graph, stream=self.stream):
                self.layer()

    def new_tokens(self, gen, live):
        """New inputs written in place on the rank's stream (no host sync)."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.x.normal_(generator=gen)
            self.num_tokens.fill_(live)

    def replay(self):
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.graph.replay()


def make_weights(args, device):
    g = torch.Generator(device=device).manual_seed(args.seed)
    E, H, F = args.experts, args.hidden, args.ffn

    def rand(*shape, scale):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(torch.bfloat16)

    return {"router": rand(H, E, scale=H ** -0.5), "gate": rand(E, H, F, scale=H ** -0.5),
            "up": rand(E, H, F, scale=H ** -0.5), "down": rand(E, F, H, scale=F ** -0.5)}


def reference_out(x, ids, weights, w, fp8):
    """The unsharded layer for the given routing: every expert on this GPU, fp64 sum over k."""
    xe = fp8_round_trip(x) if fp8 else x
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=x.device)
    bound = torch.zeros_like(out)
    for e in range(w["gate"].shape[0]):
        tok, slot = torch.nonzero(ids.long() == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        y = swiglu(xe[tok], w["gate"][e], w["up"][e], w["down"][e]).double()
        wk = weights[tok, slot].double().unsqueeze(-1)
        out.index_add_(0, tok, wk * y)
        bound.index_add_(0, tok, (wk * y).abs())
    return out, bound


def count_wrong(rank, live, w, fp8):
    """Elements of rows [0, live) outside 2^-6 of sum_k |w_k y_k| (+ 2^-9) of the reference."""
    dev0 = w["router"].device
    x, ids, wts = (t[:live].to(dev0) for t in (rank.x, rank.ids, rank.weights))
    ref, bound = reference_out(x, ids, wts, w, fp8)
    got = rank.out[:live].to(dev0).double()
    return int(((got - ref).abs() > bound * 2.0 ** -6 + 2.0 ** -9).sum())


def build(args):
    n = torch.cuda.device_count()
    devices = [0, 0] if args.one_gpu or n == 1 else list(range(n))
    path = {"auto": graphep.MoePath.AUTO, "latency": graphep.MoePath.LATENCY,
            "throughput": graphep.MoePath.THROUGHPUT}[args.path]
    config = graphep.MoeConfig(max_tokens_per_rank=args.tokens, hidden=args.hidden, num_experts=args.experts,
                               top_k=args.topk, path=path,
                               dispatch_type=graphep.DType.FP8_E4M3 if args.dtype == "fp8" else graphep.DType.BF16)
    weights = make_weights(args, torch.device("cuda", 0))
    need = graphep.memory_requirements(config, len(devices))
    group = graphep.Group.local(devices)
    engines = graphep.create_engines(group, config)
    ranks = [Rank(e, weights, args) for e in engines]
    return devices, config, need, weights, ranks


def run(args):
    """Builds, captures and replays; returns (wrong elements, checks, per-step latencies in us)."""
    devices, config, need, weights, ranks = build(args)
    print(f"04_torch_moe: {len(ranks)} ranks on GPUs {devices}, {config}")
    print(f"  memory per rank: {need}; experts: {ranks[0].experts_kind}")
    # Every kernel of the layer runs once per rank before any rank waits on another: a lazily
    # loaded module cannot then stall behind a spinning graphep kernel.
    for r in ranks:
        with torch.cuda.device(r.device):
            r.x.normal_()
            ids, wts = route(r.x, r.w_router, args.topk, r.index_dtype)
            xr = fp8_round_trip(r.x) if args.dtype == "fp8" else r.x
            offsets = torch.full((r.experts.w[0].shape[0] + 1,), r.x.shape[0], dtype=torch.int32, device=r.device)
            offsets[0] = 0  # every row to local expert 0
            r.experts(xr, offsets)
            torch.cuda.synchronize(r.device)
    for r in ranks:
        r.capture()
    gens = [torch.Generator(device=r.device).manual_seed(args.seed + 1 + i) for i, r in enumerate(ranks)]
    pick = torch.Generator().manual_seed(args.seed)
    wrong, checks, times = 0, 0, []
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(args.steps)]
    for step in range(args.steps):
        lives = [int(torch.randint(1, args.tokens + 1, (1,), generator=pick)) for _ in ranks]
        for r, g, live in zip(ranks, gens, lives):
            r.new_tokens(g, live)
        events[step][0].record(ranks[0].stream)
        for r in ranks:
            r.replay()
        events[step][1].record(ranks[0].stream)
        if (step + 1) % args.check_every == 0 or step + 1 == args.steps:
            for r in ranks:
                torch.cuda.synchronize(r.device)
            for r, live in zip(ranks, lives):
                wrong += count_wrong(r, live, weights, args.dtype == "fp8")
                checks += 1
    for r in ranks:
        torch.cuda.synchronize(r.device)
        status = r.engine.status()
        if not status.ok:
            print(f"  rank {r.engine.rank}: {status.describe()}")
            wrong += 1
    times = sorted(b.elapsed_time(e) * 1e3 for b, e in events)
    return wrong, checks, times


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("04_torch_moe: no GPU; skipped")
        return 77
    t0 = time.perf_counter()
    wrong, checks, times = run(args)

    def pct(p):
        return times[min(len(times) - 1, int(p / 100 * len(times)))]

    print(f"  {args.steps} steps, step latency (rank 0's stream) p50 {pct(50):.1f} us, p90 {pct(90):.1f} us, "
          f"p99 {pct(99):.1f} us; {checks} rank-steps checked, {wrong} wrong; {time.perf_counter() - t0:.1f} s")
    print("PASS" if wrong == 0 else f"FAIL: {wrong} wrong")
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
