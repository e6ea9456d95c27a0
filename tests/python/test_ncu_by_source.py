"""CPU: scripts/ncu_by_source.py maps each profiled kernel's demangled name to its mangled cubin
function, templated instances included (one dispatch kernel per wire format)."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ncu_by_source.py"
spec = importlib.util.spec_from_file_location("ncu_by_source", SCRIPT)
ncu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ncu)

PREFIX = "_ZN7graphep11moe_latency43_GLOBAL__N__6c24f4da_10_latency_cu_a971c3ea"
FP8 = PREFIX + "14dispatchKernelILb1EEEvNS_9MoeParamsE"
BF16 = PREFIX + "14dispatchKernelILb0EEEvNS_9MoeParamsE"
COMBINE = PREFIX + "13combineKernelENS_9MoeParamsE"
BATCHED = PREFIX + "14dispatchKernelILb1ELNS1_13MoeRecvLayoutE1EEEvNS_9MoeParamsE"
RANK_MAJOR = PREFIX + "14dispatchKernelILb1ELNS1_13MoeRecvLayoutE2EEEvNS_9MoeParamsE"


def test_a_plain_kernel_is_found():
    assert ncu.matching({FP8: {}, COMBINE: {}}, "combineKernel(graphep::MoeParams)") == COMBINE


def test_a_bool_template_argument_picks_the_instance():
    funcs = {FP8: {}, BF16: {}, COMBINE: {}}
    assert ncu.matching(funcs, "dispatchKernel<true>(graphep::MoeParams)") == FP8
    assert ncu.matching(funcs, "dispatchKernel<false>(graphep::MoeParams)") == BF16


def test_an_enum_template_argument_and_a_qualified_name():
    funcs = {BATCHED: {}, RANK_MAJOR: {}, COMBINE: {}}
    name = ("void graphep::moe_latency::(anonymous namespace)::dispatchKernel<true, "
            "(graphep::moe_latency::(anonymous namespace)::MoeRecvLayout)2>(graphep::MoeParams)")
    assert ncu.matching(funcs, name) == RANK_MAJOR


def test_a_kernel_no_cubin_holds_is_none():
    assert ncu.matching({COMBINE: {}}, "dispatchKernel<true>(graphep::MoeParams)") is None
