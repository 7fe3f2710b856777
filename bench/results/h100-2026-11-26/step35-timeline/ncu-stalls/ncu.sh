#!/usr/bin/env bash
# Diagnostic: where the forward kernel's warps stall (16/64 1x8192, CP off, fast): the stall mix and
# the SASS lines with the most "no instruction" samples.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT; t0=$SECONDS
D=/tmp/v-ncu; rm -rf $D; mkdir -p $D; tar -cf - --exclude=./build* --exclude=./.gpu --exclude=./.whl . | tar -xf - -C $D; cd $D
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_FLAGS="-lineinfo" > /dev/null && cmake --build build-gpu -j $(nproc) --target flashgdn_run > /dev/null || echo BUILD-FAILED
export LD_LIBRARY_PATH=$PWD/build-gpu
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt; ncu --version | tail -1 >> $OUT/gpu.txt
echo "build $((SECONDS - t0)) s"
timeout 300 ncu --section WarpStateStats --section SourceCounters --section LaunchStats -k regex:gdn_fwd_kernel --launch-count 1 -o /tmp/f build-gpu/flashgdn_run --device cuda --backward 0 --check 0 --iters 1 --precision fast --Hq 16 --Hv 64 --T 8192 --cp off > $OUT/ncu.log 2>&1
echo "ncu $((SECONDS - t0)) s"
ncu --import /tmp/f.ncu-rep --page details > $OUT/details.txt 2>&1
ncu --import /tmp/f.ncu-rep --page source --csv --print-source sass > /tmp/src.csv 2>&1
python3 - > $OUT/no-instruction.txt <<'PY'
import csv
rows = list(csv.reader(open('/tmp/src.csv')))
hdr = None
for i, r in enumerate(rows):
    if any('Address' in c for c in r) and any('Source' in c for c in r): hdr = i; break
h = rows[hdr]; print("columns:", h[:40])
def col(name):
    for j, c in enumerate(h):
        if c == name: return j
    for j, c in enumerate(h):
        if name.lower() in c.lower(): return j
    return None
ci = {k: col(k) for k in ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_no_instruction", "Instructions Executed"]}
print(ci)
data = rows[hdr + 1:]
tot = {}
keys = [c for c in h if c.startswith("stall_") or "Sampling" in c]
for k in keys:
    j = h.index(k); tot[k] = sum(float(r[j] or 0) for r in data if len(r) > j and r[j].replace('.', '', 1).isdigit())
for k, v in sorted(tot.items(), key=lambda x: -x[1])[:25]: print(f"{k:60} {v:12.0f}")
j = col("stall_no_inst")
if j is not None:
    top = sorted(data, key=lambda r: -float(r[j] or 0) if len(r) > j and r[j].replace('.', '', 1).isdigit() else 0)[:40]
    for r in top: print(r[ci["Address"]], r[j], r[ci["Source"]][:90])
PY
head -60 $OUT/no-instruction.txt
grep -iE "No Eligible|Issued Warp|Stall|Warp Cycles" $OUT/details.txt | head -20
echo "total $((SECONDS - t0)) s"
