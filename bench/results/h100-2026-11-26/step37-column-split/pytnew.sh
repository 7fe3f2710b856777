#!/usr/bin/env bash
# Device: the Python GPU suite on main + a patch ($1).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT; t0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt; date -u +%FT%TZ >> $OUT/gpu.txt
D=/tmp/v-new; rm -rf $D; mkdir -p $D; tar -cf - --exclude=./build* --exclude=./.gpu --exclude=./.whl . | tar -xf - -C $D
(cd $D && patch -p1 -s < $OLDPWD/.gpu/$1.patch) || echo "patch failed"
(cd $D && python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site-new . > /tmp/pip.log 2>&1) || { echo PIP-FAILED; tail -5 /tmp/pip.log; }
echo "build $((SECONDS - t0)) s"
(cd $D && LD_LIBRARY_PATH= PYTHONPATH=/tmp/site-new timeout 420 python3 -m pytest -q -m gpu tests/python -p no:cacheprovider 2>&1 | tail -8 > $OUT/pytest-tail.txt); cat $OUT/pytest-tail.txt
echo "total $((SECONDS - t0)) s"
