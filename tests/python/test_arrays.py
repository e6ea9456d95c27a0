"""CPU: the one place arrays are checked names the argument and the bad value."""

import ctypes

import pytest

import graphep
from graphep.arrays import ArrayInfo, describe, require_matrix, require_scalar, stream_handle

CUDA = 2


def info(shape, dtype="bfloat16", device=0, strides=None, device_type=CUDA):
    if strides is None:
        strides = (shape[1], 1) if len(shape) == 2 else (1,) * len(shape)
    return ArrayInfo(0x1000, tuple(shape), tuple(strides), dtype, device_type, device)


def expect(message, fn, *args, **kwargs):
    with pytest.raises(graphep.Error) as e:
        fn(*args, **kwargs)
    assert e.value.status == graphep.Status.INVALID_ARGUMENT
    assert message in e.value.message, e.value.message


def test_a_good_matrix_returns_its_rows():
    assert require_matrix(info((7, 64)), "x", cols=64, dtypes=("bfloat16",), device=0, max_rows=8) == 7


def test_matrix_errors_name_the_value():
    m = dict(cols=64, dtypes=("bfloat16",), device=0)
    expect("x has dtype float16, expected bfloat16", require_matrix, info((4, 64), "float16"), "x", **m)
    expect("x has shape [4, 32], expected [rows, 64]", require_matrix, info((4, 32)), "x", **m)
    expect("x has shape [256], expected [rows, 64]", require_matrix, info((256,)), "x", **m)
    expect("x has 9 rows, expected 1 to 8", require_matrix, info((9, 64)), "x", max_rows=8, **m)
    expect("topk_idx has 3 rows, expected 4", require_matrix, info((3, 64)), "topk_idx", rows=4, **m)
    expect("x has strides [128, 1], expected row-major [64, 1]", require_matrix,
           info((4, 64), strides=(128, 1)), "x", **m)
    expect("x is on GPU 1, but this rank runs on GPU 0", require_matrix, info((4, 64), device=1), "x", **m)
    expect("x is on the CPU; graphep needs it on GPU 0", require_matrix, info((4, 64), device_type=1), "x", **m)


def test_scalar_errors_name_the_value():
    require_scalar(info((1,), "int32"), "num_tokens", dtype="int32", device=0)
    require_scalar(info((), "int32"), "num_tokens", dtype="int32", device=0)
    expect("num_tokens has dtype int64, expected int32", require_scalar, info((1,), "int64"), "num_tokens",
           dtype="int32", device=0)
    expect("num_tokens has shape [2], expected a device scalar", require_scalar, info((2,), "int32"),
           "num_tokens", dtype="int32", device=0)


def test_host_arrays_are_refused_by_name():
    np = pytest.importorskip("numpy", reason="numpy is not installed")
    a = np.zeros((4, 64), dtype=np.float32)
    described = describe(a, "topk_weights")
    assert described.shape == (4, 64) and described.dtype == "float32" and described.device_type == 1
    expect("topk_weights is on the CPU", require_matrix, described, "topk_weights", cols=64,
           dtypes=("float32",), device=0)


def test_non_arrays_are_refused_by_name():
    expect("x is a list, not a GPU array", describe, [1, 2, 3], "x")


def test_cuda_array_interface_without_a_numeric_type():
    class Opaque:
        __cuda_array_interface__ = {"shape": (4, 64), "typestr": "<V2", "data": (0, False), "version": 3}

    expect("x has __cuda_array_interface__ typestr '<V2'", describe, Opaque(), "x")


def test_cuda_array_interface_strides_and_byte_order():
    def cai(**fields):
        class Exported:
            __cuda_array_interface__ = dict({"shape": (4, 8), "typestr": "<f4", "data": (0, False), "version": 3},
                                            **fields)
        return Exported()

    m = dict(cols=8, dtypes=("float32",), device=-1)
    assert require_matrix(describe(cai(strides=(32, 4)), "w"), "w", **m) == 4
    # Byte strides that split an element are refused, not rounded down to a row-major layout.
    expect("w has __cuda_array_interface__ strides [34, 4] (bytes), not multiples of its 4-byte elements",
           describe, cai(strides=(34, 4)), "w")
    expect("strides [32, 5] (bytes)", describe, cai(strides=(32, 5)), "w")
    expect("w has __cuda_array_interface__ typestr '>f4', whose byte order is not this machine's", describe,
           cai(typestr=">f4"), "w")


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLPackLike:
    """A DLPack producer built by hand (no NumPy here): its capsule's tensor, kept alive by the object."""

    def __init__(self, shape, code, bits, device_type=CUDA, data=0x1000):
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.tensor = _DLManagedTensor(_DLTensor(data, _DLDevice(device_type, 0), len(shape),
                                                 _DLDataType(code, bits, 1), self.shape, None, 0), None, None)

    def __dlpack__(self, stream=None):
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self.tensor), b"dltensor", None)


def test_dlpack_dtypes_and_export_failures():
    a = describe(DLPackLike((4, 2), code=6, bits=8), "token_in_rank")  # DLPack's bool: CuPy's, JAX's
    assert (a.dtype, a.shape, a.strides, a.ptr) == ("bool", (4, 2), (2, 1), 0x1000)
    assert describe(DLPackLike((3,), code=0, bits=32), "n").dtype == "int32"
    assert describe(DLPackLike((3,), code=4, bits=16), "x").dtype == "bfloat16"

    class Refuses:
        def __dlpack__(self, stream=None):
            raise BufferError("the array is read-only")

    expect("x: its DLPack export failed (BufferError: the array is read-only)", describe, Refuses(), "x")

    class NotACapsule:
        def __dlpack__(self, stream=None):
            return 42

    expect("x: the array does not export a DLPack tensor", describe, NotACapsule(), "x")


def test_streams_from_ints_and_stream_objects():
    class TorchLike:
        cuda_stream = 1234

    class Protocol:
        def __cuda_stream__(self):
            return (0, 5678)

    assert stream_handle(0) == 0 and stream_handle(TorchLike()) == 1234 and stream_handle(Protocol()) == 5678
    expect("stream is a str", stream_handle, "default")
