"""Degenerate keys on the library's backward levels (bench/fused-backward.md, "Degenerate keys
break a 16-bit Ar"): every token of a head with one unit key (`identical`) or one key with
alternating signs (`alternating`), beta = 0.99 for every token, the benchmark's gates (head 0
without decay, the others A in [0, 16]); q, v, dO normal, bf16, an initial state and dht. Each
gradient's relative L2 error against the float64 oracle, per precision level, and at `fast` with
the fused backward (FLASHGDN_BWD_FUSED=1) where the device is CUDA. Random keys beside them, for
scale. The float64 emulation (bench/fused_precision.py) predicts that 16-bit Ar and T diag(beta)
lose dv and dbeta on such keys; this measures the kernels.

    python bench/degenerate_keys.py [--device cuda] [--T 512] [--heads 2/4] [--keys identical,alternating,random]
"""
import argparse
import os

import numpy as np
import torch

import flashgdn
from flashgdn.reference import reference_backward, to_f64

GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def make_inputs(keys, T, Hq, Hv, device, seed=2026):
    gen = torch.Generator().manual_seed(seed)
    K = V = 128
    q = torch.nn.functional.normalize(torch.randn(1, T, Hq, K, generator=gen), dim=-1)
    if keys == "random":
        k = torch.nn.functional.normalize(torch.randn(1, T, Hq, K, generator=gen), dim=-1)
    else:
        k0 = torch.nn.functional.normalize(torch.randn(1, 1, Hq, K, generator=gen), dim=-1)
        sign = torch.ones(T) if keys == "identical" else torch.where(torch.arange(T) % 2 == 1, -1.0, 1.0)
        k = k0 * sign.view(1, T, 1, 1)
    v = torch.randn(1, T, Hv, V, generator=gen)
    A = 16.0 * torch.rand(Hv, generator=gen)
    A[0] = 0.0
    g = -A * torch.nn.functional.softplus(torch.randn(1, T, Hv, generator=gen) + 1.0)
    beta = torch.full((1, T, Hv), 0.99)
    h0 = 0.1 * torch.randn(1, Hv, K, V, generator=gen)
    do = torch.randn(1, T, Hv, V, generator=gen)
    dht = 0.1 * torch.randn(1, Hv, K, V, generator=gen)
    bf = lambda x: x.to(device=device, dtype=torch.bfloat16).contiguous()  # noqa: E731
    f32 = lambda x: x.to(device=device, dtype=torch.float32).contiguous()  # noqa: E731
    return (bf(q), bf(k), bf(v), f32(g), f32(beta)), f32(h0), bf(do), f32(dht)


def rel(x, ref):
    a, r = to_f64(x), ref
    return float(np.linalg.norm((a - r).ravel()) / max(np.linalg.norm(r.ravel()), 1e-300))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--heads", default="2/4")
    ap.add_argument("--keys", default="identical,alternating,random")
    a = ap.parse_args()
    Hq, Hv = (int(x) for x in a.heads.split("/"))
    levels = [("high", "0"), ("default", "0"), ("fast", "0")]
    if a.device == "cuda":
        levels.append(("fast", "1"))
    print(f"T {a.T}, Hq/Hv {Hq}/{Hv}, beta 0.99, device {a.device}; relative L2 against the float64 oracle\n")
    print("| keys | level | " + " | ".join(GRADS) + " |")
    print("|---|---|" + "---|" * len(GRADS))
    for keys in a.keys.split(","):
        inputs, h0, do, dht = make_inputs(keys, a.T, Hq, Hv, a.device)
        ref = reference_backward(*inputs, do, dht, initial_state=h0)
        for level, fused in levels:
            os.environ["FLASHGDN_BWD_FUSED"] = fused
            gr = flashgdn.chunk_gated_delta_rule_bwd(*inputs, do, dht, initial_state=h0, precision=level)
            name = level + (" (fused)" if fused == "1" else "")
            print(f"| {keys} | {name} | " + " | ".join(f"{rel(getattr(gr, n), ref[n]):.2e}" for n in GRADS) + " |")


if __name__ == "__main__":
    main()
