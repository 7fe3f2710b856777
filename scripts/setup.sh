#!/usr/bin/env bash
# Installs what flashgdn's build and tests need on a fresh Debian/Ubuntu machine, idempotently:
# the C++ toolchain from Debian's packages, and a Python virtual environment (PyTorch, nanobind,
# scikit-build-core, pytest, fla-core) from PyPI with pip's cache, created once and reused.
# Prints the venv's python path last; --cpp-only stops after the toolchain. FLASHGDN_VENV overrides where the venv lives.
set -euo pipefail

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v g++ >/dev/null || need_apt+=(g++)
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)
if [ "${1:-}" != "--cpp-only" ]; then
  # The venv and the extension build need venv/ensurepip and the Python headers.
  PY_CHECK="${FLASHGDN_PYTHON:-python3}"
  command -v "$PY_CHECK" >/dev/null || need_apt+=(python3)
  "$PY_CHECK" -c "import venv, ensurepip" 2>/dev/null || need_apt+=(python3-venv)
  "$PY_CHECK" -c "import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" 2>/dev/null || need_apt+=(python3-dev)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]} from Debian's packages" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >&2
fi

if [ "${1:-}" = "--cpp-only" ]; then
  exit 0
fi

VENV="${FLASHGDN_VENV:-$HOME/.cache/flashgdn/venv}"
PY="${FLASHGDN_PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV" >&2
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV" >&2
fi
# One install, then a no-op: pip skips what is there; its cache makes a fresh venv quick.
"$VENV/bin/python" -m pip install -q --upgrade-strategy only-if-needed \
  torch numpy pytest hypothesis "nanobind>=2.0" "scikit-build-core>=0.10" ninja cmake >&2
# FLA's core package (1 MB pure Python, plus einops; no torch or triton of its own) for the tests
# that run FLA's chunk_gated_delta_rule routed to flashgdn (tests/python/test_fla_backend.py).
# It needs Python >= 3.10; elsewhere those tests skip with the reason. (The GPU machine, with no
# registry, gets it from .whl/fla instead: scripts/fetch_fla_wheel.sh, scripts/gpu_check.sh.)
if "$VENV/bin/python" -c "import sys; sys.exit(sys.version_info < (3, 10))"; then
  "$VENV/bin/python" -m pip install -q --upgrade-strategy only-if-needed "fla-core==0.6.0" >&2
fi
echo "$VENV/bin/python"
