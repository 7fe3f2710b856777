"""Which kernels take the time: flashgdn forward and forward+backward under torch.profiler,
CUDA time per kernel name, at (Hq, Hv) = (16, 64) and (2, 8), one sequence of T tokens, with the
benchmark's inputs (gdnbench.inputs, next to this file).

    python bench/profile_kernels.py [--T 32768] [--precision default] [--heads 16/64,2/8] [--out kernels.md]
"""
import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

import flashgdn
from gdnbench.configs import seq
from gdnbench.inputs import make_inputs


def kernel_table(fn, reps=3):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    totals = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name] += e.device_time_total / reps
    return totals


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--precision", default="default")
    ap.add_argument("--heads", default="16/64,2/8")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = []
    for Hq, Hv in [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]:
        x = make_inputs(Hq, Hv, seq(args.T), requires_grad=True, with_grads_out=True)
        q, k, v, g, b, h0 = (x[n] for n in ("q", "k", "v", "g", "beta", "h0"))

        def call():
            return flashgdn.chunk_gated_delta_rule(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True, precision=args.precision)

        def fwd():
            with torch.no_grad():
                call()

        def fwdbwd():
            o, ht = call()
            torch.autograd.grad((o, ht), (q, k, v, g, b, h0), (x["do"], x["dht"]))

        for mode, fn in (("forward", fwd), ("forward+backward", fwdbwd)):
            t = kernel_table(fn)
            total = sum(t.values())
            lines += [f"\n### Hq{Hq}/Hv{Hv} 1x{args.T}, {mode}, {args.precision}: {total / 1e3:.3f} ms of kernel time "
                      "per call\n",
                      "| kernel | ms | share |", "|---|---|---|"]
            for name, us in t.most_common(12):
                lines.append(f"| `{name[:90]}` | {us / 1e3:.3f} | {100 * us / total:.0f}% |")
        del x, q, k, v, g, b, h0
        torch.cuda.empty_cache()
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
