#!/usr/bin/env python3
"""What graphep.deep_ep's Buffer adds to graphep's own call, measured the way DeepEP's harness
measures (a CUDA event before and after each call on the current stream, 50 warm-up calls, 50
timed, the first timed one dropped, the mean), on one rank per GPU:

    python3 bench/deep_ep_overhead.py [--num-processes 2] [--num-tokens 4096] [--hidden 7168]
                                      [--num-experts 256] [--num-topk 8] [--num-sms 24] [--low-latency]
                                      [--default-device] [--profile N] [--deepep]

For the cached dispatch (bf16 and fp8, as DeepEP's tuning loop times it) and the combine, or with
--low-latency for low_latency_dispatch (fp8, bf16) and low_latency_combine (T = --num-tokens tokens
per rank, the batched latency engine), rank 0 prints one line each:
    adapter   Buffer.dispatch / Buffer.combine (fresh outputs, streams and events as DeepEP's)
    engine    the engine's own call with the same inputs into outputs allocated once
    gpu       the engine's call enqueued 50 times back to back, then one sync: the time per call
              with the host ahead of the device (kernels only)
    host      the adapter's host time per call (perf_counter around 50 calls, no sync between),
              and the engine's call's beside it
    host in the events' loop
              the host's time per call of the events' timed loop itself, events included: when it
              nears the events' mean, the device waited for the host, and the figure holds host time
    host ahead
              the same events, the device first spinning (torch.cuda._sleep) until the host has
              enqueued every timed call: the device's time per call alone, adapter and engine
and adapter / engine (adapter and engine each timed 3 times in turn: the medians). With
--low-latency the dispatches also print "two engines in turn": the engine's call alternating
over the shape's two engines, as the adapter's dispatch -> dispatch does. --default-device runs
everything as DeepEP's tests do, after torch.set_default_dtype(torch.bfloat16) and
torch.set_default_device('cuda') (the second puts a Python function mode in front of every torch
call). --profile N: rank 0 also prints the 12 most costly functions (own time) of N adapter calls
of each case under cProfile. --deepep (with --low-latency): DeepEP's own deep_ep times its
low_latency_dispatch the same ways, for comparison. Needs PyTorch and a GPU per process;
NCCL_NVLS_ENABLE=0 is set.
"""

import os
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from deep_ep_common import back_to_back, decode_batch, finish, low_latency_buffer, parser  # noqa: E402

WARMUP, TIMED = 50, 50


AHEAD_CYCLES = 20_000_000  # ~10 ms of GPU clock: longer than the host takes to enqueue the timed calls


def event_mean(fn, ahead: bool = False):
    """DeepEP's bench: events around each call on the current stream, the mean in us; and the
    host's time per call of that loop (events included), in us. When the host's is not well
    below the events' mean, the device waited for the host: the figure then holds host time.
    ahead: the device first spins (torch.cuda._sleep) while the host enqueues every timed call,
    so that the events time the device's work alone."""
    torch.cuda.synchronize()
    for _ in range(WARMUP):
        fn()
    if ahead:
        torch.cuda.synchronize()
        torch.cuda._sleep(AHEAD_CYCLES)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(TIMED)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(TIMED)]
    t0 = time.perf_counter()
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)][1:]
    return sum(times) / len(times), (t1 - t0) * 1e6 / TIMED


