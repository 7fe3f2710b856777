#!/usr/bin/env bash
# Downloads (on a machine that reaches PyPI) the peers' wheels for Python 3.12 manylinux x86_64,
# installs them with --no-deps into two staging folders, prunes what the benchmark never loads,
# and packs both into one xz stream cut into pieces under .whl/ (git-ignored; never commit these):
#
#   part a   FlashQLA 0.1.3 + tilelang 0.1.15 (+ apache-tvm-ffi, torch-c-dlpack-ext, z3-solver without
#            its z3 binary) + FLA (fla-core 0.6.0) + FlashInfer 0.7.2.post1 (+ cuda-tile) with
#            flashinfer/data/{csrc,cutlass,cccl} (CUDA sources for its JIT-compiled kernels) dropped,
#            since its SM90 GDN prefill is CuTe DSL and never reads them + nvidia-cutlass-dsl 4.8.1
#            with -libs-base and -libs-core
#   part b   nvidia-cutlass-dsl-libs-cu13 4.8.1 (the CuTe DSL's MLIR library and runtime for CUDA 13:
#            a 92 MB wheel, 227 MB installed)
#
#   .whl/peers-1/peers.tar.xz.piece0-of-N, .whl/peers-2/...piece1-of-N, ...   (PIECE_MIB=28 each)
#
# A device call carries the working tree (~33 MB) and one piece, under its 64 MiB; the packages
# the device image already has (torch, triton, numpy, einops, tqdm, cuda-bindings, ...) are not
# fetched. Then it prints how to install them on the device.
#
#   bash scripts/fetch_peer_wheels.sh            # WORK=/tmp/peer-wheels by default (kept as a cache)
#   PYTHON=python3.12 bash scripts/fetch_peer_wheels.sh
#   PEERS=flashqla bash scripts/fetch_peer_wheels.sh   # FlashQLA alone (with tilelang, tvm-ffi,
#                                                       # dlpack ext, z3): one 46 MB piece, one
#                                                       # carry; FLA and FlashInfer then skip
#                                                       # (bench/results/h200-2026-11-30/
#                                                       # flashqla-side-by-side-e5cdd94/ ran so)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
WORK=${WORK:-/tmp/peer-wheels}
XZ=${XZ:-xz -T1 --lzma2=preset=9e,dict=192MiB}   # one thread, large window: ~97 MiB for both parts
DEST=${DEST:-.whl}
mkdir -p "$WORK/wheels" "$DEST"

PLAT=(--python-version 3.12 --implementation cp --only-binary=:all:
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

FLASHQLA=(flash-qla==0.1.3 tilelang==0.1.15 apache-tvm-ffi==0.1.12 torch-c-dlpack-ext==0.1.5 "z3-solver==4.15.4.0")
PART_A=("${FLASHQLA[@]}" fla-core==0.6.0 flashinfer-python==0.7.2.post1 cuda-tile==1.7.0
        nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1)
PART_B=(nvidia-cutlass-dsl-libs-cu13==4.8.1)
case ${PEERS:-all} in
  all) ;;
  flashqla) PART_A=("${FLASHQLA[@]}") PART_B=() ;;
  *) echo "PEERS: expected all or flashqla, got '$PEERS'" >&2; exit 2 ;;
esac

echo "== downloading into $WORK/wheels" >&2
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$WORK/wheels" "${PART_A[@]}" ${PART_B[@]+"${PART_B[@]}"}

