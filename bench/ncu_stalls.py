"""Where a kernel's warps wait, from an Nsight Compute per-instruction export.

    ncu -k regex:fused_bwd -s 1 -c 1 --section SourceCounters --section WarpStateStats \
        --page source --csv --print-source sass python3 bench/ncu_stalls.py --drive 16/64 > walk.csv
    python3 bench/ncu_stalls.py walk.csv            # samples by stall reason, then the top sites

--drive runs the forward + backward of one 32768-token (--T) sequence twice (the call ncu profiles);
scripts/gpu_check.sh's `ncu` step runs both and keeps the walk's cubin (walk.cubin in its logs). A
wait on an mbarrier shows as stall_long_sb on the branch after its SYNCS.PHASECHK (try_wait); the
site's preceding instructions name the barrier.

By role and stage of the fused walk (which stage's code the samples fall in, and why):

    nvdisasm -g -gi -c walk.cubin > walk.sass
    python3 bench/ncu_stalls.py walk.csv --sass walk.sass [--source csrc/sm90/bwd_fused_kernel.cuh]

Each instruction's line table (innermost first) names the first line of the kernel source inside a
role's branch (`// ---- producer`, `// ---- C:`, `// ---- D:`, `// ---- R:`); the stage is the last
`if (s == N` above that line in the branch ("-": before the first, the role's waits and loop).
The source must be the tree the cubin was built from (its line numbers).

The code itself, by role and stage, without a profile (any machine with nvcc; a base to compare):

    nvcc ... -lineinfo -cubin -o walk.cubin csrc/sm90/bwd_fused.cu; nvdisasm -g -gi -c walk.cubin > walk.sass
    python3 bench/ncu_stalls.py --sass walk.sass [--base-sass base.sass --base-source base/csrc/sm90/bwd_fused_kernel.cuh]
"""
import argparse
import collections
import csv
import os
import re
import sys


