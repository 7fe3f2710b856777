"""Results: CSV, JSON, a markdown table, PNG plots; merging the parts of a split run.

    python bench/run.py report --merge DIR [DIR ...] --out DIR

Every row carries its q/k convention (``qk_norm``: configs.QK_NORMS); the tables come one per
mode and convention. Results of runs before the column (no ``qk_norm`` in their rows, the
accuracy check keyed by contender alone) measured the in_kernel convention and are read as such.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import re
from pathlib import Path
from typing import Dict, List

from .configs import QK_NORMS

CONTENDER_ORDER = ["flashgdn", "flashqla", "flashinfer", "fla"]
PEERS = ["flashqla", "flashinfer", "fla"]
MODE_TITLE = {"fwd": "Forward (inference: no saved state)", "bwd": "Backward alone",
              "fwdbwd": "Forward + backward"}
QK_TITLE = {"in_kernel": "q, k normalised in the call (in_kernel)",
            "prenormalized": "q, k normalised before the call (prenormalized)"}
CSV_FIELDS = ["config", "Hq", "Hv", "layout", "kind", "nseq", "T_total", "mode", "qk_norm", "contender", "status",
              "reason", "ms", "speedup_of_flashgdn", "method", "reps", "spread", "nsets", "error", "err_o",
              "err_ht", "err_grad", "mem_mib", "first_call_s", "floor_ms", "floor_frac", "tflops", "gbps",
              "floor_flop", "floor_bytes", "wall_s", "warmup_running"]


def gpu_slug(name: str) -> str:
    s = name.lower().replace("nvidia", "").strip()
    return re.sub(r"[^a-z0-9]+", "-", s).strip("-") or "gpu"


def default_out_dir(hdr: Dict) -> Path:
    """bench/results/<gpu>-<date>/ next to this package."""
    return Path(__file__).resolve().parents[1] / "results" / f"{gpu_slug(hdr['gpu'])}-{hdr['date'][:10]}"


def _ok(r) -> bool:
    return r.get("status") == "ok" and isinstance(r.get("ms"), (int, float)) and r["ms"] == r["ms"]


def qk_of(r: Dict) -> str:
    """A row's q/k convention; a row of a run before the column measured in_kernel."""
    return r.get("qk_norm") or "in_kernel"


def accuracy_by_norm(acc: Dict) -> Dict[str, Dict]:
    """The accuracy check as {qk_norm: {contender: result}}; a run before the conventions kept
    {contender: result} (in_kernel)."""
    if not acc:
        return {}
    if set(acc) <= set(QK_NORMS):
        return acc
    return {"in_kernel": acc}


def _norms(rows: List[Dict], acc: Dict = None) -> List[str]:
    """The conventions present, in QK_NORMS order (then any unknown one)."""
    seen = {qk_of(r) for r in rows} | set(accuracy_by_norm(acc or {}))
    return [n for n in QK_NORMS if n in seen] + sorted(seen - set(QK_NORMS))


def _cells(rows: List[Dict]):
    """{(mode, qk_norm, config, layout): {contender: row}} in first-seen order."""
    out = {}
    for r in rows:
        out.setdefault((r["mode"], qk_of(r), r["config"], r["layout"]), {})[r["contender"]] = r
    return out


def add_speedups(rows: List[Dict]) -> None:
    for _, by in _cells(rows).items():
        me = by.get("flashgdn")
        for n, r in by.items():
            r["speedup_of_flashgdn"] = (r["ms"] / me["ms"]) if (me and _ok(me) and _ok(r) and n != "flashgdn") else float("nan")


def _fmt(x, nd=3):
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return ""
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _e(x):
    return f"{x:.1e}" if isinstance(x, float) and x == x else ""


def _short(r) -> str:
    s = r.get("status", "")
    return {"not installed": "n/i", "refused": "refused", "failed": "FAILED", "skipped": "skipped"}.get(s, s)


def write_csv(path: Path, rows: List[Dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (_fmt(r.get(k), 6) if isinstance(r.get(k), float) else r.get(k, "")) for k in CSV_FIELDS}
                       | {"qk_norm": qk_of(r)})


def _json_safe(x):
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    return x


