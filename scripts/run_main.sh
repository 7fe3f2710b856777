#!/usr/bin/env bash
# The main job: sets up, builds, and runs one GDN forward + backward on a Qwen3.5-shaped problem
# (Hq = 16, Hv = 64, K = V = 128) on the GPU if there is one (else the CPU backend with a
# shorter sequence), printing the times and every tensor's error against the float64 oracle.
# Extra arguments go to flashgdn_run (e.g. --T 4096).
#
# It builds only what this machine can run: with a CUDA GPU visible (nvidia-smi -L lists one),
# the CUDA backend in build/ (the directory scripts/test.sh uses); without one, the CPU backend
# alone (-DFLASHGDN_CUDA=OFF) in build-cpu/, so a machine with nvcc and no GPU does not compile
# the sm90 kernels. FLASHGDN_CUDA=ON or OFF overrides the probe. The compiler's output goes to
# run_main.log in the build directory; it is printed only when the build fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --cpp-only

gpu_visible() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '
}

cuda="${FLASHGDN_CUDA:-}"
if [ -z "$cuda" ]; then
  if gpu_visible; then cuda=ON; else cuda=OFF; fi
fi
case "$cuda" in
  ON) dir=build; what="with the CUDA backend" ;;
  OFF) dir=build-cpu; what="CPU backend only (no CUDA GPU visible; FLASHGDN_CUDA=ON to override)"
       [ -n "${FLASHGDN_CUDA:-}" ] && what="CPU backend only (FLASHGDN_CUDA=OFF)" ;;
  *) echo "FLASHGDN_CUDA: expected ON or OFF, got '$cuda'" >&2; exit 2 ;;
esac
extra=()
[ "$cuda" = OFF ] && extra=(-DFLASHGDN_TESTS=OFF)

mkdir -p "$dir"
log="$dir/run_main.log"
echo "building flashgdn_run in $dir/, $what (log: $log)"
if ! { cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "-DFLASHGDN_CUDA=$cuda" "${extra[@]}" &&
       cmake --build "$dir" -j "${JOBS:-$(nproc)}" --target flashgdn_run; } >"$log" 2>&1; then
  echo "build failed; the end of $log:" >&2
  tail -n 40 "$log" >&2
  exit 1
fi
"./$dir/flashgdn_run" "$@"
