#!/usr/bin/env python3
"""DeepEP's own tests, run against graphep.deep_ep: the acceptance suite of DeepEP's API on graphep.

    python3 tests/compat/run_deepep_tests.py --deepep-src DIR --test NAME|all \\
        [--num-processes 2] [-- --hidden 2048 --num-experts 128 --num-topk 8]

NAME: intranode, low_latency, shrink, shrink_at_combine or shrink_at_clean (TESTS below).

DIR is a DeepEP source tree (its tests/ folder is what is used; nothing is fetched or built). The
tests are copied into a temporary folder beside a package `deep_ep` that re-exports graphep.deep_ep,
so their `import deep_ep` gets graphep. test_intranode.py gets two edits, each asserted to match
once: its two tuning sweeps over NVL chunk sizes (graphep has no chunk knob) become one pass at
DeepEP's default chunk for the rank count, so the timing lines still print in DeepEP's format;
every assertion is untouched. test_low_latency.py runs as it is (it has no sweep to replace).
`shrink` runs test_low_latency.py with --shrink-test (DeepEP's shrink mode: a rank stops at its
first dispatch, combine or clean, and the others' kernels mask it after their timeout) and one
edit: the failure schedule (rank 1 at the first dispatch, 3 at the first combine, 5 at the first
clean) keeps only the ranks the world has, since on fewer than 6 ranks the test would expect ranks
the mask cannot hold (on 6 ranks or more the edit changes nothing); GRAPHEP_TIMEOUT_MS defaults to
2000 there. On 2 ranks that tests a failure at the first dispatch only, so `shrink_at_combine` and
`shrink_at_clean` move rank 1's failure to its first combine (the others' combine masks it) or
its first clean (their clean, a barrier in shrink mode, masks it), two more edits each (DeepEP's
own schedule fails ranks 3 and 5 there). `--test all` runs test_intranode.py,
test_low_latency.py, then the three shrink tests, with the same arguments.

Each test runs as `python3 test_<name>.py --num-processes N ...` with PYTHONPATH=<temp>:<graphep>
(GRAPHEP_PYTHONPATH, else this repository's build/python) and NCCL_NVLS_ENABLE=0; its output
streams through. The exit code is the test's (with `all`: the first failing test's, else 0). 77:
skipped (no PyTorch, or fewer GPUs than processes), with the reason.
"""

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

SKIP = 77
REPO = Path(__file__).resolve().parents[2]

# test_intranode.py's tuning sweeps: (DeepEP's line, what replaces it). One pass at the default
# chunk: the sweep's `nvl_chunk_size > 0` branch builds the same Config DeepEP's default has.
INTRANODE_EDITS: Tuple[Tuple[str, str], ...] = (
    ("for nvl_chunk_size in tuple(range(4, 33, 2)) + (0, ):",
     "for nvl_chunk_size in (deep_ep.Buffer.get_dispatch_config(num_ranks).num_max_nvl_chunked_send_tokens, ):"),
    ("for nvl_chunk_size in tuple(range(1, 17, 1)) + (0, ):",
     "for nvl_chunk_size in (deep_ep.Buffer.get_combine_config(num_ranks).num_max_nvl_chunked_send_tokens, ):"),
)

# test_low_latency.py's failure schedule, cut to the ranks the world has (the module's docstring);
# and moved so that rank 1 fails at its first combine, or at its first clean, instead of its
# first dispatch (no rank fails at dispatch: the rank there is the world size, which is cut).
SHRINK_EDITS: Tuple[Tuple[str, str], ...] = (
    ("if api in failed_api_ranks.keys():",
     "if api in failed_api_ranks.keys() and failed_api_ranks[api] < dist.get_world_size():"),
)
NO_DISPATCH_FAILURE = ("'dispatch': 1,", "'dispatch': dist.get_world_size(),")
SHRINK_AT_COMBINE_EDITS = SHRINK_EDITS + (NO_DISPATCH_FAILURE, ("'combine': 3,", "'combine': 1,"))
SHRINK_AT_CLEAN_EDITS = SHRINK_EDITS + (NO_DISPATCH_FAILURE, ("'clean': 5", "'clean': 1"))


@dataclass(frozen=True)
class DeepEpTest:
    script: str  # the file in DeepEP's tests/
    edits: Tuple[Tuple[str, str], ...]
    args: Tuple[str, ...] = ()  # before the caller's
    env: Tuple[Tuple[str, str], ...] = ()  # defaults (the caller's environment wins)


