"""Time flashgdn on one shape: ``python -m flashgdn.bench [options]``.

flashgdn alone: the forward (inference, no autograd) and, with --backward, forward + backward;
a few warm-up calls, then the median of the timed calls (CUDA events on a GPU, the wall clock on
the CPU backend). --check also prints the relative L2 errors against the float64 oracle
(``flashgdn.reference``, which needs numpy: the ``oracle`` extra). Comparisons with
other libraries are the repository's peer benchmark (bench/README.md), not part of the package.

    python -m flashgdn.bench --heads 16/64 --T 8192 --backward
    python -m flashgdn.bench --device cpu --T 256 --check
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from . import chunk_gated_delta_rule, has_cuda, library_version

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULTS = {"cuda": ("16/64", 8192), "cpu": ("2/4", 256)}  # (heads, T) when not given
LEAVES = ("q", "k", "v", "g", "beta", "h0")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flashgdn.bench", description="Time flashgdn's "
                                "chunk_gated_delta_rule on one shape (flashgdn alone).")
    p.add_argument("--heads", metavar="HQ/HV", help="query/key heads / value heads (default 16/64 on "
                   "cuda, 2/4 on cpu)")
    p.add_argument("--T", type=int, help="tokens per sequence (default 8192 on cuda, 256 on cpu)")
    p.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    p.add_argument("--varlen", action="store_true", help="pack the sequences into one row with "
                   "cu_seqlens (default: a dense [batch, T] batch)")
    p.add_argument("--dim", type=int, default=128, help="head size K = V (default 128)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="q, k, v (default bf16)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda where torch sees a CUDA "
                   "device and flashgdn has its CUDA backend, else cpu")
    p.add_argument("--backward", action="store_true", help="also time forward + backward")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    p.add_argument("--reps", type=int, default=20, help="timed calls (default 20)")
    p.add_argument("--check", action="store_true", help="errors against the float64 oracle (needs numpy)")
    a = p.parse_args(argv)
    for name, lo in (("T", 1), ("batch", 1), ("dim", 1), ("warmup", 0), ("reps", 1)):
        val = getattr(a, name)
        if val is not None and val < lo:
            p.error(f"--{name}: expected an integer >= {lo}, got {val}")
    if a.heads is not None:
        parts = a.heads.split("/")
        if len(parts) != 2 or not all(x.isdigit() and int(x) > 0 for x in parts):
            p.error(f"--heads: expected HQ/HV, two positive integers such as 16/64, got {a.heads!r}")
    return a


def _inputs(a, hq: int, hv: int, dev: str) -> dict:
    """Random inputs on ``dev``: q, k, v in --dtype; g (log-decay < 0), beta and h0 in float32."""
    gen = torch.Generator().manual_seed(0)
    B, T = (1, a.batch * a.T) if a.varlen else (a.batch, a.T)
    K = a.dim

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    x = dict(q=rnd(B, T, hq, K), k=rnd(B, T, hq, K), v=rnd(B, T, hv, K),
             g=torch.nn.functional.logsigmoid(rnd(B, T, hv) + 3.0), beta=torch.rand(B, T, hv, generator=gen),
             h0=0.1 * rnd(a.batch, hv, K, K), do=rnd(B, T, hv, K), dht=rnd(a.batch, hv, K, K))
    for n in ("q", "k", "v", "do"):
        x[n] = x[n].to(DTYPES[a.dtype])
    x = {n: t.to(dev) for n, t in x.items()}
    x["cu_cpu"] = torch.arange(0, (a.batch + 1) * a.T, a.T) if a.varlen else None
    x["cu"] = x["cu_cpu"].to(dev) if a.varlen else None
    return x


def _call(x: dict):
    return chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                                  output_final_state=True, use_qk_l2norm_in_kernel=True,
                                  cu_seqlens=x["cu"], cu_seqlens_cpu=x["cu_cpu"])


def _fwd_bwd(x: dict):
    o, ht = _call(x)
    return (o, ht), torch.autograd.grad((o, ht), [x[n] for n in LEAVES], (x["do"], x["dht"]))


def _time_ms(fn, a, cuda: bool):
    """(median, min) milliseconds of ``a.reps`` calls after ``a.warmup`` untimed ones."""
    for _ in range(a.warmup):
        fn()
    samples = []
    for _ in range(a.reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples), min(samples)


def _errors(reference, x: dict, backward: bool) -> dict:
    """Relative L2 errors of o, the final state and (backward) the gradients against the oracle."""
    def rel(t, ref):
        ref = torch.from_numpy(ref)
        return (t.detach().cpu().double() - ref).norm().item() / max(ref.norm().item(), 1e-300)

    args = [x[n].detach() for n in ("q", "k", "v", "g", "beta")]
    kw = dict(initial_state=x["h0"].detach(), use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu_cpu"])
    (o, ht), grads = _fwd_bwd(x) if backward else (_call(x), None)
    f = reference.reference_forward(*args, **kw)
    err = {"o": rel(o, f["o"]), "final_state": rel(ht, f["final_state"])}
    if backward:
        r = reference.reference_backward(*args, x["do"], x["dht"], **kw)
        err.update({"d" + n: rel(gr, r["d" + n]) for n, gr in zip(LEAVES, grads)})
    return err


def run(a) -> dict:
    """Times the selection of ``a`` (parse_args); {'device', 'shape', 'forward': (median, min) ms,
    'forward+backward' (--backward), 'errors' (--check)}; SystemExit with a message (status 1)
    where it cannot."""
    reference = None
    if a.check:  # before any timing: a missing numpy fails at once
        try:
            from . import reference
        except ImportError as e:
            raise SystemExit(f"flashgdn.bench: --check: {e}")
    cuda_ok = torch.cuda.is_available() and has_cuda()
    why = "this flashgdn has no CUDA backend" if torch.cuda.is_available() else "torch sees no CUDA device"
    if a.device == "cuda" and not cuda_ok:
        raise SystemExit(f"flashgdn.bench: --device cuda: {why}; --device cpu times the CPU backend")
    dev = a.device or ("cuda" if cuda_ok else "cpu")
    if a.device is None and dev == "cpu":
        print(f"flashgdn.bench: {why}: timing the CPU backend on a small shape (--device cpu)",
              file=sys.stderr)
    heads, T = DEFAULTS[dev]
    a.T = a.T or T
    hq, hv = (int(n) for n in (a.heads or heads).split("/"))
    x = _inputs(a, hq, hv, dev)
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "shape": f"{a.batch} x {a.T} tokens ({'varlen' if a.varlen else 'dense'}), Hq/Hv {hq}/{hv}, "
                    f"K = V = {a.dim}, {a.dtype}"}
    try:
        with torch.no_grad():
            res["forward"] = _time_ms(lambda: _call(x), a, dev == "cuda")
        if a.backward:
            for n in LEAVES:
                x[n].requires_grad_(True)
            res["forward+backward"] = _time_ms(lambda: _fwd_bwd(x), a, dev == "cuda")
        if a.check:
            res["errors"] = _errors(reference, x, a.backward)
    except (ValueError, RuntimeError) as e:  # the library's message names the argument
        raise SystemExit(f"flashgdn.bench: the call failed: {type(e).__name__}: {e}")
    return res


def main(argv=None) -> int:
    res = run(parse_args(argv))
    print(f"flashgdn {library_version()} on {res['device']}: {res['shape']}")
    for what in ("forward", "forward+backward"):
        if what in res:
            med, lo = res[what]
            print(f"{what:17s} {med:10.3f} ms  (median; min {lo:.3f})")
    if "errors" in res:
        print("vs float64 oracle: " + ", ".join(f"{n} {e:.1e}" for n, e in res["errors"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
