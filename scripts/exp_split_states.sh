#!/usr/bin/env bash
# exp/split-states on the GPU in one call (prepared in the twentieth session, not yet run): the
# fused backward's states at `default` (its states pass and the forward that saves them under
# autograd) from a forward kernel that splits the state recurrence's two operands (S, and
# e^{c_L - c} Vn in the update: Precision::kSplitStates), against main (`fast` states).
#
#   here:   bash scripts/ab_base.sh main           # main's tree into .ab/base
#   device: carry [".ab"]; command: OUT=$OUT bash scripts/exp_split_states.sh
#
# 1. both built, flashgdn_run A/B (backward with its own states pass, `default` and `fast`): the
#    `default` rows' times and errors move (its bits differ, expected), `fast`'s must not (same
#    bits); 2. the fused and saved-states tests; 3. the errors on the benchmark's check inputs in
#    both q/k conventions (compare with flashqla-side-by-side.md: dg 5.94e-3, FlashQLA 5.51e-3);
#    4. the rows and the kernel profile (compare with role-waits.md).
set -uo pipefail
t0=$SECONDS
OUT=${OUT:-/tmp/out}
export OUT
AB_ROWS=${AB_ROWS:-"16/64/32768 2/8/32768 16/64/8192"} AB_REPS=${AB_REPS:-2} \
  bash scripts/gpu_check.sh build,ab 2>&1 | grep -E '^\| ' | tail -30
echo "A/B $((SECONDS - t0)) s"
export PYTHONPATH=/tmp/site LD_LIBRARY_PATH=$PWD/build-gpu
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site . > /tmp/pip.log 2>&1 || tail -5 /tmp/pip.log
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/python/test_bwd_fused.py 2>&1 | grep -v "^SKIPPED" | tail -4
echo "tests $((SECONDS - t0)) s"
timeout 150 python3 bench/grad_precision.py --configs 16/64 --layouts check --qk-norm in_kernel,prenormalized --seeds 3 \
  --variants default,fast --out "$OUT/p" 2>&1 | grep -E "^\||^##" | tail -12
timeout 90 python3 bench/run.py --full --contenders flashgdn --modes bwd,fwdbwd --configs 16/64,2/8 \
  --layouts 1x32768,4x8192,1x8192 --no-check --prewarm 0 --target-ms 100 --out "$OUT/rows" 2>&1 | grep -E "^(bwd|fwdbwd) "
PYTHONPATH=/tmp/site:$PWD/bench timeout 60 python3 bench/profile_kernels.py --T 32768 --heads 16/64,2/8 \
  --out "$OUT/kernels.md" > /dev/null 2>&1
grep -E "forward\+backward|gdn_fwd|fused_bwd" "$OUT/kernels.md" | cut -c1-140
echo "done $((SECONDS - t0)) s"
