#!/usr/bin/env bash
# Mutation check of the test suite: each tests/mutations/NN-name.patch puts one defect into the
# library (a fix reverted, or a bug that a hole in the suite once let through), and the tests named
# for it below must then FAIL; unmutated, the same tests must pass. A mutant that passes its tests
# is a hole in the suite.
#
#   scripts/mutation-check.sh LOG_DIR [BUILD_DIR] [MUTANT...]
#
# BUILD_DIR (default build-gpu) holds a built tree (scripts/gpu-check.sh makes one). Only the
# library is rebuilt per mutant, in a copy of the tree, all mutants in parallel; the test binaries
# are the built ones, run with the mutant's libgraphep.so preloaded. Needs a GPU (two for the
# mutants whose tests need two). Logs: LOG_DIR/mutant_NAME.log, a summary line per mutant.
set -uo pipefail
out=${1:?usage: scripts/mutation-check.sh LOG_DIR [BUILD_DIR] [MUTANT...]}
build=${2:-build-gpu}
shift $(($# >= 2 ? 2 : 1))
source "$(dirname "$0")/lib/env.sh" && graphep_enter_repo || exit 2
root=$(pwd)
build=$(cd "$build" && pwd) || { echo "no build tree at $build"; exit 2; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 GRAPHEP_TIMEOUT_MS=2000
export PATH=/usr/local/cuda/bin:$PATH
gpu="$build/tests/graphep_gpu_tests"

# The tests each mutant must fail, and why the suite before them could not see it.
tests_for() {
  case "$1" in
    01-*) echo "$gpu --gtest_filter=Gpu1_MoeOverflow.*:Moe/Gpu1_Moe4Ranks.Case/overflow_auto" ;;  # the overflow defect
    02-*) echo "$gpu --gtest_filter=Moe/Gpu1_Moe4Ranks.Case/fp8_wide_*" ;;        # NaN from bf16-subnormal tiles
    03-*) echo "$gpu --gtest_filter=Mixed/Gpu2_MoeFourRanksPerGpu.Case/prefill_h2048_e128_top8_sms64_throughput" ;;
    04-*) echo "$gpu --gtest_filter=Gpu1_MoeStrict.*" ;;                           # strict mode had no test
    05-*) echo "$gpu --gtest_filter=Moe/Gpu1_Moe4Ranks.Case/invalid_ids_auto" ;;   # first_* never asserted
    06-*) echo "$gpu --gtest_filter=Moe/Gpu1_Moe4Ranks.Case/uniform_varying_T_auto" ;;
    07-*) echo "$gpu --gtest_filter=Moe/Gpu1_Moe4Ranks.Case/skewed_auto" ;;        # the path never asserted
    08-*) echo "$gpu --gtest_filter=Gpu2_AllToAllv.ForcedRemoteThroughAdoptedNccl" ;;  # the staged remote path (the MoE's goes in place since fixed slots)
    09-*) echo "$gpu --gtest_filter=Moe/Gpu1_Moe4Ranks.Case/uniform_varying_T_auto" ;;  # every rank had one count
    10-*) echo "$gpu --gtest_filter=Moe/Gpu1_Moe1Rank.Case/uniform_varying_T_auto" ;;   # combine within 2^-7 only
    11-*) echo "$gpu --gtest_filter=Moe/Gpu1_Moe4Ranks.Case/rank_empty_auto" ;;    # layout words never poisoned
    12-*) echo "$gpu --gtest_filter=Moe/Gpu1_Moe4Ranks.Case/aligned_throughput" ;; # metadata poison was -1
    13-*) echo "$gpu --gtest_filter=Moe/Gpu1_Moe4Ranks.Case/fp8_int64_auto" ;;     # the fp8 reference shared the code
    14-*) echo "$gpu --gtest_filter=Gpu1_Moe.MisuseFourEmulatedRanksLatency" ;;    # out-of-order results unchecked
    15-*) echo "$build/tests/graphep_c_api_test" ;;                                # the C test checked too little
    16-*) echo "$gpu --gtest_filter=Moe/Gpu2_Moe.Case/uniform_varying_T_throughput" ;;  # the direct dispatch's last block
    17-*) echo "$gpu --gtest_filter=Gpu1_Moe.MisuseFourEmulatedRanksLatency:Gpu1_MoeGraph.FourEmulatedRanksLatency" ;;  # the combine receiver's own records
    18-*|19-*) echo "$gpu --gtest_filter=Gpu2_MoeCapabilities.RoutingAndCallerOutputs" ;;  # the rank prefix matrix; a mask leaving a rank out
    20-*) echo "$gpu --gtest_filter=Gpu2_MoeCapabilities.RepeatedOperationsAndCombineInputs" ;;  # the combine's values
    21-*) echo "$gpu --gtest_filter=Gpu2_MoeCapabilities.DispatchAfterDispatchWhileAPeerStillReads" ;;  # missed by the small shapes
    22-*) echo "$gpu --gtest_filter=Gpu2_MoeLatencyCapabilities.CombineTimeWeights" ;;  # combine-time weights, a peer's records
    23-*) echo "$gpu --gtest_filter=Gpu2_MoeLatencyCapabilities.Fp8ScaleFormats" ;;   # the packed UE8M0 scales
    24-*) echo "$gpu --gtest_filter=Gpu2_MoeLatencyCapabilities.SendHalfThenReceive" ;;  # a send half alone keeps the step
    25-*) echo "$gpu --gtest_filter=Gpu2_MoeLatencyCapabilities.StepTraceOfBackToBackOperations:Moe/Gpu2_Moe.Case/graph_replays_auto" ;;  # the step trace's order: only operations back to back (no expert kernel, no host between) enter early
    26-*|32-*) echo "$gpu --gtest_filter=Gpu2_MoeCapabilities.DirectBlockFlagsKeepPaceWithTheSteps" ;;  # empty blocks' flags fell behind (26: at the peers; 32: the reduce's local ready flags)
    27-*) echo "$gpu --gtest_filter=Gpu2_MoeCapabilities.OperationStoppedPartWayFailsTheEngineByName" ;;  # a part-way stop left the engine healthy
    28-*) echo "$gpu --gtest_filter=Gpu2_MoeCapabilities.CombineAfterCombineWhileAPeerStillReads" ;;  # the combine's ack had no mutant
    29-*|30-*) echo "$gpu --gtest_filter=Gpu2_MoeLatencyCapabilities.ActiveRankMaskFlips" ;;  # the active-rank mask: a masked rank sent to, waited for
    34-*|35-*) echo "$gpu --gtest_filter=Moe/Gpu2_Moe.Case/active_mask_throughput:Moe/Gpu2_Moe.Case/active_mask_graph_throughput" ;;  # the direct path's mask: a masked source waited for; acknowledgements by the global step
    36-*) echo "$gpu --gtest_filter=Gpu2_MoeCapabilities.DirectPairStepsUnderTheMask" ;;  # the direct send's block flags posted to a masked peer
    37-*) echo "$gpu --gtest_filter=Gpu1_MoeFaults.ShrinkOnTimeout" ;;  # the receive keeps a rank masked after a timeout
    31-*) echo "$build/tests/graphep_fault_killed_peer" ;;  # recovery after a killed process: the dead rank left in the mask
    38-*|39-*) echo "$gpu --gtest_filter=Gpu1_MoeFaults.Barrier" ;;  # the device barrier: returns without waiting; a rank outside its own mask takes part
    40-*) echo "$gpu --gtest_filter=Gpu2_AllToAllv.FixedSlotsForcedRemote" ;;  # a fixed-slot table off its slot goes unreported
    41-*) echo "$gpu --gtest_filter=Moe/Gpu2_MoeRemote.Case/uniform_varying_T_auto:Moe/Gpu1_Moe4RanksMovers.Case/uniform_varying_T_throughput" ;;  # the own records, no longer copied by the exchange
    42-*) echo "$gpu --gtest_filter=Moe/Gpu2_MoeRemote.Case/uniform_varying_T_auto:Moe/Gpu1_Moe4RanksMoversChunked.Case/uniform_varying_T_throughput" ;;  # every chunk's exchange moves the first chunk's window
    43-*) echo "$gpu --gtest_filter=Gpu1_AllToAllv.EmulatedNodesCountNetworkBytes:Moe/Gpu1_Moe4RanksEmulatedNodes.Case/uniform_varying_T_throughput" ;;  # the emulated network's meter misses a peer
    44-*) echo "$gpu --gtest_filter=Moe/Gpu1_Moe4RanksEmulatedNodes.Case/uniform_varying_T_throughput" ;;  # the landing rank's own share of the hop records not forwarded
    45-*) echo "$gpu --gtest_filter=Moe/Gpu1_Moe4RanksEmulatedNodes.Case/uniform_varying_T_throughput" ;;  # the node-aware dispatch never chosen: flat bytes
    46-*) echo "$gpu --gtest_filter=Moe/Gpu1_Moe4RanksEmulatedNodes.Case/uniform_varying_T_throughput" ;;  # the landing rank's own partial left out of its node's sum
    47-*) echo "$gpu --gtest_filter=Gpu1_AllToAllv.EmulatedNetworkRateCap" ;;  # the emulated network's rate cap never holds the exchange
    48-*) echo "$gpu --gtest_filter=Gpu1_MoeMemory.QueryEqualsAllocationOnEmulatedNodes" ;;  # the memory query sized the flat engine on emulated nodes
    49-*) echo "$gpu --gtest_filter=Gpu1_MoeStress.LatencyFromTheWrapStep" ;;  # the count words' tag wrapped to 0, the value of words never written (Unit_MoeCountWords, compiled with the header, also fails on it)
    50-*) echo "$gpu --gtest_filter=Gpu2_MoeLatencyCapabilities.CombineSendHalfWaitsForNoPeer" ;;  # the combine send half waits for the peers' weights
    51-*) echo "$gpu --gtest_filter=Gpu2_MoeLatencyCapabilities.CombineSendHalfWaitsForNoPeer:Gpu2_MoeLatencyCapabilities.CombineHalvesShrinkWhenAPeerStopsBeforeItsWeights" ;;  # the receive half, standing in for a send CTA, arrives at no peer (the peers' wait for arrivals after their sums, or before them with shrink on timeout, times out)
    52-*) echo "$gpu --gtest_filter=Gpu2_MoeLatencyCapabilities.CombineHalvesShrinkWhenAPeerStopsBeforeItsWeights" ;;  # a stand-in that gave up on a source's weights still waits for its partials (the meeting times out)
    53-*) echo "$gpu --gtest_filter=Gpu2_MoeLatencyCapabilities.DispatchReceiveHalfLeavesRoomForAnotherEngine" ;;  # a receive half's helpers wait for the senders like its receivers (no room for another engine's send half)
    54-*) echo "$gpu --gtest_filter=Gpu2_MoeLatencyCapabilities.CombineSendHalfWaitsForNoPeer" ;;  # the combine weights' tags never looked at: a send half reduces a held peer's records with old weights
    55-*) echo "$gpu --gtest_filter=Gpu1_Lines.*:Gpu2_MoeLatencyCapabilities.CombineTimeWeights*:Gpu2_MoeLatencyCapabilities.Fp8ScaleFormats" ;;  # the payload lines' cut halves handed to the wrong lanes
    56-*|57-*) echo "$gpu --gtest_filter=Gpu1_Lines.*:Gpu2_MoeLatencyCapabilities.CombineTimeWeights*:Gpu2_MoeLatencyCapabilities.GraphReplayOfHalves:Gpu2_MoeLatencyCapabilities.Fp8ScaleFormats" ;;  # a chunk read before its lines (or its spill line) have landed
    58-*) echo "$gpu --gtest_filter=Gpu2_MoeLatencyCapabilities.CombineSumsWaitForAHeldPeersPartials:Gpu2_MoeLatencyCapabilities.CombineTimeWeights*" ;;  # the combine's sums read the partials' lines before they land
    59-*) echo "$gpu --gtest_filter=Gpu2_MoeLatencyCapabilities.CombineTimeWeightsExpertMajorHidden7168:Mixed/Gpu2_MoeFourRanksPerGpu.Case/decode_h2048_e128_top8_auto" ;;  # the receive's items past the receivers' first ones never claimed (rows left unwritten)
    64-*) echo "$gpu --gtest_filter=Moe/Gpu1_Moe4Ranks.Case/uniform_varying_T_auto:Moe/Gpu2_Moe.Case/uniform_varying_T_auto" ;;  # the metadata items one short: the last token's metadata lines never sent
    65-*) echo "$gpu --gtest_filter=Moe/Gpu1_Moe4Ranks.Case/fp8_wide_auto:Moe/Gpu1_Moe4Ranks.Case/few_wide_rows_auto:Moe/Gpu1_Moe1Rank.Case/few_wide_rows_auto:Gpu2_MoeLatencyCapabilities.CombineTimeWeightsExpertMajorHidden7168" ;;  # the combine sums' accumulator kept from one chunk into the next
    *) return 1 ;;
  esac
}

