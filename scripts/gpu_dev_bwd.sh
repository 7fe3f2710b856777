#!/usr/bin/env bash
# Development loop for the CUDA backward. Build here (no GPU needed), run the tests on a device:
#   scripts/gpu_dev_bwd.sh build   # Release build in ./build-bwd (git-ignored: build*/)
#   scripts/gpu_dev_bwd.sh ptxas   # registers / spills of every backward kernel (-Xptxas -v)
#   scripts/gpu_dev_bwd.sh test    # on the GPU machine (carry build-bwd): the backward tests
# FGDN_FILTER overrides the gtest filter; per-tensor errors are printed (FLASHGDN_TEST_VERBOSE).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bld=$root/build-bwd
case "${1:-build}" in
  build)
    cmake -S "$root" -B "$bld" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
    cmake --build "$bld" -j2
    ;;
  ptxas)
    for f in "$root"/csrc/cuda/chunk_bwd*.cu; do
      echo "== $(basename "$f")"
      nvcc -std=c++17 -arch=sm_90a -O3 --expt-relaxed-constexpr -Xptxas -v -I "$root/include" \
        -I "$root/csrc" -c "$f" -o /dev/null 2>&1 | grep -E "Compiling entry|Used|spill" || true
    done
    ;;
  test)
    nvidia-smi -L || true
    export LD_LIBRARY_PATH=$bld:${LD_LIBRARY_PATH:-}
    FLASHGDN_TEST_VERBOSE=1 "$bld/flashgdn_tests" --gtest_filter="${FGDN_FILTER:-*CudaBackward*}"
    ;;
  *) echo "usage: $0 build|ptxas|test" >&2; exit 2 ;;
esac
