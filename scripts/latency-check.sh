#!/usr/bin/env bash
# The latency path's GPU check in one device call, as issue 17 asked for it (runs 88, 90 and 91
# in docs/VALIDATION.md): every test that runs the latency path (the `_auto` cases of every case
# suite, the latency graph, overflow, misuse and fault tests, the stress at its default count,
# micro-batches, the examples, the C ABI), compute-sanitizer memcheck, synccheck and racecheck on
# the three latency tests that run kernels, and the replay stress on the latency path (4 emulated
# ranks on one GPU, every GPU in one process, one process per GPU under mpirun) at
# GRAPHEP_STRESS_LATENCY replays (default 100000), the throughput path at 100.
#
#   scripts/latency-check.sh LOG_DIR [BUILD_DIR]
#
# Builds through scripts/gpu-check.sh (BUILD_DIR, default build-gpu, kept between calls on a warm
# machine). About 6 minutes on nvidia-h200-x2 from a cold build. Prints the test, sanitizer and
# stress summaries; exits non-zero when any of them failed.
set -uo pipefail
out=${1:?usage: scripts/latency-check.sh LOG_DIR [BUILD_DIR]}
build=${2:-build-gpu}
source "$(dirname "$0")/lib/env.sh" && graphep_enter_repo || exit 2
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
status=0

GRAPHEP_BENCH_ONLY=none GRAPHEP_CTEST_BUDGET=${GRAPHEP_CTEST_BUDGET:-300} \
  GRAPHEP_CTEST_ARGS="-R _auto|Latency|Stress|Faults|MicroBatches|MoeGraph|Example|C_Api|Misuse|Gpu1_Moe1Rank" \
  GRAPHEP_SANITIZER=1 GRAPHEP_PROBE_VARIANTS=plain GRAPHEP_SANITIZER_BUDGET=${GRAPHEP_SANITIZER_BUDGET:-110} \
  GRAPHEP_SANITIZER_TESTS="Gpu1_MoeGraph.FourEmulatedRanksLatency Gpu1_MoeOverflow.FourEmulatedRanksLatency Gpu1_Moe.MisuseFourEmulatedRanksLatency" \
  scripts/gpu-check.sh "$out/check" "$build" >"$out/check.log" 2>&1 || status=1
grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)|memcheck|synccheck|racecheck|summary|FAILED" "$out/check.log"

replays=${GRAPHEP_STRESS_LATENCY:-100000}
gpu="$build/tests/graphep_gpu_tests"
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
filter='Gpu1_MoeStress.FourEmulatedRanks'
[ "$ngpu" -ge 2 ] && filter="$filter:Gpu2_MoeStress.*"
GRAPHEP_STRESS_REPLAYS=$replays GRAPHEP_STRESS_THROUGHPUT_REPLAYS=100 timeout -s INT ${GRAPHEP_STRESS_BUDGET:-150} \
  "$gpu" --gtest_filter="$filter" >"$out/stress.log" 2>&1 || { echo "stress failed (rc=$?)"; status=1; }
if [ "$ngpu" -ge 2 ] && command -v mpirun >/dev/null; then
  timeout -s INT ${GRAPHEP_STRESS_BUDGET:-150} mpirun --allow-run-as-root --oversubscribe -np 2 \
    -x GRAPHEP_STRESS_REPLAYS=$replays -x GRAPHEP_STRESS_THROUGHPUT_REPLAYS=100 -x NCCL_NVLS_ENABLE \
    "$build/tests/graphep_mpi_tests" --gtest_filter='Mpi_MoeStress*' >"$out/stress_mpi.log" 2>&1 \
    || { echo "mpirun stress failed (rc=$?)"; status=1; }
fi
grep -hE "stress  |PASSED|FAILED|Failure" "$out"/stress*.log | sort | uniq -c
grep -qhE "FAILED|Failure| [1-9][0-9]* mismatches" "$out"/stress*.log && status=1
echo "== latency check: status=$status (logs in $out)"
exit $status
