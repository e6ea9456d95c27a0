#!/usr/bin/env bash
# docs/PERFORMANCE.md's at-a-glance table from one device call on one machine: graphep-bench rows
# (graph replay) beside the three rivals, each measured in the same call:
#   - DeepEP V1's normal kernels (its tests/test_intranode.py through deepep-v1-baseline.sh beside
#     its source), at 4096 tokens per rank: graphep's throughput path, expert-major and rank-major;
#   - DeepEP V1's low-latency kernels (its tests/test_low_latency.py through deepep-ll-baseline.sh),
#     at 128 tokens: graphep's latency path, batched and rank-major;
#   - NCCL: graphep-bench measures NCCL's own send/recv and all-to-all beside the movers.
# DeepSeek-V3's shape (H 7168, top-8 of 256 experts), 24 SMs, 2 GPUs. Prints a markdown table
# (ratio = the rival's time / graphep's: > 1, graphep faster), the machine and the tree.
#
#   scripts/at-a-glance.sh LOG_DIR [BUILD_DIR] [DEEPEP_SRC]
#
# BUILD_DIR (default build-gpu) must hold graphep-bench; DEEPEP_SRC (default .deepep) the DeepEP
# source with the two baseline scripts beside it (carried to the device, never committed). DeepEP
# is built first (both builds at once, about 3 minutes on 32 cores), so that no compile runs
# beside a measurement. Exits non-zero when a command fails or a row reports wrong elements.
set -uo pipefail
out=${1:?usage: scripts/at-a-glance.sh LOG_DIR [BUILD_DIR] [DEEPEP_SRC]}
build=${2:-build-gpu}
deepep=${3:-.deepep}
source "$(dirname "$0")/lib/env.sh" && graphep_enter_repo || exit 2
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PATH=/usr/local/cuda/bin:$PATH
# Two GPUs, as the DeepEP baselines use: graphep-bench would take every visible one.
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
bench="$build/bench/graphep-bench"
status=0
rm -f "$out"/*.json "$out"/deepep_v1.log "$out"/deepep_ll.log  # no row of an earlier run in a reused LOG_DIR
{ nvidia-smi -L; echo "tree $(scripts/tree-hash.sh)"; } >"$out/machine.log" 2>&1

if [ -f "$deepep/deepep-v1-baseline.sh" ]; then
  bash "$deepep/deepep-v1-baseline.sh" "$deepep" build >"$out/deepep_v1_build.log" 2>&1 &
  bash "$deepep/deepep-ll-baseline.sh" "$deepep" build >"$out/deepep_ll_build.log" 2>&1 &
  wait || true
fi

shape=(--hidden 7168 --experts 256 --topk 8 --sms 24 --dtype both)
run() {  # NAME BENCH_ARGS...: one graphep-bench run, its rows in NAME.json
  local name=$1
  shift
  "$bench" "$@" --json "$out/$name.json" >"$out/$name.log" 2>&1 || { echo "graphep-bench $* failed"; status=1; }
}
run prefill_em moe -b 4096 -e 4096 --path throughput --layout expert-major "${shape[@]}"
run prefill_rm moe -b 4096 -e 4096 --path throughput --layout rank-major "${shape[@]}"
run decode_batched moe -b 128 -e 128 --path latency --layout batched "${shape[@]}"
run decode_rm moe -b 128 -e 128 --path latency --layout rank-major "${shape[@]}"
run sendrecv sendrecv -b 16M -e 16M --sms 24
run alltoallv alltoallv -b 16M -e 16M --sms 24

if [ -f "$deepep/deepep-v1-baseline.sh" ]; then
  bash "$deepep/deepep-v1-baseline.sh" "$deepep" 4096 >"$out/deepep_v1.log" 2>&1 || status=1
  bash "$deepep/deepep-ll-baseline.sh" "$deepep" 128 7168 8 256 >"$out/deepep_ll.log" 2>&1 || status=1
  grep -h "^deepep-" "$out"/deepep_v1.log "$out"/deepep_ll.log
fi

python3 - "$out" <<'EOF' || status=1
import json, os, sys
out = sys.argv[1]
rows, wrong = {}, 0
for name in ("prefill_em", "prefill_rm", "decode_batched", "decode_rm", "sendrecv", "alltoallv"):
    path = os.path.join(out, name + ".json")
    if not os.path.exists(path):
        continue
    for r in json.load(open(path))["rows"]:
        rows[(r["op"], r["variant"], r["bytes"])] = r
        wrong += r["wrong"]
def us(op, variant, size):
    r = rows.get((op, variant, size))
    return r["time_us"] if r else None
rival, missing = {}, []
for name in ("deepep_v1", "deepep_ll"):
    path = os.path.join(out, name + ".log")
    if os.path.exists(path):
        for line in open(path):
            # a failed run prints "deepep-.. tokens=N failed: ..." (no figures): not measured
            if line.startswith("deepep-") and "failed" not in line:
                rival[name] = dict(kv.partition("=")[::2] for kv in line.split()[1:])
    if name not in rival:
        missing.append(name)
machine = open(os.path.join(out, "machine.log")).read().strip().replace("\n", "; ")
print("machine: " + machine)
print()
print("| operation | graphep (us) | rival, same call (us) | ratio |")
print("|---|---|---|---|")
def line(what, mine, name, theirs):
    if mine is None:
        print("| %s | (no row) | %s | - |" % (what, name)); return
    if theirs is None:
        print("| %s | %.2f | %s: not measured | - |" % (what, mine, name)); return
    print("| %s | %.2f | %s %.2f | %.2fx |" % (what, mine, name, theirs, theirs / mine))
v1 = rival.get("deepep_v1", {})
ll = rival.get("deepep_ll", {})
def f(d, k):  # a figure, or None where the line lacks it (not measured)
    try:
        return float(d[k])
    except (KeyError, ValueError):
        return None
for layout in ("expert-major", "rank-major"):
    for op, key in (("dispatch bf16", "dispatch_bf16_us"), ("dispatch fp8", "dispatch_fp8_us"), ("combine bf16", "combine_bf16_us")):
        line("prefill %s, 4096 tokens/rank, %s" % (op, layout), us("moe", "%s throughput%s" % (op, "" if layout == "expert-major" else " " + layout), 4096),
             "DeepEP V1 normal", f(v1, key))
for layout in ("batched", "rank-major"):
    for op, key in (("dispatch fp8", "dispatch_fp8_us"), ("dispatch bf16", "dispatch_fp8_us"), ("combine bf16", "combine_bf16_us")):
        line("decode %s, 128 tokens/rank, %s" % (op, layout), us("moe", "%s latency %s" % (op, layout), 128),
             "DeepEP V1 low-latency (fp8 dispatch, kernel time)" if op.startswith("dispatch") else "DeepEP V1 low-latency (kernel time)",
             f(ll, key))
for op in ("sendrecv", "alltoallv"):
    for (o, variant, size), r in sorted(rows.items()):
        if o == op and r.get("nccl_us", 0) > 0:
            line("%s %s, %d MiB" % (op, variant, size >> 20), r["time_us"], "NCCL", r["nccl_us"])
print()
print("wrong elements over every graphep row: %d" % wrong)
if missing:
    print("no figures from: " + ", ".join(missing) + " (see its log)")
sys.exit(1 if wrong or missing else 0)
EOF
exit $status
