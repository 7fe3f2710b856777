"""Every gradient's error against the float64 oracle, flashgdn's levels and backward paths beside
the peers', on the same inputs over several draws: the evidence for issue 36's precision item
(the `default` level's every gradient no worse than the best peer's on the same inputs).

One process, one GPU. Inputs, oracle and calls are the benchmark's (gdnbench: realistic gates,
bf16 q/k/v, h0 and dht, scale K^-0.5); each draw is a fresh seed. A flashgdn variant is a level
and, optionally, environment variables the library reads at each call (the backward path:
FLASHGDN_BWD_FUSED=0 for the staged kernels), written LEVEL or LEVEL:VAR=VAL;VAR=VAL. Prints, per head configuration,
layout and q/k convention, each gradient's median and largest relative L2 error over the draws,
and each flashgdn variant's median against the best peer's median (ratio <= 1: no worse).

    python bench/grad_precision.py --configs 16/64,2/8 --layouts 1x2048,check --seeds 4 \\
        --variants "default,fast,default:FLASHGDN_BWD_FUSED=0" --peers flashqla [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def parse_layout(spec: str):
    from gdnbench import configs as C

    if spec == "check":
        return C.CHECK_LAYOUT
    if "x" in spec and spec.split("x")[0].isdigit():
        n, t = (int(x) for x in spec.split("x"))
        return C.seq(t) if n == 1 else C.varlen(n, t)
    raise SystemExit(f"--layouts: {spec!r} is not 'check' or NxT (e.g. 1x2048, 4x512)")


def parse_variant(spec: str):
    level, _, env = spec.partition(":")
    if level not in ("default", "fast", "high"):
        raise SystemExit(f"--variants: {spec!r}: the level must be default, fast or high")
    pairs = {}
    for kv in filter(None, env.split(";")):
        k, sep, v = kv.partition("=")
        if not sep:
            raise SystemExit(f"--variants: {spec!r}: {kv!r} is not VAR=VAL")
        pairs[k] = v
    return level, pairs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/grad_precision.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="16/64,2/8", help="Hq/Hv, comma list")
    ap.add_argument("--layouts", default="1x2048,check", help="NxT (N sequences of T tokens) or 'check', comma list")
    ap.add_argument("--qk-norm", default="in_kernel,prenormalized", help="q/k conventions, comma list")
    ap.add_argument("--seeds", type=int, default=4, help="draws per cell")
    ap.add_argument("--first-seed", type=int, default=7,
                    help="the first draw's seed (7: the benchmark's accuracy check draws these inputs)")
    ap.add_argument("--variants", default="default,fast",
                    help="flashgdn variants, comma list of LEVEL[:VAR=VAL;VAR=VAL]")
    ap.add_argument("--peers", default="flashqla", help="comma list of flashqla, fla (those with a backward)")
    ap.add_argument("--out", default=None, help="folder for grad_precision.json and .md")
    a = ap.parse_args(argv)

    import torch

    from gdnbench import contenders as K
    from gdnbench.cli import accuracy_check
    from gdnbench.inputs import make_inputs
    from gdnbench.oracle import oracle

    if not torch.cuda.is_available():
        print("grad_precision: no CUDA device", file=sys.stderr)
        return 2
    variants = [(v, *parse_variant(v)) for v in filter(None, a.variants.split(","))]
    peers = []
    for n in filter(None, a.peers.split(",")):
        obj = K.ALL[n]()
        try:
            obj.load()
            peers.append((n, obj))
        except K.Unavailable as e:
            print(f"# {n}: not installed ({e})", file=sys.stderr)
    fg = K.FlashGDN()
    fg.load()
    saved_env = {k: os.environ.get(k) for _, _, env in variants for k in env}

    results = []
    lines = [f"# gradient errors against the float64 oracle, median (max) over {a.seeds} draws; "
             f"GPU {torch.cuda.get_device_name(0)}; flashgdn {fg.version()}"]
    for n, obj in peers:
        lines.append(f"# {n}: {obj.version()}")
    for cfg in filter(None, a.configs.split(",")):
        hq, hv = (int(x) for x in cfg.split("/"))
        for lay_spec in filter(None, a.layouts.split(",")):
            layout = parse_layout(lay_spec)
            for qk in filter(None, a.qk_norm.split(",")):
                errs = {}  # name -> grad -> [per seed]
                for seed in range(a.first_seed, a.first_seed + a.seeds):
                    inp = make_inputs(hq, hv, layout, seed=seed, requires_grad=True, with_grads_out=True,
                                      qk_norm=qk)
                    ref = oracle(inp, True)
                    runs = [(label, fg, level, env) for label, level, env in variants]
                    runs += [(n, obj, None, {}) for n, obj in peers]
                    for label, obj, level, env in runs:
                        if level is not None:
                            obj.precision = level
                        for k, v in env.items():
                            os.environ[k] = v
                        t0 = time.perf_counter()
                        try:
                            r = accuracy_check(torch, obj, inp, ref, True)
                        finally:
                            for k in env:
                                if saved_env[k] is None:
                                    os.environ.pop(k, None)
                                else:
                                    os.environ[k] = saved_env[k]
                        print(f"# {cfg} {layout.name} {qk} seed {seed} {label}: {time.perf_counter() - t0:.1f} s",
                              file=sys.stderr, flush=True)
                        for t in ("q", "k", "v", "g", "beta", "h0"):
                            inp[t].grad = None
                        for g in GRADS:
                            errs.setdefault(label, {}).setdefault(g, []).append(float(r.get(g, float("nan"))))
                    del inp, ref
                    torch.cuda.empty_cache()
                med = {lab: {g: statistics.median(v) for g, v in d.items()} for lab, d in errs.items()}
                best = {g: min((med[n][g] for n, _ in peers if med[n][g] == med[n][g]), default=float("nan"))
                        for g in GRADS}
                results.append(dict(config=cfg, layout=layout.name, qk_norm=qk, seeds=a.seeds, errors=errs,
                                    median=med, best_peer_median=best))
                lines.append("")
                lines.append(f"## {cfg} {layout.name} {qk}")
                lines.append("| | " + " | ".join(GRADS) + " |")
                lines.append("|---" * (len(GRADS) + 1) + "|")
                for lab, d in errs.items():
                    lines.append(f"| {lab} | " + " | ".join(f"{statistics.median(d[g]):.2e} ({max(d[g]):.2e})"
                                                              for g in GRADS) + " |")
                if peers:
                    for lab, _, _ in variants:
                        lines.append(f"| {lab} / best peer | " + " | ".join(
                            f"{med[lab][g] / best[g]:.2f}" if best[g] == best[g] and best[g] > 0 else "-"
                            for g in GRADS) + " |")
                print("\n".join(lines[-(len(errs) + len(variants) * bool(peers) + 3):]), flush=True)
    text = "\n".join(lines) + "\n"
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "grad_precision.md").write_text(text)
        (out / "grad_precision.json").write_text(json.dumps(results, indent=1))
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