mutants=("$@")
if [ ${#mutants[@]} -eq 0 ]; then
  for p in tests/mutations/*.patch; do mutants+=("$(basename "$p" .patch)"); done
fi

# Build every mutant's library in parallel: a copy of the sources (no build trees), the patch,
# the library target alone.
work=/tmp/graphep-mutants
rm -rf "$work" && mkdir -p "$work"
build_one() {  # NAME
  local name=$1 dir=$work/$1
  mkdir -p "$dir"
  # The build's inputs (as scripts/tree-hash.sh lists them; the device's copy may carry a stale .git).
  (cd "$root" && cp -r CMakeLists.txt cmake engine graphs examples include kernels bench python tests tools "$dir/") || return 1
  (cd "$dir" && git apply "$root/tests/mutations/$name.patch") >"$out/mutant_$name.build.log" 2>&1 ||
    { echo "$name: patch does not apply"; return 1; }
  cmake -S "$dir" -B "$dir/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGRAPHEP_BUILD_TESTS=OFF \
    -DGRAPHEP_BUILD_BENCH=OFF -DGRAPHEP_BUILD_EXAMPLES=OFF -DGRAPHEP_BUILD_TOOLS=OFF -DGRAPHEP_BUILD_PYTHON=OFF >>"$out/mutant_$name.build.log" 2>&1 &&
    cmake --build "$dir/build" --target graphep --parallel 4 >>"$out/mutant_$name.build.log" 2>&1 ||
    { echo "$name: build failed"; return 1; }
}
export -f build_one
export root work out
t0=$SECONDS
printf '%s\n' "${mutants[@]}" | xargs -P 8 -I{} bash -c 'build_one {}'
echo "mutant libraries built in $((SECONDS - t0)) s"

status=0
run_tests() {  # LIBDIR COMMAND...: rc of the command with LIBDIR's library preloaded ("" = as built)
  local lib=$1; shift
  if [ -n "$lib" ]; then
    LD_LIBRARY_PATH="$lib" LD_PRELOAD="$lib/libgraphep.so.0" timeout -s KILL 240 "$@"
  else
    timeout -s KILL 240 "$@"
  fi
}
for name in "${mutants[@]}"; do
  cmd=$(tests_for "$name") || { echo "$name: no tests named for it"; status=1; continue; }
  lib=$work/$name/build
  if [ ! -f "$lib/libgraphep.so.0" ]; then echo "$name: NOT BUILT"; status=1; continue; fi
  run_tests "" $cmd >"$out/mutant_$name.control.log" 2>&1
  control=$?
  run_tests "$lib" $cmd >"$out/mutant_$name.log" 2>&1
  rc=$?
  first=$(grep -m1 -hE "Failure|FAILED: |rank [0-9]+: |timed out|strict child" "$out/mutant_$name.log" | cut -c1-160)
  if [ $control -ne 0 ]; then
    echo "$name: unmutated tests FAILED (rc=$control): no verdict"; status=1
  elif [ $rc -ne 0 ]; then
    echo "$name: caught (rc=$rc) -- $first"
  else
    echo "$name: MISSED (the tests passed with the defect)"; status=1
  fi
done
echo "== mutation summary: status=$status"
exit $status
