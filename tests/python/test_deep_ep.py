"""graphep.deep_ep, DeepEP's API on graphep.

CPU: Config and its tables, EventOverlap, the T_max rule (synthetic heaps and graphep's own),
the compat runner's edit of DeepEP's test_intranode.py (a synthetic snippet, and the real file
where a DeepEP tree is checked out at .deepep/), and, with PyTorch, the arguments Buffer refuses
by name before touching a GPU. 2 GPUs + PyTorch: this file run as a worker under torchrun (two
processes, a Buffer over the world group) checks get_dispatch_layout, dispatch (bf16, fp8 tuple,
with and without top-k, cached, num_worst_tokens, a rank with no tokens, async with
previous_event), combine and its top-k weights against a reference every rank builds from every
rank's inputs (per-rank seeds), repeated dispatches and combines, the errors, and
Buffer.status().ok at the end; two micro-batches in flight (a shape's second engine: dispatches
before combines, combines in either order, a third dispatch reusing the older engine).

    torchrun --nproc_per_node 2 tests/python/test_deep_ep.py --worker
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import expect_error, full_tier, requires_gpus, requires_torch
from deep_ep_worker import counting_mode, finish, start

import graphep  # noqa: E402
from graphep.deep_ep import Config, EventOverlap  # noqa: E402
from graphep.deep_ep import config as dconfig  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEEPEP_SRC = Path(os.environ.get("GRAPHEP_DEEPEP_SRC", REPO / ".deepep"))


def compat_runner():
    spec = importlib.util.spec_from_file_location("run_deepep_tests", REPO / "tests" / "compat" / "run_deepep_tests.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- CPU ---------------------------------------------------------------------------------------

def test_config_is_deepeps_record():
    c = Config(24, 8, 256)
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens) == (24, 8, 256)
    assert (c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (6, 256)
    assert Config() == Config(20, 6, 256, 6, 256)
    assert dconfig.dispatch_config(2, 24) == Config(24, 24, 256, 6, 128)
    assert dconfig.dispatch_config(8, 20) == Config(20, 6, 256, 6, 128)
    assert dconfig.combine_config(2, 24) == Config(24, 10, 256, 6, 128)
    assert dconfig.combine_config(8, 20) == Config(20, 4, 256, 6, 128)
    assert dconfig.dispatch_config(3, 20).num_sms == 20  # rank counts DeepEP has no entry for: defaults
    assert [dconfig.sm_budget(n) for n in (0, 1, 24, 64, 132)] == [1, 1, 24, 64, 64]


def test_buffer_size_hints():
    c = Config(24)
    assert c.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    hint = c.get_nvl_buffer_size_hint(7168 * 2, 8)
    assert hint == c.get_nvl_buffer_size_hint(7168 * 2, 8) > 0
    # A Buffer sized by the hint holds 4,096 tokens per rank of that hidden size, any expert count.
    for experts in (8, 64, 256, 8192):
        heap = dconfig.heap_bytes_for(7168, experts, 8, 24)
        assert dconfig.max_tokens_per_rank(hint, heap) >= 4096
    a = dconfig.low_latency_rdma_size_hint(128, 7168, 8, 288)  # the low-latency engine's heap
    cfg = dconfig.low_latency_engine_config(128, 7168, 288, 8)
    assert a == graphep.memory_requirements(cfg, 8).symmetric_heap_bytes > 0


def test_event_overlap_without_an_event():
    e = EventOverlap(None, extra_tensors=("kept",))
    assert e.event is None and e.extra_tensors == ("kept",)
    with e as inside:  # no event: entering and leaving do nothing
        assert inside is e
    expect_error(graphep.Status.INVALID_ARGUMENT, "there is no event", e.current_stream_wait)


def test_max_tokens_rule_on_a_synthetic_heap():
    heap = lambda t: 1000 * t + 50_000  # noqa: E731
    rule = dconfig.max_tokens_per_rank
    assert rule(heap(1000), heap) == 896  # the largest multiple of 128 that fits
    assert rule(heap(1024), heap) == 1024  # exactly at the edge
    assert rule(heap(1024) - 1, heap) == 896
    assert rule(0, heap) == 128  # nothing fits: the smallest
    assert rule(heap(100_000), heap) == 8192  # the cap
    assert rule(0, heap, "300") == 300  # GRAPHEP_DEEPEP_MAX_TOKENS wins
    assert rule(heap(1000), heap, "") == 896  # set but empty: the rule
    expect_error(graphep.Status.INVALID_ARGUMENT, "GRAPHEP_DEEPEP_MAX_TOKENS='many' is not an integer", rule, 0, heap,
                 "many")
    expect_error(graphep.Status.INVALID_ARGUMENT, "GRAPHEP_DEEPEP_MAX_TOKENS=0 is out of range", rule, 0, heap, "0")


@pytest.mark.parametrize("hidden, experts, world", [(7168, 256, 8), (2048, 128, 2), (512, 16, 2)])
def test_max_tokens_rule_on_graphep_heaps(hidden, experts, world):
    heap = dconfig.heap_bytes_for(hidden, experts, world, 24)
    for budget in (heap(128) - 1, heap(640), heap(640) + heap(768) // 2 - heap(640) // 2, heap(8192), 1 << 40):
        t = dconfig.max_tokens_per_rank(budget, heap)
        assert t % 128 == 0 and 128 <= t <= 8192
        if heap(t) <= budget:
            assert t == 8192 or heap(t + 128) > budget
        else:
            assert t == 128  # not even the smallest fits
    # The engine config behind it: rank-major, throughput path, bf16 records, top-k min(16, E).
    cfg = dconfig.engine_config(256, hidden, experts, 24)
    assert (cfg.receive_layout, cfg.path, cfg.dispatch_type) == (
        graphep.ReceiveLayout.RANK_MAJOR, graphep.MoePath.THROUGHPUT, graphep.DType.BF16)
    assert (cfg.top_k, cfg.sm_budget, cfg.max_tokens_per_rank) == (min(16, experts), 24, 256)
    assert graphep.memory_requirements(cfg, world).symmetric_heap_bytes == heap(256)


SNIPPET = '''    for current_x in filter(lambda elem: elem is not None, (x_e4m3, x)):
        for nvl_chunk_size in tuple(range(4, 33, 2)) + (0, ):
            assert t > 0
    for nvl_chunk_size in tuple(range(1, 17, 1)) + (0, ):
        assert best_time > 0
'''


def test_compat_edit_replaces_exactly_the_two_sweeps():
    run = compat_runner()
    out = run.apply_edits(SNIPPET, run.INTRANODE_EDITS)
    assert out == SNIPPET.replace(
        "tuple(range(4, 33, 2)) + (0, )",
        "(deep_ep.Buffer.get_dispatch_config(num_ranks).num_max_nvl_chunked_send_tokens, )").replace(
        "tuple(range(1, 17, 1)) + (0, )",
        "(deep_ep.Buffer.get_combine_config(num_ranks).num_max_nvl_chunked_send_tokens, )")
    with pytest.raises(ValueError, match="found 0"):
        run.apply_edits(SNIPPET.replace("range(4, 33, 2)", "range(4, 34, 2)"), run.INTRANODE_EDITS)
    with pytest.raises(ValueError, match="found 2"):
        run.apply_edits(SNIPPET + SNIPPET, run.INTRANODE_EDITS)
    assert run.TESTS["low_latency"].edits == ()


@pytest.mark.skipif(not (DEEPEP_SRC / "tests" / "test_intranode.py").is_file(),
                    reason=f"no DeepEP tree at {DEEPEP_SRC} (set GRAPHEP_DEEPEP_SRC)")
def test_compat_edit_on_deepeps_test_intranode(tmp_path):
    run = compat_runner()
    script = run.prepare(DEEPEP_SRC, "intranode", tmp_path)
    before = (DEEPEP_SRC / "tests" / "test_intranode.py").read_text().splitlines()
    after = script.read_text().splitlines()
    assert len(before) == len(after)
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert [a.strip() for a, _ in changed] == [old for old, _ in run.INTRANODE_EDITS]
    assert [b.strip() for _, b in changed] == [new for _, new in run.INTRANODE_EDITS]
    asserts = [line for line in before if "assert" in line]
    assert asserts and asserts == [line for line in after if "assert" in line]
    assert (tmp_path / "utils.py").is_file() and (tmp_path / "test_low_latency.py").is_file()
    assert "from graphep.deep_ep import" in (tmp_path / "deep_ep" / "__init__.py").read_text()
    (tmp_path / "ll").mkdir()
    untouched = run.prepare(DEEPEP_SRC, "low_latency", tmp_path / "ll")
    assert untouched.read_text() == (DEEPEP_SRC / "tests" / "test_low_latency.py").read_text()
    # the shrink tests: lines of the failure schedule, every assertion kept
    ll = untouched.read_text().splitlines()
    for name, edits in (("shrink", run.SHRINK_EDITS), ("shrink_at_combine", run.SHRINK_AT_COMBINE_EDITS),
                        ("shrink_at_clean", run.SHRINK_AT_CLEAN_EDITS)):
        (tmp_path / name).mkdir()
        shrink = run.prepare(DEEPEP_SRC, name, tmp_path / name).read_text().splitlines()
        assert len(shrink) == len(ll)
        changed = [(a.strip(), b.strip()) for a, b in zip(ll, shrink) if a != b]
        assert sorted(changed) == sorted(edits), name
        assert [line for line in ll if "assert" in line] == [line for line in shrink if "assert" in line]


def test_compat_runner_skips_without_what_it_needs(monkeypatch, capsys):
    run = compat_runner()
    monkeypatch.setattr(run, "skip_reason", lambda n: "PyTorch is not installed")
    assert run.main(["--deepep-src", "/nonexistent", "--test", "intranode"]) == run.SKIP
    assert "SKIPPED test_intranode.py: PyTorch is not installed" in capsys.readouterr().out


def test_compat_runner_all_runs_each_test_in_order(monkeypatch, tmp_path, capsys):
    run = compat_runner()
    src = tmp_path / "deepep"
    (src / "tests").mkdir(parents=True)
    (src / "tests" / "test_intranode.py").write_text(SNIPPET)
    low_latency = ("def fail(api):\n    failed_api_ranks = {\n        'dispatch': 1,\n        'combine': 3,\n"
                   "        'clean': 5\n    }\n    if api in failed_api_ranks.keys():\n        pass\n")
    (src / "tests" / "test_low_latency.py").write_text(low_latency)
    package = tmp_path / "pkg"
    (package / "graphep").mkdir(parents=True)
    (package / "graphep" / "__init__.py").write_text("")
    calls = []

    def call(cmd, cwd, env):
        calls.append((cmd[1], cmd[2:], Path(cwd, cmd[1]).read_text(), env["PYTHONPATH"].split(os.pathsep)[1],
                      env.get("GRAPHEP_TIMEOUT_MS")))
        return 3 if cmd[1] == "test_intranode.py" else 0

    monkeypatch.setattr(run, "skip_reason", lambda n: None)
    monkeypatch.setattr(run, "graphep_pythonpath", lambda: package)
    monkeypatch.setattr(run.subprocess, "call", call)
    monkeypatch.delenv("GRAPHEP_TIMEOUT_MS", raising=False)
    assert run.main(["--deepep-src", str(src), "--test", "all", "--", "--num-topk", "2"]) == 3  # the first failure
    assert [c[0] for c in calls] == ["test_intranode.py"] + ["test_low_latency.py"] * 4
    assert [c[1] for c in calls] == [["--num-processes", "2", "--num-topk", "2"]] * 2 + [
        ["--num-processes", "2", "--shrink-test", "--num-topk", "2"]] * 3
    assert calls[0][2] == run.apply_edits(SNIPPET, run.INTRANODE_EDITS) and calls[1][2] == low_latency
    cut = low_latency.replace("keys():", "keys() and failed_api_ranks[api] < dist.get_world_size():")
    no_dispatch = cut.replace("'dispatch': 1,", "'dispatch': dist.get_world_size(),")
    assert calls[2][2] == cut
    assert calls[3][2] == no_dispatch.replace("'combine': 3,", "'combine': 1,")  # rank 1 fails at its combine
    assert calls[4][2] == no_dispatch.replace("'clean': 5", "'clean': 1")  # at its clean
    assert all(c[3] == str(package.resolve()) for c in calls)
    assert [c[4] for c in calls] == [None, None, "2000", "2000", "2000"]  # the shrink tests' default timeout
    assert ("test_intranode.py exit 3, test_low_latency.py exit 0, " + ", ".join(
        ["test_low_latency.py --shrink-test exit 0"] * 3)) in capsys.readouterr().out
    calls.clear()
    assert run.main(["--deepep-src", str(src), "--test", "low_latency"]) == 0 and len(calls) == 1
    calls.clear()
    monkeypatch.setenv("GRAPHEP_TIMEOUT_MS", "500")  # the caller's wins
    assert run.main(["--deepep-src", str(src), "--test", "shrink"]) == 0 and calls[0][4] == "500"


# ---- CPU, with PyTorch ---------------------------------------------------------------------------

@requires_torch
def test_torch_names():
    import torch

    import graphep.deep_ep as deep_ep

    assert deep_ep.topk_idx_t is torch.int64
    assert set(deep_ep.__all__) == {"Buffer", "Config", "EventOverlap", "topk_idx_t"}
    B = deep_ep.Buffer
    saved = B.num_sms
    try:
        B.set_num_sms(24)
        assert B.get_dispatch_config(2) == Config(24, 24, 256, 6, 128)
        assert B.get_combine_config(8).num_sms == 24
        expect_error(graphep.Status.INVALID_ARGUMENT, "the SM count must be even", B.set_num_sms, 23)
    finally:
        B.num_sms = saved
    assert B.get_low_latency_rdma_size_hint(128, 7168, 8, 288) == dconfig.low_latency_rdma_size_hint(128, 7168, 8, 288)


@requires_torch
@pytest.mark.parametrize("kwargs, status, needle", [
    (dict(group=None), "INVALID_ARGUMENT", "Buffer(group=None)"),
    (dict(group=object(), comm=object()), "NOT_SUPPORTED", "mpi4py communicators are not supported"),
    (dict(group=object(), num_rdma_bytes=1 << 30), "NOT_SUPPORTED",
     "Buffer(num_rdma_bytes=1073741824) without low_latency_mode"),
    (dict(group=object(), enable_shrink=True), "NOT_SUPPORTED",
     "Buffer(enable_shrink=True) without low_latency_mode"),
], ids=["no-group", "mpi4py", "rdma", "shrink-without-low-latency"])
def test_buffer_refuses_what_it_lacks_before_any_work(kwargs, status, needle):
    from graphep.deep_ep import Buffer

    expect_error(getattr(graphep.Status, status), needle, Buffer, **kwargs)


@requires_torch
@pytest.mark.parametrize("method, args", [
    ("internode_dispatch", (None,)), ("internode_combine", (None,)),
    ("get_local_buffer_tensor", (None,)),
])
def test_missing_modes_raise_not_supported_by_name(method, args):
    from graphep.deep_ep import Buffer

    buffer = Buffer.__new__(Buffer)  # these refuse before reading any state
    err = expect_error(graphep.Status.NOT_SUPPORTED, f"{method}:", getattr(buffer, method), *args)
    assert "later" in err.message or "raw communication buffer" in err.message


@requires_torch
def test_a_second_engine_for_a_second_dispatch_in_flight(monkeypatch):
    """Buffer._dispatch_engine (no GPU): a free engine first; a re-dispatch of the routing an engine
    holds (the same mask tensor and token count) stays on it with no second engine; a dispatch of
    other tokens while the shape's one engine holds one not yet combined makes the second (once,
    named for the call it is made for); with both held, the older dispatch's engine is reused."""
    from graphep.deep_ep import Buffer
    from graphep.deep_ep.in_flight import InFlight

    made = []

    def state(name):
        st = InFlight()
        st.name, st.hidden, st.num_experts, st.last_mask, st.last_tokens = name, 256, 16, None, None
        return st

    def make(self, hidden, num_experts, budget, what):
        made.append((hidden, num_experts, budget, what))
        return state(f"made {len(made)}")

    monkeypatch.setattr(Buffer, "_make_engine", make)
    b = Buffer.__new__(Buffer)
    b._sm_budget = 24
    first = state("first")
    m1, m2, m3 = object(), object(), object()  # three routings (is_token_in_rank tensors)

    def held(st, seq, mask):
        st.combined, st.seq, st.last_mask, st.last_tokens = False, seq, mask, 8

    assert b._dispatch_engine(first, 8, m1) is first and made == []
    held(first, 1, m1)
    assert b._dispatch_engine(first, 8, m1) is first and made == [], "the same routing again: no second engine"
    second = b._dispatch_engine(first, 8, m2)
    assert second is first.second and made == [(256, 16, 24, "dispatch while an earlier one is not yet combined")]
    held(second, 2, m2)
    assert b._dispatch_engine(first, 8, m3) is first and len(made) == 1, "both held: the older dispatch's engine"
    held(first, 3, m3)
    assert b._dispatch_engine(first, 8, m1) is second
    assert b._dispatch_engine(first, 8, m3) is first and b._dispatch_engine(first, 9, m3) is second, \
        "the same mask with another token count is another routing"
    second.combined = True  # its combine came
    assert b._dispatch_engine(first, 8, m3) is second and len(made) == 1, "a free engine before the same routing"


