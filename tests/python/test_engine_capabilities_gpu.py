"""graphep.Engine's keywords for DeepEP's API. The normal mode (rank-major layout, throughput path,
direct dispatch): per-call top_k, token_in_rank routing, caller-quantised fp8 input (strided
scales) and engine-quantised fp8 into the caller's buffers, DispatchOutputs, combine from [n, H]
rows with row_values, and repeated dispatches and combines. The low-latency mode (batched layout,
latency path): dispatch without weights and combine with topk_weights, scale_format (float, pow2,
ue8m0) of an fp8 dispatch on a bf16 engine (layout.recv_x_fp8), recv_stats, the send halves and
Engine.receive, expert_source_ranges.

CPU: every argument check, against a recording stand-in for the extension's EngineCore (what
each call hands the core, and the error naming each bad array). 2 GPUs + PyTorch: two ranks on
two GPUs driven from one thread (Group.local([0, 1]), one stream per rank), each dispatch and
combine against a reference built from both ranks' inputs, outputs poisoned first; the engine's
own refusals (NOT_SUPPORTED off the rank-major layout) and what it counts (rows past the caller's
outputs, expert-output rows missing)."""

import types

import pytest

from conftest import GPUS, requires_gpus, requires_torch

import graphep  # noqa: E402
import graphep.engine as engine_module  # noqa: E402
from graphep import DispatchInput, DispatchOutputs, Fp8Scales, MoeHalf  # noqa: E402
from graphep.arrays import ArrayInfo  # noqa: E402

CUDA = 2
T, H, E, K, R = 64, 512, 16, 4, 2


# ---- CPU: the argument checks, against a recording core ------------------------------------------

class Fake:
    """An array graphep.engine.describe reads as `info` (pointers are made up; nothing runs)."""

    _next = 0x10000

    def __init__(self, shape, dtype, strides=None, device=0):
        if strides is None:
            strides, step = [], 1
            for extent in reversed(shape):
                strides.insert(0, step)
                step *= extent
        Fake._next += 0x10000
        self.info = ArrayInfo(Fake._next, tuple(shape), tuple(strides), dtype, CUDA, device)


class RecordingCore:
    rank, world_size, device = 0, R, 0

    def __init__(self, path=graphep.MoePath.THROUGHPUT):
        self.calls = []
        self.path = path

    def dispatch(self, *args, **kwargs):
        self.calls.append(("dispatch", args, kwargs))

    def combine(self, *args, **kwargs):
        self.calls.append(("combine", args, kwargs))

    def receive(self, *args, **kwargs):
        self.calls.append(("receive", args, kwargs))

    def set_active_ranks(self, *args, **kwargs):
        self.calls.append(("set_active_ranks", args, kwargs))

    def recover(self, *args, **kwargs):
        self.calls.append(("recover", args, kwargs))


def recording_engine(monkeypatch, layout, path):
    real = engine_module.describe
    monkeypatch.setattr(engine_module, "describe", lambda a, name: a.info if isinstance(a, Fake) else real(a, name))
    cfg = graphep.MoeConfig(max_tokens_per_rank=T, hidden=H, num_experts=E, top_k=K, receive_layout=layout, path=path)
    e = graphep.Engine.__new__(graphep.Engine)
    e._core, e._config, e._rows, e._k = RecordingCore(path), cfg, 0, 0
    e._layout = types.SimpleNamespace(capacity=R * T)
    return e


@pytest.fixture
def eng(monkeypatch):
    return recording_engine(monkeypatch, graphep.ReceiveLayout.RANK_MAJOR, graphep.MoePath.THROUGHPUT)


@pytest.fixture
def lat(monkeypatch):
    """A recording engine on the latency path, batched layout (the low-latency mode's)."""
    return recording_engine(monkeypatch, graphep.ReceiveLayout.BATCHED, graphep.MoePath.LATENCY)


def last(e):
    return e._core.calls[-1]


def bad(needle, fn, *args, status=graphep.Status.INVALID_ARGUMENT, **kwargs):
    with pytest.raises(graphep.Error) as err:
        fn(*args, **kwargs)
    assert err.value.status == status and needle in err.value.message, err.value.message


def inputs(rows=T, k=K, ids="int32"):
    return Fake((rows, H), "bfloat16"), Fake((rows, k), ids), Fake((rows, k), "float32"), Fake((1,), "int32")


def test_the_old_call_hands_the_core_what_it_did(eng):
    x, ids, w, n = inputs()
    eng.dispatch(x, ids, w, n, 7)
    op, args, kwargs = last(eng)
    assert (op, args, kwargs) == ("dispatch", (x.info.ptr, ids.info.ptr, graphep.IndexType.INT32, w.info.ptr,
                                               n.info.ptr, 7), {})
    out = Fake((T, H), "bfloat16")
    eng.combine(out, 7)
    assert last(eng) == ("combine", (0, out.info.ptr, 7), {})


def test_per_call_top_k(eng):
    x, ids, w, n = inputs(k=2, ids="int64")
    eng.dispatch(x, ids, w, n, 0, top_k=2)
    assert last(eng)[2] == {"top_k": 2} and last(eng)[1][2] == graphep.IndexType.INT64
    bad("top_k=5 is out of range [1, 4]", eng.dispatch, *inputs(k=5), 0, top_k=5)
    bad("topk_idx has shape [64, 2], expected [rows, 4]", eng.dispatch, x, ids, w, n, 0)  # no top_k: config's K
    bad("top_k=2 is given, but topk_idx is None", eng.dispatch, x, None, None, n, 0, top_k=2)


