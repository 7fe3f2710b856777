#!/usr/bin/env bash
# exp/role-waits on the GPU in one call (prepared in the nineteenth session, not yet run): the
# fused walk's roles waiting for one another only where the stage table orders a shared tile
# (stage_wait; 16 waits a chunk where 16 rendezvous of all three roles were), with
# start_states_kernel, fused_cp_scan_kernel and fused_reduce_kernel's latency and index-math
# changes, against main.
#
#   here:   bash scripts/ab_base.sh main           # main's tree into .ab/base
#   device: carry [".ab"]; command: OUT=$OUT bash scripts/exp_role_waits.sh
#
# 1. both built, flashgdn_run A/B (backward, `default` and `fast`, 16/64 and 2/8 at 32768
#    tokens, 16/64 at 8192) with the outputs' digests: the same bits are expected (the same
#    operations in the same order; the certificate's new summation order could flip a decision
#    only for a segment whose bound sits within rounding of e^-16); 2. compute-sanitizer on the C++
#    cases that run the fused backward (racecheck and synccheck are what the barriers answer to);
#    3. the fused tests; 4. this tree's benchmark rows (compare with results/h200-2026-11-29/
#    prep-latency.md, same GPU kind) and kernel profile (each changed kernel has its own row).
set -uo pipefail
t0=$SECONDS
OUT=${OUT:-/tmp/out}
export OUT
AB_ROWS=${AB_ROWS:-"16/64/32768 2/8/32768 16/64/8192"} AB_REPS=${AB_REPS:-3} \
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
