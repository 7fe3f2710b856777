#!/usr/bin/env bash
# Runs every test: the C++ suite through ctest (no PyTorch involved), a consumer project built
# against the installed C++ package, the CPU part of the suite again under ASan + UBSan, then the
# Python package built by pip and its pytest suite. GPU tests run when a CUDA device is present
# and are skipped, with the reason, where there is none.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=$(bash scripts/setup.sh)
JOBS=${JOBS:-$(nproc)}

echo "== C++: configure, build, ctest"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHGDN_WERROR=ON >/dev/null
cmake --build build -j "$JOBS"
ctest --test-dir build --output-on-failure -j "$JOBS"

# The C++ package as a consumer sees it: install the build above into a temporary prefix, then
# build examples/cmake_consumer with find_package(flashgdn) against that prefix alone, and run it.
echo "== C++ package: cmake --install, examples/cmake_consumer against the installed tree"
PKG=$(mktemp -d)
trap 'rm -rf "$PKG"' EXIT
cmake --install build --prefix "$PKG/prefix" >/dev/null
cmake -S examples/cmake_consumer -B "$PKG/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  "-DCMAKE_PREFIX_PATH=$PKG/prefix" "-DCMAKE_CXX_FLAGS=-Wall -Wextra -Wpedantic -Werror" |
  grep -F -- "-- flashgdn "
grep -qF "flashgdn_DIR:PATH=$PKG/prefix/" "$PKG/build/CMakeCache.txt" ||
  { echo "the consumer found flashgdn outside $PKG/prefix" >&2; exit 1; }
cmake --build "$PKG/build"
"$PKG/build/flashgdn_consumer"

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
"$PYTHON" -m pytest -q -rfEs tests/python
rc=$?
set -e
if [ $rc -eq 5 ]; then
  echo "pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit $rc