# ---- 2 GPUs: the worker under torchrun ----------------------------------------------------------

@requires_torch
@requires_gpus(2)
@full_tier  # a torchrun launch; the fast tier keeps the low-latency one
def test_buffer_on_two_ranks_under_torchrun():
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    env.pop(dconfig.MAX_TOKENS_ENV, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__, "--worker"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    print(r.stdout[-6000:], r.stderr[-6000:])
    assert r.returncode == 0 and "PASS" in r.stdout


H, E, K, T_MAX, SMS = 512, 16, 4, 256, 24
TOKENS = (96, 70)  # rank r has TOKENS[r % 2] tokens


class Inputs:
    """One rank's tokens and routing, from its seed (every rank builds every rank's)."""

    def __init__(self, torch, rank, tokens, device, seed, world):
        gen = torch.Generator(device=device).manual_seed(seed + rank)
        self.x = torch.randn(tokens, H, generator=gen, device=device).to(torch.bfloat16)
        ids = torch.rand(tokens, E, generator=gen, device=device).argsort(dim=1)[:, :K]  # K distinct experts
        self.ids = torch.where(torch.rand(tokens, K, generator=gen, device=device) < 0.15, -1, ids).to(torch.int64)
        self.w = torch.rand(tokens, K, generator=gen, device=device)
        self.free_mask = torch.rand(tokens, world, generator=gen, device=device) < 0.6  # routing without top-k
        L = E // world
        dest = torch.where(self.ids >= 0, self.ids // L, torch.full_like(self.ids, -1))
        self.mask = torch.stack([(dest == q).any(dim=1) for q in range(world)], dim=1)  # [T, R] bool
        valid = self.ids[self.ids >= 0]
        self.per_expert = torch.bincount(valid, minlength=E).to(torch.int32)
        self.per_rank = self.mask.sum(dim=0).to(torch.int32)
        # fp8 as DeepEP's tests make it: per 128 values, scale amax / 448; scales column-major.
        tiles = self.x.float().view(tokens, H // 128, 128)
        amax = tiles.abs().amax(dim=2).clamp(min=1e-4)
        self.x_fp8 = (tiles * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(tokens, H)
        self.x_fp8_bytes = self.x_fp8.view(torch.uint8)  # what the reference indexes (plain bytes)
        self.scales = (amax / 448.0).T.contiguous().T


def worker() -> int:
    import torch
    import torch.distributed as dist

    import graphep.deep_ep as deep_ep

    device, rank, R = start()
    L = E // R
    wrong = {}

    def count(name, n):
        wrong[name] = wrong.get(name, 0) + int(n)

    def poison():
        """The Buffer allocates its outputs: fill the memory PyTorch's caching allocator hands out next
        with 0x7F bytes (bf16 and fp32 about 3.4e38, ints 0x7F7F...: nothing the engine writes, and
        not the -1 that num_worst_tokens' unreceived rows must read), so unwritten rows show."""
        block = torch.empty(64 << 20, dtype=torch.uint8, device=device)
        block.fill_(0x7F)
        del block

    def inputs(seed, tokens=None):
        tokens = tokens or [TOKENS[s % 2] for s in range(R)]
        return [Inputs(torch, s, tokens[s], device, seed, R) for s in range(R)]

    def expected(all_in, mask_of):
        """Rank `rank`'s rank-major rows: (src, token) of each source's tokens routed here, in order."""
        src, tok = [], []
        for s, inp in enumerate(all_in):
            t = torch.nonzero(mask_of(inp)[:, rank]).flatten()
            src.append(torch.full_like(t, s)), tok.append(t)
        return torch.cat(src), torch.cat(tok)

    def prefix(all_in, mask_of):
        sent = torch.stack([mask_of(inp).sum(dim=0) for inp in all_in])  # [src, dst]
        return sent.cumsum(dim=0).to(torch.int32)

    def slots(all_in, src, tok):
        ids = torch.cat([all_in[s].ids[tok[src == s]] for s in range(R)]) if src.numel() else \
            torch.empty(0, K, dtype=torch.int64, device=device)
        w = torch.cat([all_in[s].w[tok[src == s]] for s in range(R)]) if src.numel() else \
            torch.empty(0, K, device=device)
        here = (ids >= rank * L) & (ids < (rank + 1) * L)
        return torch.where(here, ids - rank * L, torch.full_like(ids, -1)), torch.where(here, w, torch.zeros_like(w))

    def rows_of(all_in, attr, src, tok):
        return torch.cat([getattr(all_in[s], attr)[tok[src == s]] for s in range(R)])

    def expert(recv_x):  # rank q's experts: rows times (1 + q / 4), bf16
        return (recv_x.float() * (1 + rank / 4)).to(torch.bfloat16).contiguous()

    def combined_ref(all_in, mask_of):
        me = all_in[rank]
        acc = torch.zeros(me.x.shape, dtype=torch.float32, device=device)
        for q in range(R):  # ascending rank, fp32, as the engine sums
            y = (me.x.float() * (1 + q / 4)).to(torch.bfloat16).float()
            acc += torch.where(mask_of(me)[:, q:q + 1], y, torch.zeros_like(y))
        return acc

    def check_combined(name, got, ref):
        if got.shape != ref.shape:
            return count(name + ".shape", 1)
        count(name, ((got.float() - ref).abs() > ref.abs() * 2.0 ** -8 + 1e-6).sum())

    def check_dispatch(name, all_in, mask_of, recv_x, topk_idx=None, topk_w=None, per_expert=None, handle=None,
                       fp8=False):
        src, tok = expected(all_in, mask_of)
        n = src.numel()
        x = recv_x[0] if fp8 else recv_x
        if x.shape[0] != n:
            return count(name + ".rows", abs(x.shape[0] - n) + 1)
        if fp8:
            count(name + ".x", (x.view(torch.uint8) != rows_of(all_in, "x_fp8_bytes", src, tok)).sum())
            count(name + ".scales", (recv_x[1] != rows_of(all_in, "scales", src, tok)).sum())
        else:
            count(name + ".x", (x.view(torch.int16) != rows_of(all_in, "x", src, tok).view(torch.int16)).sum())
        if topk_idx is not None:
            ids, w = slots(all_in, src, tok)
            count(name + ".topk_idx", (topk_idx != ids).sum())
            count(name + ".topk_weights", (topk_w.view(torch.int32) != w.view(torch.int32)).sum())
        if per_expert is not None:
            want = sum(inp.per_expert[rank * L:(rank + 1) * L] for inp in all_in).tolist()
            count(name + ".per_expert", want != per_expert)
        if handle is not None:
            count(name + ".rank_prefix_matrix", (handle[0] != prefix(all_in, mask_of)).sum())
            count(name + ".recv_src_idx", (handle[3].long() != tok).sum())
        return None

    def expect_error(name, status, needles, fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
        except graphep.Error as e:
            count(name, e.status != status or any(s not in e.message for s in needles))
            if e.status != status or any(s not in e.message for s in needles):
                print(f"rank {rank} {name}: {e}", flush=True)
            return
        count(name, 1)

    heap = dconfig.heap_bytes_for(H, E, R, SMS)
    buffer = deep_ep.Buffer(dist.group.WORLD, heap(T_MAX), explicitly_destroy=True)  # T_max = T_MAX
    cfg = deep_ep.Config(SMS, 8, 256)
    topk_mask, free_mask = (lambda inp: inp.mask), (lambda inp: inp.free_mask)

    # get_dispatch_layout, synchronous and asynchronous after an event.
    all_in = inputs(1)
    me = all_in[rank]
    for async_finish in (False, True):
        prev = buffer.capture() if async_finish else None
        per_rank, per_rdma, per_expert, in_rank, ev = buffer.get_dispatch_layout(me.ids, E, previous_event=prev,
                                                                                 async_finish=async_finish)
        if async_finish:
            ev.current_stream_wait()
        count("layout.per_rank", (per_rank != me.per_rank).sum())
        count("layout.per_expert", (per_expert != me.per_expert).sum())
        count("layout.in_rank", (in_rank != me.mask).sum() + (per_rdma is not None))

    # Non-cached bf16 with top-k; its combine with top-k weights.
    common = dict(num_tokens_per_rank=me.per_rank, is_token_in_rank=me.mask, num_tokens_per_expert=me.per_expert,
                  config=cfg)
    poison()
    recv_x, recv_ids, recv_w, per_list, handle_a, _ = buffer.dispatch(me.x, topk_idx=me.ids, topk_weights=me.w,
                                                                      **common)
    check_dispatch("bf16+topk", all_in, topk_mask, recv_x, recv_ids, recv_w, per_list, handle_a)
    y_a = expert(recv_x)
    poison()
    combined, combined_w, _ = buffer.combine(y_a, handle_a, topk_weights=recv_w, config=cfg)
    ref_a = combined_ref(all_in, topk_mask)
    check_combined("combine", combined, ref_a)
    want_w = torch.where((me.ids >= 0) & me.mask.gather(1, (me.ids.clamp(min=0) // L)), me.w, torch.zeros_like(me.w))
    count("combine.topk_weights", (combined_w.view(torch.int32) != want_w.view(torch.int32)).sum())

    # num_worst_tokens (no sync): the rows of the dispatch above, then -1 ids; combine the first handle.
    worst = sum(TOKENS[s % 2] for s in range(R)) + 7
    poison()
    w_x, w_ids, w_w, w_list, _, _ = buffer.dispatch(me.x, topk_idx=me.ids, topk_weights=me.w, num_worst_tokens=worst,
                                                    **common)
    n = recv_x.shape[0]
    count("worst.shape", (w_x.shape[0], w_ids.shape[0], w_w.shape[0], len(w_list)) != (worst, worst, worst, 0))
    count("worst.x", not torch.equal(w_x[:n], recv_x))
    count("worst.ids", not torch.equal(w_ids[:n], recv_ids) or not bool((w_ids[n:] == -1).all()))
    count("worst.weights", not torch.equal(w_w[:n], recv_w))
    poison()
    again, _, _ = buffer.combine(y_a, handle_a, topk_weights=recv_w, config=cfg)  # the same routing: accepted
    count("worst.combine", not torch.equal(again, combined))

    # fp8 tuple (column-major scales) with top-k, asynchronous, allocated on the comm stream.
    poison()
    prev = buffer.capture()
    (f_x, f_s), f_ids, f_w, f_list, handle_f, ev = buffer.dispatch(
        (me.x_fp8, me.scales), topk_idx=me.ids, topk_weights=me.w, previous_event=prev, async_finish=True,
        allocate_on_comm_stream=True, **common)
    ev.current_stream_wait()
    check_dispatch("fp8+topk", all_in, topk_mask, (f_x, f_s), f_ids, f_w, f_list, handle_f, fp8=True)

    # Without top-k, a mask unrelated to any expert; cached dispatches (bf16, fp8) with its handle.
    common_free = dict(common, is_token_in_rank=me.free_mask,
                       num_tokens_per_rank=me.free_mask.sum(dim=0).to(torch.int32))
    poison()
    e_x, e_ids, e_w, e_list, handle_e, _ = buffer.dispatch(me.x, **common_free)
    count("free.topk", (e_ids is not None) + (e_w is not None))
    check_dispatch("free", all_in, free_mask, e_x, per_expert=e_list, handle=handle_e)
    poison()
    c_x, c_ids, c_w, c_list, c_handle, _ = buffer.dispatch(me.x, handle=handle_e, config=cfg)
    count("cached.nones", sum(v is not None for v in (c_ids, c_w, c_list, c_handle)))
    count("cached.x", not torch.equal(c_x, e_x))
    poison()
    (cf_x, cf_s), *_ = buffer.dispatch((me.x_fp8, me.scales), handle=handle_e, config=cfg)
    check_dispatch("cached.fp8", all_in, free_mask, (cf_x, cf_s), fp8=True)
    bias = torch.full((TOKENS[rank % 2], H), 0.5, dtype=torch.bfloat16, device=device)
    poison()
    e_comb, e_comb_w, _ = buffer.combine(expert(e_x), handle_e, bias=(bias, bias), config=cfg)
    ref_e = combined_ref(all_in, free_mask)
    check_combined("free.combine+bias", e_comb, (ref_e.to(torch.bfloat16).float() + 1.0))
    count("free.combine.weights", e_comb_w is not None)

    # Repeated: 20 dispatches, each as the first; 20 combines, each as the first.
    for i in range(20):
        poison()
        r_x, r_ids, r_w, r_list, handle_r, _ = buffer.dispatch(me.x, topk_idx=me.ids, topk_weights=me.w, **common)
        same = (torch.equal(r_x, recv_x) and torch.equal(r_ids, recv_ids) and torch.equal(r_w, recv_w)
                and r_list == per_list and torch.equal(handle_r[0], handle_a[0])
                and torch.equal(handle_r[3], handle_a[3]))
        count("repeat.dispatch", not same)
    for i in range(20):
        poison()
        r_comb, r_comb_w, _ = buffer.combine(y_a, handle_r, topk_weights=recv_w, config=cfg)
        count("repeat.combine", not (torch.equal(r_comb, combined) and torch.equal(r_comb_w, combined_w)))

    # Two micro-batches in flight (SGLang's two-batch overlap in prefill): B's dispatch (fp8, async
    # after an event) before A's combine runs on the shape's second engine; the combines come in
    # either order, each checked against its own inputs; a third dispatch reuses the older one's
    # engine, whose handle is then refused, while the other is still served.
    for order in ((0, 1), (1, 0)):
        pair = [inputs(40 + 2 * order[0] + m) for m in range(2)]
        mine = [p[rank] for p in pair]
        args = [dict(num_tokens_per_rank=m.per_rank, is_token_in_rank=m.mask, num_tokens_per_expert=m.per_expert,
                     config=cfg) for m in mine]
        poison()
        a_x, a_ids, a_w, a_list, handle_a2, _ = buffer.dispatch(mine[0].x, topk_idx=mine[0].ids,
                                                                topk_weights=mine[0].w, **args[0])
        prev = buffer.capture()
        (b_x, b_s), b_ids, b_w, b_list, handle_b2, ev = buffer.dispatch(
            (mine[1].x_fp8, mine[1].scales), topk_idx=mine[1].ids, topk_weights=mine[1].w, previous_event=prev,
            async_finish=True, **args[1])
        ev.current_stream_wait()
        count("two.engines", handle_a2[5].state is handle_b2[5].state)
        check_dispatch(f"two.{order}.a", pair[0], topk_mask, a_x, a_ids, a_w, a_list, handle_a2)
        check_dispatch(f"two.{order}.b", pair[1], topk_mask, (b_x, b_s), b_ids, b_w, b_list, handle_b2, fp8=True)
        ys = {0: (expert(a_x), handle_a2, a_w), 1: (expert(b_x.float().view(-1, H // 128, 128).mul(
            b_s.unsqueeze(-1)).view(-1, H).to(torch.bfloat16)), handle_b2, b_w)}
        got = {}
        for m in order:
            poison()
            got[m] = buffer.combine(ys[m][0], ys[m][1], topk_weights=ys[m][2], config=cfg)[0]
        check_combined(f"two.{order}.combine_a", got[0], combined_ref(pair[0], topk_mask))
        # B's rows came as fp8: its experts' outputs are the dequantised rows, so its reference is
        # B's combine of those rows (each source's dequantised row times (1 + q / 4))
        ref_b = torch.zeros(mine[1].x.shape, dtype=torch.float32, device=device)
        deq = (mine[1].x_fp8.float().view(-1, H // 128, 128) * mine[1].scales.unsqueeze(-1)).view(-1, H)
        for q in range(R):
            yq = (deq.to(torch.bfloat16).float() * (1 + q / 4)).to(torch.bfloat16).float()
            ref_b += torch.where(mine[1].mask[:, q:q + 1], yq, torch.zeros_like(yq))
        check_combined(f"two.{order}.combine_b", got[1], ref_b)
    # A third non-cached dispatch while two are held: the older one's engine; its handle refused.
    # (The third's inputs and mask are their own: handle_e's engine must not end on its routing. h2
    # and h3 route the same tokens through two mask tensors: the same tensor again would be a
    # re-dispatch of h2's routing, which stays on h2's engine.)
    third = inputs(45)[rank]
    third_args = dict(num_tokens_per_rank=third.per_rank, is_token_in_rank=third.mask,
                      num_tokens_per_expert=third.per_expert, config=cfg)
    _, _, _, _, h1, _ = buffer.dispatch(me.x, topk_idx=me.ids, topk_weights=me.w, **common)
    x2, _, _, _, h2, _ = buffer.dispatch(third.x, **third_args)
    x3, _, _, _, h3, _ = buffer.dispatch(third.x, **dict(third_args, is_token_in_rank=third.mask.clone()))
    count("two.third_reuses_the_older", h3[5].state is not h1[5].state or h2[5].state is h1[5].state)
    expect_error("two.stale_handle", graphep.Status.INVALID_ARGUMENT,
                 ["the handle is of dispatch", "routed other tokens", "its last two dispatches"],
                 buffer.combine, y_a, h1, topk_weights=recv_w, config=cfg)
    buffer.combine(expert(x2), h2, config=cfg)  # the other dispatch in flight is still served
    buffer.combine(expert(x3), h3, config=cfg)
    # A cached dispatch whose handle's engine now holds another micro-batch's dispatch (A combined,
    # then B on A's free engine) moves to the other engine, the handle with it: both combines served.
    pair = [inputs(46 + m) for m in range(2)]
    pargs = [dict(num_tokens_per_rank=p[rank].per_rank, is_token_in_rank=p[rank].mask,
                  num_tokens_per_expert=p[rank].per_expert, config=cfg) for p in pair]
    xa, _, _, _, ha, _ = buffer.dispatch(pair[0][rank].x, **pargs[0])
    buffer.combine(expert(xa), ha, config=cfg)
    xb, _, _, _, hb, _ = buffer.dispatch(pair[1][rank].x, **pargs[1])
    count("cached_move.b_on_a_engine", hb[5].state is not ha[5].state)
    poison()
    xa2, *_ = buffer.dispatch(pair[0][rank].x, handle=ha, config=cfg)
    count("cached_move.moved", ha[5].state is hb[5].state)
    check_dispatch("cached_move.dispatch_a", pair[0], topk_mask, xa2)
    poison()
    cb = buffer.combine(expert(xb), hb, config=cfg)[0]
    poison()
    ca = buffer.combine(expert(xa2), ha, config=cfg)[0]
    check_combined("cached_move.combine_b", cb, combined_ref(pair[1], topk_mask))
    check_combined("cached_move.combine_a", ca, combined_ref(pair[0], topk_mask))

    # Under a Python function mode (DeepEP's tests install one with torch.set_default_device): no
    # torch call of the Buffer's reaches it, and the results are the same.
    mode = counting_mode()
    poison()
    with mode:
        lay_m = buffer.get_dispatch_layout(me.ids, E)
        m_x, m_ids, m_w, m_list, handle_m, _ = buffer.dispatch(me.x, topk_idx=me.ids, topk_weights=me.w, **common)
        m_comb, m_comb_w, _ = buffer.combine(y_a, handle_m, topk_weights=recv_w, config=cfg)
    count("mode.calls", len(mode.calls))
    if mode.calls:
        print(f"rank {rank}: the mode saw {len(mode.calls)} calls: {mode.calls[:8]}", flush=True)
    count("mode.layout", (lay_m[3] != me.mask).sum() + (lay_m[2] != me.per_expert).sum())
    count("mode.dispatch", not (torch.equal(m_x, recv_x) and torch.equal(m_ids, recv_ids) and torch.equal(m_w, recv_w)
                                and m_list == per_list))
    count("mode.combine", not (torch.equal(m_comb, combined) and torch.equal(m_comb_w, combined_w)))

    # A rank with no tokens (rank 1): it still receives, and its combine returns [0, H].
    idle_tokens = [TOKENS[0] if s != 1 else 0 for s in range(R)]
    idle_in = inputs(3, idle_tokens)
    me_i = idle_in[rank]
    lay = buffer.get_dispatch_layout(me_i.ids, E)
    count("idle.layout", (lay[0] != me_i.per_rank).sum() + (lay[3] != me_i.mask).sum())
    poison()
    i_x, i_ids, i_w, i_list, handle_i, _ = buffer.dispatch(
        me_i.x, topk_idx=me_i.ids, topk_weights=me_i.w, num_tokens_per_rank=me_i.per_rank,
        is_token_in_rank=me_i.mask, num_tokens_per_expert=me_i.per_expert, config=cfg)
    check_dispatch("idle", idle_in, topk_mask, i_x, i_ids, i_w, i_list, handle_i)
    poison()
    i_comb, _, _ = buffer.combine(expert(i_x), handle_i, config=cfg)
    check_combined("idle.combine", i_comb, combined_ref(idle_in, topk_mask))

    # Captured (num_worst_tokens: nothing syncs): dispatch, the experts and combine in one CUDA
    # graph, with a token count this Buffer had not dispatched before the capture. Then an eager
    # dispatch of that count before the first replay (its live count must not be one the capture
    # made: that memory is filled only by a replay), then replays with fresh inputs copied into
    # the captured tensors.
    cap_tokens = [TOKENS[s % 2] - 5 for s in range(R)]
    cap_worst = sum(cap_tokens) + 3
    first = inputs(21, cap_tokens)
    c_in = {a: getattr(first[rank], a).clone() for a in ("x", "ids", "w", "mask", "per_expert", "per_rank")}

    def captured_args():
        return dict(topk_idx=c_in["ids"], topk_weights=c_in["w"], num_tokens_per_rank=c_in["per_rank"],
                    is_token_in_rank=c_in["mask"], num_tokens_per_expert=c_in["per_expert"],
                    num_worst_tokens=cap_worst, config=cfg)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_x, g_ids, g_w, _, g_handle, _ = buffer.dispatch(c_in["x"], **captured_args())
        g_comb, g_comb_w, _ = buffer.combine(expert(g_x), g_handle, topk_weights=g_w, config=cfg)
    e_x, e_ids, e_w, _, e_handle, _ = buffer.dispatch(c_in["x"], **captured_args())  # eager, before a replay
    n_first = expected(first, topk_mask)[0].numel()
    check_dispatch("captured.eager_first", first, topk_mask, e_x[:n_first], e_ids[:n_first], e_w[:n_first])
    for round_ in range(3):
        fresh = inputs(22 + round_, cap_tokens)
        for a in c_in:
            c_in[a].copy_(getattr(fresh[rank], a))
        for t in (g_x, g_w, g_comb, g_comb_w):  # the graph's outputs, poisoned: the replay rewrites them
            t.view(torch.uint8).fill_(0x7F)
        g_ids.fill_(0x7F7F7F7F)
        graph.replay()
        n = expected(fresh, topk_mask)[0].numel()
        check_dispatch(f"captured.replay{round_}", fresh, topk_mask, g_x[:n], g_ids[:n], g_w[:n])
        count(f"captured.replay{round_}.unreceived_ids", not bool((g_ids[n:] == -1).all()))
        check_combined(f"captured.replay{round_}.combine", g_comb, combined_ref(fresh, topk_mask))
        want_w = torch.where((fresh[rank].ids >= 0) & fresh[rank].mask.gather(1, fresh[rank].ids.clamp(min=0) // L),
                             fresh[rank].w, torch.zeros_like(fresh[rank].w))
        count(f"captured.replay{round_}.combine.topk_weights",
              (g_comb_w.view(torch.int32) != want_w.view(torch.int32)).sum())
    del graph

    # Errors, named: every rank makes the same bad call, so no rank is left waiting.
    expect_error("error.scales_dtype", graphep.Status.INVALID_ARGUMENT, ["x_scales has dtype torch.float16"],
                 buffer.dispatch, (me.x_fp8, me.scales.half()), **common)
    expect_error("error.scales_int32", graphep.Status.NOT_SUPPORTED, ["x_scales has dtype torch.int32"],
                 buffer.dispatch, (me.x_fp8, me.scales.view(torch.int32)), **common)
    big = Inputs(torch, rank, T_MAX + 1, device, 5, R)
    expect_error("error.num_tokens", graphep.Status.INVALID_ARGUMENT,
                 [f"num_tokens={T_MAX + 1}", f"limit of {T_MAX} tokens", "num_nvl_bytes >=",
                  "GRAPHEP_DEEPEP_MAX_TOKENS"],
                 buffer.dispatch, big.x, num_tokens_per_rank=big.per_rank, is_token_in_rank=big.mask,
                 num_tokens_per_expert=big.per_expert, config=cfg)
    expect_error("error.foreign_handle", graphep.Status.INVALID_ARGUMENT, ["graphep combines the last dispatch"],
                 buffer.combine, expert(e_x), handle_e, config=cfg)  # the last dispatch is the idle round's
    expect_error("error.not_a_handle", graphep.Status.INVALID_ARGUMENT, ["not a handle of this"],
                 buffer.combine, y_a, tuple(handle_a[:5]) + (None,), config=cfg)

    torch.cuda.synchronize()
    status = buffer.status()
    two = (H, E, 1) in status.engines and len(status.engines) == 2  # the shape's engine and its second
    return finish("test_deep_ep", buffer, wrong, status.ok and two, rank, R, device)


if __name__ == "__main__" and "--worker" in sys.argv:
    sys.exit(worker())
