"""Reference and checks for dispatch / combine on PyTorch (GPU tests only).

Every rank's inputs are fresh random tensors; the expected layout of rank q is built from them
directly: the rows of local expert j are the (source rank, token, slot) entries with
topk_idx == q * L + j among the live tokens, in that order (one row per slot, duplicates
included, -1 skipped). Each check returns its count of wrong elements.
"""

from dataclasses import dataclass
from typing import List

import torch

ROUTINGS = ("uniform", "masked", "duplicates")
POISON_BF16 = -3.0e38  # far outside any value a test writes


@dataclass
class RankInputs:
    x: torch.Tensor  # [T, H] bf16
    ids: torch.Tensor  # [T, K] int32 / int64
    weights: torch.Tensor  # [T, K] float32
    live: int
    num_tokens: torch.Tensor  # [1] int32 device


def make_inputs(device, T, H, E, K, routing, index_dtype, live, gen) -> RankInputs:
    x = torch.randn(T, H, generator=gen, device=device).to(torch.bfloat16)
    ids = torch.rand(T, E, generator=gen, device=device).argsort(dim=1)[:, :K]  # K distinct experts
    if routing == "masked":
        ids = torch.where(torch.rand(T, K, generator=gen, device=device) < 0.3, -1, ids)
    elif routing == "duplicates":
        dup = torch.rand(T, generator=gen, device=device) < 0.5
        ids[:, 1] = torch.where(dup, ids[:, 0], ids[:, 1])
    weights = torch.rand(T, K, generator=gen, device=device)
    count = torch.full((1,), live, dtype=torch.int32, device=device)
    return RankInputs(x, ids.to(index_dtype).contiguous(), weights, live, count)