def host_time(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(TIMED):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e6 / TIMED


PROFILE = 0  # --profile N


def profile(rank: int, name: str, fn) -> None:
    """N calls of fn under cProfile (every rank makes them); rank 0 prints the costliest functions."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(PROFILE):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    if rank == 0:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
        print(f"[rank 0] profile of {PROFILE} calls, {name}:\n{out.getvalue()}", flush=True)


ROUNDS = 3  # adapter and engine timed in turn this many times; the medians are reported


def median(values) -> float:
    """The median of ROUNDS figures."""
    return sorted(values)[ROUNDS // 2]


def report(rank: int, head: str, cases) -> None:
    """cases: (name, adapter, engine) or (name, adapter, engine, engines): `engines` is the engine's
    call alternating over the shape's two engines, as the adapter's dispatch -> dispatch does."""
    for name, adapter, engine, *alt in cases:
        calls = [adapter, engine] + alt
        # In turn, so that a drift of the machine (or of the peer's pace) falls on each alike.
        rounds = [[event_mean(fn) for fn in calls] + [event_mean(fn, True) for fn in calls[:2]]
                  for _ in range(ROUNDS)]
        us, loop = [[median(r[i][j] for r in rounds) for i in range(len(rounds[0]))] for j in (0, 1)]
        a, e, *two = us[:len(calls)]
        la, le = loop[0], loop[1]
        aa, ea = us[-2], us[-1]
        g, h, he = back_to_back(engine, TIMED), host_time(adapter), host_time(engine)
        if rank == 0:
            both = f", two engines in turn {two[0]:.1f} us (/ engine {two[0] / e:.3f})" if two else ""
            print(f"[rank 0] {head} {name}: adapter {a:.1f} us, engine {e:.1f} us{both}, host in the events' loop "
                  f"{la:.1f} us (engine's {le:.1f}), adapter / engine {a / e:.3f}; host ahead: adapter {aa:.1f} us, "
                  f"engine {ea:.1f} us, adapter / engine {aa / ea:.3f}; gpu {g:.1f} us, host {h:.1f} us (engine's "
                  f"{he:.1f})", flush=True)
        if PROFILE:
            profile(rank, f"{head} {name}", adapter)


def run_deepep_low_latency(rank: int, args) -> None:
    """--deepep: DeepEP's own low_latency_dispatch timed the same ways (no engine to compare with):
    what its Buffer costs the host per call, and whether its events' loop is host-bound too."""
    import deep_ep

    T, H, E, K, R = args.num_tokens, args.hidden, args.num_experts, args.num_topk, args.num_processes
    buffer = low_latency_buffer(deep_ep, T, H, R, E)
    x, topk_idx, _, _ = decode_batch(deep_ep, T, H, E, K, R)
    for name, fp8 in (("dispatch fp8", True), ("dispatch bf16", False)):
        def call():
            buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=fp8)

        rounds = [(event_mean(call), event_mean(call, True)) for _ in range(ROUNDS)]
        a, la = [median(r[0][j] for r in rounds) for j in (0, 1)]
        aa = median(r[1][0] for r in rounds)
        g, h = back_to_back(call, TIMED), host_time(call)
        if rank == 0:
            print(f"[rank 0] DeepEP low-latency T={T} H={H} E={E} K={K} {name}: events {a:.1f} us, host in the events' "
                  f"loop {la:.1f} us; host ahead {aa:.1f} us; gpu {g:.1f} us, host {h:.1f} us", flush=True)
    finish(buffer)


def run_low_latency(rank: int, args) -> None:
    """low_latency_dispatch / low_latency_combine against the engine's own calls."""
    import graphep.deep_ep as deep_ep
    from graphep._graphep import DispatchInput, IndexType

    T, H, E, K = args.num_tokens, args.hidden, args.num_experts, args.num_topk
    R = args.num_processes
    buffer = low_latency_buffer(deep_ep, T, H, R, E)
    x = torch.randn((T, H), dtype=torch.bfloat16, device="cuda")
    scores = torch.randn((T, E), dtype=torch.float32, device="cuda").abs() + 1
    topk_idx = torch.topk(scores, K, dim=-1, sorted=True)[1]
    topk_w = torch.rand((T, K), dtype=torch.float32, device="cuda")
    _, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)
    buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)  # uncombined: makes the shape's second engine
    y = torch.randn_like(buffer.get_next_low_latency_combine_buffer(handle))
    out = torch.empty((T, H), dtype=torch.bfloat16, device="cuda")
    st = handle.state
    core, stream = st.core, torch.cuda.current_stream()
    assert st.second is not None

    def engine_dispatch(fp8: bool, states=(st,)):
        turn = [0]

        def call():
            s = states[turn[0]]
            turn[0] = (turn[0] + 1) % len(states)
            s.core.dispatch(x.data_ptr(), topk_idx.data_ptr(), IndexType.INT64, 0, s.counts_ptr + 4 * T,
                            stream.cuda_stream, top_k=K,
                            input=DispatchInput.FP8_QUANTIZE if fp8 else DispatchInput.BF16)
        return call

    def engine_combine():
        core.combine(y.data_ptr(), out.data_ptr(), stream.cuda_stream, expert_output_rows=y.shape[0] * y.shape[1],
                     topk_weights=topk_w.data_ptr())

    def ll_dispatch(fp8: bool):
        def call():
            buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=fp8)
        return call

    report(rank, f"low-latency T={T} H={H} E={E} K={K}", [
        ("dispatch fp8", ll_dispatch(True), engine_dispatch(True), engine_dispatch(True, (st, st.second))),
        ("dispatch bf16", ll_dispatch(False), engine_dispatch(False), engine_dispatch(False, (st, st.second))),
    ])
    # low_latency_combine takes the handle of the shape's last dispatch.
    last = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)[2]

    def ll_combine():
        buffer.low_latency_combine(y, topk_idx, topk_w, last, out=out)

    report(rank, f"low-latency T={T} H={H} E={E} K={K}", [("combine bf16", ll_combine, engine_combine)])
    st_all = buffer.status()
    assert st_all.ok, st_all.describe()
    finish(buffer)


