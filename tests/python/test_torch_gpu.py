"""GPU + PyTorch: the whole layer of examples/04_torch_moe.py captured with torch.cuda.graph and
replayed 1,000 times with new tokens and a new live count each replay, every replay checked against
the unsharded reference (0 wrong); the custom ops inside torch.compile; the vLLM- and SGLang-shaped
adapters against the reference."""

import importlib.util
import sys
from pathlib import Path

import pytest

from conftest import GPUS, full_tier, requires_gpus, requires_torch

pytestmark = [requires_torch, requires_gpus(1)]

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

import graphep  # noqa: E402
import graphep.torch as gt  # noqa: E402
from moe_check import POISON_BF16, check_combine, expert_rows, make_inputs  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def example():
    spec = importlib.util.spec_from_file_location("torch_moe_example", ROOT / "examples" / "04_torch_moe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# About 7 s each: the fast tier keeps bf16 on two GPUs, the full tier all four.
@pytest.mark.parametrize("one_gpu", [pytest.param(True, marks=full_tier), False], ids=["emulated2", "gpus2"])
@pytest.mark.parametrize("dtype, index", [("bf16", "int32"), pytest.param("fp8", "int64", marks=full_tier)])
def test_layer_graph_replayed_1000_times(one_gpu, dtype, index):
    if not one_gpu and GPUS < 2:
        pytest.skip(f"needs 2 GPUs, found {GPUS}")
    ex = example()
    args = ex.parse_args(["--steps", "1000", "--check-every", "1", "--dtype", dtype, "--index", index]
                         + (["--one-gpu"] if one_gpu else []))
    wrong, checks, times = ex.run(args)
    assert checks == 1000 * 2 and wrong == 0, f"{wrong} wrong over {checks} rank-steps"
    print(f"\n  layer replay p50 {times[len(times) // 2]:.1f} us ({dtype}, {'1 GPU' if one_gpu else '2 GPUs'})")


def test_ops_are_opaque_to_torch_compile():
    cfg = graphep.MoeConfig(max_tokens_per_rank=32, hidden=256, num_experts=8, top_k=2)
    engines = graphep.create_engines(graphep.Group.local([0, 0]), cfg)
    layouts = [gt.torch_layout(e) for e in engines]
    keys = [id(e) for e in engines]

    def dispatch(key, layout, x, ids, w, n):
        torch.ops.graphep.dispatch(key, x, ids, w, n, layout.written())
        return layout.expert_counts.sum()  # reads what dispatch wrote: must stay after it

    compiled = torch.compile(dispatch, backend="aot_eager", fullgraph=True)
    gen = torch.Generator(device="cuda:0").manual_seed(9)
    inputs = [make_inputs("cuda:0", 32, 256, 8, 2, "uniform", torch.int32, 32, gen) for _ in engines]
    streams = [torch.cuda.Stream() for _ in engines]
    torch.cuda.synchronize()  # the inputs (made on the default stream) before the side streams read them
    totals = []
    for key, lay, inp, s in zip(keys, layouts, inputs, streams):
        with torch.cuda.stream(s):
            totals.append(compiled(key, lay, inp.x, inp.ids, inp.weights, inp.num_tokens))
    outs = [torch.empty(32, 256, dtype=torch.bfloat16, device="cuda:0") for _ in engines]
    for e, s, out in zip(engines, streams, outs):
        with torch.cuda.stream(s):
            gt.combine(e, out)
    torch.cuda.synchronize()
    assert sum(int(t) for t in totals) == 2 * 32 * 2  # every (token, slot) of both ranks received once


def _adapter_round(make_adapter, call):
    """Two emulated ranks through an adapter; returns wrong elements against the reference."""
    cfg = graphep.MoeConfig(max_tokens_per_rank=64, hidden=512, num_experts=8, top_k=2)
    engines = graphep.create_engines(graphep.Group.local([0, 0]), cfg)
    adapters = [make_adapter(e) for e in engines]
    streams = [torch.cuda.Stream() for _ in engines]
    gen = torch.Generator(device="cuda:0").manual_seed(21)
    inputs = [make_inputs("cuda:0", 64, 512, 8, 2, "masked", torch.int64, live, gen) for live in (40, 64)]
    torch.cuda.synchronize()  # the inputs and the adapters' counts (default stream) before the side streams
    outs = call(adapters, streams, inputs)
    torch.cuda.synchronize()
    return sum(check_combine(out, inputs, r, 4, False) for r, out in enumerate(outs))


def test_vllm_shaped_prepare_finalize():
    def call(adapters, streams, inputs):
        prepared = []
        for a, s, inp in zip(adapters, streams, inputs):
            with torch.cuda.stream(s):
                x = inp.x[: inp.live]
                a1q, scale, meta, ids, w = a.prepare(x, inp.weights[: inp.live], inp.ids[: inp.live], 8, None, False, None)
                assert scale is None and ids is None and w is None
                assert meta.expert_num_tokens.data_ptr() == a.layout.expert_counts.data_ptr()
                prepared.append(expert_rows(a.layout, 4, False).contiguous())
        outs = []
        for a, s, y, inp in zip(adapters, streams, prepared, inputs):
            with torch.cuda.stream(s):
                out = torch.full((64, 512), POISON_BF16, dtype=torch.bfloat16, device="cuda:0")
                a.finalize(out[: inp.live], y, None, None, False, None)
                outs.append(out)
        return outs

    assert _adapter_round(gt.GraphepPrepareAndFinalize, call) == 0


def test_sglang_shaped_dispatcher():
    class TopK:  # SGLang's StandardTopKOutput fields
        def __init__(self, inp):
            self.topk_ids, self.topk_weights = inp.ids[: inp.live], inp.weights[: inp.live]

    def call(adapters, streams, inputs):
        ys = []
        for a, s, inp in zip(adapters, streams, inputs):
            with torch.cuda.stream(s):
                d = a.dispatch(inp.x[: inp.live], TopK(inp))
                assert d.format == "graphep_expert_major" and d.hidden_states.shape[1] == 512
                ys.append(expert_rows(d.layout, 4, False).contiguous())
        outs = []
        for a, s, y in zip(adapters, streams, ys):
            with torch.cuda.stream(s):
                got = a.combine(y)
                out = torch.full((64, 512), POISON_BF16, dtype=torch.bfloat16, device="cuda:0")
                out[: got.shape[0]].copy_(got)
                outs.append(out)
        return outs

    assert _adapter_round(gt.GraphepDispatcher, call) == 0
