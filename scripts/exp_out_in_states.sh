#!/usr/bin/env bash
# exp/out-in-states on the GPU (prepared in the twenty-fourth session, not yet run): the walk's dk,
# dq tiles stored into the chunk-start states' memory (a unit's tiles after its state is read), so
# the backward's workspace holds no out buffer: without saved states always, with them where the
# caller consents (fgdn_bwd_args.saved_states_scratch; autograd does). Prediction in bench/NOTES.md.
#
#   here:   bash scripts/ab_base.sh main;  device: carry [".ab"];
#           OUT=$OUT bash scripts/exp_out_in_states.sh check   (~4 min: correctness first)
#           OUT=$OUT bash scripts/exp_out_in_states.sh speed   (~5 min)
#
# check: C++ tests (all), test_bwd_fused.py (saved_states_scratch: same bits, states overwritten,
#        workspace smaller; a second backward through the graph the same bits) and test_contract.py;
#        memcheck and racecheck on the fused cases (a store into a state the walk still reads would
#        show as changed bits, not as a sanitizer report: the same-bits tests are the check).
# speed: A/B against main (same bits, the workspace 1.07 GB smaller at 16/64 1x32768), both q/k
#        conventions; then the benchmark's flashgdn cells (bwd, fwdbwd; 16/64 and 2/8 at one
#        32768-token sequence; both conventions) for the memory beside the committed FlashQLA figures.
set -uo pipefail
t0=$SECONDS
OUT=${OUT:-/tmp/out}
export OUT
case "${1:-check}" in
check)
  SANITIZE_TOOLS="memcheck racecheck" SANITIZE_FILTER='Cuda/CudaBackwardCase*D128*:CudaBackward.*' \
    timeout 400 bash scripts/gpu_check.sh build,ctest,sanitize 2>&1 | grep -E '^\| ' | tail -8
  echo "steps $((SECONDS - t0)) s"
  python3 -m pip install -q --upgrade --no-deps --no-build-isolation --target /tmp/site . >/tmp/pip.log 2>&1 || tail -5 /tmp/pip.log
  PYTHONPATH=/tmp/site timeout 170 python3 -m pytest -q -p no:cacheprovider tests/python/test_bwd_fused.py \
    tests/python/test_contract.py 2>&1 | grep -v "^SKIPPED" | tail -6
  ;;
speed)
  AB_ROWS="16/64/32768 2/8/32768" AB_REPS=2 AB_LEVELS=default AB_QK="in_kernel prenormalized" \
    bash scripts/gpu_check.sh build,ab 2>&1 | grep -E '^\| ' | tail -24
  python3 -m pip install -q --upgrade --no-deps --no-build-isolation --target /tmp/site . >/tmp/pip.log 2>&1 || tail -5 /tmp/pip.log
  PYTHONPATH=/tmp/site timeout 200 python3 bench/run.py --contenders flashgdn --configs 16/64,2/8 --modes bwd,fwdbwd \
    --layouts 1x32768 --qk-norm in_kernel,prenormalized --no-check --out "$OUT/bench" 2>&1 | tail -14
  ;;
esac
echo "done $((SECONDS - t0)) s"
