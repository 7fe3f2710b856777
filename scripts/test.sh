#!/usr/bin/env bash
# Runs every test: the C++ suite through ctest (no PyTorch involved), the CPU part of it again
# under ASan + UBSan, then the Python package built by pip and its pytest suite. GPU tests run
# when a CUDA device is present and are skipped, with the reason, where there is none.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=$(bash scripts/setup.sh)
JOBS=${JOBS:-$(nproc)}

echo "== C++: configure, build, ctest"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHGDN_WERROR=ON >/dev/null
cmake --build build -j "$JOBS"
ctest --test-dir build --output-on-failure -j "$JOBS"

# The CPU suite again under AddressSanitizer and UndefinedBehaviorSanitizer, any report fatal:
# the hostile calls of tests/cpp/test_contract.cpp use exactly sized buffers, so a check that
# lets a bad call through reaches the backend and shows up here. -O1 -g1 keeps the build short
# (about 100 s of CPU; the tests about 50 s) and the reports readable.
echo "== C++ under ASan + UBSan (CPU backend): configure, build, ctest"
cmake -S . -B build-asan -G Ninja -DFLASHGDN_SANITIZE=ON -DFLASHGDN_WERROR=ON -DCMAKE_BUILD_TYPE=Debug \
  "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -g1" "-DCMAKE_C_FLAGS_DEBUG=-O1 -g1" >/dev/null
cmake --build build-asan -j "$JOBS"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j "$JOBS"

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
