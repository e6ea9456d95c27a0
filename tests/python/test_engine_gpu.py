"""GPU + PyTorch: dispatch and combine against the reference in moe_check.py, on 2 ranks in one
process (2 emulated ranks on GPU 0, and one rank on each of 2 GPUs), through the framework-free
API (graphep.Engine with torch tensors, and with arrays that expose only DLPack or
__cuda_array_interface__) and through torch.ops.graphep. bf16 and fp8, int32 and int64 ids,
uniform / masked (-1) / duplicate ids, live token counts below the maximum, both paths, both
receive layouts (expert-major, batched, rank-major). Every
layout buffer and output is poisoned before every round; each round is fresh random data."""

import pytest

from conftest import GPUS, requires_gpus, requires_torch

pytestmark = [requires_torch, requires_gpus(1)]

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

import graphep  # noqa: E402
import graphep.torch as gt  # noqa: E402
from moe_check import (POISON_BF16, ROUTINGS, check_combine, check_dispatch, check_rank_major,  # noqa: E402
                       make_inputs, rank_major_rows)

T, H, E, K = 64, 1024, 16, 4
WORLDS = {"emulated2": [0, 0], "gpus2": [0, 1]}
_engines = {}


def engines_for(world, dtype, path, layout=graphep.ReceiveLayout.EXPERT_MAJOR):
    """One engine set per (world, dtype, path, layout), shared by the cases that use it."""
    if world == "gpus2" and GPUS < 2:
        pytest.skip(f"needs 2 GPUs, found {GPUS}")
    key = (world, dtype, path, layout)
    if key not in _engines:
        cfg = graphep.MoeConfig(max_tokens_per_rank=T, hidden=H, num_experts=E, top_k=K, path=path,
                                dispatch_type=graphep.DType.FP8_E4M3 if dtype == "fp8" else graphep.DType.BF16,
                                receive_layout=layout)
        group = graphep.Group.local(WORLDS[world])
        engines = graphep.create_engines(group, cfg)
        streams = []
        for e in engines:
            with torch.cuda.device(e.device):
                streams.append(torch.cuda.Stream())
        _engines[key] = (engines, streams)
    return _engines[key]


class DlpackOnly:
    """An array known to graphep only through DLPack (what CuPy or JAX hand over)."""

    def __init__(self, t):
        self._t = t

    def __dlpack__(self, **kw):
        return self._t.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._t.__dlpack_device__()


class CaiOnly:
    """An array known only through __cuda_array_interface__ (numeric dtypes only)."""

    def __init__(self, t):
        self.__cuda_array_interface__ = t.__cuda_array_interface__
        self._t = t


def poison(layout, out):
    """Every buffer dispatch writes (expert_totals aside: it accumulates over the engine's life)."""
    for t in layout.written():
        if t.data_ptr() == layout.expert_totals.data_ptr():
            continue
        t.fill_(-7) if t.dtype == torch.int32 else t.view(torch.uint8).fill_(0xFF)
    out.fill_(POISON_BF16)


def run_round(engines, streams, routing, index_dtype, lives, api, seed, own_output=True):
    """One dispatch + experts + combine on every rank; returns the wrong count of each check."""
    fp8 = engines[0].config.dispatch_type == graphep.DType.FP8_E4M3
    L = E // len(engines)
    gens = [torch.Generator(device=f"cuda:{e.device}").manual_seed(seed + i) for i, e in enumerate(engines)]
    inputs = [make_inputs(f"cuda:{e.device}", T, H, E, K, routing, index_dtype, live, g)
              for e, g, live in zip(engines, gens, lives)]
    outs = [torch.empty(T, H, dtype=torch.bfloat16, device=f"cuda:{e.device}") for e in engines]
    layouts = [gt.torch_layout(e) for e in engines]
    for e, s, lay, out in zip(engines, streams, layouts, outs):
        with torch.cuda.device(e.device):
            poison(lay, out)
            torch.cuda.synchronize()
    for e, s, inp in zip(engines, streams, inputs):  # every rank's dispatch before any combine
        with torch.cuda.device(e.device), torch.cuda.stream(s):
            if api == "torch_ops":
                gt.dispatch(e, inp.x, inp.ids, inp.weights, inp.num_tokens)
            elif api == "dlpack":
                e.dispatch(DlpackOnly(inp.x), DlpackOnly(inp.ids), DlpackOnly(inp.weights),
                           DlpackOnly(inp.num_tokens), s)
            elif api == "cuda_array_interface":  # bf16 x has no CAI type: it goes through DLPack
                e.dispatch(DlpackOnly(inp.x), CaiOnly(inp.ids), CaiOnly(inp.weights), CaiOnly(inp.num_tokens), s)
            else:
                e.dispatch(inp.x, inp.ids, inp.weights, inp.num_tokens, s.cuda_stream)
    wrong_dispatch = 0
    for r, (e, s, lay) in enumerate(zip(engines, streams, layouts)):
        with torch.cuda.device(e.device):
            s.synchronize()
            if e.config.receive_layout == graphep.ReceiveLayout.RANK_MAJOR:
                wrong_dispatch += check_rank_major(lay, rank_major_views(e), inputs, r, L, fp8)
            else:
                wrong_dispatch += check_dispatch(lay, inputs, r, L, fp8, getattr(e.layout, "rows_per_expert", 0))
    ys = []
    for e, s, lay in zip(engines, streams, layouts):
        with torch.cuda.device(e.device), torch.cuda.stream(s):
            y = expert_rows_into(lay, L, fp8, own_output,
                                 rank_major_views(e) if e.config.receive_layout == graphep.ReceiveLayout.RANK_MAJOR
                                 else None)
            ys.append(y)
    for e, s, y, out in zip(engines, streams, ys, outs):
        with torch.cuda.device(e.device), torch.cuda.stream(s):
            if api == "torch_ops":
                gt.combine(e, out, y)
            else:
                e.combine(out, s, None if own_output else y)
    wrong_combine = 0
    for r, (e, s, out) in enumerate(zip(engines, streams, outs)):
        with torch.cuda.device(e.device):
            s.synchronize()
            wrong_combine += check_combine(out, inputs, r, L, fp8)
    for e in engines:
        st = e.status()
        assert st.ok, st.describe()
    return wrong_dispatch, wrong_combine


