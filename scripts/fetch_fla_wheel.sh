#!/usr/bin/env bash
# Fetches FLA's core package for the GPU machine, which reaches no package registry: on a machine
# that reaches PyPI, downloads the fla-core 0.6.0 wheel (pure Python) and the einops wheel it
# imports, with --no-deps, and unpacks them into a git-ignored folder small enough to travel with
# a device call (never commit it):
#
#   .whl/fla/site/   fla (fla-core 0.6.0), without __pycache__
#   .whl/fla/deps/   einops, put on the path only where the interpreter has none
#   .whl/fla/MANIFEST.txt   the wheels and their sha256
#
# scripts/gpu_check.sh puts .whl/fla/site on PYTHONPATH when the folder is there, so that the
# GPU tests which route FLA's chunk_gated_delta_rule to flashgdn's CUDA backend
# (tests/python/test_fla_backend.py) run instead of skipping. On the device: carry [".whl/fla"]
# with the call that runs scripts/gpu_check.sh. FLA also imports triton, which the device image
# has (it comes with torch); torch itself is not fetched.
#
# CI does not need this: scripts/setup.sh pip-installs fla-core into the test venv.
#
#   bash scripts/fetch_fla_wheel.sh                  # python3 -m pip; PYTHON=... to choose another
#   FLA_VERSION=0.6.0 EINOPS_VERSION=0.8.2 DEST=.whl/fla bash scripts/fetch_fla_wheel.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
FLA_VERSION=${FLA_VERSION:-0.6.0}
EINOPS_VERSION=${EINOPS_VERSION:-0.8.2}
DEST=${DEST:-.whl/fla}

"$PY" -m pip --version >/dev/null 2>&1 ||
  { echo "fetch_fla_wheel: $PY has no pip; set PYTHON to an interpreter that has one" >&2; exit 1; }

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
REQS=("fla-core==$FLA_VERSION" "einops==$EINOPS_VERSION")
echo "== downloading ${REQS[*]} (no dependencies, wheels only)" >&2
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$WORK" "${REQS[@]}"

wheel_of() {  # the downloaded wheel of a distribution name (fla-core -> fla_core-*.whl)
  local f
  f=$(ls "$WORK/${1//-/_}-"*.whl 2>/dev/null | head -1)
  [ -n "$f" ] || { echo "fetch_fla_wheel: no wheel for $1 in $WORK" >&2; exit 1; }
  echo "$f"
}
FLA_WHL=$(wheel_of fla-core)
EINOPS_WHL=$(wheel_of einops)

# A wheel is a zip archive: unpack it as it is (no pip install, so nothing is compiled and no
# interpreter check stands between this machine's Python and the device's).
unpack() {  # unpack WHEEL DIR
  rm -rf "$2"
  mkdir -p "$2"
  "$PY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$1" "$2"
  find "$2" -name __pycache__ -type d -prune -exec rm -rf {} +
}
rm -rf "$DEST"
unpack "$FLA_WHL" "$DEST/site"
unpack "$EINOPS_WHL" "$DEST/deps"
[ -f "$DEST/site/fla/__init__.py" ] && [ -f "$DEST/site/fla/backends.py" ] ||
  { echo "fetch_fla_wheel: $FLA_WHL has no fla/__init__.py or fla/backends.py" >&2; exit 1; }

{
  echo "# .whl/fla: wheels unpacked by scripts/fetch_fla_wheel.sh (site/: fla-core; deps/: einops)"
  printf '%s\n' "${REQS[@]}"
  echo "# sha256"
  (cd "$WORK" && sha256sum "$(basename "$FLA_WHL")" "$(basename "$EINOPS_WHL")")
} > "$DEST/MANIFEST.txt"

size=$(du -sk "$DEST" | cut -f1)
echo "$DEST: $(awk -v k="$size" 'BEGIN { printf "%.1f", k / 1024 }') MiB on disk, $(find "$DEST" -type f | wc -l) files"
[ "$size" -lt $((48 * 1024)) ] ||
  echo "WARNING: $DEST is over 48 MiB: with the working tree it may not travel in one device call" >&2
cat <<EOF

Check it here:  PYTHONPATH=$DEST/site:$DEST/deps python -c "import fla; print(fla.__version__, fla.__file__)"
On the device:  run with carry [".whl/fla"] (and a build, e.g. "dist"): bash scripts/gpu_check.sh pytest
EOF
