"""graphep.deep_ep's low-latency mode (Buffer.low_latency_*), DeepEP's decode API on graphep.

CPU: the low-latency engine config and size hint, and (with PyTorch) what a Buffer refuses by
name before touching a GPU. 2 GPUs + PyTorch: this file run as a worker under torchrun (two
processes, a Buffer over the world group) checks, against a reference every rank builds from
every rank's inputs (per-rank seeds, fresh data each round, outputs poisoned first):

    dispatch  recv_count, every received row (bf16 bit-exact; fp8 dequantised within e4m3's
              error, float scales amax / 448, round_scale powers of two, use_ue8m0 the same
              powers as exponent bytes), src_info, layout_range, the cumulative stats
    combine   sum_k w x y(t, k) within two bf16 roundings: from x, zero_copy (x not read), into
              out, after return_recv_hook's hooks, with async_finish's event
    more      the hinted shape's engine made by the constructor, a rank with no tokens, a second
              engine shape (made on its first call), capture in a CUDA graph and replays with new
              inputs, the errors (each names the value), Buffer.status().ok at the end
    two       two micro-batches in flight (a shape's second engine): send halves and hooks
              interleaved, eagerly and captured in one graph replayed with new inputs; a third
              dispatch refused while both wait for hooks, a stale handle refused
    shrink    a shrink-mode Buffer whose last rank stops after the constructor: the others' two
              rounds exact without it, the query and MoeStatus.shrunk_ranks naming it

    torchrun --nproc_per_node 2 tests/python/test_deep_ep_low_latency.py --worker
"""

import copy
import gc
import os
import subprocess
import sys
import weakref

import pytest

from conftest import expect_error, requires_gpus, requires_torch
from deep_ep_worker import counting_mode, finish, start

import graphep  # noqa: E402
from graphep.deep_ep import config as dconfig  # noqa: E402


# ---- CPU ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens, hidden, experts, world", [(128, 7168, 288, 2), (128, 2048, 128, 2),
                                                            (128, 4096, 8, 2), (256, 7168, 256, 8)])
def test_low_latency_engine_config(tokens, hidden, experts, world):
    cfg = dconfig.low_latency_engine_config(tokens, hidden, experts, world)
    assert (cfg.receive_layout, cfg.path, cfg.dispatch_type) == (
        graphep.ReceiveLayout.BATCHED, graphep.MoePath.LATENCY, graphep.DType.BF16)
    assert (cfg.max_tokens_per_rank, cfg.hidden, cfg.num_experts) == (tokens, hidden, experts)
    assert cfg.top_k == min(16, experts, 4096 // tokens) and cfg.rows_per_expert == world * tokens
    assert cfg.sm_budget == 0  # the latency path's own default
    need = graphep.memory_requirements(cfg, world)
    assert need.path == graphep.MoePath.LATENCY
    assert dconfig.low_latency_rdma_size_hint(tokens, hidden, world, experts) == need.symmetric_heap_bytes > 0


def test_low_latency_sm_budget_from_the_environment():
    rule = dconfig.low_latency_sm_budget
    assert rule(None) == 0 and rule("") == 0 and rule(" ") == 0  # unset: the engine's default
    assert rule("64") == 64 and rule(" 32 ") == 32
    assert dconfig.low_latency_engine_config(128, 7168, 288, 2, rule("64")).sm_budget == 64
    expect_error(graphep.Status.INVALID_ARGUMENT, "GRAPHEP_DEEPEP_LL_SMS='all' is not an integer", rule, "all")
    expect_error(graphep.Status.INVALID_ARGUMENT, "GRAPHEP_DEEPEP_LL_SMS=-1 is out of range", rule, "-1")
    # Past the engines' limit: refused here, naming the value, not later when an engine is made.
    expect_error(graphep.Status.INVALID_ARGUMENT, "GRAPHEP_DEEPEP_LL_SMS=65 is out of range [0, 64]", rule, "65")


def test_low_latency_size_hint_names_what_the_latency_path_refuses():
    # T = 512 is past the latency path's limit: the engine's validation names the field.
    expect_error(graphep.Status.INVALID_ARGUMENT, "maxTokensPerRank", dconfig.low_latency_rdma_size_hint, 512, 7168,
                 2, 288)
    expect_error(graphep.Status.INVALID_ARGUMENT, "hidden=0 is not a positive integer",
                 dconfig.low_latency_rdma_size_hint, 128, 0, 2, 288)


@requires_torch
def test_buffer_low_latency_hint_is_the_config_one():
    from graphep.deep_ep import Buffer

    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 2, 288) == dconfig.low_latency_rdma_size_hint(
        128, 7168, 2, 288)


@requires_torch
def test_the_hinted_shapes_are_the_constructors_engines(monkeypatch):
    # The hint remembers each shape once, in order; the constructor makes the engines of those of
    # its rank count whose hint fits num_rdma_bytes, on every rank those any rank asked for.
    from graphep.deep_ep import Buffer
    from graphep.deep_ep import low_latency as ll

    monkeypatch.setattr(ll, "HINTED", {})
    small = Buffer.get_low_latency_rdma_size_hint(8, 128, 2, 16)
    Buffer.get_low_latency_rdma_size_hint(8, 128, 4, 16)  # another rank count
    big = Buffer.get_low_latency_rdma_size_hint(64, 1024, 2, 16)
    assert Buffer.get_low_latency_rdma_size_hint(8, 128, 2, 16) == small  # asked again: kept once
    assert small < big and list(ll.HINTED) == [(8, 128, 2, 16), (8, 128, 4, 16), (64, 1024, 2, 16)]
    assert ll.hinted_shapes(ll.HINTED, 2, big) == [(8, 128, 16), (64, 1024, 16)]
    assert ll.hinted_shapes(ll.HINTED, 2, big - 1) == [(8, 128, 16)]  # a hint past num_rdma_bytes: not made
    assert ll.hinted_shapes(ll.HINTED, 4, 1 << 30) == [(8, 128, 16)]
    assert ll.hinted_shapes(ll.HINTED, 2, 0) == []  # DeepEP's normal mode passes 0
    assert ll.hinted_by_any_rank([[(8, 128, 16)], [(8, 128, 16)]]) == [(8, 128, 16)]
    # Ranks that asked for other shapes, or none (a stack that sizes on one rank): every rank makes
    # the engines of every shape any rank asked for, rank 0's first, in the same order on each.
    assert ll.hinted_by_any_rank([[], [(16, 256, 16), (8, 128, 16)], [(8, 128, 16)]]) == [(16, 256, 16),
                                                                                          (8, 128, 16)]
    assert ll.hinted_by_any_rank([[(8, 128, 16)], [[16, 256, 16]]]) == [(8, 128, 16), (16, 256, 16)]  # gathered lists


@requires_torch
def test_buffer_refuses_shrink_mode_without_low_latency_by_name():
    from graphep.deep_ep import Buffer

    expect_error(graphep.Status.NOT_SUPPORTED, "Buffer(enable_shrink=True) without low_latency_mode", Buffer,
                 group=object(), enable_shrink=True)


def _fake_state(**attrs):
    """A stand-in for a low-latency engine's state: `attrs`, no second engine, not busy."""
    import types

    st = types.SimpleNamespace(second=None, pending=None, combined=True, seq=0, **attrs)
    st.engines = lambda: [st] if st.second is None else [st, st.second]
    return st


