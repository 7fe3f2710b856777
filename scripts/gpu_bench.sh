#!/usr/bin/env bash
# The side-by-side benchmark on a GPU machine (the device tool), in steps that fit its calls:
#
#   bash scripts/gpu_bench.sh unpack              # every carried .whl/peers-*/*.tar.xz into /tmp/peers
#   bash scripts/gpu_bench.sh install             # flashgdn into /tmp/site (dist/*.whl if carried, else built)
#   bash scripts/gpu_bench.sh prewarm [ARGS...]   # compile the peers' kernels for the full matrix (no timing)
#   bash scripts/gpu_bench.sh part I/N [ARGS...]  # python -m flashgdn.bench --full --part I/N --out $OUT/part-I
#
# The peers come from scripts/fetch_peer_wheels.sh (.whl/peers-a, .whl/peers-b: one carry each,
# on one warm machine). Compile caches (~/.triton, ~/.tilelang, the CuTe DSL's) stay on the
# machine between calls, so a prewarm call before the parts leaves them only cache loads.
# FLASHGDN_COMMIT names the commit in the results' header (the device copy has no .git).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashgdn-bench}
PY=${PYTHON:-python3}
export PYTHONPATH=/tmp/site:/tmp/peers:/tmp/peers/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
export FLA_DISABLE_BACKEND_DISPATCH=1
step=${1:?usage: gpu_bench.sh unpack|install|prewarm|part I/N [ARGS...]}
shift

case $step in
  unpack)
    mkdir -p /tmp/peers
    for f in .whl/peers-*/*.tar.xz; do
      [ -f "$f" ] || continue
      stamp=/tmp/peers/.unpacked-$(basename "$f")
      [ -f "$stamp" ] && continue
      tar -xJf "$f" -C /tmp/peers && touch "$stamp" || { echo "unpack $f failed" >&2; exit 1; }
      echo "unpacked $f"
    done ;;
  install)
    if [ -f /tmp/site/flashgdn/_C.abi3.so ]; then echo "flashgdn already in /tmp/site"; exit 0; fi
    if ls dist/*.whl >/dev/null 2>&1; then
      $PY -m pip install -q --no-deps --no-index --target /tmp/site dist/*.whl
    else
      $PY -m pip install -q --no-deps --no-build-isolation --target /tmp/site .
    fi ;;
  prewarm)
    # By path, so that it needs no flashgdn build: it only runs the peers.
    $PY python/flashgdn/bench prewarm --full --contenders flashqla,fla,flashinfer "$@" ;;
  part)
    p=${1:?part I/N}; shift
    $PY -m flashgdn.bench --full --part "$p" --out "$OUT/part-${p%%/*}" \
      --commit "${FLASHGDN_COMMIT:-unknown}" "$@" ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
