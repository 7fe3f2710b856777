#!/usr/bin/env bash
# Puts the tree of a git ref into the git-ignored .ab/base/ (with its commit in .ab/base/COMMIT),
# so that one GPU call can build it beside the working tree and time both on the same machine:
#
#   bash scripts/ab_base.sh main           # here, where the repository's history is
#   (device) carry [".ab"]; command: bash scripts/gpu_check.sh build,ab
#
# The device copy of the repository has no history of its own to check a ref out of, and timings
# are compared only within one call on one GPU (bench/results/README.md). flashgdn_run fills its
# inputs the same way in both trees from 6e2755d on (older bases fill them on one core: ~20 s a
# 32768-token run, the same values).
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:?usage: ab_base.sh REF}
commit=$(git rev-parse --short "$ref^{commit}")
rm -rf .ab/base
mkdir -p .ab/base
git archive "$commit" | tar -x -C .ab/base
echo "$commit" >.ab/base/COMMIT
echo ".ab/base: $ref ($commit), $(du -sh .ab/base | cut -f1)"
