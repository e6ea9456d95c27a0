"""graphep.deep_ep's Config and the sizing rules behind a Buffer's engines (no PyTorch needed).

DeepEP's Config tunes its NVLink chunking (SMs, chunk sizes per channel). graphep tunes itself:
of a Config only num_sms is honoured, as the engines' MoeConfig.sm_budget (clamped to [1, 64]).
The chunk fields are kept, so code that builds and reads Configs runs unchanged.

A Buffer's engines (one per (hidden, num_experts), made on the first dispatch that needs one):

    MoeConfig(max_tokens_per_rank=T_max, hidden=H, num_experts=E, top_k=min(16, E),
              receive_layout=RANK_MAJOR, path=THROUGHPUT, dispatch_type=BF16, sm_budget=...)

T_max (max_tokens_per_rank below): GRAPHEP_DEEPEP_MAX_TOKENS when set, else the largest multiple
of 128, from 128 to 8,192, whose symmetric heap fits the Buffer's num_nvl_bytes (128 when none
does: the engine then takes what it needs, graphep.memory_requirements says how much).

The low-latency mode's engines (one per (num_max_dispatch_tokens_per_rank T, hidden, num_experts),
made by the Buffer's constructor for the shapes get_low_latency_rdma_size_hint was asked for, else
on the first low_latency_dispatch that needs one):

    MoeConfig(max_tokens_per_rank=T, hidden=H, num_experts=E, top_k=min(16, E, 4096 // T),
              receive_layout=BATCHED, rows_per_expert=world x T, path=LATENCY, dispatch_type=BF16,
              sm_budget=0)

DeepEP's [num_local_experts, world x T, hidden] receive buffer is the batched layout itself;
top_k is the most the latency path takes (T x top_k <= 4,096), each call passes its own; the SM
budget is the latency path's default (DeepEP's low-latency calls take no Config either).
"""

import math
from dataclasses import dataclass
from typing import Callable, Optional

from graphep import _graphep
from graphep.engine import memory_requirements
from graphep.errors import invalid_argument

MAX_TOKENS_ENV = "GRAPHEP_DEEPEP_MAX_TOKENS"
# The low-latency engines' SM budget (MoeConfig.sm_budget: the combine's send CTAs, the receive
# taking the SMs left; a dispatch sends and receives on all of them). DeepEP's low-latency kernels
# have no Config; unset or 0: graphep's default.
LOW_LATENCY_SMS_ENV = "GRAPHEP_DEEPEP_LL_SMS"
TOKENS_STEP = 128  # T_max from num_nvl_bytes is a multiple of this ...
TOKENS_CAP = 8192  # ... and at most this
MAX_TOP_K = 16  # graphep's kMoeMaxTopK: the engines' top_k is min(this, E)
MAX_LOCAL_EXPERTS = 1024  # graphep's kMoeMaxLocalExperts
HINT_TOKENS = 4096  # what Config.get_nvl_buffer_size_hint sizes for
LATENCY_SLOTS = 4096  # graphep's latency path: max_tokens_per_rank x top_k at most
MAX_SM_BUDGET = 64  # graphep's MoeConfig.sm_budget limit (Engine::validate)


@dataclass
class Config:
    """DeepEP's Config (positional order as DeepEP's). graphep honours num_sms only."""

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """num_nvl_bytes for a Buffer of `num_ranks` ranks whose tokens take `hidden_bytes` (bf16:
        2 x hidden): graphep's symmetric heap for 4,096 tokens per rank with the most experts
        (1,024 per rank) and top-k 16 (the largest count messages and records), so a Buffer sized
        by it gets T_max >= 4,096 for that hidden size and any expert count."""
        hidden = max(TOKENS_STEP, math.ceil(hidden_bytes / 2 / TOKENS_STEP) * TOKENS_STEP)
        heap = heap_bytes_for(hidden, MAX_LOCAL_EXPERTS * num_ranks, num_ranks, sm_budget(self.num_sms))
        return heap(HINT_TOKENS)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: graphep.deep_ep has no RDMA buffer (intranode only in this version)."""
        return 0


# DeepEP's recommended chunking per rank count (its Buffer.get_dispatch_config / get_combine_config):
# (nvl send, nvl recv, rdma send, rdma recv) chunk tokens. Any other rank count gets Config's defaults.
_DISPATCH_CHUNKS = {
    2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
    24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
    96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128),
}
_COMBINE_CHUNKS = {
    2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
    24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
    96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128),
}


def dispatch_config(num_ranks: int, num_sms: int) -> Config:
    return Config(num_sms, *_DISPATCH_CHUNKS.get(num_ranks, (6, 256, 6, 256)))


def combine_config(num_ranks: int, num_sms: int) -> Config:
    return Config(num_sms, *_COMBINE_CHUNKS.get(num_ranks, (6, 256, 6, 256)))


def sm_budget(num_sms: int) -> int:
    """Config.num_sms as MoeConfig.sm_budget: clamped to [1, 64]."""
    return min(max(int(num_sms), 1), MAX_SM_BUDGET)


def engine_config(max_tokens: int, hidden: int, num_experts: int, budget: int) -> _graphep.MoeConfig:
    """The MoeConfig of a Buffer's engine for (hidden, num_experts)."""
    return _graphep.MoeConfig(max_tokens_per_rank=max_tokens, hidden=hidden, num_experts=num_experts,
                              top_k=min(MAX_TOP_K, num_experts), receive_layout=_graphep.ReceiveLayout.RANK_MAJOR,
                              path=_graphep.MoePath.THROUGHPUT, dispatch_type=_graphep.DType.BF16, sm_budget=budget)


