#!/usr/bin/env bash
# Puts the tree of a git ref into the git-ignored .ab/NAME/ (default NAME: base), with its commit
# in .ab/NAME/COMMIT, so that one GPU call can build it beside the working tree and time them all
# on the same machine; several NAMEs for several variants (each its own build there):
#
#   bash scripts/ab_base.sh main                 # here, where the repository's history is
#   bash scripts/ab_base.sh exp/other other      # a second base, if wanted
#   (device) carry [".ab"]; command: bash scripts/gpu_check.sh build,ab
#
# The device copy of the repository has no history of its own to check a ref out of, and timings
# are compared only within one call on one GPU (bench/results/README.md). flashgdn_run fills its
# inputs the same way in every tree from 6e2755d on (older bases fill them on one core: ~20 s a
# 32768-token run, the same values). `rm -rf .ab` drops them all.
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:?usage: ab_base.sh REF [NAME]}
name=${2:-base}
case "$name" in tree | *[!A-Za-z0-9_.-]*) echo "ab_base.sh: NAME must be letters, digits, '_', '.', '-' and not 'tree'" >&2; exit 2 ;; esac
commit=$(git rev-parse --short "$ref^{commit}")
rm -rf ".ab/$name"
mkdir -p ".ab/$name"
git archive "$commit" | tar -x -C ".ab/$name"
echo "$commit" >".ab/$name/COMMIT"
echo ".ab/$name: $ref ($commit), $(du -sh ".ab/$name" | cut -f1)"