def _bare_buffer(low_latency_mode=True, enable_shrink=False):
    """A Buffer with the state the low-latency checks read and no engine (they refuse before one)."""
    from graphep.deep_ep import Buffer

    b = Buffer.__new__(Buffer)
    b._destroyed, b.low_latency_mode, b.group_size, b._device, b._ll_engines = False, low_latency_mode, 2, 0, {}
    b.enable_shrink, b._masked_ranks = enable_shrink, set()
    return b


@requires_torch
@pytest.mark.parametrize("call, status, needle", [
    (lambda b, t: b.low_latency_dispatch(t.x, t.ids, 8, 16, dispatch_wait_recv_cost_stats=t.ids),
     "NOT_SUPPORTED", "dispatch_wait_recv_cost_stats is not supported"),
    (lambda b, t: b.low_latency_dispatch(t.x, t.ids, 8, 16, round_scale=False, use_ue8m0=True),
     "INVALID_ARGUMENT", "use_ue8m0=True needs round_scale=True"),
    (lambda b, t: b.low_latency_dispatch(t.x, t.ids, 4, 16), "INVALID_ARGUMENT",
     "x has 8 rows (num_tokens), more than num_max_dispatch_tokens_per_rank=4"),
    (lambda b, t: b.low_latency_dispatch(t.x, t.ids, 8, 15), "INVALID_ARGUMENT",
     "num_experts=15 is not a multiple of the 2 ranks"),
    (lambda b, t: b.low_latency_dispatch(t.x, t.ids, 0, 16), "INVALID_ARGUMENT",
     "num_max_dispatch_tokens_per_rank=0 is not a positive integer"),
    (lambda b, t: b.low_latency_dispatch(t.x, t.ids, 8, 16), "INVALID_ARGUMENT",
     "x is on cpu, expected cuda:0"),
    (lambda b, t: b.low_latency_dispatch(t.x[0], t.ids, 8, 16), "INVALID_ARGUMENT",
     "x is [128], expected a [num_tokens, hidden]"),
    (lambda b, t: b.low_latency_combine(t.y, t.ids, t.w, None, use_logfmt=True), "NOT_SUPPORTED",
     "use_logfmt=True"),
    (lambda b, t: b.low_latency_combine(t.y, t.ids, t.w, None, combine_wait_recv_cost_stats=t.ids),
     "NOT_SUPPORTED", "combine_wait_recv_cost_stats is not supported"),
    (lambda b, t: b.low_latency_combine(t.y, t.ids, t.w, (None,) * 5), "INVALID_ARGUMENT",
     "the handle is not one of this graphep.deep_ep.Buffer's low_latency_dispatch"),
    (lambda b, t: b.get_next_low_latency_combine_buffer((None,) * 5), "INVALID_ARGUMENT",
     "the handle is not one of this"),
    (lambda b, t: b.clean_low_latency_buffer(8, 128, 7), "INVALID_ARGUMENT", "num_experts=7 is not a multiple"),
    (lambda b, t: b.low_latency_update_mask_buffer(1, True), "INVALID_ARGUMENT", "shrink mode is off"),
    (lambda b, t: b.low_latency_query_mask_buffer(t.ids), "INVALID_ARGUMENT", "shrink mode is off"),
    (lambda b, t: b.low_latency_clean_mask_buffer(), "INVALID_ARGUMENT", "shrink mode is off"),
], ids=["wait-stats", "ue8m0-without-round", "too-many-tokens", "experts-vs-ranks", "zero-tokens-max",
        "x-on-cpu", "x-1d", "logfmt", "combine-wait-stats", "foreign-handle", "next-buffer-foreign-handle",
        "clean-bad-experts", "update-mask", "query-mask", "clean-mask"])
def test_low_latency_refusals_before_any_engine(call, status, needle):
    import types

    import torch

    t = types.SimpleNamespace(x=torch.zeros(8, 128, dtype=torch.bfloat16), ids=torch.zeros(8, 2, dtype=torch.int64),
                              w=torch.zeros(8, 2), y=torch.zeros(8, 16, 128, dtype=torch.bfloat16))
    expect_error(getattr(graphep.Status, status), needle, call, _bare_buffer(), t)


@requires_torch
def test_shrink_mode_masks_every_low_latency_engine():
    """Shrink mode (no GPU): the mask-buffer calls keep the masked ranks and change, in every
    low-latency engine's mask word, only the bits of the ranks they mask or unmask (a rank the
    kernels masked after a timeout stays masked until unmasked by name or clean); a mask that would leave no
    rank and a bad rank are refused by name and change nothing; query refuses a tensor that is not
    int32 [num_ranks] on a GPU."""
    import torch

    def engine():  # the mask word (int32 [1]) as the engine's view holds it: every rank in
        return _fake_state(active=torch.full((1,), 0b11, dtype=torch.int32))

    def words(b):
        return {k: int(st.active[0]) for k, st in b._ll_engines.items()}

    b = _bare_buffer(enable_shrink=True)
    b._ll_engines = {"a": engine()}
    b.low_latency_update_mask_buffer(1, True)
    assert words(b) == {"a": 0b01} and b._masked_ranks == {1}
    expect_error(graphep.Status.INVALID_ARGUMENT, "masking rank 0 would leave no rank",
                 b.low_latency_update_mask_buffer, 0, True)
    expect_error(graphep.Status.INVALID_ARGUMENT, "rank_to_mask=2 is not a rank in [0, 2)",
                 b.low_latency_update_mask_buffer, 2, True)
    assert words(b) == {"a": 0b01} and b._masked_ranks == {1}
    b._ll_engines["b"] = engine()
    b._ll_engines["b"].active.fill_(0b01)  # as _low_latency_engine leaves a new engine: the masks so far
    b.low_latency_update_mask_buffer(1, False)
    assert words(b) == {"a": 0b11, "b": 0b11} and b._masked_ranks == set()
    b._ll_engines["a"].active.fill_(0b01)  # engine a's kernels masked rank 1 after a timeout
    b.low_latency_update_mask_buffer(0, True)
    assert words(b) == {"a": 0b00, "b": 0b10}, "rank 1, masked by the kernels, stays masked in engine a"
    b.low_latency_update_mask_buffer(0, False)
    assert words(b) == {"a": 0b01, "b": 0b11}, "rank 0 back; rank 1, masked by the kernels, still out of engine a"
    b.low_latency_update_mask_buffer(1, False)  # unmasked by name: back in every engine
    assert words(b) == {"a": 0b11, "b": 0b11} and b._masked_ranks == set()
    b._ll_engines["b"].active.fill_(0b10)  # engine b's kernels masked rank 0
    b.low_latency_clean_mask_buffer()  # every rank back, as DeepEP's clean does
    assert words(b) == {"a": 0b11, "b": 0b11} and b._masked_ranks == set()
    b._ll_engines["a"].second = engine()  # a shape's second engine (two operations in flight) is masked too
    b.low_latency_update_mask_buffer(0, True)
    assert int(b._ll_engines["a"].second.active[0]) == 0b10 and words(b) == {"a": 0b10, "b": 0b10}
    b._ll_engines["a"].second.pending = ("the receive hook of low_latency_dispatch 9", object())
    expect_error(graphep.Status.INVALID_ARGUMENT, "the receive hook of low_latency_dispatch 9 has not been called",
                 b.low_latency_update_mask_buffer, 0, False)
    assert int(b._ll_engines["a"].second.active[0]) == 0b10 and b._masked_ranks == {0}, "a refusal changes nothing"
    b._ll_engines["a"].second.pending = None
    b.low_latency_clean_mask_buffer()
    assert int(b._ll_engines["a"].second.active[0]) == 0b11 and words(b) == {"a": 0b11, "b": 0b11}
    expect_error(graphep.Status.INVALID_ARGUMENT, "mask_status must be an int32 CUDA tensor of [2]",
                 b.low_latency_query_mask_buffer, torch.zeros(2, dtype=torch.int32))