def fp8_quantize(x):
    """The engine's e4m3 quantisation: scale = amax / 448 per 128 values (1 for an all-zero tile)."""
    rows, h = x.shape
    tiles = x.float().view(rows, h // 128, 128)
    amax = tiles.abs().amax(dim=-1)
    # True divisions, as the engine's: PyTorch turns a division by a Python scalar into a
    # multiplication by its rounded reciprocal, which differs in the last bit.
    floor = torch.full_like(amax, 448.0 * 2.0 ** -126)  # the engine's floor (bf16 subnormal tiles)
    scales = torch.where(amax > 0, torch.maximum(amax, floor) / torch.full_like(amax, 448.0),
                         torch.ones_like(amax))
    q = (tiles * (torch.ones_like(scales) / scales).unsqueeze(-1)).to(torch.float8_e4m3fn)
    return q.view(rows, h), scales


def expected_rows(inputs: List[RankInputs], q, L, device):
    """(src rank, token, slot, local expert) of rank q's received rows, in layout order."""
    T, K = inputs[0].ids.shape
    R = len(inputs)
    keys, srcs, toks, slots, experts = [], [], [], [], []
    for src, inp in enumerate(inputs):
        ids = inp.ids[: inp.live].long().to(device)
        mine = (ids >= q * L) & (ids < (q + 1) * L)
        t, k = torch.nonzero(mine, as_tuple=True)
        j = ids[t, k] - q * L
        keys.append(((j * R + src) * T + t) * K + k)
        srcs.append(torch.full_like(t, src)), toks.append(t), slots.append(k), experts.append(j)
    order = torch.cat(keys).argsort()
    return [torch.cat(v)[order] for v in (srcs, toks, slots, experts)]


def check_dispatch(layout, inputs: List[RankInputs], q, L, fp8, rows_per_expert=0) -> int:
    """Rank q's layout (expert_alignment 1). Expert-major (rows_per_expert 0): the rows packed by
    expert; rows whose place is at or past the capacity are dropped (the last rows of the last
    experts): offsets clamp to it. Batched: expert j's rows at j x rows_per_expert, its first
    rows_per_expert kept. Counts are the kept rows, expert_dropped the rest."""
    dev = layout.recv_x.device
    capacity = layout.recv_x.shape[0]
    src, tok, slot, j = expected_rows(inputs, q, L, dev)
    per_expert = torch.bincount(j, minlength=L)
    starts = torch.zeros(L + 1, dtype=torch.long, device=dev)
    starts[1:] = per_expert.cumsum(0)
    within = torch.arange(src.numel(), device=dev) - starts[j]  # each row's place in its expert's list
    if rows_per_expert > 0:
        offsets = torch.arange(L + 1, device=dev) * rows_per_expert
        pos = j * rows_per_expert + within
        kept = within < rows_per_expert
    else:
        offsets = starts.clamp(max=capacity)
        pos = torch.arange(src.numel(), device=dev)
        kept = pos < capacity
    counts = torch.bincount(j[kept], minlength=L)
    wrong = int((layout.expert_counts.long() != counts).sum())
    wrong += int((layout.expert_dropped.long() != per_expert - counts).sum())
    wrong += int((layout.expert_offsets.long() != offsets).sum())
    n = int(kept.sum())
    wrong += int(layout.num_recv_rows.item() != n)
    src, tok, slot, pos = src[kept], tok[kept], slot[kept], pos[kept]
    wrong += int((layout.row_src_rank[pos].long() != src).sum())
    wrong += int((layout.row_src_token[pos].long() != tok).sum())
    wrong += int((layout.row_topk_slot[pos].long() != slot).sum())
    xs = torch.stack([inputs[s].x.to(dev) for s in range(len(inputs))])[src, tok]
    ws = torch.stack([inputs[s].weights.to(dev) for s in range(len(inputs))])[src, tok, slot]
    wrong += int((layout.row_weight[pos] != ws).sum())
    if fp8:
        qx, scales = fp8_quantize(xs)
        wrong += int((layout.recv_x[pos].view(torch.uint8) != qx.view(torch.uint8)).sum())
        wrong += int((layout.recv_scales[pos] != scales).sum())
    else:
        wrong += int((layout.recv_x[pos].view(torch.int16) != xs.view(torch.int16)).sum())
    return wrong


def expert_rows(layout, L, fp8):
    """What the test's experts output for each received row: its input times (1 + j / 8), bf16."""
    x = layout.recv_x
    if fp8:
        rows, h = x.shape
        x = (x.float().view(rows, h // 128, 128) * layout.recv_scales.unsqueeze(-1)).view(rows, h)
    rows = torch.arange(x.shape[0], device=x.device)
    j = torch.searchsorted(layout.expert_offsets[1:].long(), rows, right=True).clamp(max=L - 1)
    return (x.float() * (1.0 + j.float() / 8).unsqueeze(-1)).to(torch.bfloat16)


def check_combine(out, inputs: List[RankInputs], r, L, fp8) -> int:
    """out of rank r against sum_k w_k y_k in fp64: within 2^-7 of sum_k |w_k y_k|; rows past the
    live count keep their poison."""
    inp = inputs[r]
    x = inp.x[: inp.live]
    if fp8:
        qx, scales = fp8_quantize(x)
        rows, h = x.shape
        x = (qx.float().view(rows, h // 128, 128) * scales.unsqueeze(-1)).view(rows, h)
    ids = inp.ids[: inp.live].long()
    w = inp.weights[: inp.live].double()
    ref = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    bound = torch.zeros_like(ref)
    for k in range(ids.shape[1]):
        valid = ids[:, k] >= 0
        j = (ids[:, k] % L).double()
        y = (x.float() * (1.0 + j.float() / 8).unsqueeze(-1)).to(torch.bfloat16).double()
        term = torch.where(valid.unsqueeze(-1), w[:, k : k + 1] * y, torch.zeros_like(y))
        ref += term
        bound += term.abs()
    got = out[: inp.live].double()
    wrong = int(((got - ref).abs() > bound * 2.0 ** -7 + 1e-6).sum())
    poison = torch.tensor(POISON_BF16, dtype=torch.bfloat16, device=out.device)
    wrong += int((out[inp.live :] != poison).sum())
    return wrong


# ---- the rank-major layout ------------------------------------------------------------------------

def expected_rank_rows(inputs: List[RankInputs], q, L, device):
    """Rank q's rank-major rows: (src, token) of each source token with a valid slot on q, sources
    and tokens in order; per row and slot, the local expert (-1: not on q) and weight (0)."""
    srcs, toks, exps, wts = [], [], [], []
    for src, inp in enumerate(inputs):
        ids = inp.ids[: inp.live].long().to(device)
        w = inp.weights[: inp.live].to(device)
        mine = (ids >= q * L) & (ids < (q + 1) * L)
        t = torch.nonzero(mine.any(dim=1)).flatten()
        srcs.append(torch.full_like(t, src)), toks.append(t)
        exps.append(torch.where(mine[t], ids[t] - q * L, torch.full_like(ids[t], -1)))
        wts.append(torch.where(mine[t], w[t], torch.zeros_like(w[t])))
    return [torch.cat(v) for v in (srcs, toks, exps, wts)], [int(v.numel()) for v in toks]


def check_rank_major(layout, extra, inputs: List[RankInputs], q, L, fp8) -> int:
    """Rank q's rank-major layout: rows, their metadata and slots, the source offsets, and the
    per-expert entry counts and offsets. `extra`: rank_offsets, row_experts, row_expert_weights."""
    dev = layout.recv_x.device
    (src, tok, exp, wt), per_source = expected_rank_rows(inputs, q, L, dev)
    n = src.numel()
    wrong = int(layout.num_recv_rows.item() != n)
    offsets = torch.tensor([0] + per_source, device=dev).cumsum(0)
    wrong += int((extra["rank_offsets"].long() != offsets).sum())
    if layout.num_recv_rows.item() != n:
        return wrong + n
    wrong += int((layout.row_src_rank[:n].long() != src).sum())
    wrong += int((layout.row_src_token[:n].long() != tok).sum())
    wrong += int((layout.row_topk_slot[:n] != -1).sum()) + int((layout.row_weight[:n] != 0).sum())
    wrong += int((extra["row_experts"][:n].long() != exp).sum())
    wrong += int((extra["row_expert_weights"][:n].view(torch.int32) != wt.view(torch.int32)).sum())
    counts = torch.bincount(exp[exp >= 0], minlength=L)
    starts = torch.zeros(L + 1, dtype=torch.long, device=dev)
    starts[1:] = counts.cumsum(0)
    wrong += int((layout.expert_counts.long() != counts).sum()) + int((layout.expert_dropped != 0).sum())
    wrong += int((layout.expert_offsets.long() != starts).sum())
    xs = torch.stack([inputs[s].x.to(dev) for s in range(len(inputs))])[src, tok]
    if fp8:
        qx, scales = fp8_quantize(xs)
        wrong += int((layout.recv_x[:n].view(torch.uint8) != qx.view(torch.uint8)).sum())
        wrong += int((layout.recv_scales[:n] != scales).sum())
    else:
        wrong += int((layout.recv_x[:n].view(torch.int16) != xs.view(torch.int16)).sum())
    return wrong


def rank_major_rows(layout, extra, fp8):
    """The test's experts in the rank-major layout: each row's output is the sum over its local
    slots of weight x (its input times (1 + j / 8), bf16), in fp32, then bf16."""
    x = layout.recv_x
    if fp8:
        rows, h = x.shape
        x = (x.float().view(rows, h // 128, 128) * layout.recv_scales.unsqueeze(-1)).view(rows, h)
    x = x.float()
    experts, weights = extra["row_experts"].long(), extra["row_expert_weights"]
    acc = torch.zeros_like(x)
    for k in range(experts.shape[1]):
        here = (experts[:, k] >= 0).unsqueeze(-1)
        y = (x * (1.0 + experts[:, k].clamp(min=0).float() / 8).unsqueeze(-1)).to(torch.bfloat16).float()
        acc = torch.where(here, acc + weights[:, k].unsqueeze(-1) * y, acc)
    return acc.to(torch.bfloat16)
