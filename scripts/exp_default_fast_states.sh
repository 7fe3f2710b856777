#!/usr/bin/env bash
# exp/default-fast-states on the GPU in one call: the fused backward's states (and the saved ones)
# from the forward's `fast` kernel at `default` too, against main's `high` ones
# (FLASHGDN_EXP_HIGH_STATES=1, the branch's temporary knob) in the same build: the fused tests;
# every gradient's error on the benchmark's check inputs, both q/k conventions, both ways; the
# benchmark's backward and forward + backward rows at 16/64 and 2/8, both ways; the kernel profile.
set -uo pipefail
t0=$SECONDS
OUT=${OUT:-/tmp/out}
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release > /tmp/build.log 2>&1 && cmake --build build-gpu -j16 >> /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site . > /tmp/pip.log 2>&1 || { tail -20 /tmp/pip.log; exit 1; }
echo "build $((SECONDS - t0)) s"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
export PYTHONPATH=/tmp/site LD_LIBRARY_PATH=$PWD/build-gpu
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/python/test_bwd_fused.py 2>&1 | grep -v "^SKIPPED" | tail -5
echo "tests $((SECONDS - t0)) s"
for knob in 0 1; do
  echo "== FLASHGDN_EXP_HIGH_STATES=$knob"
  FLASHGDN_EXP_HIGH_STATES=$knob timeout 60 python3 bench/grad_precision.py --configs 16/64 --layouts check \
    --qk-norm in_kernel,prenormalized --seeds 3 --variants default --out $OUT/precision-$knob 2>&1 | grep -v "^#" | tail -9
  FLASHGDN_EXP_HIGH_STATES=$knob timeout 90 python3 bench/run.py --full --contenders flashgdn --modes bwd,fwdbwd \
    --configs 16/64,2/8 --layouts 1x32768,4x8192,1x8192 --no-check --prewarm 0 --target-ms 100 --out $OUT/rows-$knob 2>&1 | grep -E "^(bwd|fwdbwd) "
done
echo "A/B $((SECONDS - t0)) s"
PYTHONPATH=/tmp/site:$PWD/bench timeout 60 python3 bench/profile_kernels.py --T 32768 --heads 16/64 --out $OUT/kernels.md > /dev/null 2>&1
grep -A8 "forward+backward" $OUT/kernels.md | head -10
echo "done $((SECONDS - t0)) s"
