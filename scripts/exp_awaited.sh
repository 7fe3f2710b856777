#!/usr/bin/env bash
# exp/awaited-arrivals on the GPU in one call (not landed): a role arrives on done[s][role] only
# where someone waits for it (D9: synccheck's "Missing wait" on the never-waited done[0][C]), and
# every lane of the gate warp arrives on full1 (racecheck's reports on S.c / S.beta).
#
#   here:   bash scripts/ab_base.sh main;  device: carry [".ab"]; OUT=$OUT bash scripts/exp_awaited.sh
#
# 1. A/B bits and times against main (same bits expected, time within noise); 2. memcheck,
# racecheck, synccheck on the fused C++ cases (clean expected); 3. Nsight Compute's per-instruction
# stall samples of one walk launch, and the walk's cubin (for the line table here).
set -uo pipefail
t0=$SECONDS
OUT=${OUT:-/tmp/out}
export OUT
AB_ROWS=${AB_ROWS:-"16/64/32768 2/8/32768 16/64/8192"} AB_REPS=${AB_REPS:-1} \
  SANITIZE_TOOLS=${SANITIZE_TOOLS:-"memcheck racecheck synccheck"} \
  SANITIZE_FILTER=${SANITIZE_FILTER:-'Cuda/CudaBackwardCase*D128*:CudaBackward.*'} \
  bash scripts/gpu_check.sh build,ab,sanitize,ncu 2>&1 | grep -E '^\| |^ *[0-9.]+%' | tail -40
echo "steps $((SECONDS - t0)) s"
mkdir -p /tmp/cub && (cd /tmp/cub && cuobjdump -xelf all "$OLDPWD/build-gpu/libflashgdn.so" >/dev/null 2>&1)
for f in /tmp/cub/*.cubin; do
  if cuobjdump -sass "$f" 2>/dev/null | grep -q "fused_bwdILb1"; then cp "$f" "$OUT/walk.cubin"; echo "cubin $f $(stat -c %s "$f")"; fi
done
echo "done $((SECONDS - t0)) s"
