#!/usr/bin/env bash
# Diagnostic: per-instruction stall samples of the forward kernel (16/64 1x8192, CP off, fast): the CSV back.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT; t0=$SECONDS
D=/tmp/v-ncu; rm -rf $D; mkdir -p $D; tar -cf - --exclude=./build* --exclude=./.gpu --exclude=./.whl . | tar -xf - -C $D; cd $D
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_FLAGS="-lineinfo" > /dev/null && cmake --build build-gpu -j $(nproc) --target flashgdn_run > /dev/null || echo BUILD-FAILED
export LD_LIBRARY_PATH=$PWD/build-gpu
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt; ncu --version | tail -1 >> $OUT/gpu.txt
timeout 300 ncu --section WarpStateStats --section SourceCounters -k regex:gdn_fwd_kernel --launch-count 1 -o /tmp/f build-gpu/flashgdn_run --device cuda --backward 0 --check 0 --iters 1 --precision fast --Hq 16 --Hv 64 --T 8192 --cp off > $OUT/ncu.log 2>&1
ncu --import /tmp/f.ncu-rep --page source --csv --print-source sass > $OUT/source-sass.csv 2>&1
gzip -9 $OUT/source-sass.csv; ls -la $OUT
echo "total $((SECONDS - t0)) s"
