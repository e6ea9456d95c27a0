"""GPU + PyTorch: the Python host cost of one eager dispatch + combine per rank, printed beside
the C++ figure (graphep-bench moe --host-cost, when a built graphep-bench is found: $GRAPHEP_BENCH
or build*/bench/graphep-bench). Three Python routes: the extension alone (raw pointers), the
framework-neutral graphep.Engine with torch tensors, and torch.ops.graphep. The outputs of the
last timed operation are checked against the reference. Run with -s to see the figures:

    python3 -m pytest -s tests/python/test_host_cost_gpu.py
"""

import glob
import os
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from conftest import GPUS, full_tier, requires_gpus, requires_torch

pytestmark = [requires_torch, requires_gpus(1), full_tier]  # a measurement beside the C++ bench: full tier

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

import graphep  # noqa: E402
import graphep.torch as gt  # noqa: E402
from moe_check import check_combine, expert_rows, make_inputs  # noqa: E402

T, H, E, K, ITERS, WARMUP = 64, 1024, 16, 4, 300, 30
ROOT = Path(__file__).resolve().parents[2]


def cpp_host_cost() -> str:
    bench = os.environ.get("GRAPHEP_BENCH") or next(iter(sorted(glob.glob(str(ROOT / "build*/bench/graphep-bench")))), None)
    if bench is None:
        return "C++: no graphep-bench built (build with GRAPHEP_BUILD_BENCH=ON or set GRAPHEP_BENCH)"
    cmd = [bench, "moe", "-b", str(T), "-e", str(T), "--hidden", str(H), "--experts", str(E), "--topk", str(K),
           "--dtype", "bf16", "--host-cost", "-n", str(ITERS)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, NCCL_NVLS_ENABLE="0"))
    lines = [line for line in r.stdout.splitlines() if line.startswith("# host cost")]
    return "C++ (" + " ".join(cmd[1:]) + "): " + (lines[0] if lines else f"no '# host cost' line (exit {r.returncode})")


def test_python_host_cost_beside_cpp():
    devices = [0, 1] if GPUS >= 2 else [0, 0]
    cfg = graphep.MoeConfig(max_tokens_per_rank=T, hidden=H, num_experts=E, top_k=K)
    engines = graphep.create_engines(graphep.Group.local(devices), cfg)
    L = E // len(engines)
    streams, inputs, outs = [], [], []
    for i, e in enumerate(engines):
        dev = f"cuda:{e.device}"
        with torch.cuda.device(e.device):
            streams.append(torch.cuda.Stream())
        inputs.append(make_inputs(dev, T, H, E, K, "uniform", torch.int32, T - i,
                                  torch.Generator(device=dev).manual_seed(i)))
        outs.append(torch.empty(T, H, dtype=torch.bfloat16, device=dev))
        gt.torch_layout(e)  # the cached views, made outside the timing

    def synchronize():  # every rank's device (torch.cuda.synchronize() waits for the current one only)
        for d in sorted(set(devices)):
            torch.cuda.synchronize(d)

    synchronize()  # the inputs (default streams) before the ranks' streams read them

    def raw(r):
        e, inp, s = engines[r], inputs[r], streams[r].cuda_stream
        e._core.dispatch(inp.x.data_ptr(), inp.ids.data_ptr(), graphep.IndexType.INT32, inp.weights.data_ptr(),
                         inp.num_tokens.data_ptr(), s)
        e._core.combine(0, outs[r].data_ptr(), s)

    def engine_api(r):
        e, inp, s = engines[r], inputs[r], streams[r].cuda_stream
        e.dispatch(inp.x, inp.ids, inp.weights, inp.num_tokens, s)
        e.combine(outs[r], s)

    def torch_ops(r):
        e, inp = engines[r], inputs[r]
        with torch.cuda.stream(streams[r]):
            gt.dispatch(e, inp.x, inp.ids, inp.weights, inp.num_tokens)
            gt.combine(e, outs[r])

    figures = {}
    for name, op in (("extension, raw pointers", raw), ("graphep.Engine, torch tensors", engine_api),
                     ("torch.ops.graphep", torch_ops)):
        per_rank = []
        for it in range(WARMUP + ITERS):
            t0 = time.perf_counter()
            for r in range(len(engines)):
                with torch.cuda.device(engines[r].device):
                    op(r)
            t1 = time.perf_counter()
            for s in streams:
                s.synchronize()
            if it >= WARMUP:
                per_rank.append((t1 - t0) * 1e6 / len(engines))
        figures[name] = statistics.median(per_rank)
    # The route timed last, checked: poison, dispatch on every rank, the test's experts
    # (moe_check.expert_rows) into each engine's expert_output, combine, compare.
    for o in outs:
        o.fill_(-3.0e38)
    synchronize()
    for r, (e, inp) in enumerate(zip(engines, inputs)):
        with torch.cuda.device(e.device), torch.cuda.stream(streams[r]):
            gt.dispatch(e, inp.x, inp.ids, inp.weights, inp.num_tokens)
    for r, e in enumerate(engines):
        with torch.cuda.device(e.device), torch.cuda.stream(streams[r]):
            layout = gt.torch_layout(e)
            layout.expert_output.copy_(expert_rows(layout, L, False))
            gt.combine(e, outs[r])
    synchronize()
    assert sum(check_combine(outs[r], inputs, r, L, False) for r in range(len(engines))) == 0
    print(f"\n# python host cost, {len(engines)} ranks on GPUs {devices}, {T} tokens bf16, median of {ITERS}, "
          "one eager dispatch + combine per rank:")
    for name, us in figures.items():
        print(f"#   {name}: {us:.2f} us per rank")
    print("# " + cpp_host_cost())
    assert all(us > 0 for us in figures.values())
