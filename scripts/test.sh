#!/usr/bin/env bash
# Runs every test: the C++ suite through ctest (no PyTorch involved), then the Python package
# built by pip and its pytest suite. GPU tests run when a CUDA device is present and are
# skipped, with the reason, where there is none.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=$(bash scripts/setup.sh)
JOBS=${JOBS:-$(nproc)}

echo "== C++: configure, build, ctest"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHGDN_WERROR=ON >/dev/null
cmake --build build -j "$JOBS"
ctest --test-dir build --output-on-failure -j "$JOBS"

echo "== Python: pip install . and pytest"
"$PYTHON" -m pip install -q --no-build-isolation .
set +e
"$PYTHON" -m pytest -q -rs tests/python
rc=$?
set -e
if [ $rc -eq 5 ]; then
  echo "pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit $rc
