"""The one check of every tensor a Buffer hands its engines (both modes), and DeepEP's id dtypes.

A Buffer checks each tensor here, once, and calls its engine's core with the bare pointers; the
engine then checks only pointers and alignment."""

import torch

from graphep.engine import _INDEX_TYPES
from graphep.errors import invalid_argument

ID_TYPES = {torch.int64: _INDEX_TYPES["int64"], torch.int32: _INDEX_TYPES["int32"]}


def check_tensor(t, name: str, dtypes, shape, device: int, contiguous: bool = True) -> None:
    """A torch tensor of one of `dtypes`, of `shape`, on cuda:`device`, contiguous unless told."""
    if not isinstance(t, torch.Tensor):
        raise invalid_argument(f"{name} is a {type(t).__name__}, expected a torch.Tensor")
    if t.dtype not in dtypes:
        raise invalid_argument(f"{name} has dtype {t.dtype}, expected {' or '.join(str(d) for d in dtypes)}")
    if tuple(t.shape) != tuple(shape):
        raise invalid_argument(f"{name} has shape {list(t.shape)}, expected {list(shape)}")
    if not t.is_cuda or t.get_device() != device:
        raise invalid_argument(f"{name} is on {t.device}, expected cuda:{device}")
    if contiguous and not t.is_contiguous():
        raise invalid_argument(f"{name} is not contiguous (strides {list(t.stride())})")
