# Sourced by the scripts that take LOG_DIR [BUILD_DIR] (gpu-check.sh, latency-check.sh,
# tune-movers.sh, decode-matrix.sh, mutation-check.sh), after they have read their arguments:
#
#   source "$(dirname "$0")/lib/env.sh" && graphep_enter_repo
#
# Each script exports its own environment still: the sets differ (not every script runs mpirun
# or torch), so they stay where they are used.

# Creates the log directory $out and makes it absolute, then moves to the repository root, so a
# script runs from any directory: a relative LOG_DIR names the directory it named where the
# script was started, and BUILD_DIR ($build) is read from the root.
graphep_enter_repo() {
  mkdir -p "$out"
  out=$(cd "$out" && pwd)
  cd "$(dirname "${BASH_SOURCE[0]}")/../.."
}
