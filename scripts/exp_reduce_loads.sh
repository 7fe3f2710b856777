#!/usr/bin/env bash
# exp/reduce-loads on the GPU in one call (twenty-third session): the reduce issues a token's loads
# before its stores and reads the prep's row scales; D's P5 undoes the fp16 island's two scales by
# one multiply. Prediction in bench/NOTES.md.
#
#   here:   bash scripts/ab_base.sh main;  device: carry [".ab"]; OUT=$OUT bash scripts/exp_reduce_loads.sh
#
# 1. A/B against main, both q/k conventions (same bits expected); memcheck ran on the first form
# (clean). 2. Nsight Compute's kernel durations of one 16/64 1x32768 backward in
# both trees. The fused tests: in the full suite after.
set -uo pipefail
t0=$SECONDS
OUT=${OUT:-/tmp/out}
export OUT
AB_ROWS=${AB_ROWS:-"16/64/32768 2/8/32768"} AB_REPS=${AB_REPS:-1} AB_QK=${AB_QK:-"in_kernel prenormalized"} \
  SANITIZE_TOOLS=${SANITIZE_TOOLS:-"memcheck"} \
  SANITIZE_FILTER=${SANITIZE_FILTER:-'Cuda/CudaBackwardCase*D128*:CudaBackward.*'} \
  bash scripts/gpu_check.sh build,ab 2>&1 | grep -E '^\| ' | tail -40
cp "$OUT/logs.tar.gz" "$OUT/steps-logs.tar.gz" 2>/dev/null
echo "steps $((SECONDS - t0)) s"
for tree in base tree; do
  b=build-gpu
  [ $tree = base ] && b=.ab/base/build
  for qn in in_kernel prenormalized; do
    echo "== $tree $qn: kernel us (16/64 1x32768 default backward)"
    LD_LIBRARY_PATH=$PWD/$b timeout 120 ncu --metrics gpu__time_duration.sum -k regex:'fused_(reduce|prep)|fused_bwd' --csv \
      "$b/flashgdn_run" --device cuda --T 32768 --Hq 16 --Hv 64 --backward 1 --check 0 --iters 1 --qk-norm $qn 2>/dev/null |
      awk -F'","' '/gpu__time_duration/ {gsub(/"/,"",$NF); split($5,k,"("); printf "%s %s\n", k[1], $NF}' | sort | uniq -c | head -12
  done
done
echo "ncu $((SECONDS - t0)) s"
echo "done $((SECONDS - t0)) s (the fused tests: in the full suite after)"
