#!/usr/bin/env bash
set -u
mkdir -p $OUT
export LD_LIBRARY_PATH=$PWD/.gpu
ncu --set full --import-source no -k regex:gdn_fwd_kernel --launch-skip 1 --launch-count 1 -o /tmp/off $PWD/.gpu/flashgdn_run --device cuda --backward 0 --check 0 --iters 1 --Hq 16 --Hv 64 --T 8192 --cp off > $OUT/off.log 2>&1
ncu --import /tmp/off.ncu-rep --page source --csv --print-source sass > /tmp/off.sass.csv 2>&1
python3 .gpu/ncu_src.py /tmp/off.sass.csv > $OUT/off-16-64.sass-top.txt 2>&1
ncu --import /tmp/off.ncu-rep --page raw --csv > /tmp/raw.csv 2>&1
python3 - > $OUT/off-16-64.stalls.txt <<'PY'
import csv
r = list(csv.reader(open('/tmp/raw.csv')))
hdr, units, vals = r[0], r[1], r[2]
for h, u, v in zip(hdr, units, vals):
    if 'issue_stalled' in h or 'pipe_tensor' in h or 'inst_executed_pipe' in h or 'l1tex__data_bank' in h or 'local' in h.lower() or 'sm__throughput' in h or 'pcsamp' in h:
        print(h, u, v)
PY
head -c 3000 $OUT/off-16-64.sass-top.txt
