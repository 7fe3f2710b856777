#!/usr/bin/env bash
# On a GPU machine, in one call: build (or take a build carried from the CPU machine), run the
# C++ and Python GPU tests, the compute-sanitizer matrix, and a short timing; print a table last.
#
#   bash scripts/gpu_check.sh [steps]     steps: any of build,ctest,pytest,sanitize,time (default all);
#                                         fuzz, sanitize-fuzz, fwd, bwd, ab, ncu and timeline run only
#                                         when named
#
# Carried builds: build-gpu/ (cmake build with CUDA) and dist/*.whl (the Python wheel, cp312
# stable ABI). Without them it builds here. Into $OUT (or /tmp/flashgdn-gpu) go three files,
# rewritten after every step so that a call cut short still returns what ran: summary.md (the
# table, also printed line by line as the steps end), gpu.txt (the GPU, and the tree tested: the
# hash `git write-tree` gives for the working tree, which `git rev-parse <commit>^{tree}` matches
# here), and logs.tar.gz (every log).
# FLA for the tests that route FLA's chunk_gated_delta_rule to flashgdn (the device has no package
# registry): carry .whl/fla, made by scripts/fetch_fla_wheel.sh; without it those tests skip.
# PYTEST_STOP= (empty) runs the whole Python GPU suite past a failure (default -x: stop at the first).
# sanitize: SANITIZE_FILTER (gtest filter, default DEFAULT_SANITIZE below), SANITIZE_TOOLS (default
# "memcheck racecheck synccheck initcheck").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashgdn-gpu}
LOG=$(mktemp -d /tmp/flashgdn-gpu-logs.XXXXXX)
mkdir -p "$OUT"
STEPS=${1:-build,ctest,pytest,sanitize,time}
BUILD=${FLASHGDN_BUILD:-build-gpu}
# A carried build keeps the RUNPATH of the machine that built it: find libflashgdn.so here.
export LD_LIBRARY_PATH=$PWD/$BUILD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
PY=${PYTHON:-python3}
declare -a SUMMARY
bundle() {
  { echo "| step | result |"; echo "|---|---|"; printf '%s\n' "${SUMMARY[@]}"; } >"$OUT/summary.md"
  cp "$LOG/gpu.txt" "$OUT/gpu.txt" 2>/dev/null
  tar czf "$OUT/logs.tar.gz" -C "$LOG" . 2>/dev/null
}
note() { SUMMARY+=("| $1 | $2 |"); echo "| $1 | $2 |"; bundle; }
# This tree's Python package into /tmp/site (the carried wheel where there is one), once a call.
install_pkg() {
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  [ -n "${PKG_INSTALLED:-}" ] && return
  if ls dist/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --upgrade --no-deps --no-index --target /tmp/site dist/*.whl
  else
    $PY -m pip install -q --upgrade --no-deps --no-build-isolation --target /tmp/site . >"$LOG/pip.log" 2>&1
  fi
  PKG_INSTALLED=1
}
# The working tree's hash (ignored files left out), from a scratch index: the device's copy of the
# tree sits on whatever commit its .git has, so HEAD alone does not name what was tested.
tree_id() {
  local idx
  idx=$(mktemp) && cp .git/index "$idx" 2>/dev/null &&
    GIT_INDEX_FILE=$idx git add -A >/dev/null 2>&1 && GIT_INDEX_FILE=$idx git write-tree 2>/dev/null
  rm -f "$idx"
}
# Small shapes that together reach every kernel and path: varlen with empty and one-token
# sequences, GVA, pools with a negative index, V-major states, checkpoints, l2norm, gate in kernel;
# the fused backward (bf16, K = V = 128, `default` and `fast`: T65_Hq4, GVA16_64, fast_T1000), which
# the filters before 2026-11-29 reached with one case or none (bench/results/h200-2026-11-29/
# fused-sanitize.md). initcheck reports the reduce reading the tiles the walk stores by TMA.
FUSED_SANITIZE='Cuda/CudaBackwardCase*T65_Hq4*:Cuda/CudaBackwardCase*GVA16_64_T130_D128*:Cuda/CudaBackwardCase*fast_T1000_Hq1_Hv2_D128*'
DEFAULT_SANITIZE="Cuda*all_options*:Cuda*varlen_edge*:Cuda*varlen_gate_in_kernel*:Cuda*varlen_pool_vfirst*:Cuda*GVA2_8_B2*:Cuda*T65_Hq4*:$FUSED_SANITIZE:Cuda*state_indices*:Cuda*checkpoints_64*"
has() { [[ ",$STEPS," == *",$1,"* ]]; }

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$LOG/gpu.txt"
echo "commit ${FLASHGDN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)} tree $(tree_id || echo unknown) $(date -u +%F)" | tee -a "$LOG/gpu.txt"
bundle

# A build left by an earlier call on a warm machine (same source path) is brought up to date, so
# that no step tests the previous call's tree; a build carried from elsewhere is used as it is.
if has build && { [ ! -x "$BUILD/flashgdn_tests" ] ||
  grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$PWD" "$BUILD/CMakeCache.txt" 2>/dev/null; }; then
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release >"$LOG/build.log" 2>&1 &&
    cmake --build "$BUILD" -j "$(nproc)" >>"$LOG/build.log" 2>&1 || { tail -30 "$LOG/build.log"; exit 1; }
fi

if has ctest; then
  t0=$SECONDS
  "$BUILD/flashgdn_tests" --gtest_brief=1 >"$LOG/ctest.log" 2>&1
  rc=$?
  tail -5 "$LOG/ctest.log"
  note "C++ tests (all, GPU included)" "$([ $rc -eq 0 ] && echo pass || echo FAIL) ($(grep -c '^\[  FAILED' "$LOG/ctest.log") failed lines, $((SECONDS - t0)) s)"
fi

if has pytest; then
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  FLA_DIR=${FLASHGDN_FLA_DIR:-$PWD/.whl/fla}
  if [ -f "$FLA_DIR/site/fla/__init__.py" ]; then
    PYTHONPATH=$PYTHONPATH:$FLA_DIR/site
    # FLA imports einops; the carried copy only where the interpreter has none.
    $PY -c "import einops" 2>/dev/null || PYTHONPATH=$PYTHONPATH:$FLA_DIR/deps
    fla_note="$($PY -c 'import fla; print("fla-core", fla.__version__, "from", fla.__file__)' 2>&1 | tail -1)"
  else
    fla_note="no $FLA_DIR (bash scripts/fetch_fla_wheel.sh, then carry .whl/fla): the FLA routing"
    fla_note+=" tests skip unless FLA is installed"
  fi
  echo "FLA: $fla_note" | tee -a "$LOG/gpu.txt"
  note "FLA for the routing tests" "$fla_note"
  install_pkg  # this call's tree, for the fuzz steps below too
  t0=$SECONDS
  # -rfEs: the short summary names every failure and error with its message (-rs alone lists the
  # skips only); each failure's line goes into the table too, so that no tail of the log loses one.
  FLASHGDN_ERROR_LOG="$LOG/errors.json" $PY -m pytest -q -rfEs -m gpu tests/python ${PYTEST_STOP--x} -p no:cacheprovider --durations=25 \
    >"$LOG/pytest.log" 2>&1
  rc=$?
  tail -15 "$LOG/pytest.log"
  note "Python GPU tests" "$(tail -1 "$LOG/pytest.log" | tr -d '=') ($((SECONDS - t0)) s)"
  while read -r failed; do note "Python GPU test failed" "$failed"; done < <(grep -E '^(FAILED|ERROR) ' "$LOG/pytest.log" | cut -c1-300)
fi

if has sanitize; then
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}; do
    filter=${SANITIZE_FILTER:-$DEFAULT_SANITIZE}
    # initcheck does not count the TMA engine's writes as initialisation, and the reduce reads the
    # tiles the fused walk stored by cp.async.bulk (1.4 million reports on its cases): the default
    # filter's fused cases run under the other three tools only.
    [ "$tool" = initcheck ] && [ -z "${SANITIZE_FILTER:-}" ] && filter="$filter-$FUSED_SANITIZE"
    compute-sanitizer --tool $tool --error-exitcode 9 --print-limit 20 \
      "$BUILD/flashgdn_tests" --gtest_brief=1 --gtest_filter="$filter" \
      >"$LOG/sanitize-$tool.log" 2>&1
    rc=$?
    note "compute-sanitizer $tool" "$([ $rc -eq 0 ] && echo clean || echo "FAIL rc=$rc") ($(grep -m1 -E '(ERROR|RACECHECK) SUMMARY' "$LOG/sanitize-$tool.log" || echo 'no summary'))"
  done
fi

if has time; then
  # Forward and forward+backward at (16, 64) and (2, 8), T = 32768: the peer benchmark's cells,
  # flashgdn alone (bench/run.py compares it with the peers when they are installed).
  $PY bench/run.py --full --configs 16/64,2/8 --layouts 1x32768 --modes fwd,fwdbwd \
    --contenders flashgdn --no-check --commit "${FLASHGDN_COMMIT:-unknown}" --out "$LOG/timing" \
    >"$LOG/timing.log" 2>&1
  grep -E '^(fwd|bwd)' "$LOG/timing.log" | tail -8
  $PY bench/profile_kernels.py --out "$LOG/kernels.md" >/dev/null 2>&1 || echo "kernel profile failed"
fi

if has sanitize-fuzz; then
  # compute-sanitizer on a fuzzed sample of calls (issue 38 item 5): the harness of the fuzz step,
  # SANITIZE_FUZZ_CASES small cases (<= 130 tokens) under each tool, only flashgdn's kernels
  # instrumented (kernel names containing "flashgdn"; torch's own kernels run unchecked), except
  # under initcheck: a kernel filter leaves the other kernels' writes untracked, so a tensor torch
  # computed on the GPU (sigmoid(beta) of use_beta_sigmoid_in_kernel) reads as uninitialised
  # (489 false reports on one case filtered, 0 unfiltered: H200, 2026-11-28, docs/reliability.md).
  # synccheck too: it aborted on the forward's kGateNorm named barrier until fk reached the gate
  # warp by an mbarrier instead (da2b253; docs/reliability.md). Not in the default steps.
  # SANITIZE_FUZZ_TOOLS picks the tools (default all four); SANITIZE_FUZZ_TIMEOUT (seconds) bounds
  # each tool's run, so that a slow one (initcheck) cannot take the rest of a device call.
  install_pkg
  SF_SEED=${FUZZ_SEED:-$RANDOM}
  for tool in ${SANITIZE_FUZZ_TOOLS:-memcheck racecheck synccheck initcheck}; do
    t0=$SECONDS
    # initcheck ran 40 cases past 450 s on an H100 while it reported TMA-stored o (2026-11-28);
    # with o by plain stores and no filter, 24 cases took ~40 s (H200): it takes 24.
    cases=${SANITIZE_FUZZ_CASES:-40}
    filter=(--kernel-name kns=flashgdn)
    [ $tool = initcheck ] && cases=${SANITIZE_FUZZ_INITCHECK_CASES:-24} && filter=()
    # initcheck does not count TMA stores as writes: o's full chunks go by plain stores under it.
    o_tma=1; [ $tool = initcheck ] && o_tma=0
    FLASHGDN_O_TMA=$o_tma timeout "${SANITIZE_FUZZ_TIMEOUT:-0}" \
      compute-sanitizer --tool $tool --error-exitcode 9 --print-limit 20 "${filter[@]}" \
      $PY tests/python/gdn_fuzz.py --device cuda --cases "$cases" --seed "$SF_SEED" \
      --max-tokens 130 >"$LOG/sanitize-fuzz-$tool.log" 2>&1
    rc=$?
    note "compute-sanitizer $tool on fuzzed calls (seed $SF_SEED)" "$([ $rc -eq 0 ] && echo clean || echo "FAIL rc=$rc") ($(grep -m1 -E '(ERROR|RACECHECK) SUMMARY' "$LOG/sanitize-fuzz-$tool.log" || echo 'no summary'); $(grep -m1 '^fuzz on' "$LOG/sanitize-fuzz-$tool.log" || echo 'no fuzz summary'); $((SECONDS - t0)) s)"
  done
fi

if has fuzz; then
  # Differential fuzzing against the float64 oracle (issue 38, docs/reliability.md): the harness of
  # tests/python/test_fuzz.py on CUDA tensors, FUZZ_CASES cases from FUZZ_SEED (printed: rerun a
  # campaign with it), failures shrunk and printed as JSON for tests/python/fuzz_regressions.json.
  # Not in the default steps: bash scripts/gpu_check.sh fuzz (after a build, or with one carried).
  install_pkg
  FUZZ_SEED=${FUZZ_SEED:-$RANDOM}
  t0=$SECONDS
  # FUZZ_SECONDS bounds it so that it ends inside one device call (a call cut short returns no
  # summary): no case starts after it.
  $PY tests/python/gdn_fuzz.py --device cuda --cases "${FUZZ_CASES:-1500}" --seed "$FUZZ_SEED" \
    --max-tokens "${FUZZ_MAX_TOKENS:-300}" --time-limit "${FUZZ_SECONDS:-400}" \
    --json "$LOG/fuzz.json" >"$LOG/fuzz.log" 2>&1
  rc=$?
  grep -v '^\[err\]' "$LOG/fuzz.log" | grep -v '^cases per class' | tail -20
  note "fuzz (CUDA vs the oracle, seed $FUZZ_SEED)" "$(grep -m1 '^fuzz on' "$LOG/fuzz.log" || echo "rc=$rc, no summary") ($((SECONDS - t0)) s)"
fi

if has fwd; then
  # The forward's development loop (issue 37), one call: its CP tests (C++), its errors and its
  # times in both q/k conventions (normalised in the kernel, or before the call), CP automatic and
  # off, on the rows where the convention changed the plan. Logs: fwd-* in logs.tar.gz.
  t0=$SECONDS
  "$BUILD/flashgdn_tests" --gtest_brief=1 --gtest_filter='*CudaCP*:*ContextParallel*:*CudaForward*' \
    >"$LOG/fwd-tests.log" 2>&1
  note "forward tests (C++)" "$(grep -E '^\[  (PASSED|FAILED)  \]' "$LOG/fwd-tests.log" | tr '\n' ' ') ($((SECONDS - t0)) s)"
  for qn in in_kernel prenormalized; do
    "$BUILD/flashgdn_run" --device cuda --T 2048 --Hq 16 --Hv 64 --backward 0 --check 1 --qk-norm $qn \
      >"$LOG/fwd-errors-$qn.log" 2>&1
    note "forward errors, $qn (16/64, T 2048)" "$(grep -E '^\| (o|final_state) ' "$LOG/fwd-errors-$qn.log" | tr -s ' ' | tr '\n' ' ')"
    for row in 16/64/32768 16/64/8192 2/8/32768; do
      IFS=/ read -r hq hv tt <<<"$row"
      for cp in auto off; do
        "$BUILD/flashgdn_run" --device cuda --T "$tt" --Hq "$hq" --Hv "$hv" --backward 0 --check 0 --iters 20 \
          --cp $cp --qk-norm $qn >"$LOG/fwd-time-$qn-$hq-$hv-$tt-$cp.log" 2>&1
        note "forward ms, $qn, CP $cp ($hq/$hv 1x$tt)" "$(grep -E '^\| forward ' "$LOG/fwd-time-$qn-$hq-$hv-$tt-$cp.log" | tr -s ' ')"
      done
    done
  done
fi

if has bwd; then
  # The backward's development loop (issue 36), one call: its C++ tests, its errors at each level
  # (default, fast, high; 16/64, T = 2048), its times at 16/64 and 2/8 1x32768 at each level, and
  # Nsight Compute's time per kernel of one 16/64 fwd+bwd (when ncu is there). Logs: bwd-* in logs.tar.gz.
  t0=$SECONDS
  "$BUILD/flashgdn_tests" --gtest_brief=1 --gtest_filter='*Backward*:GateReset*' >"$LOG/bwd-tests.log" 2>&1
  note "backward tests (C++)" "$(grep -E '^\[  (PASSED|FAILED)  \]' "$LOG/bwd-tests.log" | tr '\n' ' ') ($((SECONDS - t0)) s)"
  for pr in default fast high; do
    "$BUILD/flashgdn_run" --device cuda --T 2048 --Hq 16 --Hv 64 --backward 1 --check 1 --precision $pr \
      >"$LOG/bwd-errors-$pr.log" 2>&1
    note "backward errors, $pr (16/64, T 2048)" "$(grep -E '^\| d' "$LOG/bwd-errors-$pr.log" | tr -s ' ' | tr '\n' ' ')"
    for heads in 16/64 2/8; do
      "$BUILD/flashgdn_run" --device cuda --T 32768 --Hq "${heads%/*}" --Hv "${heads#*/}" --backward 1 --check 0 \
        --iters 7 --precision $pr >"$LOG/bwd-time-$pr-${heads/\//-}.log" 2>&1
      note "backward ms, $pr ($heads 1x32768)" "$(grep -E '^\| (backward|forward\+backward) ' "$LOG/bwd-time-$pr-${heads/\//-}.log" | tr -s ' ' | tr '\n' ' ')"
    done
  done
  # The reverse pass unsplit (--cp off) beside the rows above (automatic): what its context
  # parallelism gives, on the same machine.
  for heads in 16/64 2/8; do
    "$BUILD/flashgdn_run" --device cuda --T 32768 --Hq "${heads%/*}" --Hv "${heads#*/}" --backward 1 --check 0 \
      --iters 7 --cp off >"$LOG/bwd-time-cpoff-${heads/\//-}.log" 2>&1
    note "backward ms, default, CP off ($heads 1x32768)" "$(grep -E '^\| (backward|forward\+backward) ' "$LOG/bwd-time-cpoff-${heads/\//-}.log" | tr -s ' ' | tr '\n' ' ')"
  done
  # The per-chunk steps in one block (FLASHGDN_BWD_BLOCK_SLOTS above the slot count: the schedule
  # before blocks of chunk slots, docs/design.md) beside the automatic blocks, same machine.
  FLASHGDN_BWD_BLOCK_SLOTS=1000000000 "$BUILD/flashgdn_run" --device cuda --T 32768 --Hq 16 --Hv 64 --backward 1 \
    --check 0 --iters 7 >"$LOG/bwd-time-oneblock.log" 2>&1
  note "backward ms, default, one block (16/64 1x32768)" "$(grep -E '^\| (backward|forward\+backward) |workspace' "$LOG/bwd-time-oneblock.log" | tr -s ' ' | tr '\n' ' ')"
  if command -v ncu >/dev/null; then
    # Every kernel of the run, the forward's included (the backward's are the *_kernel names):
    # each name's summed time and launch count, with the automatic blocks and with one block.
    for blocks in auto one; do
      slots=0
      [ $blocks = one ] && slots=1000000000
      FLASHGDN_BWD_BLOCK_SLOTS=$slots ncu --metrics gpu__time_duration.sum \
        "$BUILD/flashgdn_run" --device cuda --T 32768 --Hq 16 --Hv 64 --backward 1 --check 0 --iters 1 \
        >"$LOG/bwd-kernels-$blocks.log" 2>&1
      note "kernels, ms x launches (16/64 1x32768 fwd+bwd, Nsight, blocks: $blocks)" "$(awk '/Context [0-9]+, Stream/ {
          k = "?"; if (match($0, /[A-Za-z0-9_]+_kernel(<[^>]*>)?/)) k = substr($0, RSTART, RLENGTH) }
        /gpu__time_duration.sum/ { v = $NF; if ($(NF - 1) == "us") v = v / 1000; if (!(k in t)) o[++n] = k; t[k] += v; c[k]++ }
        END { for (i = 1; i <= n; ++i) printf "%s %.2f x%d; ", o[i], t[o[i]], c[o[i]] }' "$LOG/bwd-kernels-$blocks.log")"
    done
  fi
fi

if has ab; then
  # One A/B on one machine (bench/NOTES.md's before/after): each base of scripts/ab_base.sh
  # (.ab/NAME, carried; several NAMEs for several variants) built beside this tree, then
  # flashgdn_run on all of them, interleaved, AB_REPS times (default 3; odd repetitions run the
  # bases in name order and this tree last, even ones the reverse, so that a drift over a long
  # row, a clock or the GPU's heat, does not always fall on one tree): the backward (or
  # AB_MODE=forward: the forward alone) at each of AB_LEVELS (default "default fast") on each of
  # AB_ROWS (Hq/Hv/T, default "16/64/32768 2/8/32768"); each tree's errors at 16/64, T = 2048;
  # whether each base's outputs have this tree's bits (digests); with AB_NCU (a kernel name
  # regex), Nsight Compute's duration of each matching launch, per tree and row. Logs: ab-* in
  # logs.tar.gz.
  bases=()
  for d in .ab/*/; do [ -f "$d/CMakeLists.txt" ] && bases+=("$(basename "$d")"); done
  if [ ${#bases[@]} = 0 ]; then
    note "A/B" "no .ab/NAME (bash scripts/ab_base.sh REF [NAME] here, then carry .ab)"
  else
    t0=$SECONDS
    for name in "${bases[@]}"; do
      { cmake -S ".ab/$name" -B ".ab/$name/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHGDN_TESTS=OFF &&
        cmake --build ".ab/$name/build" -j "$(nproc)" --target flashgdn_run; } >"$LOG/ab-build-$name.log" 2>&1 &
    done
    wait
    for name in "${bases[@]}"; do
      [ -x ".ab/$name/build/flashgdn_run" ] || { tail -30 "$LOG/ab-build-$name.log"; exit 1; }
    done
    ab_bin() { [ "$1" = tree ] && echo "$BUILD" || echo ".ab/$1/build"; }
    ab_label() { [ "$1" = tree ] && echo "this tree" || cat ".ab/$1/COMMIT" 2>/dev/null || echo "$1"; }
    ab_run() {  # tree (a base's name | tree), flashgdn_run arguments; prints its table rows on one line
      local b
      b=$(ab_bin "$1")
      shift
      LD_LIBRARY_PATH=$PWD/$b "$b/flashgdn_run" --device cuda "$@" 2>&1 |
        grep -E '^\| (forward|backward|o|final_state|d[a-z0-9]+) \||workspace' | tr -s ' ' | tr '\n' ' '
    }
    trees=("${bases[@]}" tree)
    bwd=1
    [ "${AB_MODE:-backward}" = forward ] && bwd=0
    for rep in $(seq "${AB_REPS:-3}"); do
      for row in ${AB_ROWS:-16/64/32768 2/8/32768}; do
        IFS=/ read -r hq hv tt <<<"$row"
        for pr in ${AB_LEVELS:-default fast}; do
          for qn in ${AB_QK:-in_kernel}; do  # the q/k conventions timed (in_kernel prenormalized)
            order=("${trees[@]}")
            [ $((rep % 2)) = 0 ] && mapfile -t order < <(printf '%s\n' "${trees[@]}" | tac)
            for tree in "${order[@]}"; do
              line=$(ab_run "$tree" --T "$tt" --Hq "$hq" --Hv "$hv" --backward $bwd --check 0 --iters 9 \
                --precision "$pr" --qk-norm "$qn")
              echo "$tree $pr $qn $row rep $rep: $line" >>"$LOG/ab-times.log"
              note "A/B ms, $tree ($(ab_label "$tree")), $pr, q/k $qn, $hq/$hv 1x$tt, rep $rep" "$line"
            done
          done
        done
      done
    done
    # Each tree's median over the repetitions, per row, level and convention.
    while read -r key med; do note "A/B median ms, $key" "$med"; done < <(awk -v mode="${AB_MODE:-backward}" '
      { key = $1 " " $2 " " $3 " " $4; v = ""
        for (i = 1; i < NF; ++i) if ($i == mode && $(i + 1) == "|") { v = $(i + 2); break }
        if (v != "") { n[key]++; x[key, n[key]] = v; if (!(key in seen)) { seen[key] = 1; order[++k] = key } } }
      END { for (j = 1; j <= k; ++j) { key = order[j]; m = n[key]
              for (a = 1; a <= m; ++a) for (b = a + 1; b <= m; ++b) if (x[key, b] + 0 < x[key, a] + 0) { t = x[key, a]; x[key, a] = x[key, b]; x[key, b] = t }
              med = m % 2 ? x[key, (m + 1) / 2] : (x[key, m / 2] + x[key, m / 2 + 1]) / 2
              gsub(" ", ",", key); printf "%s %.4g\n", key, med } }' "$LOG/ab-times.log")
    for pr in ${AB_LEVELS:-default fast}; do
      for tree in "${trees[@]}"; do
        note "A/B errors, $tree, $pr (16/64, T 2048)" \
          "$(ab_run "$tree" --T 2048 --Hq 16 --Hv 64 --backward $bwd --check 1 --precision "$pr" | grep -oE '\| (o|final_state|d[a-z0-9]+) \| [0-9.e+-]+ \|' | tr '\n' ' ')"
      done
    done
    # The outputs' bits (flashgdn_run --digest, 64-bit FNV-1a of every output's bytes) on each of
    # AB_ROWS at each level, each base against this tree: "same bits" or the outputs that differ.
    # A base older than 4c2475d has no --digest: "no digest".
    ab_digest() {  # tree, Hq, Hv, T, level
      local b
      b=$(ab_bin "$1")
      LD_LIBRARY_PATH=$PWD/$b "$b/flashgdn_run" --device cuda --T "$4" --Hq "$2" --Hv "$3" --backward $bwd \
        --check 0 --iters 1 --precision "$5" --digest 1 2>/dev/null | grep -o 'digest [a-z]*:.*' | cut -d: -f2-
    }
    for row in ${AB_ROWS:-16/64/32768 2/8/32768}; do
      IFS=/ read -r hq hv tt <<<"$row"
      for pr in ${AB_LEVELS:-default fast}; do
        mine=$(ab_digest tree "$hq" "$hv" "$tt" "$pr")
        for name in "${bases[@]}"; do
          theirs=$(ab_digest "$name" "$hq" "$hv" "$tt" "$pr")
          if [ -z "$theirs" ] || [ -z "$mine" ]; then
            verdict="no digest"
          elif [ "$theirs" = "$mine" ]; then
            verdict="same bits"
          else
            verdict="differ:$(join <(tr ' ' '\n' <<<"$theirs" | sort) <(tr ' ' '\n' <<<"$mine" | sort) -v 2 | cut -d= -f1 | tr '\n' ' ')"
          fi
          echo "$pr $row $name: $theirs | $mine" >>"$LOG/ab-digests.log"
          note "A/B bits, $name against this tree, $pr, $hq/$hv 1x$tt" "$verdict"
        done
      done
    done
    if [ -n "${AB_NCU:-}" ]; then  # each matching kernel's duration (us, Nsight Compute's clocks), in launch order
      for row in ${AB_ROWS:-16/64/32768 2/8/32768}; do
        IFS=/ read -r hq hv tt <<<"$row"
        for tree in "${trees[@]}"; do
          b=$(ab_bin "$tree")
          note "A/B ncu us, $AB_NCU, $tree, $hq/$hv 1x$tt" "$(LD_LIBRARY_PATH=$PWD/$b ncu --metrics gpu__time_duration.sum \
            -k regex:"$AB_NCU" "$b/flashgdn_run" --device cuda --T "$tt" --Hq "$hq" --Hv "$hv" --backward $bwd --check 0 \
            --iters 1 2>&1 | awk '/gpu__time_duration.sum/ { v = $NF; if ($(NF - 1) == "ms") v *= 1000; if ($(NF - 1) == "ns") v /= 1000; printf "%s ", v }')"
        done
      done
    fi
    note "A/B" "bases ${bases[*]} against this tree ($((SECONDS - t0)) s)"
  fi
fi

if has ncu; then
  # Where the fused backward's warps wait: Nsight Compute's stall samples by instruction of one
  # launch of NCU_KERNEL (default fused_bwd) in a forward + backward at NCU_HEADS (default 16/64,
  # one NCU_T-token sequence, default 32768), summarised by bench/ncu_stalls.py; the CSV in the
  # logs. Not in the default steps.
  install_pkg
  t0=$SECONDS
  PYTHONPATH=$PYTHONPATH:$PWD/bench ncu -k regex:"${NCU_KERNEL:-fused_bwd}" -s 1 -c 1 --section SourceCounters \
    --section WarpStateStats --page source --csv --print-source sass \
    $PY bench/ncu_stalls.py --drive "${NCU_HEADS:-16/64}" --T "${NCU_T:-32768}" >"$LOG/ncu.csv" 2>"$LOG/ncu.err"
  $PY bench/ncu_stalls.py "$LOG/ncu.csv" --top 12 >"$LOG/ncu-summary.txt" 2>&1
  cat "$LOG/ncu-summary.txt"
  # The walk's cubin, for the samples by role and stage (bench/ncu_stalls.py --sass, nvdisasm here
  # or on the CPU machine: the source lines must be this tree's).
  cub=$(mktemp -d)
  (cd "$cub" && cuobjdump -xelf all "$OLDPWD/$BUILD/libflashgdn.so" >/dev/null 2>&1)
  cp "$cub"/bwd_fused.sm_*.cubin "$LOG/walk.cubin" 2>/dev/null  # (not bwd_fused_prep, _reduce, _scan)
  if command -v nvdisasm >/dev/null && [ -f "$LOG/walk.cubin" ]; then
    nvdisasm -g -gi -c "$LOG/walk.cubin" >"$cub/walk.sass" 2>/dev/null &&
      $PY bench/ncu_stalls.py "$LOG/ncu.csv" --sass "$cub/walk.sass" >"$LOG/ncu-stages.txt" 2>&1
  fi
  rm -rf "$cub"
  note "ncu stalls, ${NCU_KERNEL:-fused_bwd}" "$(sed -n 2,4p "$LOG/ncu-summary.txt" | tr -s ' ' | tr '\n' ';') ($((SECONDS - t0)) s)"
fi

if has timeline; then
  # The fused walk's per-role stage timeline (csrc/sm90/bwd_fused_timeline.cuh): a build of its own
  # with -DFLASHGDN_WALK_TIMELINE=ON (build-timeline/), flashgdn_run's backward at TL_HEADS (default
  # 16/64) on one TL_T-token sequence (default 8192), CP TL_CP (default off: CTA (0, 0, 0) walks the
  # whole sequence; auto: its first segment, in the walk's last launch), `default` unless
  # TL_PRECISION; the table it prints to stderr, then the launch's CTAs' entries and exits. Not in
  # the default steps.
  t0=$SECONDS
  tl_heads=${TL_HEADS:-16/64}
  if cmake -S . -B build-timeline -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHGDN_WALK_TIMELINE=ON \
      -DFLASHGDN_TESTS=OFF >"$LOG/timeline-build.log" 2>&1 &&
      cmake --build build-timeline -j"$(nproc)" --target flashgdn_run >>"$LOG/timeline-build.log" 2>&1; then
    LD_LIBRARY_PATH=$PWD/build-timeline build-timeline/flashgdn_run --device cuda --T "${TL_T:-8192}" \
      --Hq "${tl_heads%/*}" --Hv "${tl_heads#*/}" --backward 1 --check 0 --cp "${TL_CP:-off}" --iters 3 \
      --precision "${TL_PRECISION:-default}" >"$LOG/timeline-run.log" 2>"$LOG/timeline.md"
    cat "$LOG/timeline.md"
    note "walk timeline, $tl_heads 1x${TL_T:-8192} ${TL_PRECISION:-default}" \
      "$(grep -E '^chunk period' "$LOG/timeline.md" | cut -c1-40) ($((SECONDS - t0)) s)"
  else
    tail -20 "$LOG/timeline-build.log"
    note "walk timeline" "build failed ($((SECONDS - t0)) s)"
  fi
fi

echo
echo "| step | result |"
echo "|---|---|"
printf '%s\n' "${SUMMARY[@]}"
[ -f "$LOG/timing/results.md" ] && sed -n '/^## Forward/,$p' "$LOG/timing/results.md" | head -30
bundle
exit 0
