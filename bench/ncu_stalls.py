"""Where a kernel's warps wait, from an Nsight Compute per-instruction export.

    ncu -k regex:fused_bwd -s 1 -c 1 --section SourceCounters --section WarpStateStats \
        --page source --csv --print-source sass python3 bench/ncu_stalls.py --drive 16/64 > walk.csv
    python3 bench/ncu_stalls.py walk.csv            # samples by stall reason, then the top sites

--drive runs the forward + backward of one 32768-token sequence twice (the call ncu profiles);
scripts/gpu_check.sh's `ncu` step runs both. A wait on an mbarrier shows as stall_long_sb on the
branch after its SYNCS.PHASECHK (try_wait); the site's preceding instructions name the barrier.
"""
import argparse
import collections
import csv
import sys


def drive(heads: str) -> None:
    import torch

    import flashgdn
    from gdnbench.configs import seq
    from gdnbench.inputs import make_inputs

    Hq, Hv = (int(a) for a in heads.split("/"))
    x = make_inputs(Hq, Hv, seq(32768), requires_grad=True, with_grads_out=True)
    q, k, v, g, b, h0 = (x[n] for n in ("q", "k", "v", "g", "beta", "h0"))
    for _ in range(2):
        o, ht = flashgdn.chunk_gated_delta_rule(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
        torch.autograd.grad((o, ht), (q, k, v, g, b, h0), (x["do"], x["dht"]))
    torch.cuda.synchronize()


def summarize(path: str, top: int) -> None:
    with open(path, encoding="utf-8") as f:
        lines = [ln for ln in f.read().splitlines() if ln.startswith('"')]
    start = next(i for i, ln in enumerate(lines) if ln.startswith('"Address"'))
    hdr = next(csv.reader([lines[start]]))
    rows = [r for r in csv.reader(lines[start + 1:]) if len(r) == len(hdr)]
    ix = {h: i for i, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    total = collections.Counter()
    for r in rows:
        for s in reasons:
            total[s] += int(r[ix[s]] or 0)
    n = sum(total.values()) or 1
    print(f"{len(rows)} instructions, {n} samples")
    for s, v in total.most_common():
        if v:
            print(f"  {s:24s} {v:9d} {100 * v / n:5.1f}%")
    key = "Warp Stall Sampling (All Samples)"
    where = {r[0]: i for i, r in enumerate(rows)}
    for r in sorted(rows, key=lambda r: -int(r[ix[key]] or 0))[:top]:
        k = int(r[ix[key]] or 0)
        why = max(reasons, key=lambda s: int(r[ix[s]] or 0))
        # A wait's branch: the mbarrier it polls, from the try_wait just before it.
        i = where[r[0]]
        polls = [rows[j][1].strip() for j in range(max(0, i - 3), i) if "SYNCS.PHASECHK" in rows[j][1]]
        barrier = f"  <- {polls[-1].split(',')[1].strip()}" if polls and "," in polls[-1] else ""
        print(f"  {r[0]} {k:7d} {100 * k / n:5.1f}% {why:18s} {r[1].strip()[:60]}{barrier}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="?", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--drive", metavar="HQ/HV", help="run the profiled call instead")
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    if a.drive:
        drive(a.drive)
    elif a.csv:
        summarize(a.csv, a.top)
    else:
        sys.exit("give a CSV to summarise or --drive HQ/HV")
