"""FLA's own entry point with and without flashgdn as its backend: the measurement behind the
backend's priority (python/flashgdn/fla_backend.py, PRIORITY).

    python bench/fla_dispatch.py [--configs 16/64,2/8] [--layouts 1x8192] [--out DIR]

Calls ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` exactly as a model built on FLA does,
through FLA 0.6's backend dispatch, twice per cell: with flashgdn registered and on
(``FLASHGDN_FLA_BACKEND=1``), and off (``=0``: FLA runs its own Triton kernels). Forward alone
(no autograd) and forward + backward. Before timing, each cell checks that the call was routed:
the routed output must equal ``flashgdn.chunk_gated_delta_rule``'s bit for bit and the unrouted
one must not. Eager timing (what an FLA user runs; the dispatch's Python is part of the call),
CUDA events, median over rotated input sets, the benchmark's realistic gates
(bench/gdnbench/inputs.py). Needs a GPU, flashgdn and fla-core >= 0.6 on the path.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from gdnbench import configs as C  # noqa: E402
from gdnbench.inputs import make_inputs  # noqa: E402
from gdnbench.timing import time_calls  # noqa: E402


def fla_call(fn, x, grad: bool):
    """One call as FLA's users write it; with ``grad`` also the backward of o and the final state."""
    o, ht = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=x["scale"], initial_state=x["h0"],
               output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu"])
    if grad:
        torch.autograd.backward((o, ht), (x["do"], x["dht"]))
    return o, ht


def main() -> int:
    p = argparse.ArgumentParser(prog="python bench/fla_dispatch.py")
    p.add_argument("--configs", default="16/64,2/8")
    p.add_argument("--layouts", default="1x8192")
    p.add_argument("--sets", type=int, default=3, help="input sets rotated per measurement")
    p.add_argument("--out", default=None, help="folder for results.json (printed either way)")
    a = p.parse_args()

    layouts = [lay for lay in C.FWD_LAYOUTS if any(s in lay.name for s in a.layouts.split(","))]
    if not layouts:
        p.error(f"--layouts: {a.layouts!r} matches no layout of the matrix "
                f"({', '.join(lay.name for lay in C.FWD_LAYOUTS)})")
    try:
        heads = [(int(c.split("/")[0]), int(c.split("/")[1])) for c in a.configs.split(",")]
    except (ValueError, IndexError):
        p.error(f"--configs: expected a comma list of Hq/Hv, e.g. 16/64,2/8, got {a.configs!r}")
    if any(hq <= 0 or hv % hq for hq, hv in heads):
        p.error(f"--configs: Hv must be a positive multiple of Hq, got {a.configs!r}")
    if a.sets < 1:
        p.error(f"--sets: expected at least 1, got {a.sets}")

    os.environ.pop("FLA_DISABLE_BACKEND_DISPATCH", None)  # FLA reads it when fla.backends loads
    import flashgdn  # registers the backend with FLA when FLA imports fla.backends
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fn
    rows = []
    print(f"# {torch.cuda.get_device_name()}, flashgdn {flashgdn.__version__}, "
          f"fla-core {__import__('fla').__version__}, torch {torch.__version__}")
    print(f"{'Hq/Hv':6s} {'layout':10s} {'mode':7s} {'routed ms':>10s} {'FLA ms':>8s} {'FLA/routed':>10s}")
    for hq, hv in heads:
        for lay in layouts:
            for grad in (False, True):
                sets = [make_inputs(hq, hv, lay, seed=s, requires_grad=grad, with_grads_out=grad)
                        for s in range(a.sets)]
                x = sets[0]
                ms = {}
                outs = {}
                refused = ""
                for on in ("1", "0"):
                    os.environ["FLASHGDN_FLA_BACKEND"] = on
                    with torch.set_grad_enabled(grad):
                        outs[on] = fla_call(fla_fn, x, False)[0].detach().clone()
                        try:
                            t = time_calls([lambda s=s: fla_call(fla_fn, s, grad) for s in sets],
                                           use_graph=False, target_ms=200.0)
                            ms[on] = t.ms
                        except RuntimeError as e:  # FLA refuses its own backward on some stacks
                            if on == "1":
                                raise
                            ms[on] = float("nan")
                            refused = str(e).splitlines()[0][:200]
                os.environ["FLASHGDN_FLA_BACKEND"] = "1"
                with torch.no_grad():
                    ref = flashgdn.chunk_gated_delta_rule(
                        x["q"], x["k"], x["v"], x["g"], x["beta"], scale=x["scale"],
                        initial_state=x["h0"], output_final_state=True,
                        use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu"])[0]
                routed = torch.equal(outs["1"], ref)
                unrouted = not torch.equal(outs["0"], ref)
                mode = "fwdbwd" if grad else "fwd"
                ratio = ms["0"] / ms["1"]
                print(f"{hq}/{hv:<4d} {lay.name:10s} {mode:7s} {ms['1']:10.3f} {ms['0']:8.3f} {ratio:10.2f}"
                      + ("" if routed and unrouted else
                         f"   ROUTING CHECK FAILED (routed {routed}, FLA's own {unrouted})")
                      + (f"   FLA's own: {refused}" if refused else ""))
                rows.append(dict(config=f"{hq}/{hv}", layout=lay.name, mode=mode, routed_ms=ms["1"],
                                 fla_ms=ms["0"], fla_refused=refused, routed_is_flashgdn=routed, unrouted_is_fla=unrouted))
                del sets, x, outs
                torch.cuda.empty_cache()
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "results.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(r["routed_is_flashgdn"] and r["unrouted_is_fla"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
