"""2 GPUs + PyTorch: two processes under torchrun with a torch.distributed NCCL process group
(tests/python/torchrun_moe.py), the graphep group bootstrapped from an NCCL id broadcast over it,
and adopting its communicator. NCCL_NVLS_ENABLE=0 always."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import full_tier, requires_gpus, requires_torch

pytestmark = [requires_torch, requires_gpus(2)]

SCRIPT = Path(__file__).resolve().parent / "torchrun_moe.py"


# The fast tier keeps the first (a torchrun launch costs seconds); the other two are full tier.
@pytest.mark.parametrize("extra", [[], pytest.param(["--dtype", "fp8"], marks=full_tier),
                                   pytest.param(["--adopt"], marks=full_tier)], ids=["bootstrap", "bootstrap-fp8", "adopt"])
def test_two_processes_under_torchrun(extra):
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    torchrun = [sys.executable, "-m", "torch.distributed.run"]  # torchrun of this interpreter
    cmd = torchrun + ["--standalone", "--nproc_per_node", "2", str(SCRIPT)] + extra
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    print(r.stdout[-4000:], r.stderr[-4000:])
    assert r.returncode == 0 and "PASS" in r.stdout
