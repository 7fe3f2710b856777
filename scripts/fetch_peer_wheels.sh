#!/usr/bin/env bash
# Downloads (on a machine that reaches PyPI) the peers' wheels for Python 3.12 manylinux x86_64,
# installs them with --no-deps into two staging folders, prunes what the benchmark never loads,
# and packs each into an xz tarball under .whl/ (git-ignored; never commit these):
#
#   .whl/peers-a/peers-a.tar.xz   FlashQLA 0.1.3 + tilelang 0.1.15 (+ apache-tvm-ffi, torch-c-dlpack-ext,
#                                 z3-solver without its z3 binary) + FLA (fla-core 0.6.0) + FlashInfer 0.7.2.post1
#                                 (+ cuda-tile) with flashinfer/data/{csrc,cutlass,cccl} (CUDA sources for its
#                                 JIT-compiled kernels) dropped, since its SM90 GDN prefill is CuTe DSL and never
#                                 reads them + nvidia-cutlass-dsl 4.8.1 with -libs-base and -libs-core
#   .whl/peers-b/peers-b.tar.xz   nvidia-cutlass-dsl-libs-cu13 4.8.1 alone (the CuTe DSL's MLIR library and
#                                 runtime for CUDA 13: a 92 MB wheel, 227 MB installed)
#
# Each part stays under ~60 MiB so that it can travel in one device call (64 MiB per call with the
# working tree); the packages the device image already has (torch, triton, numpy, einops, tqdm,
# cuda-bindings, ...) are not fetched. Then it prints how to install them on the device.
#
#   bash scripts/fetch_peer_wheels.sh            # WORK=/tmp/peer-wheels by default (kept as a cache)
#   PYTHON=python3.12 bash scripts/fetch_peer_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
WORK=${WORK:-/tmp/peer-wheels}
XZ=${XZ:-xz -T1 --lzma2=preset=9e,dict=192MiB}   # one thread, large window: ~51 MiB for part b (-9 -T0: 61 MiB)
DEST=${DEST:-.whl}
mkdir -p "$WORK/wheels" "$DEST/peers-a" "$DEST/peers-b"

PLAT=(--python-version 3.12 --implementation cp --only-binary=:all:
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

PART_A=(flash-qla==0.1.3 tilelang==0.1.15 apache-tvm-ffi==0.1.12 torch-c-dlpack-ext==0.1.5
        "z3-solver==4.15.4.0" fla-core==0.6.0 flashinfer-python==0.7.2.post1 cuda-tile==1.7.0
        nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1)
PART_B=(nvidia-cutlass-dsl-libs-cu13==4.8.1)

echo "== downloading into $WORK/wheels" >&2
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$WORK/wheels" "${PART_A[@]}" "${PART_B[@]}"

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

echo "== staging part b (nvidia-cutlass-dsl-libs-cu13)" >&2
stage "$WORK/b" "${PART_B[@]}"

rm -f "$DEST"/peers-a/*.tar.xz "$DEST"/peers-b/*.tar.xz   # every *.tar.xz there is unpacked on the device
for p in a b; do
  out="$DEST/peers-$p/peers-$p.tar.xz"
  echo "== packing $out (xz -9e, one thread: minutes)" >&2
  rm -f "$out"
  tar -C "$WORK/$p" -cf - . | $XZ > "$out.tmp" && mv "$out.tmp" "$out"
  { echo "# peers-$p: pip install --no-deps --target of these wheels, then pruned (scripts/fetch_peer_wheels.sh)"
    if [ $p = a ]; then printf '%s\n' "${PART_A[@]}"; else printf '%s\n' "${PART_B[@]}"; fi
    echo "# sha256"; sha256sum "$out" | sed "s#  .*#  peers-$p.tar.xz#"
  } > "$DEST/peers-$p/MANIFEST.txt"
done

echo
du -h "$DEST"/peers-a/*.tar.xz "$DEST"/peers-b/*.tar.xz
for p in a b; do
  s=$(cat "$DEST"/peers-$p/*.tar.xz | wc -c)
  [ "$s" -lt $((60 * 1024 * 1024)) ] || echo "WARNING: peers-$p is $((s / 1048576)) MiB: over 60 MiB, it may not travel with the working tree" >&2
done
cat <<'EOF'

On the device (run tool), two calls back to back so that the machine stays warm (it keeps /tmp
and the ignored paths already carried between calls; a fresh machine needs both again):

  call 1  carry [".whl/peers-a"]
    mkdir -p /tmp/peers && for f in .whl/peers-a/*.tar.xz; do tar -xJf $f -C /tmp/peers || exit 1; done
  call 2  carry [".whl/peers-b"]            (add the flashgdn build the lead carries, e.g. "dist")
    test -d /tmp/peers/flash_qla || echo "fresh machine: call 1 again first"
    for f in .whl/peers-b/*.tar.xz; do tar -xJf $f -C /tmp/peers || exit 1; done
    export PYTHONPATH=/tmp/peers:/tmp/peers/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
    export FLA_DISABLE_BACKEND_DISPATCH=1
    python3 bench/run.py --quick --out $OUT

PYTHONPATH does not read .pth files: nvidia-cutlass-dsl's nvidia_cutlass_dsl_packages.pth would add
/tmp/peers/nvidia_cutlass_dsl/dsl_packages to sys.path (where its Python package `cutlass` lives,
from -libs-core); add it to PYTHONPATH yourself, as above. FlashInfer is imported as
flashinfer.gdn_prefill; its package __init__ imports every module it has, and where that fails
(packages the GDN path does not need, e.g. nccl4py, cudnn-frontend) the benchmark loads the
module without the package __init__ (see bench/gdnbench/contenders.py).
EOF
