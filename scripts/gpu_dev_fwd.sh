#!/usr/bin/env bash
# Dev loop of the CUDA forward on the GPU machine: runs the prebuilt test binary (build here with
#   cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release && cmake --build build-cuda
# and carry build-cuda). Usage: scripts/gpu_dev_fwd.sh [gtest filter]   (default: CUDA forward)
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-cuda}
FILTER=${1:-'*CudaForward*'}
OUTDIR=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader || true
export LD_LIBRARY_PATH="$PWD/$BUILD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FLASHGDN_TEST_VERBOSE=${FLASHGDN_TEST_VERBOSE:-1}
if [[ -n "${SANITIZE:-}" ]] && command -v compute-sanitizer >/dev/null; then
  compute-sanitizer --tool "${SANITIZE}" "$BUILD/flashgdn_tests" --gtest_filter="$FILTER" \
    2>&1 | tee "$OUTDIR/sanitize.log" | tail -40
  exit "${PIPESTATUS[0]}"
fi
"$BUILD/flashgdn_tests" --gtest_filter="$FILTER" 2>&1 | tee "$OUTDIR/fwd_tests.log"
exit "${PIPESTATUS[0]}"
