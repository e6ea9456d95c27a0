#!/usr/bin/env bash
# Sweeps the data-mover knobs (warps per role, staging slot size, slots per channel, channels) at
# a few sizes, with NCCL in every run, and prints one table. Needs a build from gpu-check.sh.
#
#   scripts/tune-movers.sh LOG_DIR [BUILD_DIR]
set -uo pipefail
out=${1:?usage: scripts/tune-movers.sh LOG_DIR [BUILD_DIR]}
build=${2:-build-gpu}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
bench="$build/bench/graphep-bench"
log="$out/tune_movers.log"
: >"$log"
for warps in 4 8; do
  for slot in 64K 256K 1M; do
    for slots in 4 8; do
      for sms in 16 32; do
        echo "# warps=$warps slot=$slot slots=$slots sms=$sms" >>"$log"
        timeout -s KILL 40 "$bench" sendrecv -b 1K -e 256M -f 64 -n 10 -w 3 --warps $warps \
          --slot $slot --slots $slots --sms $sms 2>/dev/null | grep -E "^  " \
          | sed "s/^/w=$warps slot=$slot slots=$slots sms=$sms /" >>"$log" || echo "# failed" >>"$log"
      done
    done
  done
done
sort -k1,4 "$log" | grep -v "^#" | awk '{print}' | head -200
