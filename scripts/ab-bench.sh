#!/usr/bin/env bash
# The same graphep-bench rows on several commits in one device call, interleaved, so that their
# times can be compared (a change's effect, or a regression's cause) on one warm machine.
#
#   scripts/ab-bench.sh prepare REF...        here (with git): each REF's tree into .ab/NAME
#                                             (NAME: the ref's short hash and its name), the
#                                             earlier ones removed; carry .ab to the device
#   scripts/ab-bench.sh run LOG_DIR ROUNDS BENCH_ARGS...
#                                             on the device: builds graphep-bench of every tree in
#                                             .ab (build-ab/NAME, kept between calls), then ROUNDS
#                                             times runs `graphep-bench BENCH_ARGS` on each tree in
#                                             turn; prints every row's median over the rounds per
#                                             tree, side by side, and the total of wrong elements
#
# Several row sets: separate them with ';' inside one argument, e.g.
#   scripts/ab-bench.sh run $OUT/ab 3 "moe -b 128 -e 128 --sms 24 --dtype both; moe -b 1 -e 1 --sms 24"
# (each row of the summary opens with its set's number, [0], [1], ...)
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: scripts/ab-bench.sh prepare REF... | run LOG_DIR ROUNDS BENCH_ARGS...}
shift

# Prints each row (its text before the time column) with its median time per tree, trees side by
# side, from LOG_DIR/rows_TREE.log; into LOG_DIR/ab_summary.log too.
summary() {  # LOG_DIR TREE...
  local out=$1 t
  shift
  for t in "$@"; do
    awk -v tree="$t" '/^#set / { set = "[" $2 "] " }
      /^  [a-z]/ {
        n = split($0, f, /  +/); key = set; time = ""
        for (i = 2; i <= n; ++i) if (f[i] ~ /^[0-9]+(\.[0-9]+)?$/ && f[i - 1] ~ /^[0-9]+$/) { time = f[i]; break } else key = key (key == set ? "" : " ") f[i]
        if (time != "") print tree "\t" key "\t" time
      }' "$out/rows_$t.log"
    done | sort -t$'\t' -k2,2 -k1,1 -s | awk -F'\t' '
    { v[$2, $1] = v[$2, $1] " " $3; keys[$2] = 1; trees[$1] = 1 }
    function median(s,   a, n, i, j, x) { n = split(s, a, " "); for (i = 2; i <= n; ++i) { x = a[i]; for (j = i - 1; j >= 1 && a[j] > x + 0; --j) a[j + 1] = a[j]; a[j + 1] = x }
      return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2 }
    END {
      printf "%-58s", "row (median us over rounds)"; for (t in trees) printf " %16s", substr(t, 1, 16); printf "\n"
      for (k in keys) {
        line = sprintf("%-58s", k)
        for (t in trees) line = line sprintf(" %16.2f", ((k, t) in v) ? median(v[k, t]) : -1)
        print line | "sort"
      }
      close("sort")
    }' | tee "$out/ab_summary.log"
}

if [ "$mode" = summary ]; then  # LOG_DIR: the summary again, from a run's logs (here, say)
  out=${1:?summary: LOG_DIR}
  trees=()
  for f in "$out"/rows_*.log; do t=${f##*/rows_}; trees+=("${t%.log}"); done
  summary "$out" "${trees[@]}"
  exit 0
fi

if [ "$mode" = prepare ]; then
  [ $# -ge 1 ] || { echo "prepare: name at least one commit" >&2; exit 2; }
  rm -rf .ab && mkdir -p .ab
  for ref in "$@"; do
    sha=$(git rev-parse --short=7 "$ref^{commit}") || { echo "prepare: $ref is not a commit" >&2; exit 2; }
    name="$sha-$(printf %s "$ref" | tr -c 'A-Za-z0-9._-' '_' | cut -c1-40)"
    mkdir -p ".ab/$name" && git archive "$sha" | tar -x -C ".ab/$name"
    echo ".ab/$name"
  done
  exit 0
fi

[ "$mode" = run ] || { echo "unknown mode '$mode' (prepare or run)" >&2; exit 2; }
out=${1:?run: LOG_DIR}
rounds=${2:?run: ROUNDS}
shift 2
rowSets=${*:?run: BENCH_ARGS}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 PATH=/usr/local/cuda/bin:$PATH
trees=()
for d in .ab/*/; do [ -f "$d/CMakeLists.txt" ] && trees+=("$(basename "$d")"); done
[ ${#trees[@]} -ge 1 ] || { echo "no tree in .ab (run 'prepare' here and carry .ab)" >&2; exit 2; }
gen=""
command -v ninja >/dev/null && gen="-G Ninja"
status=0
for t in "${trees[@]}"; do  # one configure + build per tree; the bench target only
  if ! { cmake -S ".ab/$t" -B "build-ab/$t" $gen -DCMAKE_BUILD_TYPE=Release -DGRAPHEP_BUILD_TESTS=OFF \
         && cmake --build "build-ab/$t" --parallel --target graphep-bench; } >"$out/build_$t.log" 2>&1; then
    echo "$t: BUILD FAILED (build_$t.log)"; tail -20 "$out/build_$t.log"; exit 1
  fi
done
for ((r = 1; r <= rounds; ++r)); do
  for t in "${trees[@]}"; do
    IFS=';' read -ra sets <<<"$rowSets"
    for i in "${!sets[@]}"; do
      s=${sets[$i]}
      echo "#set $i $s" >>"$out/rows_$t.log"  # the summary keeps the sets' rows apart (same row text, other shapes)
      # shellcheck disable=SC2086  # each set is a word list of bench arguments
      timeout -s KILL ${GRAPHEP_BENCH_BUDGET:-90} "build-ab/$t/bench/graphep-bench" $s >>"$out/rows_$t.log" 2>&1 || status=1
    done
  done
done
summary "$out" "${trees[@]}"
grep -h "total #wrong" "$out"/rows_*.log | sort | uniq -c
grep -qh "total #wrong: [1-9]" "$out"/rows_*.log && { echo "WRONG ELEMENTS in a row"; status=1; }
exit $status
