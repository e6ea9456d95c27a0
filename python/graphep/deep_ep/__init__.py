"""graphep.deep_ep: DeepEP V1's Python API (deep_ep.Buffer, Config, EventOverlap, topk_idx_t) on graphep.

    import graphep.deep_ep as deep_ep                     # in place of `import deep_ep`
    buffer = deep_ep.Buffer(group, num_nvl_bytes=int(2e9))
    ... buffer.get_dispatch_layout / dispatch / combine, as with DeepEP ...

The normal (intranode) mode: dispatch and combine over the GPUs of one node, with DeepEP's
arguments, results, receive order, streams and events; DeepEP's own tests/test_intranode.py
runs against it (tests/compat). The low-latency mode (Buffer(..., low_latency_mode=True),
low_latency_dispatch / low_latency_combine, the receive hooks) on graphep's latency path, on one
node; DeepEP's tests/test_low_latency.py runs against it. What graphep does differently: docs in
graphep/deep_ep/buffer.py, low_latency.py and config.py, and README "Serving stacks: DeepEP's API
on graphep". Internode groups and LogFMT raise graphep.Error NOT_SUPPORTED naming what is missing
(they come later); shrink mode maps the mask buffer onto the engines' active-rank mask.

Config and EventOverlap need no PyTorch; Buffer and topk_idx_t import it on first use.
"""

from graphep.deep_ep.config import Config
from graphep.deep_ep.events import EventOverlap

_NEEDS_TORCH = ("Buffer", "topk_idx_t")


def __getattr__(name: str):
    if name in _NEEDS_TORCH:
        try:
            import torch  # noqa: F401
        except ImportError as e:  # pragma: no cover - exercised where PyTorch is missing
            raise ImportError(f"graphep.deep_ep.{name} needs PyTorch (graphep itself does not): "
                              "pip install torch") from e
        from graphep.deep_ep import buffer

        return getattr(buffer, name)
    raise AttributeError(f"module 'graphep.deep_ep' has no attribute {name!r}")


__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]
