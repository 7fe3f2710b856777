#!/usr/bin/env bash
# Nsight Compute: the forward's kernels at (16,64) and (2,8) 1x32768 (automatic CP) and the
# chunk-rate kernel alone (16/64 1x8192 --cp off, with per-instruction stall samples).
set -u
mkdir -p $OUT
R=".gpu/flashgdn_run --device cuda --backward 0 --check 0 --iters 1"
export LD_LIBRARY_PATH=$PWD/.gpu
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
ncu --version | tail -1 >> $OUT/gpu.txt
for c in "16 64" "2 8"; do set -- $c
  ncu --set full --launch-skip 0 --launch-count 8 -o $OUT/cp-$1-$2 $R --Hq $1 --Hv $2 --T 32768 --cp auto > $OUT/cp-$1-$2.log 2>&1
  ncu --import $OUT/cp-$1-$2.ncu-rep --page details > $OUT/cp-$1-$2.details.txt 2>&1
done
ncu --set full --import-source no -k regex:gdn_fwd_kernel --launch-skip 1 --launch-count 1 -o $OUT/off-16-64 $R --Hq 16 --Hv 64 --T 8192 --cp off > $OUT/off-16-64.log 2>&1
ncu --import $OUT/off-16-64.ncu-rep --page details > $OUT/off-16-64.details.txt 2>&1
ncu --import $OUT/off-16-64.ncu-rep --page source --csv --print-source sass > $OUT/off-16-64.sass.csv 2>&1
ls -la $OUT; grep -E "gdn|Duration|Tensor|Throughput|Stall|Registers" $OUT/cp-16-64.details.txt | head -40
