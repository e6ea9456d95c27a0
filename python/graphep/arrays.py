"""GPU arrays in and out, for any framework.

In: `describe` reads an array's data pointer, shape, strides, dtype and device (PyTorch tensors
through their attributes, without importing PyTorch; anything else through DLPack, asked not to
synchronise, or `__cuda_array_interface__`), and `require_matrix` / `require_scalar` are the one
place arrays are checked; errors name the argument and the bad value.

Out: `DeviceArray` is a zero-copy view of engine-owned memory that exports itself through DLPack
and `__cuda_array_interface__`; it (and anything made from it) keeps the engine alive.
"""

import sys
from typing import NamedTuple, Optional, Sequence, Tuple

from graphep import _graphep
from graphep.errors import Error, invalid_argument

# DLPack device types.
_CPU, _CUDA, _CUDA_HOST, _CUDA_MANAGED = 1, 2, 3, 13


class ArrayInfo(NamedTuple):
    ptr: int
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]  # in elements
    dtype: str  # "bfloat16", "float32", "int32", "int64", "uint8", "float8_e4m3fn", ...
    device_type: int  # DLPack device type
    device: int


def _torch_info(t) -> ArrayInfo:
    dtype = str(t.dtype)[6:]  # "torch.bfloat16" -> "bfloat16"
    return ArrayInfo(t.data_ptr(), tuple(t.shape), tuple(t.stride()), dtype, _CUDA if t.is_cuda else _CPU,
                     t.get_device())


_TYPESTR_KINDS = {"f": "float", "i": "int", "u": "uint", "b": "bool"}