def heap_bytes_for(hidden: int, num_experts: int, world_size: int, budget: int) -> Callable[[int], int]:
    """T -> the symmetric heap bytes of that engine with max_tokens_per_rank T (no GPU needed)."""
    def heap(tokens: int) -> int:
        return memory_requirements(engine_config(tokens, hidden, num_experts, budget), world_size).symmetric_heap_bytes
    return heap


def max_tokens_per_rank(num_nvl_bytes: int, heap_bytes: Callable[[int], int], env: Optional[str] = None) -> int:
    """T_max of an engine: `env` (GRAPHEP_DEEPEP_MAX_TOKENS's value) when set, else the largest
    multiple of 128 from 128 to 8,192 with heap_bytes(T) <= num_nvl_bytes, else 128."""
    if env is not None and env.strip():
        try:
            tokens = int(env.strip())
        except ValueError:
            raise invalid_argument(f"{MAX_TOKENS_ENV}={env!r} is not an integer") from None
        if not 1 <= tokens <= (1 << 20):
            raise invalid_argument(f"{MAX_TOKENS_ENV}={tokens} is out of range [1, 1048576]")
        return tokens
    best = TOKENS_STEP
    for tokens in range(TOKENS_STEP, TOKENS_CAP + 1, TOKENS_STEP):
        if heap_bytes(tokens) <= num_nvl_bytes:
            best = tokens
    return best


def low_latency_sm_budget(env: Optional[str]) -> int:
    """GRAPHEP_DEEPEP_LL_SMS's value as MoeConfig.sm_budget: 0 (the engine's default) when unset."""
    if env is None or not env.strip():
        return 0
    try:
        budget = int(env.strip())
    except ValueError:
        raise invalid_argument(f"{LOW_LATENCY_SMS_ENV}={env!r} is not an integer") from None
    if not 0 <= budget <= MAX_SM_BUDGET:
        raise invalid_argument(f"{LOW_LATENCY_SMS_ENV}={budget} is out of range [0, {MAX_SM_BUDGET}] (the engines' "
                               f"sm_budget)")
    return budget


def low_latency_engine_config(max_tokens: int, hidden: int, num_experts: int, world_size: int,
                              budget: int = 0, shrink: bool = False) -> _graphep.MoeConfig:
    """The MoeConfig of a Buffer's low-latency engine for (T = max_tokens, hidden, num_experts);
    `shrink` (Buffer(enable_shrink=True)): a peer that times out is masked by the kernels."""
    top_k = max(1, min(MAX_TOP_K, num_experts, LATENCY_SLOTS // max(1, max_tokens)))
    return _graphep.MoeConfig(max_tokens_per_rank=max_tokens, hidden=hidden, num_experts=num_experts, top_k=top_k,
                              receive_layout=_graphep.ReceiveLayout.BATCHED, rows_per_expert=world_size * max_tokens,
                              path=_graphep.MoePath.LATENCY, dispatch_type=_graphep.DType.BF16, sm_budget=budget,
                              shrink_on_timeout=shrink)


def low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                               num_experts: int) -> int:
    """Buffer.get_low_latency_rdma_size_hint: the symmetric heap bytes per rank of the low-latency
    engine a Buffer makes for (T, hidden, num_experts) over num_ranks ranks (no GPU needed). Its
    private buffers (recv_x, expert outputs, ...) come on top: graphep.memory_requirements.
    graphep.Error names a configuration the latency path does not take."""
    for name, value in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank), ("hidden", hidden),
                        ("num_ranks", num_ranks), ("num_experts", num_experts)):
        if not isinstance(value, int) or value < 1:
            raise invalid_argument(f"get_low_latency_rdma_size_hint: {name}={value!r} is not a positive integer")
    cfg = low_latency_engine_config(num_max_dispatch_tokens_per_rank, hidden, num_experts, num_ranks)
    return memory_requirements(cfg, num_ranks).symmetric_heap_bytes
