#!/usr/bin/env bash
# exp/cp-buffers on the GPU: the fused backward's reverse CP keeps per chain only the matrices its
# walks and scan use (3 S - 5 seeds and transfers, bwd_dh_plan.h's fused_cp_*), not 3 S.
# Prediction in bench/NOTES.md.
#
#   here:   bash scripts/ab_base.sh main;  device: carry [".ab"];
#           OUT=$OUT bash scripts/exp_cp_buffers.sh check   (~4 min: correctness first)
#           OUT=$OUT bash scripts/exp_cp_buffers.sh speed   (~4 min)
#
# check: C++ tests (all); test_bwd_fused.py (its reverse-CP cases compare a split walk's bits with
#        the unsplit's: a seed or transfer landing on another's matrix changes them) and
#        test_contract.py; memcheck and racecheck on flashgdn_run calls that split (2/8 one
#        4096-token sequence, automatic: 13 segments; a fixed 1024-token segment, varlen-free).
# speed: A/B against main (same bits; the workspace line), 16/64 and 2/8 one 32768-token sequence;
#        then the benchmark's flashgdn cells (bwd, fwdbwd; 16/64 and 2/8, all 16 layouts, q/k in
#        the call) for the peaks beside the committed FlashQLA figures; 2/8 again with CP off.
set -uo pipefail
t0=$SECONDS
OUT=${OUT:-/tmp/out}
export OUT
case "${1:-check}" in
check)
  timeout 300 bash scripts/gpu_check.sh build,ctest 2>&1 | grep -E '^\| ' | tail -4
  for tool in memcheck racecheck; do
    for args in "--T 4096 --Hq 2 --Hv 8" "--T 8192 --Hq 2 --Hv 8 --cp on --cp-segment 1024" "--T 8192 --Hq 16 --Hv 64"; do
      echo "$tool $args: $(LD_LIBRARY_PATH=$PWD/build-gpu timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 \
        build-gpu/flashgdn_run --device cuda $args --backward 1 --check 0 --iters 1 2>&1 |
        grep -E "ERROR SUMMARY|RACECHECK SUMMARY" | tr -s " " | tr '\n' ' ')"
    done
  done
  echo "steps $((SECONDS - t0)) s"
  python3 -m pip install -q --upgrade --no-deps --no-build-isolation --target /tmp/site . >/tmp/pip.log 2>&1 || tail -5 /tmp/pip.log
  PYTHONPATH=/tmp/site timeout 170 python3 -m pytest -q -p no:cacheprovider tests/python/test_bwd_fused.py \
    tests/python/test_contract.py 2>&1 | grep -v "^SKIPPED" | tail -6
  ;;
speed)
  AB_ROWS="16/64/32768 2/8/32768" AB_REPS=2 AB_LEVELS=default AB_QK="in_kernel" \
    bash scripts/gpu_check.sh build,ab 2>&1 | grep -E '^\| ' | tail -10
  python3 -m pip install -q --upgrade --no-deps --no-build-isolation --target /tmp/site . >/tmp/pip.log 2>&1 || tail -5 /tmp/pip.log
  PYTHONPATH=/tmp/site timeout 150 python3 bench/run.py --full --contenders flashgdn --configs 16/64,2/8 --modes bwd,fwdbwd \
    --qk-norm in_kernel --target-ms 100 --no-check --out "$OUT/bench" 2>&1 | tail -3
  PYTHONPATH=/tmp/site timeout 100 python3 bench/run.py --full --contenders flashgdn --configs 2/8 --modes bwd,fwdbwd \
    --qk-norm in_kernel --target-ms 100 --no-check --flashgdn-cp off --out "$OUT/bench-cp-off" 2>&1 | tail -3
  ;;
esac
echo "done $((SECONDS - t0)) s"
