#!/usr/bin/env bash
# exp/fp32-transpose on the GPU in one call (prepared in the twenty-second session, not yet run):
# R's stage 14 transposes dkk through t11 / t13 in fp32 (exact, a conflict-free swizzle) instead of
# bf16 hi + lo halves: R's per-chunk code -233 instructions (its instruction fetch is its largest
# stall: bench/results/h200-2026-11-29/awaited-arrivals.md).
#
#   here:   bash scripts/ab_base.sh main;  device: carry [".ab"]; OUT=$OUT bash scripts/exp_fp32_transpose.sh
#
# 1. A/B against main: dk's bits expected to differ (dAs = dkk + dkk^T now exact), every other
#    output the same; the errors against float64 equal or lower; backward 16/64 1x32768 `default`
#    7.28 -> ~7.0 ms. 2. memcheck, racecheck, synccheck on the fused cases (clean expected: the
#    tiles and the role barrier are the ones the hi + lo form used). 3. The fused tests. 4. The stall
#    samples by role and stage (R's stage 14 and its fetch share expected lower).
set -uo pipefail
t0=$SECONDS
OUT=${OUT:-/tmp/out}
export OUT
AB_ROWS=${AB_ROWS:-"16/64/32768 2/8/32768 16/64/8192"} AB_REPS=${AB_REPS:-1} AB_QK=${AB_QK:-"in_kernel prenormalized"} \
  SANITIZE_TOOLS=${SANITIZE_TOOLS:-"memcheck racecheck synccheck"} \
  SANITIZE_FILTER=${SANITIZE_FILTER:-'Cuda/CudaBackwardCase*D128*:CudaBackward.*'} \
  bash scripts/gpu_check.sh build,ab,sanitize,ncu 2>&1 | grep -E '^\| ' | tail -40
cp "$OUT/logs.tar.gz" "$OUT/steps-logs.tar.gz" 2>/dev/null
echo "steps $((SECONDS - t0)) s"
export PYTHONPATH=/tmp/site LD_LIBRARY_PATH=$PWD/build-gpu
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/python/test_bwd_fused.py 2>&1 | grep -v "^SKIPPED" | tail -3
echo "done $((SECONDS - t0)) s"
