"""CPU: the package imports without PyTorch or a GPU, its version is the CMake project's, configs
are validated with the bad field named in Python's spelling, the static memory query answers
before anything is allocated, and every failure is a graphep.Error carrying its status."""

import re
import sys
from pathlib import Path

import pytest

import graphep
from conftest import GPUS


def good(**changes):
    fields = dict(max_tokens_per_rank=128, hidden=7168, num_experts=256, top_k=8)
    fields.update(changes)
    return graphep.MoeConfig(**fields)


def test_imports_without_pytorch_loaded():
    # graphep (not graphep.torch) must never import PyTorch: one wheel for every PyTorch version.
    import subprocess

    code = "import sys, graphep; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_version_is_the_cmake_project_version():
    cmake = (Path(__file__).resolve().parents[2] / "CMakeLists.txt").read_text()
    version = re.search(r"project\(graphep VERSION (\S+)", cmake).group(1)
    assert graphep.__version__ == version


def test_config_fields_round_trip_in_python_spelling():
    c = good(dispatch_type=graphep.DType.FP8_E4M3, recv_capacity=4096, expert_alignment=64, sm_budget=24,
             path=graphep.MoePath.THROUGHPUT, epilogue_sms=100)
    assert (c.max_tokens_per_rank, c.hidden, c.num_experts, c.top_k) == (128, 7168, 256, 8)
    assert (c.recv_capacity, c.expert_alignment, c.sm_budget, c.epilogue_sms) == (4096, 64, 24, 100)
    assert "epilogue_sms=100" in repr(c)
    assert c.dispatch_type == graphep.DType.FP8_E4M3 and c.path == graphep.MoePath.THROUGHPUT
    assert "expert_alignment=64" in repr(c)
    with pytest.raises(TypeError):
        graphep.MoeConfig(hiden=7168)  # a misspelt field is refused, not ignored


@pytest.mark.parametrize("changes, world, needle", [
    (dict(hidden=7004), 8, "MoeConfig.hidden=7004 is not a positive multiple of 8"),
    (dict(hidden=7176, dispatch_type=graphep.DType.FP8_E4M3), 8, "MoeConfig.hidden=7176 is not a multiple of 128"),
    (dict(max_tokens_per_rank=0), 8, "MoeConfig.max_tokens_per_rank=0 is out of range"),
    (dict(num_experts=250), 8, "MoeConfig.num_experts=250 is not divisible by the 8 ranks"),
    (dict(top_k=17), 8, "MoeConfig.top_k=17 exceeds the supported 16"),
    (dict(expert_alignment=0), 8, "MoeConfig.expert_alignment=0 is out of range"),
    (dict(sm_budget=65), 8, "MoeConfig.sm_budget=65 is out of range"),
    (dict(epilogue_sms=-1), 8, "MoeConfig.epilogue_sms=-1 is out of range"),
    (dict(recv_capacity=-1), 8, "MoeConfig.recv_capacity=-1 is negative"),
    (dict(max_tokens_per_rank=512, path=graphep.MoePath.LATENCY), 8, "MoeConfig.path=kLatency needs"),
    (dict(), 33, "world size 33 is out of range"),
])
def test_validation_names_the_field(changes, world, needle):
    with pytest.raises(graphep.Error) as e:
        graphep.validate(good(**changes), world)
    assert e.value.status == graphep.Status.INVALID_ARGUMENT
    assert needle in e.value.message
    assert str(e.value).startswith("INVALID_ARGUMENT: ")


def test_memory_query_needs_no_gpu_and_picks_the_path():
    latency = graphep.memory_requirements(good(), 8)
    assert latency.path == graphep.MoePath.LATENCY and latency.nccl_staging_bytes == 0
    assert latency.symmetric_heap_bytes > 0 and latency.private_bytes > 0
    throughput = graphep.memory_requirements(good(path=graphep.MoePath.THROUGHPUT), 8)
    assert throughput.path == graphep.MoePath.THROUGHPUT
    # No NCCL staging: NCCL moves the exchanges' fixed slots in place.
    assert throughput.nccl_staging_bytes == 0
    assert graphep.memory_requirements(good(max_tokens_per_rank=512), 8).path == graphep.MoePath.THROUGHPUT