def _cai_info(cai: dict, name: str) -> ArrayInfo:
    typestr = cai["typestr"]
    kind = _TYPESTR_KINDS.get(typestr[1])
    if kind is None:
        raise invalid_argument(f"{name} has __cuda_array_interface__ typestr {typestr!r}, which names no "
                               "numeric type (bfloat16 arrays must come through DLPack)")
    itemsize = int(typestr[2:])
    if itemsize > 1 and typestr[0] not in ("=", "<" if sys.byteorder == "little" else ">"):
        raise invalid_argument(f"{name} has __cuda_array_interface__ typestr {typestr!r}, whose byte order is not "
                               "this machine's")
    dtype = f"{kind}{8 * itemsize}"
    shape = tuple(cai["shape"])
    if cai.get("strides") is None:
        strides, step = [], 1
        for extent in reversed(shape):
            strides.insert(0, step)
            step *= extent
        strides = tuple(strides)
    else:
        byte_strides = tuple(cai["strides"])
        if any(b % itemsize for b in byte_strides):
            raise invalid_argument(f"{name} has __cuda_array_interface__ strides {list(byte_strides)} (bytes), not "
                                   f"multiples of its {itemsize}-byte elements")
        strides = tuple(b // itemsize for b in byte_strides)
    ptr = cai["data"][0]
    device = _graphep.pointer_device(ptr) if ptr else -1
    return ArrayInfo(ptr, shape, strides, dtype, _CUDA, device)


def describe(array, name: str) -> ArrayInfo:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(array, torch.Tensor):
        return _torch_info(array)
    if hasattr(array, "__dlpack__"):
        try:
            return ArrayInfo(*_graphep.dlpack_info(array))
        except (TypeError, BufferError) as e:
            raise invalid_argument(f"{name}: its DLPack export failed ({type(e).__name__}: {e})") from None
        except Error as e:
            raise invalid_argument(f"{name}: {e.message}") from None
    cai = getattr(array, "__cuda_array_interface__", None)
    if cai is not None:
        return _cai_info(cai, name)
    raise invalid_argument(f"{name} is a {type(array).__name__}, not a GPU array (DLPack or "
                           "__cuda_array_interface__)")


def _require_on(info: ArrayInfo, name: str, device: int) -> None:
    if info.device_type not in (_CUDA, _CUDA_MANAGED):
        where = "the CPU" if info.device_type == _CPU else f"DLPack device type {info.device_type}"
        raise invalid_argument(f"{name} is on {where}; graphep needs it on GPU {device}")
    if info.device_type == _CUDA and info.device != device:
        raise invalid_argument(f"{name} is on GPU {info.device}, but this rank runs on GPU {device}")


def require_matrix(info: ArrayInfo, name: str, *, cols: int, dtypes: Sequence[str], device: int,
                   max_rows: Optional[int] = None, rows: Optional[int] = None) -> int:
    """Checks a row-major [rows, cols] array and returns its row count."""
    _require_on(info, name, device)
    if info.dtype not in dtypes:
        raise invalid_argument(f"{name} has dtype {info.dtype}, expected {' or '.join(dtypes)}")
    if len(info.shape) != 2 or info.shape[1] != cols:
        raise invalid_argument(f"{name} has shape {list(info.shape)}, expected [rows, {cols}]")
    n = info.shape[0]
    if rows is not None and n != rows:
        raise invalid_argument(f"{name} has {n} rows, expected {rows}")
    if max_rows is not None and not 1 <= n <= max_rows:
        raise invalid_argument(f"{name} has {n} rows, expected 1 to {max_rows} (max_tokens_per_rank)")
    if (n > 1 and info.strides[0] != cols) or (cols > 1 and info.strides[1] != 1):
        raise invalid_argument(f"{name} has strides {list(info.strides)}, expected row-major [{cols}, 1] "
                               "(pass a contiguous array)")
    return n


def require_scalar(info: ArrayInfo, name: str, *, dtype: str, device: int) -> None:
    """Checks a one-element device array (shape [] or [1])."""
    _require_on(info, name, device)
    if info.dtype != dtype:
        raise invalid_argument(f"{name} has dtype {info.dtype}, expected {dtype}")
    if info.shape not in ((), (1,)):
        raise invalid_argument(f"{name} has shape {list(info.shape)}, expected a device scalar ([] or [1])")


def stream_handle(stream) -> int:
    """A cudaStream_t as an int, from an int or a stream object (__cuda_stream__, .cuda_stream, .ptr)."""
    if type(stream) is int:
        return stream
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        return int(protocol()[1])
    for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        handle = getattr(stream, attr, None)
        if isinstance(handle, int):
            return handle
    raise invalid_argument(f"stream is a {type(stream).__name__}; pass a cudaStream_t as an int or a stream "
                           "object (torch.cuda.Stream, cupy.cuda.Stream, __cuda_stream__)")


# __cuda_array_interface__ typestrs of the dtypes engine views have (bfloat16 has no numeric one:
# it goes as 2 opaque bytes; use DLPack to keep its type).
_TYPESTRS = {"bfloat16": "<V2", "float32": "<f4", "int32": "<i4", "int64": "<i8", "uint8": "|u1"}


class DeviceArray:
    """A zero-copy view of engine-owned GPU memory.

    Convert it with your framework's from_dlpack (torch.from_dlpack(view), cupy.from_dlpack(view),
    jax.dlpack.from_dlpack(view)) or through `__cuda_array_interface__`. The view, and whatever
    is made from it, keeps the engine alive. Its contents are those of the last dispatch.
    """

    __slots__ = ("_nd", "ptr", "shape", "dtype", "device")

    def __init__(self, nd):
        self._nd = nd  # nanobind ndarray whose owner is the engine
        info = ArrayInfo(*_graphep.dlpack_info(nd))
        self.ptr, self.shape, self.dtype, self.device = info.ptr, info.shape, info.dtype, info.device

    def __dlpack__(self, **kwargs):
        return self._nd.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._nd.__dlpack_device__()

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"version": 3, "shape": self.shape, "typestr": _TYPESTRS[self.dtype], "data": (self.ptr, False),
                "strides": None, "stream": None}

    def __repr__(self) -> str:
        return f"DeviceArray(shape={list(self.shape)}, dtype={self.dtype}, device=cuda:{self.device})"
