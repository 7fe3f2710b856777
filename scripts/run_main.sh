#!/usr/bin/env bash
# The main job: sets up, builds, and runs one GDN forward + backward on a Qwen3.5-shaped problem
# (Hq = 16, Hv = 64, K = V = 128) on the GPU if there is one (else the CPU backend with a
# shorter sequence), printing the times and every tensor's error against the float64 oracle.
# Extra arguments go to flashgdn_run (e.g. --T 4096).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --cpp-only
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "${JOBS:-$(nproc)}" --target flashgdn_run
./build/flashgdn_run "$@"
