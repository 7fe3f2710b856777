#!/usr/bin/env bash
# Device: step 39 (.gpu/nospill.patch on main): builds, C++ suite, Python subset, errors, high timings main vs new.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
J=$(nproc); t0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt; date -u +%FT%TZ >> $OUT/gpu.txt
mk() { D=/tmp/v-$1; rm -rf $D; mkdir -p $D; tar -cf - --exclude=./build* --exclude=./.gpu --exclude=./.whl . | tar -xf - -C $D; shift
  for p in "$@"; do (cd $D && patch -p1 -s < $OLDPWD/.gpu/$p.patch) || echo "patch $p failed"; done; }
mk main; mk new nospill
for v in main new; do (cd /tmp/v-$v && cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release > $OUT/build-$v.log 2>&1 && cmake --build build-gpu -j $J --target flashgdn_tests flashgdn_run >> $OUT/build-$v.log 2>&1 || echo BUILD-$v-FAILED) & done
rm -rf /tmp/site-new; (cd /tmp/v-new && python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site-new . > /tmp/pip-new.log 2>&1 || { echo PIP-FAILED; tail -5 /tmp/pip-new.log; }) &
wait; echo "builds $((SECONDS - t0)) s"
cd /tmp/v-new
LD_LIBRARY_PATH=$PWD/build-gpu timeout 150 build-gpu/flashgdn_tests --gtest_brief=1 > $OUT/ctest.txt 2>&1; echo "ctest rc $?"; grep -E "FAILED|PASSED" $OUT/ctest.txt | head -8
LD_LIBRARY_PATH= PYTHONPATH=/tmp/site-new timeout 200 python3 -m pytest -q tests/python/test_gpu.py -k "high or precision or column_split or invariance or determin or graph" -p no:cacheprovider 2>&1 | tail -2 | tee $OUT/pytest-subset.txt
for v in main new; do cd /tmp/v-$v
for a in "16 64 8192 off" "4 4 2048 off" "2 8 8192 auto" "16 64 1024 on" "2 6 4096 off"; do set -- $a
  LD_LIBRARY_PATH=$PWD/build-gpu build-gpu/flashgdn_run --device cuda --Hq $1 --Hv $2 --T $3 --cp $4 --precision high --check 1 --iters 20 --backward 0 > /tmp/r.txt 2>&1
  echo "$v $1/$2 T=$3 cp=$4 high: $(grep -E '^\| (forward|o|final_state) ' /tmp/r.txt | tr -s ' ' | tr '\n' ' ')"
done; done | tee $OUT/high.txt
echo "total $((SECONDS - t0)) s"