TESTS = {
    "intranode": DeepEpTest("test_intranode.py", INTRANODE_EDITS),
    "low_latency": DeepEpTest("test_low_latency.py", ()),
    "shrink": DeepEpTest("test_low_latency.py", SHRINK_EDITS, ("--shrink-test",), (("GRAPHEP_TIMEOUT_MS", "2000"),)),
    "shrink_at_combine": DeepEpTest("test_low_latency.py", SHRINK_AT_COMBINE_EDITS, ("--shrink-test",),
                                    (("GRAPHEP_TIMEOUT_MS", "2000"),)),
    "shrink_at_clean": DeepEpTest("test_low_latency.py", SHRINK_AT_CLEAN_EDITS, ("--shrink-test",),
                                  (("GRAPHEP_TIMEOUT_MS", "2000"),)),
}
ALL = "all"  # --test all: every test of TESTS, in this order

SHIM = '''"""deep_ep for DeepEP's tests: graphep.deep_ep (written by graphep's tests/compat/run_deepep_tests.py)."""
from graphep.deep_ep import Buffer, Config, EventOverlap, topk_idx_t  # noqa: F401
'''


def apply_edits(source: str, edits: Sequence[Tuple[str, str]], name: str = "the test") -> str:
    """`source` with each edit's text replaced; each must occur exactly once (a DeepEP version whose
    tests changed there fails loudly instead of running something else)."""
    for old, new in edits:
        count = source.count(old)
        if count != 1:
            raise ValueError(f"{name}: expected exactly one occurrence of {old!r}, found {count}")
        source = source.replace(old, new)
    return source


def label(test: str) -> str:
    """How the output names a test: its DeepEP file, with its extra arguments."""
    t = TESTS[test]
    return " ".join((t.script,) + t.args)


def graphep_pythonpath() -> Path:
    value = os.environ.get("GRAPHEP_PYTHONPATH")
    return Path(value) if value else REPO / "build" / "python"


def skip_reason(num_processes: int) -> Optional[str]:
    if importlib.util.find_spec("torch") is None:
        return "PyTorch is not installed"
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < num_processes:
        return f"needs {num_processes} GPUs, found {gpus}"
    return None


def prepare(deepep_src: Path, test: str, workdir: Path) -> Path:
    """Copies DeepEP's tests into `workdir`, writes the deep_ep shim, applies the edits; returns the
    test script."""
    tests = deepep_src / "tests"
    script = tests / TESTS[test].script
    if not script.is_file():
        raise FileNotFoundError(f"--deepep-src {deepep_src}: {script} does not exist")
    for f in sorted(tests.glob("*.py")):
        shutil.copy2(f, workdir / f.name)
    (workdir / "deep_ep").mkdir()
    (workdir / "deep_ep" / "__init__.py").write_text(SHIM)
    target = workdir / script.name
    target.write_text(apply_edits(target.read_text(), TESTS[test].edits, script.name))
    return target


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: List[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepep-src", required=True, type=Path, help="a DeepEP source tree (its tests/ are used)")
    p.add_argument("--test", required=True, choices=sorted(TESTS) + [ALL],
                   help="which DeepEP test to run (all: each, in this order)")
    p.add_argument("--num-processes", type=int, default=2, help="processes (one GPU each); default 2")
    args = p.parse_args(argv)

    tests = list(TESTS) if args.test == ALL else [args.test]
    reason = skip_reason(args.num_processes)
    if reason is not None:
        print(f"run_deepep_tests: SKIPPED {', '.join(label(t) for t in tests)}: {reason}", flush=True)
        return SKIP
    package = graphep_pythonpath()
    if not (package / "graphep" / "__init__.py").is_file():
        print(f"run_deepep_tests: no graphep package under {package} (build it, or set GRAPHEP_PYTHONPATH to the "
              "folder that holds graphep/)", file=sys.stderr, flush=True)
        return 2
    results = [(test, run_one(args.deepep_src.resolve(), test, package, args.num_processes, extra)) for test in tests]
    if len(results) > 1:
        print("run_deepep_tests: " + ", ".join(f"{label(t)} exit {rc}" for t, rc in results), flush=True)
    return next((rc for _, rc in results if rc != 0), 0)


def run_one(deepep_src: Path, test: str, package: Path, num_processes: int, extra: List[str]) -> int:
    """Runs one prepared DeepEP test in a temporary folder; returns its exit code."""
    with tempfile.TemporaryDirectory(prefix="graphep-deepep-") as tmp:
        workdir = Path(tmp)
        script = prepare(deepep_src, test, workdir)
        env = dict(TESTS[test].env)
        env.update(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(
            [str(workdir), str(package.resolve())] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        cmd = [sys.executable, script.name, "--num-processes", str(num_processes)] + list(TESTS[test].args) + extra
        print(f"run_deepep_tests: {' '.join(cmd)} (in {workdir}, graphep from {package})", flush=True)
        return subprocess.call(cmd, cwd=workdir, env=env)


if __name__ == "__main__":
    sys.exit(main())