def markdown(hdr: Dict, rows: List[Dict], acc: Dict) -> str:
    acc = accuracy_by_norm(acc)
    names = [n for n in CONTENDER_ORDER if any(r["contender"] == n for r in rows)] or \
        [n for n in CONTENDER_ORDER if any(n in a for a in acc.values())]
    peers = [n for n in names if n != "flashgdn"]
    L = [f"# flashgdn benchmark: {hdr.get('gpu', '?')}, {hdr.get('date', '?')}", ""]
    L += ["| | |", "|---|---|"]
    for k in ("gpu", "sm_count", "l2_mb", "driver", "torch", "cuda", "triton", "python", "flashgdn_commit",
              "flashgdn_precision", "flashgdn_backward", "flashgdn_cp", "selection", "qk_norms", "argv", "copy_GBps",
              "bf16_TFLOPs", "oracle", "check_shape", "wall_s", "parts"):
        if k in hdr:
            L.append(f"| {k} | {hdr[k]} |")
    for n, v in hdr.get("contenders", {}).items():
        L.append(f"| {n} | {v} |")
    L += ["", "K = V = 128; q, k, v bf16; g = -A softplus(x + 1) fp32 with A per head in [0, 16] "
          "and one head A = 0; beta fp32 in (0, 1); fp32 initial state; final state returned; "
          "scale = K^-0.5. q/k convention (`qk_norm`): in_kernel = raw q, k, every call normalises "
          "them (use_qk_l2norm_in_kernel = True; FlashInfer's separate pass, timed); prenormalized = "
          "q, k L2-normalised when the inputs are made (not timed), no call normalises "
          "(use_qk_l2norm_in_kernel = False; FlashInfer's native call), gradients w.r.t. the "
          "normalised q, k. ms: median per call; floor: gdn-math section 4 with the copy bandwidth "
          "and bf16 rate above (bench/README.md).", ""]
    if acc:
        L += ["## Accuracy (relative L2 error against the float64 oracle, on each convention's inputs)", "",
              "| contender | q/k | status | o | final state | dq | dk | dv | dg | dbeta | dh0 | first call s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for n in [x for x in CONTENDER_ORDER if any(x in a for a in acc.values())]:
            for qk in [q for q in _norms([], acc) if n in acc[q]]:
                r = acc[qk][n]
                L.append(f"| {n} | {qk} | {r.get('status', '')[:200]} | " + " | ".join(
                    _e(r.get(k)) for k in ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"))
                    + f" | {_fmt(r.get('first_call_s'), 1)} |")
        L.append("")
    L += prewarm_section(hdr)
    cells = _cells(rows)
    notes = {}
    for mode, qk in [(m, q) for m in ("fwd", "bwd", "fwdbwd") for q in _norms(rows)]:
        keys = [k for k in cells if k[:2] == (mode, qk)]
        if not keys:
            continue
        L += [f"## {MODE_TITLE[mode]}, {QK_TITLE.get(qk, qk)}: ms per call", "",
              "| Hq/Hv | layout | " + " | ".join(names) + " | best peer | flashgdn speedup vs best"
              + "".join(f" | vs {p}" for p in peers) + " | floor ms | flashgdn % of floor |",
              "|---|---|" + "---|" * (len(names) + 4 + len(peers))]
        for key in keys:
            by = cells[key]
            vals = []
            for n in names:
                r = by.get(n)
                if r is None:
                    vals.append("")
                elif _ok(r):
                    vals.append(f"{r['ms']:.3f}")
                else:
                    tag = _short(r)
                    note = f"{n}: {r.get('reason', '')[:200]}"
                    idx = notes.setdefault(note, len(notes) + 1)
                    vals.append(f"{tag} [{idx}]")
            ok_peers = [(by[p]["ms"], p) for p in peers if p in by and _ok(by[p])]
            best = min(ok_peers) if ok_peers else None
            me = by.get("flashgdn")
            sp_best = (best[0] / me["ms"]) if (best and me and _ok(me)) else float("nan")
            sps = [(by[p]["ms"] / me["ms"]) if (p in by and _ok(by[p]) and me and _ok(me)) else float("nan")
                   for p in peers]
            any_r = next(iter(by.values()))
            frac = (any_r["floor_ms"] / me["ms"] * 100) if (me and _ok(me)) else float("nan")
            L.append(f"| {key[2]} | {key[3]} | " + " | ".join(vals)
                     + f" | {best[1] + ' ' + format(best[0], '.3f') if best else ''} | {_fmt(sp_best, 2)}"
                     + "".join(f" | {_fmt(s, 2)}" for s in sps)
                     + f" | {_fmt(any_r.get('floor_ms'), 3)} | {_fmt(frac, 1)} |")
        L.append("")
    if notes:
        L += ["Notes:", ""] + [f"[{i}] {n}" for n, i in notes.items()] + [""]
    ok_rows = [r for r in rows if _ok(r)]
    if ok_rows:
        L += ["## Peak extra device memory per call (MiB) and first-call time (s)", "",
              "| mode | q/k | Hq/Hv | layout | " + " | ".join(f"{n} MiB" for n in names) + " | "
              + " | ".join(f"{n} first s" for n in names) + " |",
              "|---|---|---|---|" + "---|" * (2 * len(names))]
        for key, by in cells.items():
            if not any(_ok(r) for r in by.values()):
                continue
            L.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | "
                     + " | ".join(_fmt(by[n].get("mem_mib"), 0) if n in by and _ok(by[n]) else "" for n in names)
                     + " | " + " | ".join(_fmt(by[n].get("first_call_s"), 1) if n in by and _ok(by[n]) else ""
                                          for n in names) + " |")
        L.append("")
        methods = {}
        for r in ok_rows:
            methods.setdefault(r["contender"], {}).setdefault(r["method"][:140], []).append(
                f"{r['mode']} {qk_of(r)} {r['config']} {r['layout']}")
        L += ["## Timing method", ""]
        for n, ms in methods.items():
            for m, where in ms.items():
                L.append(f"- {n}: {m} ({len(where)} cells{', e.g. ' + where[0] if len(where) else ''})")
        busy = [r for r in ok_rows if (r.get("warmup_running") or 0) > 0]
        if busy:
            L.append(f"- {len(busy)} of {len(ok_rows)} measurements were taken while warm-up processes "
                     "compiled in the background (column `warmup_running` in results.csv: how many); "
                     "those processes were stopped while the samples were taken (and while FLA "
                     "autotuned).")
        L.append("")
    return "\n".join(L)


def prewarm_section(hdr: Dict) -> List[str]:
    """The compile-cache warm-up (prewarm.py): per task, its wall time and what its calls did."""
    pre = hdr.get("prewarm")
    if not pre or not pre.get("tasks"):
        return []
    L = ["## Compile-cache warm-up (worker processes; nothing there is timed)", "",
         f"{len(pre['tasks'])} tasks, {pre.get('workers')} processes at a time, the last ending at "
         f"{pre.get('wall_s')} s. Each task is one process (niceness 19) that calls one peer once on every "
         "layout of its head configuration (with gradients for fwd+bwd), so that the timed process loads "
         "compiled kernels from the on-disk caches; the timed process times each contender on a head "
         "configuration once that task has ended, and others meanwhile. Seconds are per task with up to "
         "that many compiles sharing the CPU, so they overstate a lone cold compile; first-call times in "
         "the tables below are cache loads (and FLA's autotuning, which the workers do not time).", "",
         "| contender | Hq/Hv | with grads | s | calls | not ok |", "|---|---|---|---|---|---|"]
    for t in pre["tasks"]:
        calls = t.get("calls") or []
        bad = [c for c in calls if c.get("status") != "ok"]
        why = t.get("error") or (f"{len(bad)}: {bad[0]['layout']} {bad[0]['status'][:120]}" if bad else "")
        if t.get("cached"):
            why = "skipped: done before on this machine's compile caches (marker)"
        elif t.get("skipped"):
            why = f"skipped: {t['skipped']}"
        L.append(f"| {t['contender']} | {t['Hq']}/{t['Hv']} | {'yes' if t['grad'] else 'no'} | "
                 f"{_fmt(t.get('s'), 1)} | {len(calls)} | {why} |")
    L.append("")
    return L


def standing(rows: List[Dict]) -> str:
    """Per cell, flashgdn's speedup over the best peer of that cell and which peer it was: one
    table per mode and q/k convention, head configurations by layouts, with the geometric mean
    per row and table."""
    tag = {"flashqla": "Q", "flashinfer": "I", "fla": "F"}
    cells = _cells(rows)
    L = ["# Where flashgdn stands, per cell", "",
         "Each entry: best peer ms / flashgdn ms (below 1: flashgdn is slower) and the best peer: "
         "Q = FlashQLA, I = FlashInfer, F = FLA (versions in results.md, with every ms, error, "
         "memory and the floor). Empty: flashgdn or every peer has no time for that cell. One table "
         "per mode and q/k convention: in_kernel, every call normalises q and k; prenormalized, "
         "they are normalised before the call and no call normalises (bench/README.md).", ""]
    for mode, qk in [(m, q) for m in ("fwd", "bwd", "fwdbwd") for q in _norms(rows)]:
        keys = [k for k in cells if k[:2] == (mode, qk)]
        if not keys:
            continue
        lays = list(dict.fromkeys(k[3] for k in keys))
        L += [f"## {MODE_TITLE[mode]}, {QK_TITLE.get(qk, qk)}", "",
              "| Hq/Hv | " + " | ".join(x.split("(")[0] for x in lays) + " | geomean |",
              "|---|" + "---|" * (len(lays) + 1)]
        every = []
        for h in dict.fromkeys(k[2] for k in keys):
            vals, ratios = [], []
            for lay in lays:
                by = cells.get((mode, qk, h, lay), {})
                me = by.get("flashgdn")
                ok = [(by[p]["ms"], p) for p in PEERS if p in by and _ok(by[p])]
                if not (me and _ok(me) and ok):
                    vals.append("")
                    continue
                ms, p = min(ok)
                ratios.append(ms / me["ms"])
                vals.append(f"{ratios[-1]:.2f} {tag[p]}")
            every += ratios
            gm = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else float("nan")
            L.append(f"| {h} | " + " | ".join(vals) + f" | {_fmt(gm, 2)} |")
        if every:
            gm = math.exp(sum(map(math.log, every)) / len(every))
            L += ["", f"{len(every)} cells: geometric mean {gm:.3f}, worst {min(every):.3f}, best "
                      f"{max(every):.3f}; flashgdn faster than the best peer in "
                      f"{sum(x > 1 for x in every)} of them."]
        L.append("")
    return "\n".join(L)


def plots(out: Path, rows: List[Dict]) -> List[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        return [f"no plots: {e}"]
    made = []
    # time vs T per head configuration: forward on one sequence; each contender one colour, solid
    # for in_kernel, dashed for prenormalized
    fwd = [r for r in rows if r["mode"] == "fwd" and r["kind"] == "seq" and _ok(r)]
    configs = list(dict.fromkeys(r["config"] for r in fwd))
    norms = _norms(rows)
    style = {qk: ("-", "--", "-.", ":")[min(j, 3)] for j, qk in enumerate(norms)}
    if configs:
        ncol = min(4, len(configs))
        nrow = -(-len(configs) // ncol)
        fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.4 * nrow), squeeze=False)
        for ax, cfg in zip(axes.flat, configs):
            for j, n in enumerate(CONTENDER_ORDER):
                for qk in norms:
                    pts = sorted((r["T_total"], r["ms"]) for r in fwd
                                 if r["config"] == cfg and r["contender"] == n and qk_of(r) == qk)
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{j}",
                                linestyle=style[qk], label=n if len(norms) == 1 else f"{n} {qk}")
            fl = sorted({(r["T_total"], r["floor_ms"]) for r in fwd if r["config"] == cfg})
            if fl:
                ax.plot([p[0] for p in fl], [p[1] for p in fl], "k:", lw=1, label="floor")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"forward Hq/Hv {cfg}")
            ax.set_xlabel("T (one sequence)")
            ax.set_ylabel("ms")
            ax.grid(True, which="both", alpha=0.3)
        for ax in list(axes.flat)[len(configs):]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "time_vs_T.png", dpi=110)
        plt.close(fig)
        made.append("time_vs_T.png")
    # speedup bars: flashgdn over each peer per cell (or, without flashgdn times, each
    # contender's time over the fastest one's)
    cells = _cells(rows)
    labels, series = [], {}
    have_me = any(r["contender"] == "flashgdn" and _ok(r) for r in rows)
    for key, by in cells.items():
        me = by.get("flashgdn")
        oks = {n: r["ms"] for n, r in by.items() if _ok(r)}
        if not oks or (have_me and not (me and _ok(me))):
            continue
        labels.append(" ".join(key if len(norms) > 1 else key[:1] + key[2:]))
        ref = me["ms"] if have_me else min(oks.values())
        for n in (PEERS if have_me else CONTENDER_ORDER):
            series.setdefault(n, []).append(oks[n] / ref if n in oks else float("nan"))
    series = {n: v for n, v in series.items() if any(x == x for x in v)}
    if labels and series:
        import numpy as np

        fig, ax = plt.subplots(figsize=(9, max(3, 0.28 * len(labels) * max(1, len(series)) / 2 + 1.5)))
        y = np.arange(len(labels))
        h = 0.8 / max(1, len(series))
        for j, (n, vals) in enumerate(series.items()):
            ax.barh(y + j * h, vals, height=h, label=n)
        ax.axvline(1.0, color="k", lw=1)
        ax.set_yticks(y + h * (len(series) - 1) / 2)
        ax.set_yticklabels(labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("flashgdn speedup over peer (peer ms / flashgdn ms)" if have_me
                      else "ms / fastest contender's ms (flashgdn has no times)")
        ax.legend(fontsize=8)
        ax.grid(True, axis="x", alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "speedup.png", dpi=110)
        plt.close(fig)
        made.append("speedup.png")
    return made


def write_all(out: Path, hdr: Dict, rows: List[Dict], acc: Dict, plots: bool = False) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    add_speedups(rows)
    write_csv(out / "results.csv", rows)
    with open(out / "results.json", "w") as f:
        json.dump(_json_safe({"header": hdr, "accuracy": acc, "rows": rows}), f, indent=1)
    (out / "results.md").write_text(markdown(hdr, rows, acc))
    (out / "standing.md").write_text(standing(rows))
    if plots:
        hdr["plots"] = _plots(out, rows)
        (out / "results.md").write_text(markdown(hdr, rows, acc))


_plots = plots


def summary_text(hdr: Dict, rows: List[Dict], acc: Dict) -> str:
    """A short table for the end of the output (the device reply carries its tail)."""
    acc = accuracy_by_norm(acc)
    cells = _cells(rows)
    names = [n for n in CONTENDER_ORDER if any(r["contender"] == n for r in rows)]
    L = [f"{hdr.get('gpu')}  torch {hdr.get('torch')}  copy {hdr.get('copy_GBps')} GB/s  "
         f"bf16 {hdr.get('bf16_TFLOPs')} TFLOP/s  wall {hdr.get('wall_s')} s"]
    for qk, by_n in acc.items():
        for n, r in by_n.items():
            L.append(f"check {n:10s} {qk:13s} {r.get('status', '')[:60]:30s} o {_e(r.get('o'))} "
                     f"ht {_e(r.get('ht'))} "
                     + " ".join(f"{k} {_e(r.get(k))}" for k in ("dq", "dk", "dv", "dg", "dbeta", "dh0") if k in r))
    L.append(f"{'mode':6s} {'q/k':13s} {'Hq/Hv':6s} {'layout':26s} " + " ".join(f"{n:>12s}" for n in names)
             + f" {'x best':>7s} {'floor':>7s}")
    for key, by in cells.items():
        vals = []
        for n in names:
            r = by.get(n)
            vals.append(f"{r['ms']:12.3f}" if r and _ok(r) else f"{(_short(r) if r else ''):>12s}")
        me = by.get("flashgdn")
        best = min([by[p]["ms"] for p in PEERS if p in by and _ok(by[p])] or [float("nan")])
        sp = best / me["ms"] if me and _ok(me) and best == best else float("nan")
        fl = next(iter(by.values())).get("floor_ms", float("nan"))
        L.append(f"{key[0]:6s} {key[1]:13s} {key[2]:6s} {key[3][:26]:26s} " + " ".join(vals)
                 + f" {_fmt(sp, 2):>7s} {_fmt(fl, 3):>7s}")
    return "\n".join(L)


def merge(dirs: List[str]):
    hdr, rows, acc, parts = None, {}, {}, []
    pre_tasks, pre_wall, pre_workers, commits = [], [], set(), []
    for d in dirs:
        j = json.loads((Path(d) / "results.json").read_text())
        h = j["header"]
        parts.append(f"{d}: {h.get('selection')} at {h.get('flashgdn_commit')} ({h.get('date')}, "
                     f"wall {h.get('wall_s')} s, copy {h.get('copy_GBps')} GB/s, bf16 {h.get('bf16_TFLOPs')} "
                     f"TFLOP/s; argv {h.get('argv')})")
        if h.get("flashgdn_commit") not in commits:
            commits.append(h.get("flashgdn_commit"))
        if h.get("prewarm"):
            pre_tasks += h["prewarm"].get("tasks", [])
            pre_wall.append(str(h["prewarm"].get("wall_s")))
            pre_workers.add(h["prewarm"].get("workers"))
        if hdr is None:
            hdr = dict(h)
        for n, v in (h.get("contenders") or {}).items():
            if "not installed" in str(hdr["contenders"].get(n, "not installed")):
                hdr["contenders"][n] = v
        for qk, by_n in accuracy_by_norm(j.get("accuracy") or {}).items():
            mine = acc.setdefault(qk, {})
            for n, v in by_n.items():
                if n not in mine or (mine[n].get("status") != "ok" and v.get("status") == "ok"):
                    mine[n] = v
        for r in j["rows"]:
            r = {k: (float("nan") if v is None and k not in ("reason", "method") else v) for k, v in r.items()}
            r["qk_norm"] = qk_of(r)  # rows of a run before the column: in_kernel
            key = (r["mode"], r["qk_norm"], r["config"], r["layout"], r["contender"])
            if key not in rows or (not _ok(rows[key]) and _ok(r)):
                rows[key] = r
    hdr["parts"] = "; ".join(parts)
    merged = sorted(rows.values(), key=matrix_order)
    hdr["flashgdn_commit"] = ", ".join(str(c) for c in commits)
    hdr["argv"] = "per part, see parts"
    hdr["copy_GBps"] = f"{hdr.get('copy_GBps')} (first part; each row's floor uses its own part's)"
    hdr["bf16_TFLOPs"] = f"{hdr.get('bf16_TFLOPs')} (first part)"
    hdr.pop("wall_s", None)
    if pre_tasks:
        hdr["prewarm"] = dict(workers=", ".join(str(w) for w in sorted(pre_workers, key=str)),
                              wall_s=" + ".join(pre_wall), tasks=pre_tasks)
    hdr["selection"] = "merged"
    hdr["qk_norms"] = ", ".join(_norms(merged, acc))
    return hdr, merged, acc


def matrix_order(r: Dict):
    """Rows of merged parts in the order of the matrix (configs.py): mode, heads, layout, q/k
    convention, contender."""
    from . import configs as C

    heads = C.FWD_HEADS + [h for h in C.BWD_HEADS if h not in C.FWD_HEADS]
    layouts = [lay.name for lay in (C.FWD_LAYOUTS if r["mode"] == "fwd" else C.BWD_LAYOUTS)]
    key_h = (int(r.get("Hq", 0)), int(r.get("Hv", 0)))
    return (C.MODES.index(r["mode"]) if r["mode"] in C.MODES else 9,
            heads.index(key_h) if key_h in heads else 99,
            layouts.index(r["layout"]) if r["layout"] in layouts else 99,
            C.QK_NORMS.index(qk_of(r)) if qk_of(r) in C.QK_NORMS else 9,
            CONTENDER_ORDER.index(r["contender"]) if r["contender"] in CONTENDER_ORDER else 9)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python bench/run.py report")
    p.add_argument("--merge", nargs="+", required=True, help="result folders (each with results.json)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    hdr, rows, acc = merge(a.merge)
    write_all(Path(a.out), hdr, rows, acc, plots=True)
    print(summary_text(hdr, rows, acc))
    print(f"\nresults: {a.out}")
    return 0