def rank_major_views(engine):
    v = engine.layout
    return {name: torch.from_dlpack(getattr(v, name)) for name in ("rank_offsets", "row_experts", "row_expert_weights")}


def expert_rows_into(layout, L, fp8, own_output, rank_major=None):
    from moe_check import expert_rows

    y = rank_major_rows(layout, rank_major, fp8) if rank_major is not None else expert_rows(layout, L, fp8)
    if own_output:
        layout.expert_output.copy_(y)
        return layout.expert_output
    return y.contiguous()


@pytest.mark.parametrize("world", ["emulated2", "gpus2"])
@pytest.mark.parametrize("path", [graphep.MoePath.AUTO, graphep.MoePath.THROUGHPUT], ids=["auto", "throughput"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("layout", [graphep.ReceiveLayout.EXPERT_MAJOR, graphep.ReceiveLayout.BATCHED,
                                    graphep.ReceiveLayout.RANK_MAJOR], ids=["expert_major", "batched", "rank_major"])
def test_dispatch_combine_match_the_reference(world, path, dtype, index_dtype, routing, layout):
    engines, streams = engines_for(world, dtype, path, layout)
    for i, lives in enumerate([(T, T), (1, T - 5), (T // 2, 3)]):
        api = ("core", "torch_ops", "core")[i]
        wd, wc = run_round(engines, streams, routing, index_dtype, lives, api, seed=100 * i + 7,
                           own_output=(i != 2))
        assert (wd, wc) == (0, 0), f"lives {lives} via {api}: {wd} wrong in dispatch, {wc} in combine"


@pytest.mark.parametrize("api", ["dlpack", "cuda_array_interface"])
def test_framework_neutral_arrays(api):
    engines, streams = engines_for("emulated2", "bf16", graphep.MoePath.AUTO)
    assert run_round(engines, streams, "masked", torch.int32, (T - 1, 17), api, seed=5) == (0, 0)


def test_views_are_zero_copy_and_keep_the_engine_alive():
    cfg = graphep.MoeConfig(max_tokens_per_rank=T, hidden=H, num_experts=E, top_k=K)
    engines = graphep.create_engines(graphep.Group.local([0, 0]), cfg)
    view = engines[0].layout.expert_counts
    t = torch.from_dlpack(view)
    assert t.data_ptr() == view.ptr == view.__cuda_array_interface__["data"][0]
    assert tuple(t.shape) == (E // 2,) and t.dtype == torch.int32
    recv = torch.from_dlpack(engines[0].layout.recv_x)
    del engines, view
    import gc

    gc.collect()
    recv.fill_(1.5)  # the engine's memory is still there: the tensor holds the engine
    torch.cuda.synchronize()
    assert float(recv[0, 0]) == 1.5


def test_run_path_errors_name_the_array():
    engines, streams = engines_for("emulated2", "bf16", graphep.MoePath.AUTO)
    e = engines[0]
    x = torch.zeros(T, H, dtype=torch.float16, device="cuda:0")
    ids = torch.zeros(T, K, dtype=torch.int32, device="cuda:0")
    w = torch.zeros(T, K, dtype=torch.float32, device="cuda:0")
    n = torch.full((1,), T, dtype=torch.int32, device="cuda:0")
    with pytest.raises(graphep.Error, match="x has dtype float16, expected bfloat16"):
        e.dispatch(x, ids, w, n, 0)
    with pytest.raises(graphep.Error, match="topk_idx has shape \\[64, 3\\], expected \\[rows, 4\\]"):
        e.dispatch(x.bfloat16(), ids[:, :3].contiguous(), w, n, 0)
    with pytest.raises(graphep.Error, match="num_tokens is on the CPU"):
        e.dispatch(x.bfloat16(), ids, w, n.cpu(), 0)
    with pytest.raises(graphep.Error, match="x has strides"):
        e.dispatch(torch.zeros(H, T, dtype=torch.bfloat16, device="cuda:0").t(), ids, w, n, 0)


def test_invalid_ids_are_counted_and_named():
    engines, streams = engines_for("emulated2", "bf16", graphep.MoePath.AUTO)
    for e in engines:
        e.clear_status()
    gen = torch.Generator(device="cuda:0").manual_seed(3)
    inputs = [make_inputs("cuda:0", T, H, E, K, "uniform", torch.int32, T, gen) for _ in engines]
    inputs[1].ids[5, 2] = E + 3  # outside [-1, E)
    outs = [torch.empty(T, H, dtype=torch.bfloat16, device="cuda:0") for _ in engines]
    torch.cuda.synchronize()  # the inputs (default stream) before the engines' streams read them
    for e, s, inp in zip(engines, streams, inputs):
        with torch.cuda.stream(s):
            e.dispatch(inp.x, inp.ids, inp.weights, inp.num_tokens, s)
    for e, s, out in zip(engines, streams, outs):
        with torch.cuda.stream(s):
            e.combine(out, s)
    st = engines[1].status()
    assert (st.invalid_expert_ids, st.first_invalid_token, st.first_invalid_slot, st.first_invalid_id) == \
        (1, 5, 2, E + 3)
    assert "topk_idx[5][2] = 19" in st.describe()
    for e in engines:
        e.clear_status()
        assert e.status().ok


@pytest.mark.parametrize("path", [graphep.MoePath.AUTO, graphep.MoePath.THROUGHPUT], ids=["auto", "throughput"])
def test_overflow_drops_the_last_rows_and_says_which(path):
    """recv_capacity 100 rows where ~256 arrive: the layout keeps the first 100 in its order,
    expert_dropped says how many of each expert went, status().dropped_rows counts them all."""
    cfg = graphep.MoeConfig(max_tokens_per_rank=T, hidden=H, num_experts=E, top_k=K, path=path, recv_capacity=100)
    engines = graphep.create_engines(graphep.Group.local([0, 0]), cfg)
    streams = [torch.cuda.Stream() for _ in engines]
    layouts = [gt.torch_layout(e) for e in engines]
    gen = torch.Generator(device="cuda:0").manual_seed(13)
    inputs = [make_inputs("cuda:0", T, H, E, K, "uniform", torch.int32, T, gen) for _ in engines]
    outs = [torch.empty(T, H, dtype=torch.bfloat16, device="cuda:0") for _ in engines]
    torch.cuda.synchronize()
    for e, s, inp in zip(engines, streams, inputs):
        with torch.cuda.stream(s):
            gt.dispatch(e, inp.x, inp.ids, inp.weights, inp.num_tokens)
    torch.cuda.synchronize()
    wrong = sum(check_dispatch(lay, inputs, r, E // 2, False) for r, lay in enumerate(layouts))
    dropped = [int(lay.expert_dropped.sum()) for lay in layouts]
    for e, s, out in zip(engines, streams, outs):  # every dispatch is paired with its combine
        with torch.cuda.stream(s):
            gt.combine(e, out)
    torch.cuda.synchronize()
    assert wrong == 0
    assert all(d > 0 for d in dropped), dropped
    assert [e.status().dropped_rows for e in engines] == dropped


def test_health_check_is_ok_after_paired_operations():
    engines, streams = engines_for("emulated2", "bf16", graphep.MoePath.AUTO)
    run_round(engines, streams, "uniform", torch.int32, (T, T), "core", seed=11)
    for e, s in zip(engines, streams):
        h = e.check_health(s, timeout_ms=2000)
        assert h.ok, h.message


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("path", [graphep.MoePath.AUTO, graphep.MoePath.THROUGHPUT], ids=["auto", "throughput"])
def test_memory_query_equals_the_allocation(dtype, path):
    cfg = graphep.MoeConfig(max_tokens_per_rank=T, hidden=H, num_experts=E, top_k=K, path=path,
                            dispatch_type=graphep.DType.FP8_E4M3 if dtype == "fp8" else graphep.DType.BF16)
    need = graphep.memory_requirements(cfg, 2)
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info(0)[0]
    engines = graphep.create_engines(graphep.Group.local([0, 0]), cfg)
    torch.cuda.synchronize()
    used = free_before - torch.cuda.mem_get_info(0)[0]
    for e in engines:
        assert e.path == need.path
        assert e.symmetric_heap_bytes == need.symmetric_heap_bytes
        assert e.private_bytes == need.private_bytes
    # What the driver saw leave: both ranks' heaps and buffers, plus allocation granularity and
    # the few small allocations outside them (error words, streams): under 64 MiB.
    want = 2 * (need.symmetric_heap_bytes + need.private_bytes)
    assert want <= used <= want + (64 << 20), f"free memory fell by {used} B, the query says {want} B"
