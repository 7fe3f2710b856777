#!/usr/bin/env bash
# Device: step 38 (.gpu/treg.patch on main): builds, C++ suite, errors, forward ms,
# flashgdn-alone matrices of main and the branch on one machine.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
J=$(nproc); t0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt; date -u +%FT%TZ >> $OUT/gpu.txt
mk() { D=/tmp/v-$1; rm -rf $D; mkdir -p $D; tar -cf - --exclude=./build* --exclude=./.gpu --exclude=./.whl . | tar -xf - -C $D; shift
  for p in "$@"; do (cd $D && patch -p1 -s < $OLDPWD/.gpu/$p.patch) || echo "patch $p failed"; done; }
mk main; mk new treg
(cd /tmp/v-new && cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release > $OUT/build.log 2>&1 && cmake --build build-gpu -j $J --target flashgdn_tests flashgdn_run >> $OUT/build.log 2>&1 || echo BUILD-FAILED) &
for v in main new; do rm -rf /tmp/site-$v; (cd /tmp/v-$v && python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site-$v . > /tmp/pip-$v.log 2>&1 || { echo PIP-$v-FAILED; tail -5 /tmp/pip-$v.log; }) & done
wait; echo "builds $((SECONDS - t0)) s"
cd /tmp/v-new
LD_LIBRARY_PATH=$PWD/build-gpu timeout 150 build-gpu/flashgdn_tests --gtest_brief=1 > $OUT/ctest.txt 2>&1; echo "ctest rc $?"; grep -E "FAILED|PASSED" $OUT/ctest.txt | head -8
(cd /tmp/v-new && LD_LIBRARY_PATH= PYTHONPATH=/tmp/site-new timeout 200 python3 -m pytest -q tests/python/test_gpu.py -k "column_split or invariance or determin or graph" -p no:cacheprovider 2>&1 | tail -4 | tee $OUT/pytest-subset.txt)
for a in "4 4 2048 off fast" "4 4 2048 off high" "16 64 1024 on fast" "16 64 1024 off fast" "2 8 8192 auto fast" "8 16 2048 auto fast" "16 64 1024 off high" "2 8 1024 on high"; do set -- $a
  LD_LIBRARY_PATH=$PWD/build-gpu build-gpu/flashgdn_run --device cuda --Hq $1 --Hv $2 --T $3 --cp $4 --precision $5 --check 1 --iters 3 2>&1 | grep -E "^\| (o|final_state) " | sed "s|^|$1/$2 T=$3 cp=$4 $5 |"
done | tee $OUT/errors.txt
for a in "16 64 8192 40 100" "4 4 2048 8 28"; do set -- $a
  LD_LIBRARY_PATH=$PWD/build-gpu timeout 60 build-gpu/flashgdn_run --device cuda --Hq $1 --Hv $2 --T $3 --cp off --backward 0 --check 0 --precision fast --iters 3 > /tmp/tl-$1-$2-$3.txt 2>&1
  echo "== $1/$2 T=$3 cp off: $(grep -E '^\| forward ' /tmp/tl-$1-$2-$3.txt)"
done | tee $OUT/timeline.txt
cd $OLDPWD
for v in main new; do
  LD_LIBRARY_PATH= PYTHONPATH=/tmp/site-$v timeout 200 python3 bench/run.py --full --contenders flashgdn --modes fwd --target-ms 100 --budget-s 150 --commit $v --out /tmp/fwd-$v > /tmp/fwd-$v.log 2>&1
  cp /tmp/fwd-$v.log /tmp/fwd-$v/log-run.txt; echo "matrix $v $((SECONDS - t0)) s"
done
tar -czf $OUT/fwd.tgz -C /tmp fwd-main fwd-new
echo "total $((SECONDS - t0)) s"
# timeline of the branch (stamps by .gpu/mktl2.py)
D=/tmp/v-tl; rm -rf $D; mkdir -p $D; tar -cf - --exclude=./build* --exclude=./.gpu --exclude=./.whl . | tar -xf - -C $D
(cd $D && patch -p1 -s < $OLDPWD/.gpu/treg.patch) && python3 .gpu/mktl2.py $D
(cd $D && cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release > $OUT/build-tl.log 2>&1 && cmake --build build-gpu -j $(nproc) --target flashgdn_run >> $OUT/build-tl.log 2>&1 || { echo TL-BUILD-FAILED; tail -20 $OUT/build-tl.log; })
cd $D
for a in "16 64 8192 40 100" "4 4 2048 8 28"; do set -- $a
  LD_LIBRARY_PATH=$PWD/build-gpu timeout 60 build-gpu/flashgdn_run --device cuda --Hq $1 --Hv $2 --T $3 --cp off --backward 0 --check 0 --precision fast --iters 3 > /tmp/tl-$1-$2-$3.txt 2>&1
  echo "== $1/$2 T=$3 cp off: $(grep -E '^\| forward ' /tmp/tl-$1-$2-$3.txt)"
  python3 $OLDPWD/.gpu/tl.py /tmp/tl-$1-$2-$3.txt $4 $5
done > $OUT/timeline-new.txt 2>&1
echo "all $((SECONDS - t0)) s"
