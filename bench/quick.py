"""Short timing of flashgdn on the GPU: forward (inference) and forward+backward at
(Hq, Hv) = (16, 64) and (2, 8), T = 32768, K = V = 128, bf16, realistic gates; with the floor
of gdn-math section 4 from the copy bandwidth and bf16 matmul rate measured here.

    python bench/quick.py [--out table.md]
"""
import argparse
import math
import statistics

import torch

import flashgdn

FLOP_PER_TOKEN_HEAD_FWD = 181e3  # gdn-math section 4, K = V = 128, C = 64


def median_ms(fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def measure_ceilings():
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    copy_ms = median_ms(lambda: y.copy_(x), reps=10)
    bw = 2 * x.numel() / (copy_ms * 1e-3)  # bytes read + written per second
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_ms = median_ms(lambda: a @ b, reps=10)
    rate = 2 * 8192**3 / (mm_ms * 1e-3)
    del x, y, a, b
    return bw, rate


def make_inputs(T, Hq, Hv, K=128, V=128, requires_grad=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = dict(device="cuda")
    q = torch.randn(1, T, Hq, K, generator=g, dtype=torch.bfloat16, **dev)
    k = torch.randn(1, T, Hq, K, generator=g, dtype=torch.bfloat16, **dev)
    v = torch.randn(1, T, Hv, V, generator=g, dtype=torch.bfloat16, **dev)
    A = torch.rand(Hv, generator=g, **dev) * 16
    A[0] = 0
    gate = -A * torch.nn.functional.softplus(torch.randn(1, T, Hv, generator=g, **dev) + 1)
    beta = torch.rand(1, T, Hv, generator=g, **dev)
    h0 = 0.1 * torch.randn(1, Hv, K, V, generator=g, **dev)
    ts = [q, k, v, gate, beta, h0]
    if requires_grad:
        for t in ts:
            t.requires_grad_(True)
    return ts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--T", type=int, default=32768)
    args = ap.parse_args()
    bw, rate = measure_ceilings()
    rows = []
    for Hq, Hv in [(16, 64), (2, 8)]:
        T = args.T
        flop = FLOP_PER_TOKEN_HEAD_FWD * T * Hv
        bytes_ = T * (2 * Hq * 128 * 2 + 2 * Hv * 128 * 2 + 2 * Hv * 4) + 2 * Hv * 128 * 128 * 4
        floor_ms = max(flop / rate, bytes_ / bw) * 1e3
        sets = [make_inputs(T, Hq, Hv, seed=s) for s in range(2)]
        i = [0]

        def fwd():
            q, k, v, g, b, h0 = sets[i[0] % 2]
            i[0] += 1
            with torch.no_grad():
                flashgdn.chunk_gated_delta_rule(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)

        try:
            f_ms = median_ms(fwd)
        except Exception as e:  # a failure is a cell, not the end of the run
            f_ms = float("nan")
            print(f"forward failed: {e}")
        gsets = [make_inputs(T, Hq, Hv, requires_grad=True, seed=10 + s) for s in range(2)]
        do = torch.randn(1, T, Hv, 128, dtype=torch.bfloat16, device="cuda")

        def fwdbwd():
            q, k, v, g, b, h0 = gsets[i[0] % 2]
            i[0] += 1
            o, ht = flashgdn.chunk_gated_delta_rule(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
            torch.autograd.grad((o, ht), (q, k, v, g, b, h0), (do, torch.ones_like(ht)))

        try:
            fb_ms = median_ms(fwdbwd, reps=10)
        except Exception as e:
            fb_ms = float("nan")
            print(f"forward+backward failed: {e}")
        rows.append((f"Hq{Hq}/Hv{Hv} 1x{T}", f_ms, fb_ms, floor_ms))
        del sets, gsets
        torch.cuda.empty_cache()

    lines = [
        f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; flashgdn {flashgdn.__version__}",
        f"measured: copy {bw / 1e12:.2f} TB/s (read+write), bf16 matmul {rate / 1e12:.0f} TFLOP/s",
        "",
        "| shape | forward ms | fwd floor ms | fwd % of floor | forward+backward ms |",
        "|---|---|---|---|---|",
    ]
    for name, f_ms, fb_ms, floor_ms in rows:
        pct = 100 * floor_ms / f_ms if f_ms == f_ms and f_ms > 0 else math.nan
        lines.append(f"| {name} | {f_ms:.3f} | {floor_ms:.3f} | {pct:.0f}% | {fb_ms:.3f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
