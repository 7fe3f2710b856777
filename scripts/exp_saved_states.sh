#!/usr/bin/env bash
# exp/saved-states on the GPU in one call: build, the saved-states tests and the fused suite, then
# flashgdn alone over the backward and forward + backward cells of 16/64 and 2/8 (both q/k
# conventions; compare with bench/results/h200-2026-11-29/fused-flip.md, same GPU kind only).
set -uo pipefail
t0=$SECONDS
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release > /tmp/build.log 2>&1 && cmake --build build-gpu -j16 >> /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site . > /tmp/pip.log 2>&1 || { tail -20 /tmp/pip.log; exit 1; }
echo "build $((SECONDS - t0)) s"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
export PYTHONPATH=/tmp/site LD_LIBRARY_PATH=$PWD/build-gpu
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/python/test_bwd_fused.py 2>&1 | tail -4
echo "tests at $((SECONDS - t0)) s"
timeout 200 python3 bench/run.py --full --contenders flashgdn --modes bwd,fwdbwd --configs 16/64,2/8 \
  --prewarm 0 --target-ms 150 --out ${OUT:-/tmp/out}/saved 2>&1 | grep -E "^(bwd|fwdbwd) " | grep -E "1x32768|1x8192|4x8192"
echo "done at $((SECONDS - t0)) s"
