#!/usr/bin/env bash
# Sweeps the data-mover knobs (warps per role, staging slot size, slots per channel, channels) at
# a few sizes, with NCCL in every run, and prints one table. Needs a build from gpu-check.sh.
#
#   scripts/tune-movers.sh LOG_DIR [BUILD_DIR]
#
# The sets swept come from TUNE_WARPS, TUNE_SLOT, TUNE_SLOTS, TUNE_SMS, TUNE_LL (space-separated lists) and
# the operation from TUNE_OP (sendrecv, alltoallv, allgather).
set -uo pipefail
out=${1:?usage: scripts/tune-movers.sh LOG_DIR [BUILD_DIR]}
build=${2:-build-gpu}
source "$(dirname "$0")/lib/env.sh" && graphep_enter_repo || exit 2
export NCCL_NVLS_ENABLE=0
bench="$build/bench/graphep-bench"
op=${TUNE_OP:-sendrecv}
log="$out/tune_$op.log"
: >"$log"

for warps in ${TUNE_WARPS:-4 8}; do
  for slot in ${TUNE_SLOT:-64K 256K 1M}; do
    for slots in ${TUNE_SLOTS:-4 8}; do
      for sms in ${TUNE_SMS:-16 32}; do
       for ll in ${TUNE_LL:-16K}; do
        echo "# warps=$warps slot=$slot slots=$slots sms=$sms ll=$ll" >>"$log"
        timeout -s KILL 40 "$bench" $op -b ${TUNE_MIN:-1K} -e ${TUNE_MAX:-256M} -f ${TUNE_F:-64} -n 10 -w 3 --warps $warps \
          --slot $slot --slots $slots --sms $sms --ll $ll 2>/dev/null | grep -E "^  " \
          | sed "s/^/w=$warps slot=$slot slots=$slots sms=$sms ll=$ll /" >>"$log" || echo "# failed" >>"$log"
       done
      done
    done
  done
done
sort -k1,4 "$log" | grep -v "^#" | awk '{print}' | head -200