wheel_of() {  # the downloaded wheel file of a requirement name==version
  local name=${1%%==*} ver=${1##*==}
  name=${name//-/_}
  ls "$WORK/wheels/${name}-${ver}-"*.whl 2>/dev/null | head -1
}

stage() {  # stage DIR REQ...: pip install --no-deps --target DIR the wheels of REQ...
  local dir=$1; shift
  local files=()
  for r in "$@"; do
    local f
    f=$(wheel_of "$r")
    [ -n "$f" ] || { echo "no wheel for $r in $WORK/wheels" >&2; exit 1; }
    files+=("$f")
  done
  rm -rf "$dir"
  "$PY" -m pip install -q --no-deps --no-compile --target "$dir" "${PLAT[@]}" "${files[@]}"
  find "$dir" -name __pycache__ -type d -prune -exec rm -rf {} +
}

echo "== staging part a (FlashQLA, tilelang, FLA, FlashInfer, CuTe DSL Python)" >&2
stage "$WORK/a" "${PART_A[@]}"
rm -f "$WORK/a/bin/z3"                                 # 22 MB solver binary: tilelang imports the z3 library only
rm -rf "$WORK/a/flashinfer/data/csrc" "$WORK/a/flashinfer/data/cutlass" "$WORK/a/flashinfer/data/cccl"

rm -rf "$WORK/b" && mkdir -p "$WORK/b"
if [ ${#PART_B[@]} -gt 0 ]; then
  echo "== staging part b (nvidia-cutlass-dsl-libs-cu13)" >&2
  stage "$WORK/b" "${PART_B[@]}"
fi

# Both parts go into one xz stream, cut into pieces of $PIECE_MIB MiB, one folder each
# (.whl/peers-1, .whl/peers-2, ...): a device call carries the working tree and one piece, under
# its 64 MiB. The device gathers the pieces and unpacks once it has them all (gpu_bench.sh unpack).
PIECE_MIB=${PIECE_MIB:-$([ "${PEERS:-all}" = flashqla ] && echo 56 || echo 28)}  # FlashQLA alone: one piece
rm -rf "$DEST"/peers-*
tmp="$WORK/peers.tar.xz"
echo "== packing $tmp (xz -9e, one thread: ~10 minutes)" >&2
tar -cf - -C "$WORK/a" . -C "$WORK/b" . | $XZ > "$tmp.tmp" && mv "$tmp.tmp" "$tmp"
rm -f "$WORK"/peers.tar.xz.piece*
split -b "${PIECE_MIB}m" -d -a 1 "$tmp" "$WORK/peers.tar.xz.piece"
pieces=("$WORK"/peers.tar.xz.piece*)
n=${#pieces[@]}
for i in "${!pieces[@]}"; do
  dir="$DEST/peers-$((i + 1))"
  mkdir -p "$dir"
  mv "${pieces[$i]}" "$dir/peers.tar.xz.piece$i-of-$n"
done
{ echo "# peers.tar.xz: pip install --no-deps --target of these wheels, then pruned (scripts/fetch_peer_wheels.sh)"
  printf '%s\n' "${PART_A[@]}" ${PART_B[@]+"${PART_B[@]}"}
  echo "# sha256 of the whole stream, then of each piece"
  sha256sum "$tmp" | sed 's#  .*#  peers.tar.xz#'
  (cd "$DEST" && sha256sum peers-*/peers.tar.xz.piece*)
} > "$DEST/peers-1/MANIFEST.txt"
echo
du -h "$DEST"/peers-*/peers.tar.xz.piece*
cat <<EOF

On the device (run tool): one call per piece, back to back so that the machine stays warm (it
keeps /tmp between calls; a fresh machine needs every piece again):

  call i = 1..$n   carry [".whl/peers-i"]   bash scripts/gpu_bench.sh unpack
                   (each call keeps its piece under /tmp/peer-pieces; the call that brings the
                   last one unpacks the stream into /tmp/peers)
  then             bash scripts/gpu_bench.sh install && bash scripts/gpu_bench.sh prewarm ...

PYTHONPATH does not read .pth files: nvidia-cutlass-dsl's nvidia_cutlass_dsl_packages.pth would add
/tmp/peers/nvidia_cutlass_dsl/dsl_packages to sys.path (where its Python package 'cutlass' lives,
from -libs-core); gpu_bench.sh adds it to PYTHONPATH. FlashInfer is imported as
flashinfer.gdn_prefill; its package __init__ imports every module it has, and where that fails
(packages the GDN path does not need, e.g. nccl4py, cudnn-frontend) the benchmark loads the
module without the package __init__ (see bench/gdnbench/contenders.py).
EOF
