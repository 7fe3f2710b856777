#!/usr/bin/env bash
# exp/fp16-island on the GPU in one call (bench/fused-backward.md, "The fp16 island"): build; main's
# bwd_fused.cu (from git) built beside it into a second library for an A/B in the same call; the
# fused tests, the fuzz and the backward tests of test_gpu.py; every gradient's error on the
# benchmark's check inputs (with FlashQLA where scripts/gpu_bench.sh unpacked it); times of 16/64
# and 2/8 at one 32768-token sequence, `default` and `fast`, branch against main; the benchmark's
# backward and forward + backward rows (autograd, saved states) at 16/64 and 2/8.
set -uo pipefail
t0=$SECONDS
OUT=${OUT:-/tmp/out}
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release > /tmp/build.log 2>&1 && cmake --build build-gpu -j16 >> /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site . > /tmp/pip.log 2>&1 || { tail -20 /tmp/pip.log; exit 1; }
echo "build $((SECONDS - t0)) s"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# main's kernel sources beside the branch's: the same compile line on them, the library relinked
main_lib=""
if rm -rf /tmp/mainsrc && mkdir -p /tmp/mainsrc && git archive main csrc 2>/dev/null | tar -x -C /tmp/mainsrc; then
  (cd build-gpu && python3 - <<'PY'
import re, subprocess
cmds = subprocess.run(["ninja", "-t", "commands", "flashgdn"], capture_output=True, text=True).stdout.splitlines()
cc = re.sub(r" -MD -MT \S+ -MF \S+", "", [c for c in cmds if "/csrc/sm90/bwd_fused.cu -o " in c][0])
obj = "CMakeFiles/flashgdn.dir/csrc/sm90/bwd_fused.cu.o"
src = cc.split(" -c ")[-1].split()[0]
root = src[: src.index("/csrc/sm90/bwd_fused.cu")]
cc = cc.replace(f"-o {obj}", "-o /tmp/mainsrc/bwd_fused.o").replace(root + "/csrc", "/tmp/mainsrc/csrc")
cc = cc.replace(f"-I{root}/csrc", "-I/tmp/mainsrc/csrc")
assert subprocess.run(cc, shell=True).returncode == 0
link = [c for c in cmds if " -shared " in c][0].replace(obj, "/tmp/mainsrc/bwd_fused.o")
link = re.sub(r"-o (\S*libflashgdn\.so\S*)", "-o /tmp/mainsrc/libflashgdn.so.0.2", link)
assert subprocess.run(link, shell=True).returncode == 0
PY
  ) && main_lib=/tmp/mainsrc && echo "main's kernel built $((SECONDS - t0)) s"
fi
export PYTHONPATH=/tmp/site:/tmp/peers${PYTHONPATH:+:$PYTHONPATH} LD_LIBRARY_PATH=$PWD/build-gpu
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/python/test_bwd_fused.py tests/python/test_fuzz.py \
  "tests/python/test_gpu.py" -k "fused or fuzz or backward or regression" 2>&1 | tail -6
echo "tests $((SECONDS - t0)) s"
peers=""; [ -d /tmp/peers/flash_qla ] && peers=flashqla
timeout 150 python3 bench/grad_precision.py --configs 16/64 --layouts check --qk-norm in_kernel --seeds 2 \
  --variants "default,fast" --peers "$peers" --out $OUT/precision 2>&1 | tail -14
echo "precision $((SECONDS - t0)) s"
for lib in $PWD/build-gpu $main_lib; do
  for lv in default fast; do for hh in "16 64" "2 8"; do set -- $hh
    r=$(LD_LIBRARY_PATH=$lib build-gpu/flashgdn_run --device cuda --T 32768 --Hq $1 --Hv $2 --backward 1 --check 0 --iters 7 --precision $lv --qk-norm in_kernel 2>&1 | grep "| backward" | tr '\n' ' ')
    echo "$(basename $lib) $lv $1/$2: $r"
  done; done
done
timeout 120 python3 bench/run.py --full --contenders flashgdn --modes bwd,fwdbwd --configs 16/64,2/8 \
  --layouts 1x32768,1x8192,4x8192 --no-check --prewarm 0 --target-ms 120 --out $OUT/island 2>&1 | grep -E "^(bwd|fwdbwd) "
echo "done $((SECONDS - t0)) s"