@requires_torch
def test_clean_is_the_barrier_in_shrink_mode(monkeypatch):
    """clean_low_latency_buffer (no GPU): in shrink mode the engine of the named shape enqueues its
    barrier on the current stream (DeepEP's clean is a barrier that masks a rank that does not
    come); other shapes' engines, a shape with no engine yet and a Buffer without shrink mode
    enqueue nothing; a send half waiting for its hook is refused by name."""
    import types

    import torch

    calls = []

    def engine(key):
        return _fake_state(engine=types.SimpleNamespace(barrier=lambda s: calls.append((key, s))),
                           active=torch.full((1,), 0b11, dtype=torch.int32))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: "the current stream")
    for shrink in (True, False):
        b = _bare_buffer(enable_shrink=shrink)
        b._ll_engines = {k: engine(k) for k in ((8, 128, 16), (16, 256, 16))}
        calls.clear()
        b.clean_low_latency_buffer(8, 128, 16)
        b.clean_low_latency_buffer(32, 128, 16)  # no engine of this shape: nothing to wait for
        assert calls == ([((8, 128, 16), "the current stream")] if shrink else [])
    b = _bare_buffer(enable_shrink=True)
    b._ll_engines = {(8, 128, 16): engine((8, 128, 16))}
    b._ll_engines[(8, 128, 16)].pending = ("the receive hook of low_latency_dispatch", object())
    calls.clear()
    expect_error(graphep.Status.INVALID_ARGUMENT, "clean_low_latency_buffer: the receive hook of low_latency_dispatch "
                 "has not been called", b.clean_low_latency_buffer, 8, 128, 16)
    assert calls == []
    first = b._ll_engines[(8, 128, 16)]
    first.pending, first.second = None, engine("second")  # the shape's second engine holds a send half
    first.second.pending = ("the receive hook of low_latency_dispatch 4", object())
    expect_error(graphep.Status.INVALID_ARGUMENT, "clean_low_latency_buffer: the receive hook of low_latency_dispatch 4 "
                 "has not been called", b.clean_low_latency_buffer, 8, 128, 16)
    first.second.pending = None
    first.active.fill_(0b01)  # as the first engine's barrier leaves it when rank 1 did not come
    b.clean_low_latency_buffer(8, 128, 16)
    assert calls == [((8, 128, 16), "the current stream")], "one barrier, on the shape's first engine"
    assert int(first.second.active[0]) == 0b01, "the rank the barrier masked, masked in the second engine too"


