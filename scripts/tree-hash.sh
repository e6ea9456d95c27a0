#!/usr/bin/env bash
# Prints a fingerprint of the source tree (every file under the build's inputs, by content), so a
# log written on the device machine, whose copy of the tree may carry a stale .git, can be matched
# to the commit it ran: run it here on the commit and compare.
set -euo pipefail
cd "$(dirname "$0")/.."
find CMakeLists.txt pyproject.toml cmake engine graphs examples include kernels bench tests tools scripts python -type f -not -path "*/__pycache__/*" -print0 \
  | LC_ALL=C sort -z | xargs -0 sha1sum | sha1sum | cut -c1-16
