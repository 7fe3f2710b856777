#!/usr/bin/env bash
# exp/handoff-syncs on the GPU in one call (prepared in the twentieth session, not yet run): a
# role barrier (role_sync) wherever a role's own wgmma reads shared-memory rows that its other
# warps stored (D: dVn 3 -> 4, the K copy 6 -> 8; R: R 4 -> 5, Vn 5 -> 6, dAr 11 -> 12), against
# main, which has none there (bench/fused-backward.md, "Open question").
#
#   here:   bash scripts/ab_base.sh main           # main's tree into .ab/base
#   device: carry [".ab"]; command: OUT=$OUT bash scripts/exp_handoff_syncs.sh
#
# 1. both built, flashgdn_run A/B with the outputs' digests: the same bits are expected (if they
#    differ, main's hand-offs raced), the time within noise; 2. compute-sanitizer on the C++ cases
#    that run the fused backward; 3. the fused tests; 4. the rows and kernel profile.
set -uo pipefail
t0=$SECONDS
OUT=${OUT:-/tmp/out}
export OUT
AB_ROWS=${AB_ROWS:-"16/64/32768 2/8/32768"} AB_REPS=${AB_REPS:-2} \
  SANITIZE_FILTER=${SANITIZE_FILTER:-'Cuda*all_options*:Cuda*GVA2_8_B2*:Cuda*varlen_edge*'} \
  bash scripts/gpu_check.sh build,ab,sanitize 2>&1 | grep -E '^\| ' | tail -30
echo "A/B and sanitizers $((SECONDS - t0)) s"
export PYTHONPATH=/tmp/site LD_LIBRARY_PATH=$PWD/build-gpu
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site . > /tmp/pip.log 2>&1 || tail -5 /tmp/pip.log
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/python/test_bwd_fused.py 2>&1 | grep -v "^SKIPPED" | tail -3
echo "tests $((SECONDS - t0)) s"
timeout 90 python3 bench/run.py --full --contenders flashgdn --modes bwd,fwdbwd --configs 16/64,2/8 \
  --layouts 1x32768,4x8192,1x8192 --no-check --prewarm 0 --target-ms 100 --out "$OUT/rows" 2>&1 | grep -E "^(bwd|fwdbwd) "
PYTHONPATH=/tmp/site:$PWD/bench timeout 60 python3 bench/profile_kernels.py --T 32768 --heads 16/64,2/8 \
  --out "$OUT/kernels.md" > /dev/null 2>&1
grep -E "forward\+backward|fused_bwd|prep|reduce|start_states|cp_scan" "$OUT/kernels.md" | cut -c1-140
echo "done $((SECONDS - t0)) s"