def test_token_in_rank_routing(eng):
    x, ids, w, n = inputs()
    mask = Fake((T, R), "bool")
    eng.dispatch(x, None, None, n, 0, token_in_rank=mask)
    op, args, kwargs = last(eng)
    assert args[1] == 0 and args[3] == 0 and kwargs == {"token_in_rank": mask.info.ptr}
    eng.dispatch(x, ids, w, n, 0, token_in_rank=mask)  # both: slots where the mask sends the token
    assert last(eng)[1][1] == ids.info.ptr and last(eng)[2] == {"token_in_rank": mask.info.ptr}
    bad("topk_idx is None: pass topk_idx [T, K] or token_in_rank [T, R]", eng.dispatch, x, None, None, n, 0)
    bad("topk_weights is given, but topk_idx is None", eng.dispatch, x, None, w, n, 0, token_in_rank=mask)
    bad("topk_weights is None, but topk_idx is given (pass both or neither; None is for the latency path, and "
        "this engine's path is THROUGHPUT)", eng.dispatch, x, ids, None, n, 0)
    bad("token_in_rank has shape [64, 3], expected [rows, 2]", eng.dispatch, x, None, None, n, 0,
        token_in_rank=Fake((T, 3), "bool"))
    bad("token_in_rank has 63 rows, expected 64", eng.dispatch, x, None, None, n, 0,
        token_in_rank=Fake((T - 1, R), "bool"))
    bad("token_in_rank has dtype float32", eng.dispatch, x, None, None, n, 0, token_in_rank=Fake((T, R), "float32"))