def drive(heads: str, tokens: int = 32768) -> None:
    import torch

    import flashgdn
    from gdnbench.configs import seq
    from gdnbench.inputs import make_inputs

    Hq, Hv = (int(a) for a in heads.split("/"))
    x = make_inputs(Hq, Hv, seq(tokens), requires_grad=True, with_grads_out=True)
    q, k, v, g, b, h0 = (x[n] for n in ("q", "k", "v", "g", "beta", "h0"))
    for _ in range(2):
        o, ht = flashgdn.chunk_gated_delta_rule(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
        torch.autograd.grad((o, ht), (q, k, v, g, b, h0), (x["do"], x["dht"]))
    torch.cuda.synchronize()


def read_rows(path: str):
    """The per-instruction table of an ncu CSV: its header and rows."""
    with open(path, encoding="utf-8") as f:
        lines = [ln for ln in f.read().splitlines() if ln.startswith('"')]
    start = next(i for i, ln in enumerate(lines) if ln.startswith('"Address"'))
    hdr = next(csv.reader([lines[start]]))
    return hdr, [r for r in csv.reader(lines[start + 1:]) if len(r) == len(hdr)]


def summarize(path: str, top: int) -> None:
    hdr, rows = read_rows(path)
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


def line_tables(sass_path: str, function: str) -> dict:
    """Offset in `function` -> [(file, line), ...] innermost first, from nvdisasm -g -gi."""
    tables, chain, in_fn, after_note = {}, [], False, False
    with open(sass_path, encoding="utf-8") as f:
        for ln in f:
            if ln.startswith(".text."):
                in_fn = function in ln
                continue
            if not in_fn:
                continue
            if "//##" in ln:
                chain = (chain if after_note else []) + re.findall(r'File "([^"]+)", line (\d+)', ln)
                after_note = True
                continue
            after_note = False
            m = re.search(r"/\*([0-9a-f]{4,})\*/\s", ln)
            if m:
                tables[int(m.group(1), 16)] = chain
    return tables


def stage_map(source: str) -> dict:
    """Kernel source line -> (role, stage) inside the roles' branches."""
    text = open(source, encoding="utf-8").read().splitlines()
    where, role, stage = {}, None, "-"
    for n, ln in enumerate(text, 1):
        m = re.search(r"// ---- (producer|[CDR]):", ln)
        if m:
            role, stage = m.group(1)[0].upper(), "-"
        elif role == "R" and ln.startswith("  }"):
            role = None  # the walk's end
        m = re.search(r"if \(s == (\d+)", ln)
        if role and m:
            stage = int(m.group(1))
        if role:
            where[n] = (role, stage)
    return where


def opcodes(sass_path: str, function: str) -> dict:
    """Offset in `function` -> opcode (without its modifiers), from the same nvdisasm listing."""
    ops, in_fn = {}, False
    with open(sass_path, encoding="utf-8") as f:
        for ln in f:
            if ln.startswith(".text."):
                in_fn = function in ln
                continue
            m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", ln) if in_fn else None
            if m:
                ops[int(m.group(1), 16)] = m.group(2)
    return ops


def code_by_stage(sass_path: str, source: str, function: str):
    """(role, stage) -> opcode counts of `function`'s instructions, no profile needed."""
    tables, where = line_tables(sass_path, function), stage_map(source)
    name = os.path.basename(source)
    code = collections.defaultdict(collections.Counter)
    for off, op in opcodes(sass_path, function).items():
        lines = [int(n) for f, n in tables.get(off, []) if f.endswith(name)]
        code[next((where[n] for n in lines if n in where), ("other", "-"))][op] += 1
    return code


def code_sizes(sass_path: str, source: str, function: str, base_sass: str = None, base_source: str = None) -> None:
    """Instructions by role and stage (the code each stage adds to the walk), and with a base
    listing (another tree's kernel: its own source for its line numbers) each stage's change and
    the opcodes that changed most."""
    code = code_by_stage(sass_path, source, function)
    base = code_by_stage(base_sass, base_source or source, function) if base_sass else None
    keys = sorted(set(code) | set(base or {}), key=lambda k: ("PCDRo".index(k[0][0]), str(k[1]).rjust(3)))
    print(f"{'role, stage':12s} {'instr':>6s}" + (f" {'base':>6s} {'change':>7s}  opcodes that changed" if base else ""))
    for k in keys:
        n = sum(code[k].values())
        line = f"{k[0] + ' ' + str(k[1]):12s} {n:6d}"
        if base is not None:
            b = sum(base[k].values())
            diff = {op: code[k][op] - base[k][op] for op in set(code[k]) | set(base[k]) if code[k][op] != base[k][op]}
            top = sorted(diff.items(), key=lambda kv: (-abs(kv[1]), kv[0]))[:5]
            line += f" {b:6d} {n - b:+7d}  " + ", ".join(f"{op} {d:+d}" for op, d in top)
        print(line)
    for role in "PCDR":
        n = sum(sum(c.values()) for k, c in code.items() if k[0] == role)
        b = sum(sum(c.values()) for k, c in (base or {}).items() if k[0] == role)
        print(f"{role}: {n} instructions" + (f", base {b}" if base is not None else ""))


def by_stage(path: str, sass_path: str, source: str, function: str) -> None:
    hdr, rows = read_rows(path)
    ix = {h: i for i, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    tables, where = line_tables(sass_path, function), stage_map(source)
    name = os.path.basename(source)
    base = min(int(r[ix["Address"]], 16) for r in rows)
    agg, count = collections.defaultdict(collections.Counter), collections.Counter()
    for r in rows:
        lines = [int(n) for f, n in tables.get(int(r[ix["Address"]], 16) - base, []) if f.endswith(name)]
        k = next((where[n] for n in lines if n in where), ("other", "-"))
        count[k] += 1
        for s in reasons:
            agg[k][s] += int(r[ix[s]] or 0)
    total = sum(sum(c.values()) for c in agg.values()) or 1
    for role in "PCDR":
        c = collections.Counter()
        for k, v in agg.items():
            if k[0] == role:
                c.update(v)
        n = sum(c.values()) or 1
        why = ", ".join(f"{s[6:]} {100 * v / n:.0f}%" for s, v in c.most_common(6))
        print(f"{role}: {100 * n / total:5.1f}% of samples, {sum(v for k, v in count.items() if k[0] == role)} "
              f"instructions: {why}")
    print(f"{'role, stage':12s} {'samples':>8s} {'share':>6s} {'instr':>6s}  top reasons")
    for k, c in sorted(agg.items(), key=lambda kv: -sum(kv[1].values())):
        n = sum(c.values())
        if n == 0:
            continue
        why = ", ".join(f"{s[6:]} {100 * v / n:.0f}%" for s, v in c.most_common(3))
        print(f"{k[0] + ' ' + str(k[1]):12s} {n:8d} {100 * n / total:5.1f}% {count[k]:6d}  {why}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="?", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--drive", metavar="HQ/HV", help="run the profiled call instead")
    ap.add_argument("--T", type=int, default=32768, help="--drive's sequence length")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--sass", help="nvdisasm -g -gi -c of the profiled kernel's cubin: group by role and stage")
    ap.add_argument("--source", default=os.path.join(os.path.dirname(__file__), "..", "csrc", "sm90", "bwd_fused_kernel.cuh"))
    ap.add_argument("--function", default="fused_bwdILb1", help="the profiled instantiation's symbol (a substring)")
    ap.add_argument("--base-sass", help="with --sass and no CSV: another tree's listing to compare the code with")
    ap.add_argument("--base-source", help="that tree's kernel source (default: --source)")
    a = ap.parse_args()
    if a.drive:
        drive(a.drive, a.T)
    elif a.csv and a.sass:
        by_stage(a.csv, a.sass, a.source, a.function)
    elif a.sass:
        code_sizes(a.sass, a.source, a.function, a.base_sass, a.base_source)
    elif a.csv:
        summarize(a.csv, a.top)
    else:
        sys.exit("give a CSV to summarise or --drive HQ/HV")
