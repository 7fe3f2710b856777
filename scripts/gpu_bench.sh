#!/usr/bin/env bash
# The side-by-side benchmark on a GPU machine (the device tool), in steps that fit its calls:
#
#   bash scripts/gpu_bench.sh unpack              # keeps a carried .whl/peers-*/ piece in /tmp/peer-pieces and,
#                                                 # once all N are there, unpacks them into /tmp/peers; a carried
#                                                 # .whl/peer-cache/ goes into $PEER_CACHE
#   bash scripts/gpu_bench.sh install             # flashgdn into /tmp/site (dist/*.whl if carried, else built)
#   bash scripts/gpu_bench.sh prewarm [ARGS...]   # compile the peers' kernels for the full matrix (no timing)
#   bash scripts/gpu_bench.sh part I/N [ARGS...]  # python bench/run.py --full --part I/N --out $OUT/part-I
#   bash scripts/gpu_bench.sh pack-caches         # $PEER_CACHE as xz parts of 15 MiB; the first 4 into $OUT/peer-cache
#   bash scripts/gpu_bench.sh cache-parts I J     # parts I..J (0-based) into $OUT/peer-cache (the rest, 4 a call)
#
# The peers come from scripts/fetch_peer_wheels.sh (.whl/peers-1 .. .whl/peers-N: one carry and
# one unpack call each, back to back on one warm machine). Their compile caches (Triton,
# TileLang, CuTe DSL) and the warm-up's markers all live under $PEER_CACHE (default /tmp/peer-cache), which stays on the machine
# between calls: after a prewarm call the parts only load kernels. pack-caches brings that
# folder back (save the parts under .whl/peer-cache/, git-ignored, never committed), so a later
# session carries it (64 MiB a call) instead of compiling the peers again (~10-15 min of device
# time for the full matrix); the caches are only good for the same device image, GPU kind and
# peer versions (Triton and TileLang check their keys; a stale entry is compiled again).
# FLASHGDN_COMMIT names the commit in the results' header (the device copy has no .git).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashgdn-bench}
PY=${PYTHON:-python3}
export PYTHONPATH=/tmp/site:/tmp/peers:/tmp/peers/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
export FLA_DISABLE_BACKEND_DISPATCH=1
PEER_CACHE=${PEER_CACHE:-/tmp/peer-cache}
export TRITON_CACHE_DIR=$PEER_CACHE/triton TILELANG_CACHE_DIR=$PEER_CACHE/tilelang \
  CUTE_DSL_CACHE_DIR=$PEER_CACHE/cute-dsl FLASHGDN_PREWARM_DIR=$PEER_CACHE/prewarm
mkdir -p "$TRITON_CACHE_DIR" "$TILELANG_CACHE_DIR" "$CUTE_DSL_CACHE_DIR" "$FLASHGDN_PREWARM_DIR"
PACKED=/tmp/peer-cache-packed
step=${1:?usage: gpu_bench.sh unpack|install|prewarm|part I/N [ARGS...]}
shift

case $step in
  unpack)
    mkdir -p /tmp/peers /tmp/peer-pieces
    for f in .whl/peers-*/peers.tar.xz.piece*-of-*; do
      [ -f "$f" ] && cp "$f" /tmp/peer-pieces/ && echo "kept $(basename "$f")"
    done
    if [ ! -f /tmp/peers/.unpacked ]; then
      set -- /tmp/peer-pieces/peers.tar.xz.piece*-of-*
      if [ -f "$1" ]; then
        n=${1##*-of-}
        if [ "$#" -eq "$n" ]; then
          # The pieces in order (piece0-of-N, piece1-of-N, ...): one xz stream.
          for i in $(seq 0 $((n - 1))); do cat "/tmp/peer-pieces/peers.tar.xz.piece$i-of-$n" || exit 1; done |
            xz -d | tar -x -C /tmp/peers && touch /tmp/peers/.unpacked && echo "unpacked $n pieces into /tmp/peers" ||
            { echo "unpack of the peers' pieces failed" >&2; exit 1; }
        else
          echo "$# of $n pieces on this machine: carry the next .whl/peers-* and call unpack again"
        fi
      fi
    fi
    if ls .whl/peer-cache/peer-cache.tar.xz.part* >/dev/null 2>&1 && [ ! -f "$PEER_CACHE/.unpacked" ]; then
      cat .whl/peer-cache/peer-cache.tar.xz.part* | xz -d | tar -x -C "$PEER_CACHE" &&
        touch "$PEER_CACHE/.unpacked" && echo "unpacked the carried compile caches into $PEER_CACHE" ||
        { echo "unpack of .whl/peer-cache failed" >&2; exit 1; }
    fi ;;
  install)
    if [ -f /tmp/site/flashgdn/_C.abi3.so ]; then echo "flashgdn already in /tmp/site"; exit 0; fi
    if ls dist/*.whl >/dev/null 2>&1; then
      $PY -m pip install -q --no-deps --no-index --target /tmp/site dist/*.whl
    else
      $PY -m pip install -q --no-deps --no-build-isolation --target /tmp/site .
    fi ;;
  prewarm)
    # Only the peers: it needs no flashgdn build.
    $PY bench/run.py prewarm --full --contenders flashqla,fla,flashinfer "$@" ;;
  part)
    p=${1:?part I/N}; shift
    $PY bench/run.py --full --part "$p" --out "$OUT/part-${p%%/*}" \
      --commit "${FLASHGDN_COMMIT:-unknown}" "$@" ;;
  pack-caches)
    rm -rf "$PACKED" && mkdir -p "$PACKED" "$OUT/peer-cache"
    du -sh "$PEER_CACHE"/* 2>/dev/null
    tar -C "$PEER_CACHE" --exclude=./.unpacked -cf - . | xz -T0 -6 |
      split -b 15m -d -a 2 - "$PACKED/peer-cache.tar.xz.part" || exit 1
    ls -l "$PACKED"
    n=$(ls "$PACKED" | wc -l)
    cp $(ls "$PACKED"/* | head -4) "$OUT/peer-cache/"
    [ "$n" -le 4 ] || echo "$n parts: the first 4 are in \$OUT; fetch the others with: cache-parts 4 $((n - 1))" ;;
  cache-parts)
    mkdir -p "$OUT/peer-cache"
    for i in $(seq "${1:?first}" "${2:?last}"); do cp "$PACKED/peer-cache.tar.xz.part$(printf %02d "$i")" "$OUT/peer-cache/"; done ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