def test_fp8_input_with_strided_scales(eng):
    _, ids, w, n = inputs()
    x8 = Fake((T, H), "float8_e4m3fn")
    cols = Fake((T, H // 128), "float32", strides=(1, T))  # DeepEP's column-major scales
    eng.dispatch(x8, ids, w, n, 0, x_scales=cols)  # input None with scales: FP8
    assert last(eng)[2] == {"x_scales": cols.info.ptr, "scale_token_stride": 1, "scale_hidden_stride": T,
                            "input": DispatchInput.FP8}
    eng.dispatch(Fake((T, H), "uint8"), ids, w, n, 0, x_scales=cols, input=DispatchInput.FP8)
    bad("x_scales has dtype float16, expected float32", eng.dispatch, x8, ids, w, n, 0,
        x_scales=Fake((T, H // 128), "float16"))
    bad("x_scales has dtype int32, expected float32", eng.dispatch, x8, ids, w, n, 0,
        x_scales=Fake((T, H // 128), "int32"))
    bad("x_scales has shape [64, 3], expected [64, 4]", eng.dispatch, x8, ids, w, n, 0,
        x_scales=Fake((T, 3), "float32"))
    bad("x_scales has strides [0, 0]", eng.dispatch, x8, ids, w, n, 0,
        x_scales=Fake((T, H // 128), "float32", strides=(0, 0)))
    bad("input=FP8 (x already e4m3) needs x_scales", eng.dispatch, x8, ids, w, n, 0, input=DispatchInput.FP8)
    bad("x has dtype bfloat16, expected float8_e4m3fn or uint8", eng.dispatch, inputs()[0], ids, w, n, 0,
        x_scales=cols)
    bad("x_scales is given, but input=BF16", eng.dispatch, inputs()[0], ids, w, n, 0, x_scales=cols,
        input=DispatchInput.BF16)
    bad("input='fp8' is not a graphep.DispatchInput", eng.dispatch, x8, ids, w, n, 0, input="fp8")
    x, *_ = inputs()
    eng.dispatch(x, ids, w, n, 0, input=DispatchInput.FP8_QUANTIZE)
    assert last(eng)[2] == {"input": DispatchInput.FP8_QUANTIZE}


def test_dispatch_outputs(eng):
    x, ids, w, n = inputs(ids="int64")
    rows = 100
    o = DispatchOutputs(recv_x=Fake((rows, H), "bfloat16"), row_experts=Fake((rows, K), "int64"),
                        row_expert_weights=Fake((rows, K), "float32"), row_src_rank=Fake((rows,), "int32"),
                        row_src_token=Fake((rows,), "int32"), rank_prefix_matrix=Fake((R, R), "int32"))
    eng.dispatch(x, ids, w, n, 0, outputs=o)
    assert last(eng)[2] == {
        "out_recv_x": o.recv_x.info.ptr, "out_rows": rows, "out_row_experts": o.row_experts.info.ptr,
        "out_row_expert_weights": o.row_expert_weights.info.ptr, "out_row_src_rank": o.row_src_rank.info.ptr,
        "out_row_src_token": o.row_src_token.info.ptr, "out_rank_prefix_matrix": o.rank_prefix_matrix.info.ptr}
    s = Fake((rows, H // 128), "float32")
    eng.dispatch(x, ids, w, n, 0, input=DispatchInput.FP8_QUANTIZE,
                 outputs=DispatchOutputs(recv_x=Fake((rows, H), "float8_e4m3fn"), recv_scales=s))
    assert last(eng)[2]["out_recv_scales"] == s.info.ptr
    bad("outputs.recv_scales is None, but this dispatch sends fp8", eng.dispatch, x, ids, w, n, 0,
        input=DispatchInput.FP8_QUANTIZE, outputs=DispatchOutputs(recv_x=Fake((rows, H), "uint8")))
    bad("outputs.recv_x has dtype uint8, expected bfloat16", eng.dispatch, x, ids, w, n, 0,
        outputs=DispatchOutputs(recv_x=Fake((rows, H), "uint8")))
    bad("outputs.recv_scales is given, but this dispatch sends bf16", eng.dispatch, x, ids, w, n, 0,
        outputs=DispatchOutputs(recv_x=Fake((rows, H), "bfloat16"), recv_scales=s))
    bad("outputs.recv_x is None", eng.dispatch, x, ids, w, n, 0, outputs=DispatchOutputs(recv_x=None))
    bad("outputs.recv_x has 0 rows", eng.dispatch, x, ids, w, n, 0,
        outputs=DispatchOutputs(recv_x=Fake((0, H), "bfloat16")))
    bad("outputs.row_experts has dtype int32, expected int64", eng.dispatch, x, ids, w, n, 0,
        outputs=DispatchOutputs(recv_x=o.recv_x, row_experts=Fake((rows, K), "int32")))
    bad("outputs.row_expert_weights has 99 rows, expected 100", eng.dispatch, x, ids, w, n, 0,
        outputs=DispatchOutputs(recv_x=o.recv_x, row_expert_weights=Fake((rows - 1, K), "float32")))
    bad("outputs.row_src_token has shape [100, 1], expected [100]", eng.dispatch, x, ids, w, n, 0,
        outputs=DispatchOutputs(recv_x=o.recv_x, row_src_token=Fake((rows, 1), "int32")))
    bad("outputs.rank_prefix_matrix has shape [2, 3], expected [rows, 2]", eng.dispatch, x, ids, w, n, 0,
        outputs=DispatchOutputs(recv_x=o.recv_x, rank_prefix_matrix=Fake((R, R + 1), "int32")))
    bad("outputs.row_experts is given, but the dispatch has no top-k slots", eng.dispatch, x, None, None, n, 0,
        token_in_rank=Fake((T, R), "bool"), outputs=DispatchOutputs(recv_x=o.recv_x, row_experts=o.row_experts))
    bad("outputs is a dict, not a graphep.DispatchOutputs", eng.dispatch, x, ids, w, n, 0, outputs={})


def test_combine_rows_and_values(eng):
    x, ids, w, n = inputs()
    eng.dispatch(x, ids, w, n, 0)
    out, y = Fake((T, H), "bfloat16"), Fake((37, H), "bfloat16")
    vals, out_vals = Fake((37, 3), "float32"), Fake((T, 3), "float32")
    eng.combine(out, 0, y, row_values=vals, out_values=out_vals)
    assert last(eng) == ("combine", (y.info.ptr, out.info.ptr, 0),
                         {"expert_output_rows": 37, "row_values": vals.info.ptr, "out_values": out_vals.info.ptr,
                          "num_values": 3})
    bad("row_values and out_values go together", eng.combine, out, 0, y, row_values=vals)
    bad("row_values has 36 rows, expected 37", eng.combine, out, 0, y, row_values=Fake((36, 3), "float32"),
        out_values=out_vals)
    bad("row_values has shape [37, 17], expected [37, V] with V from 1 to 16", eng.combine, out, 0, y,
        row_values=Fake((37, 17), "float32"), out_values=Fake((T, 17), "float32"))
    bad("out_values has shape [64, 2], expected [rows, 3]", eng.combine, out, 0, y, row_values=vals,
        out_values=Fake((T, 2), "float32"))
    bad("out_values has 10 rows, fewer than the 64 rows", eng.combine, out, 0, y, row_values=vals,
        out_values=Fake((10, 3), "float32"))
    bad("expert_output has 0 rows", eng.combine, out, 0, Fake((0, H), "bfloat16"))
    bad("row_values has dtype float16", eng.combine, out, 0, y, row_values=Fake((37, 3), "float16"),
        out_values=out_vals)


def test_latency_dispatch_takes_weights_at_combine(lat):
    x, ids, w, n = inputs()
    lat.dispatch(x, ids, None, n, 3)  # no weights: the latency path takes 1, combine brings them
    assert last(lat) == ("dispatch", (x.info.ptr, ids.info.ptr, graphep.IndexType.INT32, 0, n.info.ptr, 3), {})
    out = Fake((T, H), "bfloat16")
    lat.combine(out, 3, topk_weights=w)
    assert last(lat) == ("combine", (0, out.info.ptr, 3), {"topk_weights": w.info.ptr})
    bad("topk_weights has 63 rows, expected 64", lat.combine, out, 3, topk_weights=Fake((T - 1, K), "float32"))
    bad("topk_weights has shape [64, 2], expected [rows, 4]", lat.combine, out, 3, topk_weights=Fake((T, 2), "float32"))
    bad("topk_weights has dtype float16, expected float32", lat.combine, out, 3, topk_weights=Fake((T, K), "float16"))
    lat.dispatch(x, Fake((T, 2), "int64"), None, n, 3, top_k=2)  # combine's weights follow the dispatch's top_k
    lat.combine(out, 3, topk_weights=Fake((T, 2), "float32"))
    bad("topk_weights has shape [64, 4], expected [rows, 2]", lat.combine, out, 3, topk_weights=w)


def test_combine_weights_need_a_dispatch_with_slots(lat):
    bad("topk_weights is given, but the last dispatch had no top-k slots", lat.combine, Fake((T, H), "bfloat16"), 0,
        topk_weights=Fake((T, K), "float32"))


def test_scale_format(lat):
    x, ids, _, n = inputs()
    for fmt in (Fp8Scales.POW2, Fp8Scales.UE8M0):
        lat.dispatch(x, ids, None, n, 0, input=DispatchInput.FP8_QUANTIZE, scale_format=fmt)
        assert last(lat)[2] == {"input": DispatchInput.FP8_QUANTIZE, "scale_format": fmt}
    lat.dispatch(x, ids, None, n, 0, input=DispatchInput.FP8_QUANTIZE, scale_format=Fp8Scales.FLOAT)
    assert last(lat)[2] == {"input": DispatchInput.FP8_QUANTIZE}  # FLOAT: the default, not passed
    lat.dispatch(x, ids, None, n, 0, scale_format=Fp8Scales.FLOAT)  # FLOAT fits any dispatch
    bad("scale_format=POW2 is the form of the scales the engine makes; this dispatch (input=CONFIG, "
        "dispatch_type=BF16) quantises nothing", lat.dispatch, x, ids, None, n, 0, scale_format=Fp8Scales.POW2)
    bad("scale_format=UE8M0 is the form", lat.dispatch, x, ids, None, n, 0, scale_format=Fp8Scales.UE8M0,
        input=DispatchInput.BF16)
    bad("scale_format='ue8m0' is not a graphep.Fp8Scales", lat.dispatch, x, ids, None, n, 0, scale_format="ue8m0",
        input=DispatchInput.FP8_QUANTIZE)


def test_recv_stats(lat):
    x, ids, _, n = inputs()
    stats = Fake((E // R,), "int32")
    lat.dispatch(x, ids, None, n, 0, recv_stats=stats)
    assert last(lat)[2] == {"recv_stats": stats.info.ptr}
    bad("recv_stats has shape [9], expected [8]", lat.dispatch, x, ids, None, n, 0, recv_stats=Fake((9,), "int32"))
    bad("recv_stats has dtype int64, expected int32", lat.dispatch, x, ids, None, n, 0,
        recv_stats=Fake((E // R,), "int64"))
    bad("recv_stats has strides [2]", lat.dispatch, x, ids, None, n, 0, recv_stats=Fake((E // R,), "int32", (2,)))


def test_halves_and_receive(lat):
    x, ids, w, n = inputs()
    lat.dispatch(x, ids, None, n, 5, half=MoeHalf.SEND)
    assert last(lat)[2] == {"half": MoeHalf.SEND}
    lat.receive(5)
    assert last(lat) == ("receive", (5,), {})
    lat.dispatch(x, ids, None, n, 5, half=MoeHalf.WHOLE)
    assert last(lat)[2] == {}
    out = Fake((T, H), "bfloat16")
    lat.combine(out, 5, topk_weights=w, half=MoeHalf.SEND)
    assert last(lat)[2] == {"topk_weights": w.info.ptr, "half": MoeHalf.SEND}
    bad("half='send' is not a graphep.MoeHalf (WHOLE, SEND)", lat.dispatch, x, ids, None, n, 5, half="send")
    bad("half=1 is not a graphep.MoeHalf", lat.combine, out, 5, half=1)


def test_active_ranks_as_a_mask_or_a_list(lat):
    lat.set_active_ranks(0b10, 5)
    assert last(lat) == ("set_active_ranks", (0b10, 5), {})
    lat.set_active_ranks([0, 1], 5)
    assert last(lat) == ("set_active_ranks", (0b11, 5), {})
    lat.recover((0,), 7)
    assert last(lat) == ("recover", (0b01, 7), {})
    with pytest.raises(graphep.Error, match=r"rank 2 is outside \[0, 2\)"):
        lat.set_active_ranks([0, 2], 5)


# ---- 2 GPUs -----------------------------------------------------------------------------------------

def engines_on_two_gpus(**config):
    """(torch, the engines of a local group on GPUs 0 and 1 with this config, a stream per engine);
    skips without 2 GPUs or PyTorch."""
    if GPUS < 2:
        pytest.skip(f"needs 2 GPUs, found {GPUS}")
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    cfg = graphep.MoeConfig(max_tokens_per_rank=T, hidden=H, num_experts=E, top_k=K, **config)
    engines = graphep.create_engines(graphep.Group.local([0, 1]), cfg)
    streams = []
    for e in engines:
        with torch.cuda.device(e.device):
            streams.append(torch.cuda.Stream())
    return torch, engines, streams


@pytest.fixture(scope="module")
def two():
    return engines_on_two_gpus(receive_layout=graphep.ReceiveLayout.RANK_MAJOR, path=graphep.MoePath.THROUGHPUT)


class Rank:
    """One rank's inputs (fresh random data from a seed); ids -1 at random, live <= T rows."""

    def __init__(self, torch, device, seed, live, k=K, index=None, mask=False):
        gen = torch.Generator(device=device).manual_seed(seed)
        self.live, self.k = live, k
        self.x = torch.randn(T, H, generator=gen, device=device).to(torch.bfloat16)
        ids = torch.rand(T, E, generator=gen, device=device).argsort(dim=1)[:, :k]
        ids = torch.where(torch.rand(T, k, generator=gen, device=device) < 0.2, -1, ids)
        self.ids = ids.to(index or torch.int32).contiguous()
        self.w = torch.rand(T, k, generator=gen, device=device)
        self.mask = (torch.rand(T, R, generator=gen, device=device) < 0.5) if mask else None
        self.count = torch.full((1,), live, dtype=torch.int32, device=device)
        tiles = self.x.float().view(T, H // 128, 128)
        amax = tiles.abs().amax(dim=2).clamp(min=1e-4)
        self.x8 = (tiles * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(T, H)
        self.x8_bytes = self.x8.view(torch.uint8)
        self.scales = (amax / 448.0).T.contiguous().T  # column-major, as DeepEP's tests pass them


def reference(torch, ranks, q, device):
    """Rank q's rank-major rows, on `device`: (src, token) routed to q, sources in order, tokens in
    order; per row the slots' local experts (-1: not on q, or left out by the mask) and weights (0
    there)."""
    L = E // R
    src, tok, exps, wts = [], [], [], []
    for s, r in enumerate(ranks):
        ids, w = r.ids[: r.live].long().to(device), r.w[: r.live].to(device)
        mine = (ids >= q * L) & (ids < (q + 1) * L)
        if r.mask is not None:
            go = r.mask[: r.live, q].to(device)
            mine &= go.unsqueeze(1)
        else:
            go = mine.any(dim=1)
        t = torch.nonzero(go).flatten()
        src.append(torch.full_like(t, s)), tok.append(t)
        exps.append(torch.where(mine[t], ids[t] - q * L, torch.full_like(ids[t], -1)))
        wts.append(torch.where(mine[t], w[t], torch.zeros_like(w[t])))
    return [torch.cat(v) for v in (src, tok, exps, wts)]


def prefix(torch, ranks, device):
    """[i][j]: rows ranks 0..i send to rank j."""
    srcs = [reference(torch, ranks, j, device)[0] for j in range(R)]
    sent = [[int((srcs[j] == i).sum()) for j in range(R)] for i in range(R)]  # [source][destination]
    return torch.tensor(sent, device=device).cumsum(dim=0).to(torch.int32)


def gather(torch, ranks, name, src, tok, device):
    """The rows `tok` of each source's `name`, in the reference's order, on `device`."""
    return torch.cat([getattr(ranks[s], name).to(device)[tok[src == s]] for s in range(R)])


def fresh_outputs(torch, device, rows, k, index, fp8=False):
    o = DispatchOutputs(
        recv_x=torch.full((rows, H), 0xFF, dtype=torch.uint8, device=device) if fp8
        else torch.full((rows, H), -3.0e38, dtype=torch.bfloat16, device=device),
        recv_scales=torch.full((rows, H // 128), -1.0, device=device) if fp8 else None,
        row_experts=torch.full((rows, k), -7, dtype=index, device=device) if k else None,
        row_expert_weights=torch.full((rows, k), -7.0, device=device) if k else None,
        row_src_rank=torch.full((rows,), -7, dtype=torch.int32, device=device),
        row_src_token=torch.full((rows,), -7, dtype=torch.int32, device=device),
        rank_prefix_matrix=torch.full((R, R), -7, dtype=torch.int32, device=device))
    return o


def dispatch_all(torch, engines, streams, ranks, make_kwargs):
    torch.cuda.synchronize(0), torch.cuda.synchronize(1)  # inputs (default streams) before the rank streams
    for e, s, r in zip(engines, streams, ranks):
        with torch.cuda.device(e.device), torch.cuda.stream(s):
            args, kwargs = make_kwargs(e, r)
            e.dispatch(*args, r.count, s, **kwargs)
    for s in streams:
        s.synchronize()


def check_rows(torch, o, ranks, q, k, fp8=None):
    """Wrong elements of rank q's caller outputs `o` against the reference."""
    dev = o.row_src_rank.device
    src, tok, exps, wts = reference(torch, ranks, q, dev)
    n = src.numel()
    wrong = int((o.row_src_rank[:n].long() != src).sum()) + int((o.row_src_token[:n].long() != tok).sum())
    wrong += int((o.rank_prefix_matrix != prefix(torch, ranks, dev)).sum())
    if fp8 == "caller":
        wrong += int((o.recv_x[:n] != gather(torch, ranks, "x8_bytes", src, tok, dev)).sum())
        wrong += int((o.recv_scales[:n] != gather(torch, ranks, "scales", src, tok, dev)).sum())
    elif fp8 == "engine":
        from moe_check import fp8_quantize

        qx, scales = fp8_quantize(gather(torch, ranks, "x", src, tok, dev))
        wrong += int((o.recv_x[:n] != qx.view(torch.uint8)).sum()) + int((o.recv_scales[:n] != scales).sum())
    else:
        want = gather(torch, ranks, "x", src, tok, dev)
        wrong += int((o.recv_x[:n].view(torch.int16) != want.view(torch.int16)).sum())
    if k:
        wrong += int((o.row_experts[:n].long() != exps).sum())
        wrong += int((o.row_expert_weights[:n].view(torch.int32) != wts.view(torch.int32)).sum())
    return wrong, n


def make_ranks(torch, seed, **kw):
    return [Rank(torch, f"cuda:{d}", seed + d, live, **kw) for d, live in zip((0, 1), (T, T - 23))]


def assert_ok(engines):
    for e in engines:
        st = e.status()
        assert st.ok, st.describe()


@requires_torch
@requires_gpus(2)
@pytest.mark.parametrize("routing", ["top_k", "mask", "mask+top_k"])
@pytest.mark.parametrize("k, index", [(K, "int32"), (2, "int64")], ids=["k4-int32", "k2-int64"])
def test_routing_into_caller_outputs(two, routing, k, index):
    torch, engines, streams = two
    idx = getattr(torch, index)
    ranks = make_ranks(torch, 100 + k, k=k, index=idx, mask=routing != "top_k")
    slots = routing != "mask"
    outs = [fresh_outputs(torch, f"cuda:{e.device}", R * T, k if slots else 0, idx) for e in engines]

    def call(e, r):
        ids, w = (r.ids, r.w) if slots else (None, None)
        return (r.x, ids, w), dict(top_k=k if (slots and k != K) else None, token_in_rank=r.mask,
                                   outputs=outs[e.rank])

    dispatch_all(torch, engines, streams, ranks, call)
    for q, (e, o) in enumerate(zip(engines, outs)):
        with torch.cuda.device(e.device):
            wrong, n = check_rows(torch, o, ranks, q, k if slots else 0)
            assert wrong == 0, f"rank {q}: {wrong} wrong"
            assert int(torch.from_dlpack(e.layout.num_recv_rows).item()) == n
            if slots:
                L = E // R
                got = torch.from_dlpack(e.layout.expert_counts).long()
                exps = reference(torch, ranks, q, got.device)[2]
                want = torch.bincount(exps.flatten() + 1, minlength=L + 1)[1:]
                assert torch.equal(got, want), (got, want)
    combine_all(torch, engines, streams, ranks, outs)  # every dispatch combined
    assert_ok(engines)


def combine_all(torch, engines, streams, ranks, outs, values=3, rows=None):
    """Each rank's experts: y = recv_x x (1 + q / 4) in bf16 and values [src, token, q] per row;
    combine them home and check out and out_values against the fp32 sums over the ranks."""
    ys, vals, results = [], [], []
    for q, (e, o) in enumerate(zip(engines, outs)):
        with torch.cuda.device(e.device):
            n = int(torch.from_dlpack(e.layout.num_recv_rows).item())
            keep = n if rows is None else rows
            y = (o.recv_x[:keep].float() * (1 + q / 4)).to(torch.bfloat16).contiguous()
            v = torch.stack([o.row_src_rank[:keep].float(), o.row_src_token[:keep].float(),
                             torch.full((keep,), float(q), device=y.device)], dim=1)[:, :values].contiguous()
            ys.append(y), vals.append(v)
    for e in engines:  # y and v were made on the default stream, which s is not ordered after
        torch.cuda.synchronize(e.device)
    for e, s, y, v in zip(engines, streams, ys, vals):
        with torch.cuda.device(e.device), torch.cuda.stream(s):
            out = torch.full((T, H), -3.0e38, dtype=torch.bfloat16, device=y.device)
            out_v = torch.full((T, values), -7.0, device=y.device)
            e.combine(out, s, y, row_values=v, out_values=out_v)
            results.append((out, out_v))
    for s in streams:
        s.synchronize()
    for r_idx, (r, (out, out_v)) in enumerate(zip(ranks, results)):
        live = r.live
        acc = torch.zeros(live, H, device=out.device)
        acc_v = torch.zeros(live, values, device=out.device)
        for q in range(R):  # ascending rank, fp32
            src, tok, _, _ = reference(torch, ranks, q, out.device)
            mine = tok[src == r_idx]
            y = (r.x[mine].float() * (1 + q / 4)).to(torch.bfloat16).float()
            acc[mine] += y
            acc_v[mine] += torch.tensor([float(r_idx), 0.0, float(q)], device=out.device)[:values] + \
                torch.stack([torch.zeros_like(mine.float()), mine.float(), torch.zeros_like(mine.float())],
                            dim=1)[:, :values]
        if rows is None:
            assert int(((out[:live].float() - acc).abs() > acc.abs() * 2.0 ** -8 + 1e-6).sum()) == 0
            assert torch.equal(out_v[:live], acc_v)
    return results


@requires_torch
@requires_gpus(2)
@pytest.mark.parametrize("fp8", ["caller", "engine"])
def test_fp8_into_caller_outputs(two, fp8):
    torch, engines, streams = two
    ranks = make_ranks(torch, 300, index=torch.int64)
    outs = [fresh_outputs(torch, f"cuda:{e.device}", R * T, K, torch.int64, fp8=True) for e in engines]

    def call(e, r):
        if fp8 == "caller":
            return (r.x8, r.ids, r.w), dict(x_scales=r.scales, input=DispatchInput.FP8, outputs=outs[e.rank])
        return (r.x, r.ids, r.w), dict(input=DispatchInput.FP8_QUANTIZE, outputs=outs[e.rank])

    dispatch_all(torch, engines, streams, ranks, call)
    for q, (e, o) in enumerate(zip(engines, outs)):
        with torch.cuda.device(e.device):
            assert check_rows(torch, o, ranks, q, K, fp8=fp8)[0] == 0
    # The experts' rows for combine: the bf16 inputs (the combine check's reference uses r.x).
    for q, (e, o) in enumerate(zip(engines, outs)):
        with torch.cuda.device(e.device):
            src, tok, _, _ = reference(torch, ranks, q, f"cuda:{e.device}")
            o.recv_x = gather(torch, ranks, "x", src, tok, f"cuda:{e.device}")
    combine_all(torch, engines, streams, ranks, outs)
    assert_ok(engines)


@requires_torch
@requires_gpus(2)
def test_repeated_dispatches_and_combines(two):
    torch, engines, streams = two
    ranks = make_ranks(torch, 500, mask=True)
    outs = [[fresh_outputs(torch, f"cuda:{e.device}", R * T, K, torch.int32) for e in engines] for _ in range(3)]
    for i in range(3):  # dispatch -> dispatch -> dispatch: each as the first
        dispatch_all(torch, engines, streams, ranks,
                     lambda e, r: ((r.x, r.ids, r.w), dict(token_in_rank=r.mask, outputs=outs[i][e.rank])))
    for q in range(R):
        with torch.cuda.device(engines[q].device):
            for i in range(3):
                assert check_rows(torch, outs[i][q], ranks, q, K)[0] == 0
    first = combine_all(torch, engines, streams, ranks, outs[2])
    for _ in range(2):  # combine -> combine: the same dispatch again, the same result
        again = combine_all(torch, engines, streams, ranks, outs[2])
        for (a, av), (b, bv) in zip(first, again):
            assert torch.equal(a, b) and torch.equal(av, bv)
    assert_ok(engines)


@requires_torch
@requires_gpus(2)
def test_short_buffers_are_counted(two):
    """Caller outputs with fewer rows than arrive, and expert outputs with fewer rows than the layout
    needs: the rows that fit are right, the rest counted (dropped_rows, missing_combine_rows)."""
    torch, engines, streams = two
    ranks = make_ranks(torch, 700, mask=True)
    rows = 20
    outs = [fresh_outputs(torch, f"cuda:{e.device}", rows, K, torch.int32) for e in engines]
    dispatch_all(torch, engines, streams, ranks,
                 lambda e, r: ((r.x, r.ids, r.w), dict(token_in_rank=r.mask, outputs=outs[e.rank])))
    for q, (e, o) in enumerate(zip(engines, outs)):
        src = reference(torch, ranks, q, f"cuda:{e.device}")[0]
        assert src.numel() > rows
        with torch.cuda.device(e.device):
            full = fresh_outputs(torch, f"cuda:{e.device}", src.numel(), K, torch.int32)
            for name in ("recv_x", "row_experts", "row_expert_weights", "row_src_rank", "row_src_token"):
                getattr(full, name)[:rows].copy_(getattr(o, name))
            full.rank_prefix_matrix = o.rank_prefix_matrix
            wrong, n = check_rows(torch, full, ranks, q, K)
            assert wrong == (n - rows) * (2 + H + 2 * K)  # only the poisoned tail differs
        st = e.status()
        assert st.dropped_rows == src.numel() - rows, st.describe()
        e.clear_status()
    combine_all(torch, engines, streams, ranks, outs, rows=5)  # 5 expert-output rows of n
    for e in engines:
        st = e.status()
        assert st.missing_combine_rows > 0 and not st.ok, st.describe()
        e.clear_status()
    assert_ok(engines)


@requires_torch
@requires_gpus(2)
def test_engine_refuses_outside_the_rank_major_layout():
    torch = pytest.importorskip("torch")
    cfg = graphep.MoeConfig(max_tokens_per_rank=T, hidden=H, num_experts=E, top_k=K)  # expert-major
    engines = graphep.create_engines(graphep.Group.local([0, 0]), cfg)
    r = Rank(torch, "cuda:0", 9, T)
    mask = torch.ones(T, R, dtype=torch.bool, device="cuda:0")
    for kwargs, needle in [(dict(token_in_rank=mask), "tokenInRank applies to the rank-major receive layout"),
                           (dict(outputs=fresh_outputs(torch, "cuda:0", R * T, K, torch.int32)),
                            "DispatchOutputs applies to the rank-major receive layout")]:
        with pytest.raises(graphep.Error) as err:
            engines[0].dispatch(r.x, r.ids, r.w, r.count, 0, **kwargs)
        assert err.value.status == graphep.Status.NOT_SUPPORTED and needle in err.value.message, err.value


# ---- 2 GPUs: the low-latency mode's keywords (latency path, batched layout) -----------------------

L_LOCAL, RPE = E // R, R * T  # local experts; rows per expert (DeepEP's R x T)


@pytest.fixture(scope="module")
def latency_two():
    return engines_on_two_gpus(receive_layout=graphep.ReceiveLayout.BATCHED, rows_per_expert=RPE,
                               path=graphep.MoePath.LATENCY)


def latency_views(torch, e):
    v = e.layout
    views = {name: torch.from_dlpack(getattr(v, name)) for name in
             ("recv_x", "recv_x_fp8", "recv_scales", "expert_counts", "row_src_rank", "row_src_token",
              "expert_source_ranges")}
    return views


def expert_rows_of(torch, ranks, q, device):
    """Rank q's local experts: per expert, (source ranks, tokens) of its rows in layout order."""
    rows = []
    for j in range(L_LOCAL):
        g = q * L_LOCAL + j
        src, tok = [], []
        for s, r in enumerate(ranks):
            t = torch.nonzero((r.ids[: r.live].long().to(device) == g).any(dim=1)).flatten()
            src.append(torch.full_like(t, s)), tok.append(t)
        rows.append((torch.cat(src), torch.cat(tok)))
    return rows


def check_latency_rows(torch, v, rows, ranks, fmt, stats):
    """Wrong elements of one rank's batched layout (after poisoning) against `rows`."""
    dev = v["recv_x"].device
    wrong = 0
    counts = v["expert_counts"].tolist()
    for j, (src, tok) in enumerate(rows):
        c = src.numel()
        if counts[j] != c:
            wrong += 1
            continue
        wrong += int(stats[j].item() != c)
        first = j * RPE
        wrong += int((v["row_src_rank"][first:first + c].long() != src).sum())
        wrong += int((v["row_src_token"][first:first + c].long() != tok).sum())
        per_src = torch.bincount(src, minlength=R)
        begin = torch.cumsum(per_src, 0) - per_src
        got = v["expert_source_ranges"][j]
        wrong += int(((got & 0xFFFFFFFF) != per_src).sum()) + int(((got >> 32) != begin)[per_src > 0].sum())
        want = gather(torch, ranks, "x", src, tok, dev)
        if fmt is None:
            wrong += int((v["recv_x"][first:first + c].view(torch.int16) != want.view(torch.int16)).sum())
            continue
        q = v["recv_x_fp8"][first:first + c].view(torch.float8_e4m3fn).float()
        if fmt == "ue8m0":  # [rows][H / 128] exponent bytes at the start of the scales buffer
            raw = v["recv_scales"].view(torch.uint8).flatten()[: v["recv_scales"].shape[0] * (H // 128)]
            s = (raw.view(-1, H // 128)[first:first + c].to(torch.int32) << 23).view(torch.float32)
        else:
            s = v["recv_scales"][first:first + c]
        amax = want.float().view(c, H // 128, 128).abs().amax(dim=2)
        if fmt == "float":
            wrong += int(((s - amax / 448).abs() > amax / 448 * 1e-6).sum())
        else:  # the smallest power of two >= amax / 448
            wrong += int((torch.frexp(s)[0] != 0.5).sum())
            wrong += int(((s < amax / 448) | ((s / 2 >= amax / 448) & (amax > 0))).sum())
        got = (q.view(c, H // 128, 128) * s.unsqueeze(-1)).view(c, H)
        tol = want.float().abs() * 2.0 ** -4 + s.repeat_interleave(128, dim=1) * 2.0 ** -9  # e4m3
        wrong += int(((got - want.float()).abs() > tol * 1.01).sum())
    return wrong


@requires_torch
@requires_gpus(2)
@pytest.mark.parametrize("half", ["whole", "send"])
@pytest.mark.parametrize("fmt", [None, "float", "pow2", "ue8m0"], ids=["bf16", "fp8-float", "fp8-pow2", "fp8-ue8m0"])
def test_latency_keywords(latency_two, fmt, half):
    """Dispatch without weights (fp8 quantised by the engine on a bf16 engine, in each scale format),
    recv_stats, expert_source_ranges; combine with topk_weights; each in one launch or as send
    halves plus Engine.receive."""
    torch, engines, streams = latency_two
    formats = {"float": Fp8Scales.FLOAT, "pow2": Fp8Scales.POW2, "ue8m0": Fp8Scales.UE8M0}
    h = MoeHalf.SEND if half == "send" else MoeHalf.WHOLE
    ranks = make_ranks(torch, 900 + 7 * len(fmt or "") + (half == "send"), index=torch.int64)
    views = [latency_views(torch, e) for e in engines]
    stats = []
    for e, v in zip(engines, views):
        with torch.cuda.device(e.device):
            v["recv_x"].view(torch.uint8).fill_(0xFF)
            v["recv_scales"].fill_(-1.0)
            for name in ("expert_counts", "row_src_rank", "row_src_token", "expert_source_ranges"):
                v[name].fill_(-7)
            stats.append(torch.zeros(L_LOCAL, dtype=torch.int32, device=f"cuda:{e.device}"))
            torch.cuda.synchronize()
    for e, s, r, st in zip(engines, streams, ranks, stats):
        with torch.cuda.device(e.device), torch.cuda.stream(s):
            kwargs = dict(recv_stats=st, half=h)
            if fmt is not None:
                kwargs.update(input=DispatchInput.FP8_QUANTIZE, scale_format=formats[fmt])
            e.dispatch(r.x, r.ids, None, r.count, s, **kwargs)
    if h == MoeHalf.SEND:  # every send before any receive (one thread drives both ranks)
        for e, s in zip(engines, streams):
            with torch.cuda.device(e.device):
                e.receive(s)
    for s in streams:
        s.synchronize()
    all_rows = []
    for q, (e, v, st) in enumerate(zip(engines, views, stats)):
        with torch.cuda.device(e.device):
            assert v["recv_x_fp8"].data_ptr() == v["recv_x"].data_ptr()
            assert v["recv_x_fp8"].shape == (R * T * L_LOCAL, H) and v["recv_x_fp8"].dtype == torch.uint8
            assert v["expert_source_ranges"].shape == (L_LOCAL, R) and v["expert_source_ranges"].dtype == torch.int64
            rows = expert_rows_of(torch, ranks, q, f"cuda:{e.device}")
            wrong = check_latency_rows(torch, v, rows, ranks, fmt, st)
            assert wrong == 0, f"rank {q}: {wrong} wrong"
            all_rows.append(rows)
    # The experts: y = the source token's bf16 row x (1 + j / 8) (from the reference inputs, so the
    # fp8 dispatches combine exact values); unreceived rows poisoned, never read.
    outs = []
    for q, (e, s, rows) in enumerate(zip(engines, streams, all_rows)):
        dev = f"cuda:{e.device}"
        with torch.cuda.device(e.device):
            y = torch.full((L_LOCAL * RPE, H), -3.0e38, dtype=torch.bfloat16, device=dev)
            for j, (src, tok) in enumerate(rows):
                if src.numel():
                    y[j * RPE:j * RPE + src.numel()] = (gather(torch, ranks, "x", src, tok, dev).float() *
                                                        (1 + j / 8)).to(torch.bfloat16)
            out = torch.full((T, H), -3.0e38, dtype=torch.bfloat16, device=dev)
            torch.cuda.synchronize()
        with torch.cuda.device(e.device), torch.cuda.stream(s):
            engines[q].combine(out, s, y, topk_weights=ranks[q].w, half=h)
            outs.append(out)
    if h == MoeHalf.SEND:
        for e, s in zip(engines, streams):
            with torch.cuda.device(e.device):
                e.receive(s)
    for s in streams:
        s.synchronize()
    for q, (r, out) in enumerate(zip(ranks, outs)):
        ref = torch.zeros(r.live, H, dtype=torch.float64, device=out.device)
        bound = torch.zeros_like(ref)
        ids = r.ids[: r.live].long()
        for k in range(K):
            valid = (ids[:, k] >= 0).unsqueeze(1)
            j = (ids[:, k] % L_LOCAL).double().unsqueeze(1)
            y = (r.x[: r.live].double() * (1 + j / 8)).to(torch.bfloat16).double()
            term = torch.where(valid, r.w[: r.live, k:k + 1].double() * y, torch.zeros_like(y))
            ref, bound = ref + term, bound + term.abs()
        assert int(((out[: r.live].double() - ref).abs() > bound * 2.0 ** -7 + 1e-6).sum()) == 0, f"rank {q}"
        assert bool((out[r.live:] == -3.0e38).all()), f"rank {q}: rows past the live count written"
    assert_ok(engines)


@requires_torch
@requires_gpus(2)
def test_latency_weights_one_without_weights(latency_two):
    """Neither dispatch nor combine weights: each slot counts with weight 1."""
    torch, engines, streams = latency_two
    ranks = make_ranks(torch, 1200)
    dispatch_all(torch, engines, streams, ranks, lambda e, r: ((r.x, r.ids, None), {}))
    outs = []
    for q, (e, s) in enumerate(zip(engines, streams)):
        with torch.cuda.device(e.device):
            v = latency_views(torch, e)
            y = (v["recv_x"].float() * 2).to(torch.bfloat16)  # unreceived rows: never read
            out = torch.full((T, H), -3.0e38, dtype=torch.bfloat16, device=f"cuda:{e.device}")
            torch.cuda.synchronize()
        with torch.cuda.device(e.device), torch.cuda.stream(s):
            e.combine(out, s, y)
            outs.append(out)
    for s in streams:
        s.synchronize()
    for q, (r, out) in enumerate(zip(ranks, outs)):
        slots = (r.ids[: r.live] >= 0).sum(dim=1, keepdim=True).double()
        ref = slots * (r.x[: r.live].double() * 2).to(torch.bfloat16).double()
        assert int(((out[: r.live].double() - ref).abs() > ref.abs() * 2.0 ** -7 + 1e-6).sum()) == 0, f"rank {q}"
    assert_ok(engines)


@requires_torch
@requires_gpus(2)
def test_torch_layout_keeps_bf16_engines_without_scales(latency_two):
    """A bf16 engine has scales (for the latency path's fp8 dispatch), but graphep.torch's layout,
    whose ops send the config's type, keeps recv_scales None: the adapters' sign of bf16."""
    torch, engines, _ = latency_two
    import graphep.torch as gt

    e = engines[0]
    assert e.layout.recv_scales is not None and e.layout.recv_x_fp8 is not None
    assert gt.torch_layout(e).recv_scales is None


@requires_torch
@requires_gpus(2)
def test_active_rank_mask_drops_and_counts():
    """The active-rank mask on the latency path: rank 1 left out on both ranks. Rank 0 receives only
    its own entries, rank 1 nothing; each rank's status counts, per destination, the live entries
    the mask removed (all of rank 1's); a bad mask is refused by name; every rank back in, the next
    dispatch counts nothing more."""
    torch, engines, streams = engines_on_two_gpus(receive_layout=graphep.ReceiveLayout.BATCHED,
                                                  path=graphep.MoePath.LATENCY)
    L = E // R
    ranks = make_ranks(torch, 900)
    for e, s in zip(engines, streams):
        with torch.cuda.device(e.device):
            e.set_active_ranks([0], s)
    dispatch_all(torch, engines, streams, ranks, lambda e, r: ((r.x, r.ids, r.w), {}))
    want = [[0, 0], [0, 0]]
    for q, r in enumerate(ranks):
        ids = r.ids[: r.live].long().cpu()
        for d in range(R):
            n = int(((ids >= d * L) & (ids < (d + 1) * L)).sum())
            if q == 1 or d == 1:
                want[q][d] += n
    for q, e in enumerate(engines):
        st = e.status()
        assert list(st.masked_entries[:R]) == want[q], (q, list(st.masked_entries[:R]), want[q])
        assert st.ok, st.describe()
        with torch.cuda.device(e.device):
            counts = torch.from_dlpack(e.layout.expert_counts).long().cpu()
        own = ranks[q].ids[: ranks[q].live].long().cpu()
        own = int(((own >= q * L) & (own < (q + 1) * L)).sum())
        assert int(counts.sum()) == (own if q == 0 else 0), (q, counts)
    bad("mask 0 leaves no rank", engines[0].set_active_ranks, 0, streams[0])
    bad("names ranks past the last (world size 2)", engines[0].set_active_ranks, 0b100, streams[0])
    for e, s in zip(engines, streams):
        with torch.cuda.device(e.device):
            e.set_active_ranks([0, 1], s)
    dispatch_all(torch, engines, streams, ranks, lambda e, r: ((r.x, r.ids, r.w), {}))
    for q, e in enumerate(engines):
        assert list(e.status().masked_entries[:R]) == want[q]
