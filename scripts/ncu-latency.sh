#!/usr/bin/env bash
# Hardware-counter profile (Nsight Compute) of one kernel of a 2-rank graphep-bench row, with its
# warp-stall samples summed by source line. On a device with ncu, 2 GPUs and a Release build
# (built with -lineinfo, as CMakeLists.txt sets):
#
#   scripts/ncu-latency.sh LOG_DIR BUILD_DIR KERNEL SKIP COUNT BENCH_ARGS...
#   e.g. scripts/ncu-latency.sh $OUT/ncu build-gpu dispatchKernel 12 4 \
#          moe -b 128 -e 128 --hidden 2048 --experts 128 --topk 8 --sms 24 --dtype fp8 \
#          --path latency --layout batched --halves 50 -w 3 -R 3
#
# Only rank 0 runs under ncu (mpirun -np 2; rank 1 runs plain): ncu serialises the kernels of the
# process it profiles, and one process holding both ranks would wait on itself. KERNEL is a regular
# expression on the kernel's name; SKIP launches of it are left out, COUNT are profiled. Writes
# LOG_DIR/profile.ncu-rep, details.txt (ncu's sections), sass.csv (ncu's per-instruction counters)
# and by_source.txt (scripts/ncu_by_source.py: samples and stall reasons by source line).
#
# The figures are of one process under the profiler, not timings: each profiled kernel is replayed
# once per counter pass, and a replayed kernel that writes to the peer or adds to its counters
# (the latency send) does so again, so rank 1's later steps may wait or read wrong rows. The
# profile is of the kernels before that; the bench's own checks after it mean nothing. Kernels
# that wait for a peer's stores in their replays see them (ncu restores this GPU's memory, not the
# peer's), and their spans under the profiler include fences that are far slower there.
set -uo pipefail

if [ "${1:-}" = "--rank" ]; then  # mpirun's entry for each rank
  shift
  if [ "${OMPI_COMM_WORLD_RANK:-0}" = 0 ]; then exec ncu --clock-control none $NCU_ARGS -o "$NCU_OUT" "$@"; fi
  exec "$@"
fi

out=${1:?usage: scripts/ncu-latency.sh LOG_DIR BUILD_DIR KERNEL SKIP COUNT BENCH_ARGS...}
build=${2:?BUILD_DIR}
kernel=${3:?KERNEL}
skip=${4:?SKIP}
count=${5:?COUNT}
shift 5
self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
source "$(dirname "$0")/lib/env.sh" && graphep_enter_repo
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# A replayed send can leave rank 1 waiting: bound its waits so that the run ends soon after.
export GRAPHEP_TIMEOUT_MS=${GRAPHEP_TIMEOUT_MS:-20000}
export NCU_OUT=$out/profile
export NCU_ARGS="-f -k regex:$kernel --launch-skip $skip --launch-count $count --section SpeedOfLight \
--section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy --section SourceCounters"
bench=$build/bench/graphep-bench
[ -x "$bench" ] || { echo "ncu-latency: no $bench (build the graphep-bench target)" >&2; exit 1; }

timeout "${NCU_LIMIT:-150}" mpirun -np 2 "$self" --rank "$bench" "$@" > "$out/run.log" 2>&1
echo "ncu-latency: bench under ncu exited $? (after the profiled launches, its checks are void)"
grep -E "==PROF== Profiling|==ERROR==" "$out/run.log" | head -20
[ -f "$out/profile.ncu-rep" ] || { echo "ncu-latency: no report written (see $out/run.log)" >&2; exit 1; }
ncu -i "$out/profile.ncu-rep" --page details --print-units base > "$out/details.txt"
ncu -i "$out/profile.ncu-rep" --page source --csv --print-source sass > "$out/sass.csv"
# The library's cubins, for the line information of the profiled kernels' SASS.
lib=$(pwd)/$build/libgraphep.so
mkdir -p "$out/cubins" && (cd "$out/cubins" && cuobjdump -xelf all "$lib" > /dev/null)
python3 scripts/ncu_by_source.py "$out/sass.csv" "$out"/cubins/*.cubin > "$out/by_source.txt"
cat "$out/by_source.txt"
