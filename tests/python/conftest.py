"""Shared by the graphep Python tests: what the machine has, and the skips that say so.

CPU tests run everywhere; GPU tests skip without enough GPUs and PyTorch tests without PyTorch,
each with its reason (pytest -rs prints them). graphep itself must import: a missing or broken
extension is a failure, never a skip.
"""

import importlib.util
import os

import pytest

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off wherever these tests run

import graphep  # noqa: E402

HAVE_TORCH = importlib.util.find_spec("torch") is not None
GPUS, NO_GPU_REASON = graphep._graphep.cuda_device_count()


def expect_error(status, needle, fn, *args, **kwargs):
    """fn(*args, **kwargs) raises graphep.Error with `status` and a message containing `needle`."""
    with pytest.raises(graphep.Error) as e:
        fn(*args, **kwargs)
    assert e.value.status == status, e.value
    assert needle in e.value.message, e.value.message
    return e.value


def requires_gpus(n: int):
    why = f"needs {n} GPU(s), found {GPUS}" + (f" ({NO_GPU_REASON})" if NO_GPU_REASON else "")
    return pytest.mark.skipif(GPUS < n, reason=why)


# Tests left out of the fast tier (GRAPHEP_TIER=fast, scripts/gpu-check.sh): deselected there, not
# skipped, so the tier's run reports no skip for them; every other run includes them.
full_tier = pytest.mark.full_tier


def pytest_configure(config):
    config.addinivalue_line("markers", "full_tier: left out of the fast tier (GRAPHEP_TIER=fast)")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("GRAPHEP_TIER") != "fast":
        return
    kept = [item for item in items if item.get_closest_marker("full_tier") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("full_tier")])
        items[:] = kept


requires_torch = pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed (graphep.torch needs it)")
