"""How a Buffer treats torch tensors (both modes): the one check of every tensor it hands its
engines, DeepEP's id dtypes, the current stream's raw handle, and `as_extension`, which runs a
Buffer call as DeepEP's C++ extension sees torch.

A Buffer checks each tensor here, once, and calls its engine's core with the bare pointers; the
engine then checks only pointers and alignment."""

import functools

import torch

from graphep.engine import _INDEX_TYPES
from graphep.errors import invalid_argument

ID_TYPES = {torch.int64: _INDEX_TYPES["int64"], torch.int32: _INDEX_TYPES["int32"]}

# torch's switch for Python function modes and subclass overrides (private, present since torch
# 1.13); without it a Buffer call runs with them, only slower.
_DisableTorchFunction = getattr(torch._C, "DisableTorchFunction", None)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def as_extension(method):
    """Runs a Buffer method with torch's Python function modes and subclass overrides off, as
    DeepEP's C++ extension runs (its at:: calls never reach Python). DeepEP's tests call
    torch.set_default_device('cuda'), a function mode that puts a Python call in front of every
    torch call and attribute the method makes (a dozen or more per dispatch); with it off, they
    cost what they cost in a serving process. Every tensor the methods make names its device, so
    the default device is not needed inside."""
    if _DisableTorchFunction is None:
        return method

    @functools.wraps(method)
    def call(*args, **kwargs):
        with _DisableTorchFunction():
            return method(*args, **kwargs)

    return call


def current_raw_stream(device: int) -> int:
    """The current stream of cuda:`device` as a cudaStream_t (an int), without making a
    torch.cuda.Stream object."""
    if _raw_stream is not None:
        return _raw_stream(device)
    return torch.cuda.current_stream(device).cuda_stream


def check_tensor(t, name: str, dtypes, shape, device: int, contiguous: bool = True) -> None:
    """A torch tensor of one of `dtypes`, of `shape`, on cuda:`device`, contiguous unless told.
    Each property is read once on the way that passes (a low-latency call makes two to four of
    these checks ahead of its launch); a failure looks again to name what is wrong."""
    try:
        if (t.dtype in dtypes and t.shape == shape and t.get_device() == device
                and (not contiguous or t.is_contiguous()) and isinstance(t, torch.Tensor)):
            return
    except (AttributeError, TypeError):  # not a tensor: named below
        pass
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


def refuse_during_capture(what: str, engine: str, after: str = "") -> None:
    """Engines are made collectively with host syncs: refused by name while the current stream is
    being captured into a CUDA graph. `engine` describes the one needed; `after`, more to say."""
    if torch.cuda.is_current_stream_capturing():
        raise invalid_argument(f"{what}: it needs a new {engine}, which is made collectively with host syncs and "
                               "cannot be made during a CUDA graph capture: run the same calls once eagerly first "
                               f"(a warm-up step){after}")