@pytest.mark.parametrize("dtype, row_bytes", [
    # recv_x, the fp8 scales (a bf16 engine keeps them too, for its fp8 dispatches), 4 metadata
    # words, the bf16 expert output
    (graphep.DType.BF16, 2 * 7168 + 7168 // 128 * 4 + 16 + 2 * 7168),
    (graphep.DType.FP8_E4M3, 7168 + 7168 // 128 * 4 + 16 + 2 * 7168),  # e4m3 bytes instead
])
def test_memory_query_private_bytes_grow_by_the_receive_rows(dtype, row_bytes):
    small = graphep.memory_requirements(good(dispatch_type=dtype, recv_capacity=1000), 8).private_bytes
    large = graphep.memory_requirements(good(dispatch_type=dtype, recv_capacity=3000), 8).private_bytes
    assert abs((large - small) - 2000 * row_bytes) <= 7 * 256  # one 256-byte alignment per region


def test_memory_query_raises_on_a_bad_config():
    with pytest.raises(graphep.Error, match="MoeConfig.top_k=0 is not positive"):
        graphep.memory_requirements(good(top_k=0), 8)


def test_worst_case_capacity():
    # T_max x R x min(K, E / R) rows plus the alignment padding of each local expert.
    assert graphep.worst_case_capacity(good(), 8) == 128 * 8 * 8
    assert graphep.worst_case_capacity(good(expert_alignment=16), 8) == 128 * 8 * 8 + 32 * 15
    assert graphep.worst_case_capacity(good(num_experts=16), 8) == 128 * 8 * 2


def test_receive_layout_names_what_is_not_built():
    assert graphep.layouts.receive_layout("expert_major") is graphep.ReceiveLayout.EXPERT_MAJOR
    assert graphep.layouts.receive_layout("batched") is graphep.ReceiveLayout.BATCHED
    assert graphep.layouts.receive_layout("rank_major") is graphep.ReceiveLayout.RANK_MAJOR
    with pytest.raises(graphep.Error) as e:
        graphep.layouts.receive_layout("ragged")
    assert e.value.status == graphep.Status.NOT_SUPPORTED and "layout='ragged'" in e.value.message


def test_batched_config_and_its_memory():
    c = good(receive_layout=graphep.ReceiveLayout.BATCHED, rows_per_expert=40)
    assert c.receive_layout == graphep.ReceiveLayout.BATCHED and c.rows_per_expert == 40
    assert "receive_layout=BATCHED" in repr(c) and "rows_per_expert=40" in repr(c)
    smaller = good(receive_layout=graphep.ReceiveLayout.BATCHED, rows_per_expert=20)
    assert graphep.memory_requirements(smaller, 8).private_bytes < graphep.memory_requirements(c, 8).private_bytes
    with pytest.raises(graphep.Error) as e:
        graphep.validate(good(receive_layout=graphep.ReceiveLayout.BATCHED, recv_capacity=100), 8)
    assert "MoeConfig.recv_capacity=100: the batched layout" in e.value.message


def test_nccl_unique_id_round_trip_is_checked():
    uid = graphep.Group.nccl_unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128
    with pytest.raises(graphep.Error, match="nccl unique id has 5 bytes, expected 128"):
        graphep.Group.from_nccl_unique_id(b"short", 2, 0, 0)


@pytest.mark.skipif(GPUS > 0, reason="checks the error a machine without a GPU gives")
def test_no_gpu_is_a_graphep_error():
    with pytest.raises(graphep.Error) as e:
        graphep.Group.local([0, 0])
    assert e.value.status in (graphep.Status.NO_DEVICE, graphep.Status.CUDA_ERROR)
    assert e.value.message


def test_mpi_support_is_reported():
    assert graphep.Group.mpi_supported() in (True, False)


def test_error_messages_get_python_spelling():
    assert graphep._graphep._python_spelling("MoeConfig.maxTokensPerRank=0 is out of range") == \
        "MoeConfig.max_tokens_per_rank=0 is out of range"


def test_engine_views_export_through_dlpack_and_keep_their_owner():
    # The engine's views are made by the same code over device memory (engine.cpp view()); this
    # probe views 4 host int32 values. A bare "dltensor" capsule here (what nanobind returns for an
    # ndarray without a framework tag) would fail DeviceArray and every from_dlpack.
    import gc
    import weakref

    class Owner:
        pass

    owner = Owner()
    alive = weakref.ref(owner)
    view = graphep.DeviceArray(graphep._graphep._view_probe(owner))
    assert (view.shape, view.dtype) == ((4,), "int32")
    assert view.__dlpack_device__() == (1, 0)
    del owner
    gc.collect()
    assert alive() is not None  # the view holds its owner
    np = pytest.importorskip("numpy", reason="numpy is not installed")
    for _ in range(2):  # each export is a fresh capsule
        a = np.from_dlpack(view)
        assert a.tolist() == [3, 1, 4, 1] and a.ctypes.data == view.ptr
    del view, a
    gc.collect()
    assert alive() is None


def test_type_information_ships_with_the_package():
    """PEP 561: py.typed and the extension's stub (nanobind's stubgen at build time), which declares
    the compiled core's classes and their run-path methods."""
    package = Path(graphep.__file__).parent
    assert (package / "py.typed").is_file()
    stub = (package / "_graphep.pyi").read_text()
    for declaration in ("class EngineCore", "def dispatch(", "def combine(", "def receive(", "class Fp8Scales",
                        "class MoeHalf", "class MoeConfig"):
        assert declaration in stub, f"_graphep.pyi lacks {declaration!r}"


def test_rank_masks_are_checked_by_name():
    from graphep.engine import _rank_mask

    assert _rank_mask(0b101, 4) == 5 and _rank_mask([0, 2], 4) == 5 and _rank_mask((r for r in [3]), 4) == 8

    class IndexLike:  # a NumPy integer or an integer 0-d tensor: an int through __index__
        def __index__(self):
            return 1

    assert _rank_mask([IndexLike()], 4) == 2 and _rank_mask(IndexLike(), 4) == 1  # a rank, or a mask
    for ranks, needle in [([4], "rank 4 is outside [0, 4)"), ([-1], "rank -1 is outside [0, 4)"),
                          ([0.9], "rank 0.9 is a float, not an int"), ([True], "rank True is a bool, not an int"),
                          (True, "ranks=True: pass an int mask or the ranks, not a bool"),
                          (-1, "ranks=-0x1 is not a 32-bit mask"), (1 << 32, "ranks=0x100000000 is not a 32-bit mask"),
                          (None, "ranks is a NoneType")]:
        with pytest.raises(graphep.Error) as e:
            _rank_mask(ranks, 4)
        assert e.value.status == graphep.Status.INVALID_ARGUMENT and needle in e.value.message, e.value.message


def test_config_ints_past_their_field_are_named():
    c = good(counter_start=2**32 - 1)
    assert c.counter_start == 2**32 - 1
    for changes, needle in [(dict(hidden=2**31), "MoeConfig.hidden=2147483648 does not fit its 32-bit field"),
                            (dict(top_k=-2**40), "MoeConfig.top_k=-1099511627776 does not fit"),
                            (dict(counter_start=-1), "MoeConfig.counter_start=-1 does not fit")]:
        with pytest.raises(graphep.Error) as e:
            good(**changes)
        assert e.value.status == graphep.Status.INVALID_ARGUMENT and needle in e.value.message, e.value.message
    with pytest.raises(graphep.Error) as e:
        c.sm_budget = 2**33
    assert "MoeConfig.sm_budget=8589934592 does not fit" in e.value.message
    c.sm_budget = 32
    assert c.sm_budget == 32