def _in_flight_module():
    """graphep/deep_ep/in_flight.py loaded by its path: it needs no PyTorch, while importing it as
    graphep.deep_ep.in_flight runs the package's __init__, which does (so this runs in CI too)."""
    import importlib.util

    path = os.path.join(os.path.dirname(graphep.__file__), "deep_ep", "in_flight.py")
    spec = importlib.util.spec_from_file_location("graphep_in_flight", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pick_engine_alternates_as_deepeps_two_buffers():
    """pick_engine (no GPU, no PyTorch): the first free engine (combined, or never used, and no hook
    waiting); with one engine held, None (make the second); with two held, the older dispatch's
    engine among those with no hook waiting; with both waiting for a hook, None (refused)."""
    pick_engine = _in_flight_module().pick_engine

    a, b = _fake_state(name="a"), _fake_state(name="b")
    assert pick_engine([a]) is a and pick_engine([a, b]) is a
    a.combined, a.seq = False, 5  # a dispatch not yet combined
    assert pick_engine([a]) is None, "one engine, held: the caller makes the second"
    assert pick_engine([a, b]) is b
    b.combined, b.seq = False, 6
    assert pick_engine([a, b]) is a, "both held: the older dispatch's engine (its handle goes stale)"
    a.seq = 7
    assert pick_engine([a, b]) is b
    b.pending = ("the receive hook of low_latency_dispatch 6", object())
    assert pick_engine([a, b]) is a, "an engine whose send half waits for its hook is never taken"
    a.pending = ("the receive hook of low_latency_dispatch 7", object())
    assert pick_engine([a, b]) is None, "both wait for a hook: refused"
    a.pending, a.combined = None, True  # a's hook called and its combine enqueued
    assert pick_engine([a, b]) is a
    a.combined, b.pending, b.combined = False, None, True
    assert pick_engine([a, b]) is b
    b.pending = ("the receive hook of low_latency_combine of dispatch 6", object())  # its combine's send half
    assert pick_engine([a, b]) is a, "combined, but its combine's send half waits for its hook: held"
    assert pick_engine([b]) is None
    # The normal mode's re-dispatch (routes_it: the engine's last dispatch routed the same tokens):
    # after the free ones, before the older one; never one whose hook waits.
    b.pending, b.combined, b.route, a.route = None, False, "m1", "m2"
    same = lambda route: lambda st: st.route == route  # noqa: E731
    assert pick_engine([a, b], same("m1")) is b and pick_engine([a, b], same("m2")) is a
    assert pick_engine([a, b], same("m3")) is b, "no engine routes it: the older dispatch's"
    assert pick_engine([a], same("m2")) is a and pick_engine([a], same("m1")) is None
    b.pending = ("the receive hook of low_latency_dispatch 6", object())
    assert pick_engine([a, b], same("m1")) is a
    b.pending, a.combined = None, True
    assert pick_engine([a, b], same("m1")) is a, "a free engine before one that routes the same tokens"


def test_engine_for_dispatch_makes_the_second_once_and_statuses_name_it():
    """in_flight (no GPU, no PyTorch): engine_for_dispatch makes the shape's second engine when the
    first is held and there is none (once), returns None when both hold a send half; statuses
    lists a second engine under its shape's key + (1,)."""
    m = _in_flight_module()
    first, made = _fake_state(name="first"), []

    def make():
        made.append(_fake_state(name="second"))
        return made[-1]

    assert m.engine_for_dispatch(first, make) is first and made == []
    first.combined, first.seq = False, 1
    second = m.engine_for_dispatch(first, make)
    assert second is first.second and made == [second]
    second.combined, second.seq = False, 2
    assert m.engine_for_dispatch(first, make) is first and len(made) == 1, "both held: the older, nothing made"
    first.pending = second.pending = ("a hook", object())
    assert m.engine_for_dispatch(first, make) is None and len(made) == 1
    other = _fake_state(name="other")
    assert m.statuses({(8, 128, 16): first, (4, 64, 8): other}, lambda st: st.name) == \
        {(8, 128, 16): "first", (8, 128, 16, 1): "second", (4, 64, 8): "other"}


@requires_torch
def test_a_second_engine_for_a_second_operation_in_flight(monkeypatch):
    """_ll_dispatch_engine (no GPU): a dispatch while the shape's one engine holds an earlier dispatch
    or a send half makes the second engine (once; named in the call it is made for), then the
    engines alternate; a dispatch while both hold a send half is refused by name, making nothing."""
    made = []

    def make(self, key, what):
        made.append((key, what))
        return _fake_state(name=f"made {len(made)}")

    from graphep.deep_ep.low_latency import LowLatencyMode

    monkeypatch.setattr(LowLatencyMode, "_make_low_latency_engine", make)
    b = _bare_buffer()
    first = b._ll_engines[(8, 128, 16)] = _fake_state(name="first", shape=(8, 128, 16))
    assert b._ll_dispatch_engine(first, "low_latency_dispatch") is first and made == []
    first.combined, first.seq = False, 1
    second = b._ll_dispatch_engine(first, "low_latency_dispatch")
    assert second is first.second and made == [((8, 128, 16), "low_latency_dispatch while an earlier one is in "
                                                              "flight")]
    assert [s.name for s in b._ll_states()] == ["first", "made 1"]
    second.combined, second.seq = False, 2
    assert b._ll_dispatch_engine(first, "low_latency_dispatch") is first and len(made) == 1, "the older, reused"
    first.pending = ("the receive hook of low_latency_dispatch 3", object())
    second.pending = ("the receive hook of low_latency_dispatch 2", object())
    expect_error(graphep.Status.INVALID_ARGUMENT,
                 "low_latency_dispatch: two operations of num_max_dispatch_tokens_per_rank=8, hidden=128, "
                 "num_experts=16 are in flight (the receive hook of low_latency_dispatch 3 and the receive hook of "
                 "low_latency_dispatch 2 have not been called)", b._ll_dispatch_engine, first, "low_latency_dispatch")
    assert len(made) == 1


@requires_torch
def test_shrink_mode_engines_share_what_their_kernels_masked():
    """_take_masked in shrink mode (no GPU): the engine a dispatch runs on first clears, in its mask
    word, the ranks the shape's other engine's kernels masked (so a dead rank costs one timeout,
    not one per engine); without shrink mode the words are left alone."""
    import torch

    for shrink in (True, False):
        b = _bare_buffer(enable_shrink=shrink)
        first = _fake_state(name="first", shape=(8, 128, 16), active=torch.tensor([0b111], dtype=torch.int32))
        first.second = _fake_state(name="second", active=torch.tensor([0b101], dtype=torch.int32))  # rank 1 masked
        st = b._ll_dispatch_engine(first, "low_latency_dispatch")
        assert st is first
        b._take_masked(first, st, None)
        assert int(first.active[0]) == (0b101 if shrink else 0b111)
        first.combined, first.seq = False, 1
        first.active.fill_(0b011)  # first's kernels masked rank 2
        st = b._ll_dispatch_engine(first, "low_latency_dispatch")
        assert st is first.second
        b._take_masked(first, st, None)
        assert int(first.second.active[0]) == (0b001 if shrink else 0b101)
        assert int(first.active[0]) == 0b011, "the other engine's word is read, not written"


@requires_torch
def test_shrink_mode_query_reads_every_engine_word():
    """The query's device half (no GPU): a rank out of any engine's mask word reads 1, bit 31 too."""
    import types

    import torch

    from graphep.deep_ep.low_latency import _masked_by_words

    def state(word, world):
        return types.SimpleNamespace(active=torch.tensor([word], dtype=torch.int32),
                                     rank_ids=torch.arange(world, dtype=torch.int32),
                                     live=torch.empty(1, dtype=torch.int32))

    out = torch.full((3,), 7, dtype=torch.int32)
    _masked_by_words([state(0b101, 3), state(0b011, 3)], out)
    assert out.tolist() == [0, 1, 1]
    out = torch.full((32,), 7, dtype=torch.int32)
    _masked_by_words([state(-(1 << 31) | 0b1, 32)], out)  # ranks 0 and 31 in
    assert out.tolist() == [0] + [1] * 30 + [0]


@requires_torch
def test_low_latency_calls_need_low_latency_mode():
    import torch

    b = _bare_buffer(low_latency_mode=False)
    x, ids = torch.zeros(8, 128, dtype=torch.bfloat16), torch.zeros(8, 2, dtype=torch.int64)
    expect_error(graphep.Status.INVALID_ARGUMENT, "needs Buffer(low_latency_mode=True)", b.low_latency_dispatch, x,
                 ids, 8, 16)
    expect_error(graphep.Status.INVALID_ARGUMENT, "needs Buffer(low_latency_mode=True)", b.clean_low_latency_buffer,
                 8, 128, 16)
    _bare_buffer().clean_low_latency_buffer(8, 128, 16)  # nothing to clean: returns


# ---- 2 GPUs: the worker under torchrun ----------------------------------------------------------

@requires_torch
@requires_gpus(2)
def test_low_latency_on_two_ranks_under_torchrun():
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1", GRAPHEP_TIMEOUT_MS="4000")  # shrink's wait
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__, "--worker"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    print(r.stdout[-6000:], r.stderr[-6000:])
    assert r.returncode == 0 and "PASS" in r.stdout


# The main shape (T, H, E, k): hidden a multiple of 512 (UE8M0), the engine's top-k 16 > k; a
# second shape on the same Buffer (hidden 640: fp8 yes, UE8M0 no; k = the engine's top-k, 4); and
# the shrink-mode Buffer's.
SHAPES = {"main": (64, 1024, 16, 4), "second": (16, 640, 4, 4), "shrink": (32, 512, 8, 4)}
POISON = -3.0e38  # bf16 / fp32 poison: far from anything the engine writes


class Inputs:
    """One rank's tokens, ids (distinct experts per token, some -1) and weights, from its seed."""

    def __init__(self, torch, rank, tokens, shape, device, seed):
        T, H, E, k = shape
        gen = torch.Generator(device=device).manual_seed(seed * 100 + rank)
        self.n = tokens
        self.x = (torch.randn(tokens, H, generator=gen, device=device) *
                  torch.rand(tokens, 1, generator=gen, device=device) * 4).to(torch.bfloat16)
        ids = torch.rand(tokens, E, generator=gen, device=device).argsort(dim=1)[:, :k]
        self.ids = torch.where(torch.rand(tokens, k, generator=gen, device=device) < 0.15, -1, ids).to(torch.int64)
        self.w = torch.rand(tokens, k, generator=gen, device=device) + 0.1


def worker() -> int:
    import torch
    import torch.distributed as dist

    import graphep.deep_ep as deep_ep

    device, rank, R = start()
    wrong = {}

    def count(name, n):
        wrong[name] = wrong.get(name, 0) + int(n)

    def expect_error(name, status, needles, fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
        except graphep.Error as e:
            bad = e.status != status or any(s not in e.message for s in needles)
            count(name, bad)
            if bad:
                print(f"rank {rank} {name}: {e}", flush=True)
            return
        count(name, 1)

    def inputs(shape, seed, tokens=None):
        T = shape[0]
        tokens = tokens or [T - 13 * (s % 2) for s in range(R)]  # rank 1: a live count below T
        return [Inputs(torch, s, tokens[s], shape, device, seed) for s in range(R)]

    def expected(all_in, shape):
        """Per local expert j of this rank: (source ranks, source tokens) of its rows, in order."""
        T, H, E, k = shape
        L = E // R
        rows = []
        for j in range(L):
            e = rank * L + j
            src, tok = [], []
            for s, inp in enumerate(all_in):
                t = torch.nonzero((inp.ids == e).any(dim=1)).flatten()
                src.append(torch.full_like(t, s)), tok.append(t)
            rows.append((torch.cat(src), torch.cat(tok)))
        return rows

    def all_x(all_in, shape):
        T, H = shape[0], shape[1]
        X = torch.zeros(R, T, H, dtype=torch.bfloat16, device=device)
        for s, inp in enumerate(all_in):
            X[s, :inp.n] = inp.x
        return X

    def dequant(q, scales):
        rows, H = q.shape
        return (q.float().view(rows, H // 128, 128) * scales.unsqueeze(-1)).view(rows, H)

    def check_dispatch(name, all_in, shape, recv, recv_count, handle, fmt, stats=None):
        """fmt: None (bf16), 'float', 'pow2' or 'ue8m0'. Returns the per-expert (src, tok) rows."""
        T, H, E, k = shape
        L = E // R
        rows = expected(all_in, shape)
        X = all_x(all_in, shape)
        count(f"{name}.handle", not (isinstance(handle, tuple) and len(handle) == 5 and
                                     tuple(handle[2:]) == (T, H, E)))
        src_info, layout_range = handle[0], handle[1]
        count(f"{name}.shapes", (tuple(recv_count.shape), tuple(src_info.shape), tuple(layout_range.shape)) !=
              ((L,), (L, R * T), (L, R)))
        counts = recv_count.tolist()
        for j, (src, tok) in enumerate(rows):
            c = src.numel()
            if counts[j] != c:
                count(f"{name}.recv_count", 1)
                continue
            if stats is not None:
                count(f"{name}.stats", int(stats[j]) != c)
            count(f"{name}.src_info", (src_info[j, :c].long() != tok).sum())
            per_src = torch.bincount(src, minlength=R)
            begin = torch.cumsum(per_src, 0) - per_src
            got = layout_range[j]
            count(f"{name}.layout_range.count", ((got & 0xFFFFFFFF) != per_src).sum())
            count(f"{name}.layout_range.begin", ((got >> 32) != begin)[per_src > 0].sum())  # begin of sources sent
            want = X[src, tok]
            if fmt is None:
                count(f"{name}.x", (recv[j, :c].view(torch.int16) != want.view(torch.int16)).sum())
                continue
            q, s = recv[0][j, :c], recv[1][j, :c]
            if fmt == "ue8m0":  # exponent bytes: value 4w + i in byte i of int32 w
                s = (s.contiguous().view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
            tiles = want.float().view(c, H // 128, 128)
            amax = tiles.abs().amax(dim=2)
            if fmt == "float":
                count(f"{name}.scales", ((s - amax / 448).abs() > amax / 448 * 1e-6).sum())
            else:  # powers of two, the smallest >= amax / 448
                mant, _ = torch.frexp(s)
                count(f"{name}.scales.pow2", (mant != 0.5).sum())
                count(f"{name}.scales.round_up", ((s < amax / 448) | (s / 2 >= amax / 448) & (amax > 0)).sum())
            got = dequant(q, s)
            # e4m3: 3 mantissa bits (half an ulp: 2^-4 relative), subnormals 2^-9 x scale apart.
            tol = want.float().abs() * 2.0 ** -4 + s.unsqueeze(-1).expand(c, H // 128, 128).reshape(c, H) * 2.0 ** -9
            count(f"{name}.x", ((got - want.float()).abs() > tol * 1.01).sum())
        return rows

    def experts(rows, shape, target, X):
        """Each local expert j's output rows into target [L, R x T, H] (poisoned first): the source
        token's bf16 row times (1 + j / 8), from the reference inputs (not from what arrived, so
        fp8 dispatches combine the same exact values)."""
        target.fill_(POISON)
        for j, (src, tok) in enumerate(rows):
            if src.numel():
                target[j, :src.numel()] = (X[src, tok].float() * (1 + j / 8)).to(torch.bfloat16)
        return target

    def combined_ref(me, shape):
        """sum_k w x bf16(x (1 + j / 8)) in fp64, and the bound sum_k |term| (moe_check's rule)."""
        L = shape[2] // R
        ref = torch.zeros(me.n, shape[1], dtype=torch.float64, device=device)
        bound = torch.zeros_like(ref)
        for k in range(me.ids.shape[1]):
            valid = (me.ids[:, k] >= 0).unsqueeze(1)
            j = (me.ids[:, k] % L).double().unsqueeze(1)
            y = (me.x.double() * (1 + j / 8)).to(torch.bfloat16).double()
            term = torch.where(valid, me.w[:, k:k + 1].double() * y, torch.zeros_like(y))
            ref += term
            bound += term.abs()
        return ref, bound

    def check_combined(name, got, me, shape):
        ref, bound = combined_ref(me, shape)
        if tuple(got.shape) != (me.n, shape[1]):
            return count(f"{name}.shape", 1)
        count(name, ((got.double() - ref).abs() > bound * 2.0 ** -7 + 1e-6).sum())
        count(f"{name}.nan", torch.isnan(got).sum())
        return None

    def poison_views(st_shape):
        """Poison what a dispatch writes (through the Buffer's own views of the shape's engines)."""
        for st in buffer._ll_engines[(st_shape[0], st_shape[1], st_shape[2])].engines():
            st.recv_x.fill_(POISON)
            st.recv_count.fill_(-7)
            st.src_info.fill_(-7)
            st.layout_range.fill_(-7)
            if st.scales is not None:
                st.scales.fill_(POISON)

    shape = SHAPES["main"]
    T, H, E, k = shape
    L = E // R
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E)
    buffer = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=L,
                            explicitly_destroy=True)
    buffer.clean_low_latency_buffer(T, H, E)  # nothing to clean
    count("engine_made_by_the_constructor", list(buffer._ll_engines) != [(T, H, E)])  # the hinted shape
    warm = inputs(shape, 99)[rank]
    buffer.low_latency_combine(torch.zeros(L, R * T, H, dtype=torch.bfloat16, device=device), warm.ids, warm.w,
                               buffer.low_latency_dispatch(warm.x, warm.ids, T, E)[2])

    # Rounds over DeepEP's formats, each with fresh data: bf16, fp8 float / pow2 / ue8m0 scales.
    formats = [(False, False, False, None), (True, False, False, "float"), (True, True, False, "pow2"),
               (True, True, True, "ue8m0")]
    for seed, (use_fp8, round_scale, use_ue8m0, fmt) in enumerate(formats):
        all_in = inputs(shape, seed)
        me = all_in[rank]
        stats = torch.zeros(L, dtype=torch.int32, device=device)
        poison_views(shape)
        recv, recv_count, handle, event, hook = buffer.low_latency_dispatch(
            me.x, me.ids, T, E, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8, round_scale=round_scale,
            use_ue8m0=use_ue8m0)
        count(f"{fmt}.event_hook", (event.event is not None) + (hook is not None))
        if use_fp8:
            want_scales = (torch.int32, H // 512) if use_ue8m0 else (torch.float32, H // 128)
            count(f"{fmt}.types", (recv[0].dtype, tuple(recv[0].shape), recv[1].dtype, tuple(recv[1].shape)) !=
                  (torch.float8_e4m3fn, (L, R * T, H), want_scales[0], (L, R * T, want_scales[1])))
        else:
            count(f"{fmt}.types", (recv.dtype, tuple(recv.shape)) != (torch.bfloat16, (L, R * T, H)))
        rows = check_dispatch(f"dispatch.{fmt}", all_in, shape, recv, recv_count, handle, fmt, stats)
        if fmt == "pow2":  # the same inputs as UE8M0 below: keep the fp8 rows and scales
            pow2_rows = [(recv[0][j, :src.numel()].view(torch.uint8).clone(), recv[1][j, :src.numel()].clone())
                         for j, (src, _) in enumerate(rows)]
        # A second dispatch adds to the stats again (cumulative).
        recv, recv_count, handle, _, _ = buffer.low_latency_dispatch(
            me.x, me.ids, T, E, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8, round_scale=round_scale,
            use_ue8m0=use_ue8m0)
        count(f"{fmt}.stats.cumulative", (stats.long() != 2 * recv_count.long()).sum())
        # combine from x, into a fresh tensor and into out
        y = experts(rows, shape, torch.empty(L, R * T, H, dtype=torch.bfloat16, device=device), all_x(all_in, shape))
        combined, event, hook = buffer.low_latency_combine(y, me.ids, me.w, handle)
        count(f"{fmt}.combine.event_hook", (event.event is not None) + (hook is not None))
        check_combined(f"combine.{fmt}", combined, me, shape)
        out = torch.full((me.n, H), POISON, dtype=torch.bfloat16, device=device)
        combined, _, _ = buffer.low_latency_combine(y, me.ids, me.w, handle, out=out)
        count(f"{fmt}.combine.out_is_out", combined.data_ptr() != out.data_ptr())
        check_combined(f"combine.out.{fmt}", out, me, shape)
        # zero_copy: the rows in the engine's buffer; x (poisoned) is not read
        nxt = buffer.get_next_low_latency_combine_buffer(handle)
        count(f"{fmt}.next_buffer", (nxt.dtype, tuple(nxt.shape)) != (torch.bfloat16, (L, R * T, H)))
        experts(rows, shape, nxt, all_x(all_in, shape))
        combined, _, _ = buffer.low_latency_combine(torch.full_like(y, POISON), me.ids, me.w, handle, zero_copy=True)
        check_combined(f"combine.zero_copy.{fmt}", combined, me, shape)

    # UE8M0 against pow2 (same seed as the pow2 round): the same e4m3 bytes, the same powers.
    all_in = inputs(shape, 2)
    me = all_in[rank]
    recv, _, handle, _, _ = buffer.low_latency_dispatch(me.x, me.ids, T, E, round_scale=True, use_ue8m0=True)
    for j, (q, s) in enumerate(pow2_rows):
        c = q.shape[0]
        count("ue8m0.bytes", (recv[0][j, :c].view(torch.uint8) != q).sum())
        exps = (recv[1][j, :c].contiguous().view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
        count("ue8m0.vs_pow2", (exps != s).sum())

    # The hook path (DeepEP's return_recv_hook): send half, then the hook's receive half.
    all_in = inputs(shape, 10)
    me = all_in[rank]
    poison_views(shape)
    stats = torch.zeros(L, dtype=torch.int32, device=device)
    recv, recv_count, handle, event, hook = buffer.low_latency_dispatch(
        me.x, me.ids, T, E, cumulative_local_expert_recv_stats=stats, use_fp8=False, return_recv_hook=True)
    count("hook.dispatch.callable", not callable(hook) or event.event is not None)
    # Two micro-batches in flight (vLLM's dual-batch overlap, SGLang's two-batch overlap): a second
    # send half while the first waits for its hook runs on the shape's other engine; a third is
    # refused naming both hooks. The hooks come in the other order, and the combines interleave.
    all_b = inputs(shape, 14)
    me_b = all_b[rank]
    stats_b = torch.zeros(L, dtype=torch.int32, device=device)
    recv_b, recv_count_b, handle_b, _, hook_b = buffer.low_latency_dispatch(
        me_b.x, me_b.ids, T, E, cumulative_local_expert_recv_stats=stats_b, use_fp8=True, return_recv_hook=True)
    count("two.engines", handle.state is handle_b.state or recv_count.data_ptr() == recv_count_b.data_ptr())
    expect_error("two.third_refused", graphep.Status.INVALID_ARGUMENT,
                 ["two operations of", "are in flight", "receive hook of low_latency_dispatch", "call a hook first"],
                 buffer.low_latency_dispatch, me.x, me.ids, T, E)
    hook_b()
    hook()
    expect_error("hook.twice", graphep.Status.INVALID_ARGUMENT, ["was called already"], hook)
    rows = check_dispatch("hook.dispatch", all_in, shape, recv, recv_count, handle, None, stats)
    rows_b = check_dispatch("two.dispatch_b", all_b, shape, recv_b, recv_count_b, handle_b, "float", stats_b)
    y = experts(rows, shape, torch.empty(L, R * T, H, dtype=torch.bfloat16, device=device), all_x(all_in, shape))
    y_b = experts(rows_b, shape, torch.empty(L, R * T, H, dtype=torch.bfloat16, device=device), all_x(all_b, shape))
    combined, event, hook = buffer.low_latency_combine(y, me.ids, me.w, handle, return_recv_hook=True)
    count("hook.combine.callable", not callable(hook))
    combined_b, _, hook_b = buffer.low_latency_combine(y_b, me_b.ids, me_b.w, handle_b, return_recv_hook=True)
    hook()
    hook_b()
    check_combined("hook.combine", combined, me, shape)
    check_combined("two.combine_b", combined_b, me_b, shape)
    # The hook holds what its receive half may read (the combine's x: a peer's records whose weights
    # came late are reduced there) until it is called: a caller that drops x after the send half,
    # whose memory the other micro-batch's tensors may then take, still gets the right sums.
    y_late = y.clone()
    held = weakref.ref(y_late)
    combined, event, hook = buffer.low_latency_combine(y_late, me.ids, me.w, handle, return_recv_hook=True)
    del y_late
    count("hook.holds_x", held() is None)
    hook()
    count("hook.releases_x", held() is not None)
    check_combined("hook.combine_after_x_dropped", combined, me, shape)

    # async_finish: the work on the comm stream, an event to wait for.
    all_in = inputs(shape, 11)
    me = all_in[rank]
    poison_views(shape)
    recv, recv_count, handle, event, hook = buffer.low_latency_dispatch(me.x, me.ids, T, E, use_fp8=False,
                                                                        async_finish=True)
    count("async.event", event.event is None or hook is not None)
    event.current_stream_wait()
    rows = check_dispatch("async.dispatch", all_in, shape, recv, recv_count, handle, None)
    y = experts(rows, shape, torch.empty(L, R * T, H, dtype=torch.bfloat16, device=device), all_x(all_in, shape))
    combined, event, _ = buffer.low_latency_combine(y, me.ids, me.w, handle, async_finish=True)
    event.current_stream_wait()
    check_combined("async.combine", combined, me, shape)

    # Under a Python function mode (DeepEP's tests install one with torch.set_default_device): no
    # torch call of the Buffer's reaches it, and the results are right.
    all_in = inputs(shape, 13)
    me = all_in[rank]
    poison_views(shape)
    mode = counting_mode()
    with mode:
        recv, recv_count, handle, _, _ = buffer.low_latency_dispatch(me.x, me.ids, T, E, use_fp8=False)
    rows = check_dispatch("mode.dispatch", all_in, shape, recv, recv_count, handle, None)
    y = experts(rows, shape, torch.empty(L, R * T, H, dtype=torch.bfloat16, device=device), all_x(all_in, shape))
    with mode:
        combined, _, _ = buffer.low_latency_combine(y, me.ids, me.w, handle)
        buffer.get_next_low_latency_combine_buffer(handle)
    check_combined("mode.combine", combined, me, shape)
    count("mode.calls", len(mode.calls))
    if mode.calls:
        print(f"rank {rank}: the mode saw {len(mode.calls)} calls: {mode.calls[:8]}", flush=True)

    # Rank 1 has no tokens: it still receives, and its combine returns [0, H].
    all_in = inputs(shape, 12, [T if s != 1 else 0 for s in range(R)])
    me = all_in[rank]
    poison_views(shape)
    recv, recv_count, handle, _, _ = buffer.low_latency_dispatch(me.x, me.ids, T, E, use_fp8=False)
    rows = check_dispatch("idle.dispatch", all_in, shape, recv, recv_count, handle, None)
    y = experts(rows, shape, torch.empty(L, R * T, H, dtype=torch.bfloat16, device=device), all_x(all_in, shape))
    combined, _, _ = buffer.low_latency_combine(y, me.ids, me.w, handle)
    check_combined("idle.combine", combined, me, shape)

    # A second engine shape on the same Buffer, then the first again (each keeps its own state).
    shape2 = SHAPES["second"]
    T2, H2, E2, k2 = shape2
    for use_fp8 in (False, True):
        all_in = inputs(shape2, 20 + use_fp8)
        me = all_in[rank]
        recv, recv_count, handle2, _, _ = buffer.low_latency_dispatch(me.x, me.ids, T2, E2, use_fp8=use_fp8)
        rows = check_dispatch(f"second.{use_fp8}", all_in, shape2, recv, recv_count, handle2,
                              "float" if use_fp8 else None)
        y = experts(rows, shape2, torch.empty(E2 // R, R * T2, H2, dtype=torch.bfloat16, device=device),
                    all_x(all_in, shape2))
        combined, _, _ = buffer.low_latency_combine(y, me.ids, me.w, handle2)
        check_combined(f"second.combine.{use_fp8}", combined, me, shape2)
    expect_error("error.ue8m0_hidden", graphep.Status.INVALID_ARGUMENT, ["hidden=640", "multiple of 512"],
                 buffer.low_latency_dispatch, me.x, me.ids, T2, E2, round_scale=True, use_ue8m0=True)

    # Captured once in a CUDA graph (dispatch -> experts -> combine), replayed with new inputs.
    all_in = inputs(shape, 30)
    me = all_in[rank]
    x_s, ids_s, w_s = me.x.clone(), me.ids.clone(), me.w.clone()
    out_s = torch.empty(me.n, H, dtype=torch.bfloat16, device=device)
    y_s = torch.empty(L, R * T, H, dtype=torch.bfloat16, device=device)
    scale = (1 + torch.arange(L, device=device, dtype=torch.float32) / 8).view(L, 1, 1)
    recv_g, _, handle_g, _, _ = buffer.low_latency_dispatch(x_s, ids_s, T, E, use_fp8=False)  # warm-up, eager
    torch.mul(recv_g.float(), scale, out=y_s)
    buffer.low_latency_combine(y_s, ids_s, w_s, handle_g, out=out_s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv_g, _, handle_g, _, _ = buffer.low_latency_dispatch(x_s, ids_s, T, E, use_fp8=False)
        torch.mul(recv_g.float(), scale, out=y_s)  # every row (unreceived ones are never read)
        buffer.low_latency_combine(y_s, ids_s, w_s, handle_g, out=out_s)
    for replay in range(5):
        all_in = inputs(shape, 40 + replay)
        me = all_in[rank]
        x_s.copy_(me.x), ids_s.copy_(me.ids), w_s.copy_(me.w)
        out_s.fill_(POISON)
        dist.barrier()
        graph.replay()
        torch.cuda.synchronize()
        check_combined("graph.combine", out_s, me, shape)
    del graph

    # Two micro-batches captured in one graph (as a stack's decode step with two-batch overlap is),
    # send halves and hooks interleaved, replayed with new inputs for both. The shape's second
    # engine exists already (made eagerly above: a capture cannot make one).
    pair = [inputs(shape, 31 + m)[rank] for m in range(2)]
    xs2 = [p.x.clone() for p in pair]
    ids2 = [p.ids.clone() for p in pair]
    ws2 = [p.w.clone() for p in pair]
    outs2 = [torch.empty(p.n, H, dtype=torch.bfloat16, device=device) for p in pair]
    ys2 = [torch.empty(L, R * T, H, dtype=torch.bfloat16, device=device) for _ in pair]

    def two_batches():
        got = [buffer.low_latency_dispatch(xs2[m], ids2[m], T, E, use_fp8=False, return_recv_hook=True)
               for m in range(2)]
        for m in (1, 0):
            got[m][4]()
        for m in range(2):
            torch.mul(got[m][0].float(), scale, out=ys2[m])
        hooks = [buffer.low_latency_combine(ys2[m], ids2[m], ws2[m], got[m][2], return_recv_hook=True, out=outs2[m])[2]
                 for m in range(2)]
        for m in (0, 1):
            hooks[m]()
        return got

    got = two_batches()  # warm-up, eager
    count("graph2.two_engines", got[0][2].state is got[1][2].state)
    torch.cuda.synchronize()
    graph2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph2):
        two_batches()
    for replay in range(4):
        both = [inputs(shape, 70 + 2 * replay + m) for m in range(2)]
        for m in range(2):
            xs2[m].copy_(both[m][rank].x), ids2[m].copy_(both[m][rank].ids), ws2[m].copy_(both[m][rank].w)
            outs2[m].fill_(POISON)
        dist.barrier()
        graph2.replay()
        torch.cuda.synchronize()
        for m in range(2):
            check_combined(f"graph2.combine.{m}", outs2[m], both[m][rank], shape)
    del graph2

    # Errors, named: every rank makes the same bad call, so no rank is left waiting.
    all_in = inputs(shape, 50)
    me = all_in[rank]
    # A shape holds its last two dispatches not yet combined (DeepEP's two buffers): a third reuses
    # the older one's engine, whose handle is then refused; the other two are served.
    _, _, handle_a, _, _ = buffer.low_latency_dispatch(me.x, me.ids, T, E, use_fp8=False)
    _, _, handle_c, _, _ = buffer.low_latency_dispatch(me.x, me.ids, T, E, use_fp8=False)
    _, _, handle_b, _, _ = buffer.low_latency_dispatch(me.x, me.ids, T, E, use_fp8=False)
    count("error.third_reuses_the_older", handle_b.state is not handle_a.state or handle_c.state is handle_a.state)
    y = torch.zeros(L, R * T, H, dtype=torch.bfloat16, device=device)
    expect_error("error.stale_handle", graphep.Status.INVALID_ARGUMENT,
                 ["the handle is of low_latency_dispatch", "combines the engine's last dispatch",
                  "its last two dispatches"],
                 buffer.low_latency_combine, y, me.ids, me.w, handle_a)
    buffer.low_latency_combine(y, me.ids, me.w, handle_c)  # the other in-flight dispatch is still served
    expect_error("error.stale_next_buffer", graphep.Status.INVALID_ARGUMENT,
                 ["get_next_low_latency_combine_buffer: the handle is of low_latency_dispatch", "belongs to that"],
                 buffer.get_next_low_latency_combine_buffer, handle_a)
    expect_error("error.logfmt", graphep.Status.NOT_SUPPORTED, ["use_logfmt=True"],
                 buffer.low_latency_combine, y, me.ids, me.w, handle_b, use_logfmt=True)
    big = torch.zeros(T + 1, H, dtype=torch.bfloat16, device=device)
    expect_error("error.num_tokens", graphep.Status.INVALID_ARGUMENT,
                 [f"x has {T + 1} rows (num_tokens)", f"num_max_dispatch_tokens_per_rank={T}"],
                 buffer.low_latency_dispatch, big, torch.zeros(T + 1, k, dtype=torch.int64, device=device), T, E)
    expect_error("error.x_dtype", graphep.Status.INVALID_ARGUMENT, ["x has dtype torch.float32"],
                 buffer.low_latency_dispatch, me.x.float(), me.ids, T, E)
    expect_error("error.ids_dtype", graphep.Status.INVALID_ARGUMENT, ["topk_idx has dtype torch.float32"],
                 buffer.low_latency_dispatch, me.x, me.ids.float(), T, E)
    expect_error("error.top_k", graphep.Status.INVALID_ARGUMENT, ["topk_idx has 17 columns", "1 to 16"],
                 buffer.low_latency_dispatch, me.x, torch.zeros(me.n, 17, dtype=torch.int64, device=device), T, E)
    expect_error("error.stats_shape", graphep.Status.INVALID_ARGUMENT,
                 ["cumulative_local_expert_recv_stats has shape", f"expected [{L}]"],
                 buffer.low_latency_dispatch, me.x, me.ids, T, E,
                 cumulative_local_expert_recv_stats=torch.zeros(L + 1, dtype=torch.int32, device=device))
    expect_error("error.async_and_hook", graphep.Status.INVALID_ARGUMENT, ["async_finish=True and return_recv_hook"],
                 buffer.low_latency_dispatch, me.x, me.ids, T, E, async_finish=True, return_recv_hook=True)
    expect_error("error.weights_shape", graphep.Status.INVALID_ARGUMENT, ["topk_weights has shape"],
                 buffer.low_latency_combine, y, me.ids, me.w[:, :1].contiguous(), handle_b)
    expect_error("error.x_shape", graphep.Status.INVALID_ARGUMENT, ["low_latency_combine: x has shape"],
                 buffer.low_latency_combine, y[:, :T], me.ids, me.w, handle_b)
    combined, _, _ = buffer.low_latency_combine(y, me.ids, me.w, handle_b)  # the last handle is still served

    # Shrink mode (DeepEP's enable_shrink): the last rank stops right after the constructor and
    # releases its Buffer, as a rank that dies before its first dispatch (DeepEP's --shrink-test
    # fails rank 1 there, and its failed rank destroys its Buffer at once, as here). Its engine
    # existed (the constructor made it), so nothing collective waits for it; the others' first
    # dispatch masks it after GRAPHEP_TIMEOUT_MS and completes with their own tokens, combine adds
    # nothing for its experts, the query names it; the second round finds it masked. The survivors'
    # part runs in a function: the tensors it holds view the engine (they keep it, and its group,
    # alive), and the stopped rank's group teardown waits until the survivors' groups are gone
    # (docs/RELIABILITY.md; the views held past destroy() hung runs 146-148 here).
    shape3 = SHAPES["shrink"]
    T3, H3, E3, k3 = shape3
    gone = R - 1

    def survive(shrink):
        all_in = inputs(shape3, 60, [T3 if s != gone else 0 for s in range(R)])  # the reference: nothing from it
        me = all_in[rank]
        live = copy.copy(me)  # the reference's routing: the entries to its experts dropped
        live.ids = torch.where(me.ids // (E3 // R) == gone, -1, me.ids)
        mask = torch.full((R,), -7, dtype=torch.int32, device=device)
        for round_ in range(2):
            if round_ == 0:  # dispatch -> dispatch (DeepEP's test does): the first masks the stopped rank after
                # a timeout on the first engine; the second runs on the shape's second engine, which the
                # constructor made (no collective now) and which the first's mask word tells of the rank
                shrink.low_latency_dispatch(me.x, me.ids, T3, E3, use_fp8=False)
            recv, recv_count, handle, _, _ = shrink.low_latency_dispatch(me.x, me.ids, T3, E3, use_fp8=False)
            rows = check_dispatch(f"shrink.dispatch.{round_}", all_in, shape3, recv, recv_count, handle, None)
            y = experts(rows, shape3, torch.empty(E3 // R, R * T3, H3, dtype=torch.bfloat16, device=device),
                        all_x(all_in, shape3))
            combined, _, _ = shrink.low_latency_combine(y, me.ids, me.w, handle)
            check_combined(f"shrink.combine.{round_}", combined, live, shape3)
            shrink.low_latency_query_mask_buffer(mask)
            count(f"shrink.query.{round_}", mask.tolist() != [int(r == gone) for r in range(R)])
        shrink.clean_low_latency_buffer(T3, H3, E3)  # the barrier, among the ranks left
        shrink.low_latency_query_mask_buffer(mask)
        count("shrink.query.clean", mask.tolist() != [int(r == gone) for r in range(R)])
        st = shrink.status().low_latency[(T3, H3, E3)]
        count("shrink.status", not st.ok or st.shrunk_ranks != 1 << gone)

    shrink = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(
        T3, H3, R, E3), low_latency_mode=True, explicitly_destroy=True, enable_shrink=True)
    count("shrink.engines_made", (T3, H3, E3) not in shrink._ll_engines or shrink._ll_engines[(T3, H3, E3)].second is None)
    if rank != gone:
        survive(shrink)
    gc.collect()  # nothing left that views the engine
    shrink.destroy()
    del shrink
    dist.barrier()

    torch.cuda.synchronize()
    status = buffer.status()
    two = (T, H, E, 1) in status.low_latency and len(status.low_latency) == 3  # main, its second, the second shape
    return finish("test_deep_ep_low_latency", buffer, wrong, status.ok and two, rank, R, device)


if __name__ == "__main__" and "--worker" in sys.argv:
    sys.exit(worker())