def run(local_rank: int, args) -> None:
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", world_size=args.num_processes,
                            rank=local_rank, device_id=torch.device("cuda", local_rank))
    torch.cuda.set_device(local_rank)
    global PROFILE
    PROFILE = args.profile
    if args.default_device:  # as DeepEP's tests/utils.py init_dist
        torch.set_default_dtype(torch.bfloat16)
        torch.set_default_device("cuda")
    if args.low_latency:
        (run_deepep_low_latency if args.deepep else run_low_latency)(dist.get_rank(), args)
        return
    import graphep.deep_ep as deep_ep
    from graphep._graphep import DispatchInput, IndexType

    rank = dist.get_rank()
    T, H, E, K = args.num_tokens, args.hidden, args.num_experts, args.num_topk
    torch.manual_seed(rank)
    buffer = deep_ep.Buffer(dist.group.WORLD, int(2e9), explicitly_destroy=True)
    x = torch.randn((T, H), dtype=torch.bfloat16, device="cuda")
    amax = x.float().abs().view(T, -1, 128).amax(-1).clamp(1e-4)
    x_fp8 = ((x.float().view(T, -1, 128) * (448.0 / amax.unsqueeze(-1))).to(torch.float8_e4m3fn).view(T, H),
             (amax / 448.0).T.contiguous().T)  # DeepEP's test passes its scales column-major
    scores = torch.randn((T, E), dtype=torch.float32, device="cuda").abs() + 1
    topk_idx = torch.topk(scores, K, dim=-1, sorted=False)[1]
    topk_w = torch.rand((T, K), dtype=torch.float32, device="cuda")
    config = deep_ep.Config(args.num_sms, 24, 256)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                      num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                                      topk_weights=topk_w, config=config)
    st = handle[5].state
    core, n, comm = st.engine._core, recv_x.shape[0], torch.cuda.current_stream()
    count = st.count_ptr(T)
    out_x = torch.empty((n, H), dtype=torch.bfloat16, device="cuda")
    out_x8 = torch.empty((n, H), dtype=torch.uint8, device="cuda")
    out_s = torch.empty((n, H // 128), dtype=torch.float32, device="cuda")
    combined = torch.empty((T, H), dtype=torch.bfloat16, device="cuda")
    combined_w = torch.empty((T, K), dtype=torch.float32, device="cuda")

    def engine_dispatch(fp8: bool):
        def call():
            kw = dict(input=DispatchInput.FP8, x_scales=x_fp8[1].data_ptr(), scale_token_stride=x_fp8[1].stride(0),
                      scale_hidden_stride=x_fp8[1].stride(1), out_recv_scales=out_s.data_ptr()) if fp8 else \
                dict(input=DispatchInput.BF16)
            core.dispatch((x_fp8[0] if fp8 else x).data_ptr(), 0, IndexType.INT64, 0,
                          count, comm.cuda_stream, top_k=0, token_in_rank=in_rank.data_ptr(),
                          out_recv_x=(out_x8 if fp8 else out_x).data_ptr(), out_rows=n, **kw)
        return call

    def engine_combine():
        core.combine(recv_x.data_ptr(), combined.data_ptr(), comm.cuda_stream, expert_output_rows=n,
                     row_values=recv_w.data_ptr(), out_values=combined_w.data_ptr(), num_values=K)

    cases = [
        ("dispatch bf16 (cached)", lambda: buffer.dispatch(x, handle=handle, config=config), engine_dispatch(False)),
        ("dispatch fp8 (cached)", lambda: buffer.dispatch(x_fp8, handle=handle, config=config), engine_dispatch(True)),
        ("combine bf16 (+ top-k weights)", lambda: buffer.combine(recv_x, handle, topk_weights=recv_w, config=config),
         engine_combine),
    ]
    report(rank, f"T={T} H={H} E={E} K={K} SMs={args.num_sms}", cases)
    st_all = buffer.status()
    assert st_all.ok, st_all.describe()
    finish(buffer)


if __name__ == "__main__":
    p = parser(__doc__, tokens=4096, experts=256, port=8371)
    p.add_argument("--num-sms", type=int, default=24)
    p.add_argument("--low-latency", action="store_true", help="the low-latency calls (T = --num-tokens)")
    p.add_argument("--default-device", action="store_true",
                   help="torch.set_default_device('cuda') and bf16 default dtype, as DeepEP's tests")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile N adapter calls of each case")
    args = p.parse_args()
    if args.deepep and not args.low_latency:
        p.error("--deepep times DeepEP's low-latency calls only: add --low-latency")
    torch.multiprocessing.spawn(run, args=(args,), nprocs=args.num_processes)
