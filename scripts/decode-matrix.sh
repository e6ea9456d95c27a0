#!/usr/bin/env bash
# The decode rows of issue 27 in one device call: graphep-bench moe on the latency path, graph
# replay, count exchange included, at 1 to 256 tokens per rank (factor 2), every receive layout,
# bf16 and fp8 dispatch, 8 / 24 / 32 SMs, at DeepSeek-V3's shape (H 7168, 256 experts, top-8), and
# at 24 SMs at H 2048, 128 experts, top-8; then DeepEP V1's low-latency kernels at 128 tokens at
# both shapes (its own tests/test_low_latency.py through the baseline script beside its source),
# and a table with the ratio DeepEP / graphep at 128 tokens, 24 SMs (DeepEP's fp8 dispatch against
# graphep's fp8 and bf16 dispatch, its bf16 combine against graphep's combine), and the floor in
# the same call: the flag round trip (graphep-bench pingpong) and the push rate to the peer on 24
# SMs (graphep-bench sendrecv at 0.5-2 MiB).
#
#   scripts/decode-matrix.sh LOG_DIR [BUILD_DIR] [DEEPEP_SRC]
#
# BUILD_DIR (default build-gpu) must hold graphep-bench; DEEPEP_SRC (default .deepep) the DeepEP
# source with deepep-ll-baseline.sh beside it (carried to the device, never committed); without it
# the graphep rows are printed with no ratio. GRAPHEP_DECODE_SMS overrides the SM budgets
# ("8 24 32"). Exits non-zero when a row reports wrong elements or a command fails.
set -uo pipefail
out=${1:?usage: scripts/decode-matrix.sh LOG_DIR [BUILD_DIR] [DEEPEP_SRC]}
build=${2:-build-gpu}
deepep=${3:-.deepep}
source "$(dirname "$0")/lib/env.sh" && graphep_enter_repo || exit 2
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PATH=/usr/local/cuda/bin:$PATH
bench="$build/bench/graphep-bench"
status=0
log="$out/graphep.log"
: >"$log"
shape() {  # TAG SMS LAYOUT BENCH_ARGS...
  local tag=$1 sms=$2 layout=$3
  shift 3
  echo "@ shape=$tag sms=$sms layout=$layout" >>"$log"
  "$bench" moe -b 1 -e 256 -f 2 --path latency --dtype both --layout "$layout" --sms "$sms" "$@" >>"$log" 2>&1 ||
    { echo "graphep-bench failed: shape=$tag sms=$sms layout=$layout"; status=1; }
}
for sms in ${GRAPHEP_DECODE_SMS:-8 24 32}; do
  for layout in expert-major batched rank-major; do
    shape v3 "$sms" "$layout" --hidden 7168 --experts 256 --topk 8
  done
done
for layout in expert-major batched rank-major; do
  shape h2048 24 "$layout" --hidden 2048 --experts 128 --topk 8
done
# The floor, same call: a flag's round trip between the ranks (one way is half), and the push of
# 0.5-2 MiB to the peer on 24 SMs (128 tokens of fp8 records are about 0.95 MB).
{ "$bench" pingpong && "$bench" sendrecv -b 512K -e 2M -f 2 --sms 24; } >"$out/floor.log" 2>&1 ||
  { echo "graphep-bench pingpong / sendrecv failed"; status=1; }
echo "floor (same call): flag round trip and the push to the peer on 24 SMs"
grep -E "^  (pingpong +flag-in-kernel|sendrecv)" "$out/floor.log"
if [ -f "$deepep/deepep-ll-baseline.sh" ]; then
  bash "$deepep/deepep-ll-baseline.sh" "$deepep" 128 7168 8 256 >"$out/deepep_v3.log" 2>&1 || status=1
  bash "$deepep/deepep-ll-baseline.sh" "$deepep" 128 2048 8 128 >"$out/deepep_h2048.log" 2>&1 || status=1
  grep -h "^deepep-ll" "$out"/deepep_*.log
fi
python3 - "$log" "$out" <<'EOF' || status=1
import glob, re, sys
log, out = sys.argv[1], sys.argv[2]
rows, wrong, cur = {}, 0, None
for line in open(log):
    m = re.match(r"@ shape=(\S+) sms=(\d+) layout=(\S+)", line)
    if m:
        cur = (m.group(1), int(m.group(2)), m.group(3))
        continue
    f = re.split(r"\s{2,}", line.strip())
    if cur is None or len(f) < 5 or f[0] != "moe":
        continue
    op = f[1].split()[0] + " " + f[1].split()[1]  # "dispatch fp8", "dispatch bf16", "combine bf16"
    rows[cur + (op, int(f[2]))] = float(f[3])
    wrong += int(f[6]) if f[6].isdigit() else 0
deep = {}
for path in glob.glob(out + "/deepep_*.log"):
    for line in open(path):
        m = re.match(r"deepep-ll tokens=(\d+) hidden=(\d+) topk=\d+ experts=\d+ dispatch_fp8_us=(\S+) combine_bf16_us=(\S+)", line)
        if m:
            deep["v3" if m.group(2) == "7168" else "h2048"] = (float(m.group(3)), float(m.group(4)))
ops = ["dispatch fp8", "dispatch bf16", "combine bf16"]
tokens = sorted({k[4] for k in rows})
print("graphep latency path, graph replay, us per operation (tokens per rank across)")
print("%-6s %3s %-13s %-14s" % ("shape", "SMs", "layout", "op") + "".join("%8d" % t for t in tokens))
for key in sorted({k[:4] for k in rows}):
    print("%-6s %3d %-13s %-14s" % key + "".join("%8.2f" % rows[key + (t,)] if key + (t,) in rows else "%8s" % "-" for t in tokens))
print("DeepEP LL / graphep at 128 tokens, 24 SMs (DeepEP: fp8 dispatch, bf16 combine, kernel time, same call)")
for shape, (dd, dc) in sorted(deep.items()):
    for layout in ["expert-major", "batched", "rank-major"]:
        g = [rows.get((shape, 24, layout, op, 128)) for op in ops]
        if None in g:
            continue
        print("%-6s %-13s dispatch fp8 %6.2f (DeepEP %6.2f: %.2fx)  dispatch bf16 %6.2f (%.2fx)  combine %6.2f (DeepEP %6.2f: %.2fx)"
              % (shape, layout, g[0], dd, dd / g[0], g[1], dd / g[1], g[2], dc, dc / g[2]))
print("wrong elements over every row: %d" % wrong)
sys.exit(1 if wrong else 0)
EOF
exit $status
