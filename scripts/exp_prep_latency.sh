#!/usr/bin/env bash
# exp/prep-latency on the GPU in one call: the fused backward's prep and reduce with their loads
# batched (and prep at four CTAs an SM), against main's kernels (FLASHGDN_EXP_OLD_PREP=1, the
# branch's temporary knob) in the same build: the fused tests; the same bits both ways; the
# benchmark's rows both ways; the kernel profile both ways.
set -uo pipefail
t0=$SECONDS
OUT=${OUT:-/tmp/out}
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release > /tmp/build.log 2>&1 && cmake --build build-gpu -j16 >> /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site . > /tmp/pip.log 2>&1 || { tail -20 /tmp/pip.log; exit 1; }
echo "build $((SECONDS - t0)) s"
export PYTHONPATH=/tmp/site LD_LIBRARY_PATH=$PWD/build-gpu
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/python/test_bwd_fused.py 2>&1 | grep -v "^SKIPPED" | tail -3
echo "tests $((SECONDS - t0)) s"
timeout 60 python3 - <<'PY'
import os, torch
from flashgdn import chunk_gated_delta_rule
torch.manual_seed(3)
dev = "cuda"
for Hq, Hv, lens, norm in [(16, 64, [101, 539, 384, 3000], True), (16, 64, [4096], False), (2, 8, [777, 64, 1], True)]:
    T = sum(lens); K = 128
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
    q = torch.randn(1, T, Hq, K, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, T, Hq, K, device=dev, dtype=torch.bfloat16)
    if not norm:
        q = torch.nn.functional.normalize(q.float(), dim=-1).bfloat16(); k = torch.nn.functional.normalize(k.float(), dim=-1).bfloat16()
    v = torch.randn(1, T, Hv, K, device=dev, dtype=torch.bfloat16)
    g = -torch.rand(1, T, Hv, device=dev) * torch.linspace(0, 3, Hv, device=dev)
    beta = torch.rand(1, T, Hv, device=dev).bfloat16()
    do = torch.randn(1, T, Hv, K, device=dev, dtype=torch.bfloat16)
    grads = []
    for knob in ("1", "0"):
        os.environ["FLASHGDN_EXP_OLD_PREP"] = knob
        xs = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
        o, _ = chunk_gated_delta_rule(*xs, use_qk_l2norm_in_kernel=norm, cu_seqlens=cu)
        o.backward(do)
        torch.cuda.synchronize()
        grads.append([x.grad for x in xs])
    same = [torch.equal(a, b) for a, b in zip(*grads)]
    print(f"same bits {Hq}/{Hv} {lens} l2norm={norm}: {same}")
PY
for knob in 0 1; do
  echo "== FLASHGDN_EXP_OLD_PREP=$knob"
  FLASHGDN_EXP_OLD_PREP=$knob timeout 90 python3 bench/run.py --full --contenders flashgdn --modes bwd,fwdbwd \
    --configs 16/64,2/8 --layouts 1x32768,4x8192,1x8192 --no-check --prewarm 0 --target-ms 100 --out $OUT/rows-$knob 2>&1 | grep -E "^(bwd|fwdbwd) "
done
echo "A/B $((SECONDS - t0)) s"
for knob in 0 1; do
  FLASHGDN_EXP_OLD_PREP=$knob PYTHONPATH=/tmp/site:$PWD/bench timeout 90 python3 bench/profile_kernels.py --T 32768 --heads 16/64,2/8 --out $OUT/kernels-$knob.md > /dev/null 2>&1
  echo "== kernels, knob $knob"; grep -E "forward\+backward|prep|reduce" $OUT/kernels-$knob.md | cut -c1-140
done
echo "done $((SECONDS - t0)) s"
