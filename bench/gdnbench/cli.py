"""The benchmark driver: ``python bench/run.py [--quick | --full [--part i/n]] ...``."""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import os
import platform
import re
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List

from . import configs as C
from . import report
from .calls import classify, make_fn, poisoned

CHECK_LAYOUT = C.CHECK_LAYOUT
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="python bench/run.py",
        description="Time flashgdn against FlashQLA, FlashInfer and FLA (K = V = 128, bf16, realistic gates).")
    sel = p.add_mutually_exclusive_group()
    sel.add_argument("--quick", action="store_true", help="a handful of cells (default)")
    sel.add_argument("--full", action="store_true", help="the whole matrix (see --part)")
    p.add_argument("--part", default=None, help="i/n: part i of n of the selection, whole head configurations per part")
    p.add_argument("--contenders", default="flashgdn,flashqla,flashinfer,fla",
                   help="comma list of flashgdn, flashqla, flashinfer, fla")
    p.add_argument("--configs", default=None, help="head configurations Hq/Hv, comma list, e.g. 16/64,2/8")
    p.add_argument("--modes", default=None, help="comma list of fwd, bwd, fwdbwd")
    p.add_argument("--layouts", default=None, help="comma list of layout names or substrings, e.g. 1x8192,B8x2048,mix")
    p.add_argument("--qk-norm", default=None, metavar="LIST",
                   help="q/k conventions, comma list of in_kernel (raw q, k, normalised in each call), "
                        "prenormalized (q, k normalised when the inputs are made, no norm in any call); "
                        "default: both, with --quick and --full")
    p.add_argument("--out", default=None, help="output folder (default: bench/results/<gpu>-<date>/)")
    p.add_argument("--no-graph", action="store_true", help="time eagerly, no CUDA graphs")
    p.add_argument("--no-check", action="store_true", help="skip the accuracy check against the float64 oracle")
    p.add_argument("--flashgdn-precision", default="default", choices=("default", "fast", "high"),
                   help="flashgdn's precision level for its calls, forward and backward (default: default); "
                        "the header and the accuracy table record it")
    p.add_argument("--flashgdn-cp", default="auto", choices=("auto", "on", "off"),
                   help="flashgdn's context parallelism in its calls, the forward's and the backward's reverse "
                        "pass (default: auto, the library's decision); the header's flashgdn_cp records it")
    p.add_argument("--flashgdn-cp-segment", type=int, default=0, metavar="TOKENS",
                   help="with --flashgdn-cp on or auto: a fixed segment length in tokens (default 0: the plan's)")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="stop starting cells after this many seconds (rest: 'skipped: time budget'); default 540")
    p.add_argument("--target-ms", type=float, default=300.0, help="timed device time per measurement (default 300 ms)")
    p.add_argument("--rotate-mb", type=float, default=None,
                   help="working set of the rotated input sets (default 2 x L2)")
    p.add_argument("--commit", default=None, help="flashgdn commit for the header (default: git, or $FLASHGDN_COMMIT)")
    p.add_argument("--check-only", action="store_true",
                   help="only the accuracy check (one small call per contender) on the first selected cell's heads")
    p.add_argument("--list", action="store_true", help="print the selected cells and a time estimate; no GPU")
    p.add_argument("--prewarm", type=int, default=-1, metavar="N",
                   help="compile the peers' kernels for the selection in N background processes; each "
                        "contender is timed on a head configuration once its kernels are compiled "
                        "(default: min(16, CPUs); 0: off, each first call compiles in the timed process)")
    p.add_argument("--workers", type=int, default=None, help="with the prewarm command: processes (as --prewarm)")
    a = p.parse_args(argv)
    seg = a.flashgdn_cp_segment
    if seg < 0 or seg % 64 != 0 or seg > 1 << 30:  # the library's bound (fgdn cp_segment)
        p.error(f"--flashgdn-cp-segment: expected 0 or a positive multiple of 64 up to 2^30, got {seg}")
    if seg and a.flashgdn_cp == "off":
        p.error(f"--flashgdn-cp-segment: a segment length needs --flashgdn-cp on or auto, got {seg} with off")
    return a


def select_cells(a) -> List[C.Cell]:
    try:
        norms = C.parse_qk_norms(a.qk_norm)
    except ValueError as e:
        raise SystemExit(str(e))
    cells = C.full_cells(norms) if a.full else C.quick_cells(norms)
    cells = C.filter_cells(cells, a.configs, a.modes, a.layouts)
    if a.part:
        i, n = (int(x) for x in a.part.split("/"))
        if not 1 <= i <= n:
            raise SystemExit(f"--part: expected i/n with 1 <= i <= n, got {a.part}")
        cells = C.part_of(cells, i, n)
    heads_order = {h: j for j, h in enumerate(C.FWD_HEADS + [h for h in C.BWD_HEADS if h not in C.FWD_HEADS])}
    mode_order = {m: j for j, m in enumerate(C.MODES)}
    return sorted(cells, key=lambda c: (heads_order.get((c.Hq, c.Hv), 99), mode_order[c.mode]))


# ---- header ---------------------------------------------------------------------------------

def _git_commit(a) -> str:
    if a.commit:
        return a.commit
    if os.environ.get("FLASHGDN_COMMIT"):
        return os.environ["FLASHGDN_COMMIT"]
    here = Path(__file__).resolve().parent
    try:
        c = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        d = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                           capture_output=True, text=True, timeout=10)
        if c.returncode == 0:
            return c.stdout.strip() + ("+dirty" if d.stdout.strip() else "")
    except Exception:
        pass
    return "unknown"


def _driver() -> str:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        return r.stdout.strip().splitlines()[0]
    except Exception:
        return "?"


def flashgdn_backward() -> str:
    """Which backward flashgdn's calls take: the fused reverse kernel where it applies (`fast` and
    `default`, bf16, K = V = 128; other calls take the staged one) unless FLASHGDN_BWD_FUSED reads
    as 0, then the staged kernels. Read as the library reads it (unset, or std::atoi of the value
    not 0)."""
    value = os.environ.get("FLASHGDN_BWD_FUSED")
    m = re.match(r"\s*[+-]?\d+", value or "")
    if value is None or (m is not None and int(m.group()) != 0):
        return "fused where it applies (fast and default, bf16, K = V = 128), else staged"
    return "staged (FLASHGDN_BWD_FUSED=0)"


def flashgdn_cp(a) -> str:
    """flashgdn's context parallelism as the header records it: auto, on or off, and a fixed segment."""
    return a.flashgdn_cp + (f", segment {a.flashgdn_cp_segment} tokens" if a.flashgdn_cp_segment else "")


def configure_flashgdn(obj, a) -> None:
    """flashgdn's options from the command line: its level and its context parallelism."""
    obj.precision = a.flashgdn_precision
    obj.context_parallel = {"auto": None, "on": True, "off": False}[a.flashgdn_cp]
    obj.cp_segment = a.flashgdn_cp_segment


def header(a, torch, loaded: Dict, ceilings: Dict) -> Dict:
    props = torch.cuda.get_device_properties(0)
    try:
        import triton
        tv = triton.__version__
    except Exception:
        tv = "not installed"
    h = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name(0),
        "sm_count": props.multi_processor_count,
        "l2_mb": round(getattr(props, "L2_cache_size", 0) / 1e6, 1),
        "driver": _driver(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": tv,
        "python": platform.python_version(),
        "flashgdn_commit": _git_commit(a),
        "selection": ("full" if a.full else "quick") + (f" part {a.part}" if a.part else ""),
        "qk_norms": ", ".join(C.parse_qk_norms(a.qk_norm)),
        "flashgdn_precision": a.flashgdn_precision,
        "flashgdn_backward": flashgdn_backward(),
        "flashgdn_cp": flashgdn_cp(a),
        "argv": " ".join(sys.argv[1:]),
        "copy_GBps": round(ceilings["copy_bytes_per_s"] / 1e9, 1),
        "bf16_TFLOPs": round(ceilings["bf16_flop_per_s"] / 1e12, 1),
        "contenders": {},
    }
    for name, (obj, why) in loaded.items():
        if obj is None:
            h["contenders"][name] = f"not installed: {why}"
        else:
            try:
                h["contenders"][name] = obj.version()
            except Exception as e:
                h["contenders"][name] = f"? ({e})"
    return h


def check_key(a, cells: List[C.Cell]):
    """(Hq, Hv, with gradients) of the accuracy check, or None without one. With gradients when
    any selected cell has them, on the first head configuration that has backward cells (its
    warm-up task compiles the kernels with gradients); else on the first cell's."""
    if a.no_check or not cells:
        return None
    grads = any(c.mode != "fwd" for c in cells)
    first = next(c for c in cells if c.mode != "fwd") if grads else cells[0]
    return (first.Hq, first.Hv, grads)


def _prewarm_tasks(cells, names, loaded: Dict, check) -> List[Dict]:
    """The compile warm-up's tasks for the contenders that loaded (prewarm.plan)."""
    from .prewarm import plan

    return plan(cells, [n for n in names if loaded[n][0] is not None], lambda n, c: loaded[n][0].refuses(c),
                check=check)


def _versions(loaded: Dict) -> Dict[str, str]:
    out = {}
    for name, (obj, _) in loaded.items():
        try:
            out[name] = obj.version() if obj is not None else "not installed"
        except Exception as e:
            out[name] = f"? ({type(e).__name__})"
    return out


# ---- one contender on one cell (its call and errors: calls.py) -----------------------------

def accuracy_check(torch, c, inp: Dict, ref: Dict, with_grads: bool) -> Dict:
    """Relative L2 errors of o and the final state and, with_grads, of the gradients; a backward
    that raises leaves the forward's errors and says why in 'grad_status'. ``inp`` and ``ref``
    are of one q/k convention (inp['qk_norm']): the contender's call follows it."""
    from .oracle import rel_l2

    res = {}
    x = c.convert(inp)
    t0 = time.perf_counter()
    grads = with_grads and c.has_backward
    with torch.set_grad_enabled(grads):
        out = c.call(x)
    torch.cuda.synchronize()
    res["first_call_s"] = time.perf_counter() - t0
    o, ht = c.canon(out, x)
    res["o"] = rel_l2(o, ref["o"])
    res["ht"] = rel_l2(ht, ref["ht"])
    if grads:
        leaves = [inp[n] for n in ("q", "k", "v", "g", "beta", "h0")]
        try:
            gr = torch.autograd.grad((out[0], out[1]), leaves, (inp["do"], inp["dht"]), allow_unused=True)
            torch.cuda.synchronize()
            for n, gx in zip(GRAD_NAMES, gr):
                res[n] = rel_l2(gx, ref[n]) if ref.get(n) is not None else float("nan")
            res["grad_status"] = "ok"
        except Exception as e:
            res["grad_status"] = f"{classify(e)}: {type(e).__name__}: {str(e)[:300]}"
            if poisoned(e):
                raise
    return res


def drain(queue: List, is_ready: Callable, run: Callable, skip: Callable, out_of_time: Callable,
          wait: Callable) -> None:
    """Runs the items of ``queue`` in their order as they become ready: each pass runs every
    ready item (skips every item once out of time) and keeps the others for the next pass; a
    pass that runs nothing first waits (``wait``: until the warm-up moves on)."""
    while queue:
        left = []
        for item in queue:
            if out_of_time():
                skip(item)
            elif is_ready(item):
                run(item)
            else:
                left.append(item)
        if left and len(left) == len(queue):
            wait()
        queue = left


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "report":
        return report.main(argv[1:])
    if argv and argv[0] == "prewarm-task":
        from .prewarm import task_main
        return task_main(argv[1])
    standalone_prewarm = bool(argv) and argv[0] == "prewarm"
    a = _parse(argv[1:] if standalone_prewarm else argv)
    cells = select_cells(a)
    if a.list:
        for c in cells:
            print(f"{c.mode:7s} {c.heads:6s} {c.qk_norm:13s} {c.layout.name}")
        norms = [n for n in C.QK_NORMS if any(c.qk_norm == n for c in cells)]
        print(f"{len(cells)} cells, {len({(c.Hq, c.Hv) for c in cells})} head configurations, "
              f"q/k {' and '.join(norms) or 'none'}, "
              f"estimated {C.estimate_s(cells) / 60:.1f} min on a fresh 16-core machine (the peers compile "
              f"in 16 background processes while the cells are timed, ~{C.S_PER_CELL['fwd']:.1f} s per cell)")
        return 0

    t_start = time.monotonic()
    import torch

    from .contenders import ALL, Unavailable
    from .inputs import floor_counts, make_inputs, set_bytes
    from .oracle import oracle
    from .timing import first_call_s, measure_ceilings, time_calls

    try:
        from tqdm import tqdm
    except Exception:  # pragma: no cover
        tqdm = None
    if not torch.cuda.is_available():
        print("gdnbench: no CUDA device", file=sys.stderr)
        return 2

    names = [n.strip() for n in a.contenders.split(",") if n.strip()]
    for n in names:
        if n not in ALL:
            raise SystemExit(f"--contenders: unknown {n!r} (known: {', '.join(ALL)})")
    loaded = {}
    for n in names:
        obj = ALL[n]()
        if n == "flashgdn":
            configure_flashgdn(obj, a)
        try:
            obj.load()
            loaded[n] = (obj, "")
        except Unavailable as e:
            loaded[n] = (None, str(e))
        except Exception as e:
            loaded[n] = (None, f"{type(e).__name__}: {e}")

    check = check_key(a, cells)
    if a.check_only:  # the warm-up compiles for the check's shape and the one cell its task needs,
        first = {}     # in each q/k convention of the selection
        for c in cells:
            if check and (c.Hq, c.Hv, c.mode != "fwd") == check:
                first.setdefault(c.qk_norm, c)
        cells = list(first.values())
    from . import prewarm as P
    if standalone_prewarm:
        workers = a.workers or (a.prewarm if a.prewarm > 0 else P.default_workers())
        tasks = _prewarm_tasks(cells, names, loaded, check)
        s = P.prewarm(tasks, workers, timeout_s=a.budget_s, versions=_versions(loaded))
        print(f"prewarm: {len(tasks)} tasks, {s['wall_s']} s on {workers} processes, "
              f"{len(P.warmed(s))} without an error")
        return 0

    # The device's ceilings first, before any warm-up process touches the GPU.
    ceilings = measure_ceilings()
    hdr = header(a, torch, loaded, ceilings)
    out_dir = Path(a.out) if a.out else report.default_out_dir(hdr)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = open(out_dir / "log.txt", "a")
    log_lock = threading.Lock()

    def say(msg: str, to_log_only: bool = False):  # also called from the warm-up's threads
        with log_lock:
            log.write(msg + "\n")
            log.flush()
            if to_log_only:
                pass
            elif tqdm is not None:
                tqdm.write(msg, file=sys.stderr)
            else:
                print(msg, file=sys.stderr)

    say(f"# {hdr['date']} {hdr['gpu']} torch {hdr['torch']} cuda {hdr['cuda']}; {len(cells)} cells; "
        f"copy {hdr['copy_GBps']} GB/s, bf16 {hdr['bf16_TFLOPs']} TFLOP/s")
    for n, v in hdr["contenders"].items():
        say(f"#   {n}: {v}")

    warm = None
    workers = a.prewarm if a.prewarm >= 0 else P.default_workers()
    if workers != 0:
        tasks = _prewarm_tasks(cells, names, loaded, check)
        if tasks:
            warm = P.Warmup(tasks, workers, say=say, versions=_versions(loaded),
                            timeout_s=max(60.0, a.budget_s - (time.monotonic() - t_start) - 30.0))

    def ready(n: str, hq: int, hv: int, grad: bool) -> bool:
        return warm is None or warm.ready(n, hq, hv, grad)

    rows: List[Dict] = []
    acc: Dict[str, Dict[str, Dict]] = {}  # {qk_norm: {contender: the accuracy check's result}}
    state = {"poisoned": None, "flushed": time.monotonic()}

    def flush(force: bool = False):
        if not force and time.monotonic() - state["flushed"] < 15.0:
            return
        if warm is not None:
            hdr["prewarm"] = warm.summary()
        rows.sort(key=report.matrix_order)
        report.write_all(out_dir, hdr, rows, acc)
        state["flushed"] = time.monotonic()

    # ---- accuracy check on one small shape, in each q/k convention of the selection, per
    # contender once its kernels are compiled; the oracle gets each convention's inputs ----
    inps: Dict[str, Dict] = {}
    refs: Dict[str, Dict] = {}
    check_norms = [n for n in C.QK_NORMS if any(c.qk_norm == n for c in cells)]
    if check is not None:
        hq, hv, grads = check
        for qk in check_norms:
            inps[qk] = make_inputs(hq, hv, CHECK_LAYOUT, seed=7, requires_grad=grads, with_grads_out=True,
                                   qk_norm=qk)
            t0 = time.perf_counter()
            refs[qk] = oracle(inps[qk], grads)
            hdr["oracle"] = refs[qk].pop("oracle")
            say(f"# oracle ({qk}): {hdr['oracle']} ({time.perf_counter() - t0:.1f} s)")
        hdr["check_shape"] = (f"Hq/Hv {hq}/{hv}, varlen {CHECK_LAYOUT.name}, T = {CHECK_LAYOUT.total}, "
                              f"q/k {' and '.join(check_norms)}")
        say(f"# check shape {hdr['check_shape']}")

    def run_check(n: str):
        obj, why = loaded[n]
        for qk in check_norms:
            acc.setdefault(qk, {})[n] = check_one(n, obj, why, qk)

    def check_one(n: str, obj, why: str, qk: str) -> Dict:
        if obj is None:
            return {"status": f"not installed: {why}"}
        if state["poisoned"]:
            return {"status": f"skipped: {state['poisoned']}"}
        hq, hv, grads = check
        inp = inps[qk]
        try:
            r = accuracy_check(torch, obj, inp, refs[qk], grads)
            r["status"] = "ok"
            if grads and not obj.has_backward:
                r["status"] = "ok (forward only: no backward)"
            elif grads and r.get("grad_status") != "ok":
                r["status"] = f"ok forward; backward {r['grad_status']}"
            say(f"  check {n} ({qk}): " + ", ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}"
                                                      for k, v in r.items()))
        except Exception as e:
            r = {"status": f"{classify(e)}: {type(e).__name__}: {str(e)[:300]}"}
            say(f"  check {n} ({qk}): {r['status']}")
            say(traceback.format_exc(), to_log_only=True)
            if poisoned(e):
                state["poisoned"] = f"CUDA context lost in {n}'s accuracy check ({qk})"
        if grads and obj.has_backward:
            for t in ("q", "k", "v", "g", "beta", "h0"):
                inp[t].grad = None
        gc.collect()
        torch.cuda.empty_cache()
        return r

    # ---- timing ---------------------------------------------------------------------------
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2 ** 20)
    rotate_bytes = (a.rotate_mb * 2 ** 20) if a.rotate_mb else 2 * l2
    stream = torch.cuda.Stream()
    cur = {"i": None, "sets": None}  # the input sets of the cell measured last

    def base_row(cell: C.Cell, n: str) -> Dict:
        lay = cell.layout
        flop, nbytes = floor_counts(cell.Hq, cell.Hv, lay, cell.mode)
        floor_ms = max(flop / ceilings["bf16_flop_per_s"], nbytes / ceilings["copy_bytes_per_s"]) * 1e3
        row = dict(config=cell.heads, Hq=cell.Hq, Hv=cell.Hv, layout=lay.name, kind=lay.kind, nseq=lay.nseq,
                   T_total=lay.total, mode=cell.mode, qk_norm=cell.qk_norm, floor_ms=floor_ms, floor_flop=flop,
                   floor_bytes=nbytes,
                   contender=n, status="", reason="", ms=float("nan"), method="", reps=0, spread=float("nan"),
                   mem_mib=float("nan"), first_call_s=float("nan"), floor_frac=float("nan"))
        a_res = acc.get(cell.qk_norm, {}).get(n, {})
        row["err_o"] = a_res.get("o", float("nan"))
        row["err_ht"] = a_res.get("ht", float("nan"))
        gerr = [a_res[g] for g in GRAD_NAMES if isinstance(a_res.get(g), float)]
        grad = cell.mode != "fwd"
        row["err_grad"] = max(gerr) if gerr and grad else float("nan")
        errs = [row["err_o"], row["err_ht"]] + ([row["err_grad"]] if grad else [])
        errs = [e for e in errs if e == e]
        row["error"] = max(errs) if errs else float("nan")
        return row

    def not_run(cell: C.Cell, n: str):
        """Why (status, reason) this contender is not timed on this cell, or None."""
        obj, why = loaded[n]
        a_res = acc.get(cell.qk_norm, {}).get(n, {})
        if obj is None:
            return "not installed", why
        if state["poisoned"]:
            return "skipped", state["poisoned"]
        if (r := obj.refuses(cell)) is not None:
            return "refused", r
        if cell.mode != "fwd" and str(a_res.get("grad_status", "ok")).startswith("refused"):
            # Its backward refused on the check shape for a reason that is not about the shape
            # (e.g. FLA's guard against its gated backward on Hopper with this Triton).
            return "refused", f"backward refused in the accuracy check: {a_res['grad_status'][len('refused: '):]}"
        return None

    def measure(i: int, n: str):
        cell = cells[i]
        lay, grad = cell.layout, cell.mode != "fwd"
        obj = loaded[n][0]
        row = base_row(cell, n)
        t_cell = time.monotonic()
        why = not_run(cell, n)
        if why is not None:
            row.update(status=why[0], reason=why[1])
        else:
            row["warmup_running"] = warm.running() if warm is not None else 0
            xs = fns = None
            try:
                if cur["i"] != i:
                    cur["i"], cur["sets"] = None, None
                    gc.collect()
                    probe = make_inputs(cell.Hq, cell.Hv, lay, seed=0, requires_grad=grad, with_grads_out=grad,
                                        qk_norm=cell.qk_norm)
                    nsets = int(max(2, min(32, -(-rotate_bytes // set_bytes(probe)))))
                    cur["sets"] = [probe] + [make_inputs(cell.Hq, cell.Hv, lay, seed=s, requires_grad=grad,
                                                         with_grads_out=grad, cu=probe["cu"], qk_norm=cell.qk_norm)
                                             for s in range(1, nsets)]
                    cur["i"] = i
                xs = [obj.convert(s) for s in cur["sets"]]
                fns = [make_fn(torch, obj, x, cell.mode, stream) for x in xs]
                quiet = warm.quiet if warm is not None else contextlib.nullcontext
                with quiet() if obj.tunes_on_first_call else contextlib.nullcontext():
                    row["first_call_s"] = first_call_s(fns[0])
                t = time_calls(fns, use_graph=not a.no_graph, target_ms=a.target_ms, stream=stream,
                               quiet=quiet)
                flop, nbytes = row["floor_flop"], row["floor_bytes"]
                row.update(status="ok", ms=t.ms, method=t.method, reps=t.reps, spread=t.spread,
                           mem_mib=t.mem_mib, floor_frac=row["floor_ms"] / t.ms, nsets=len(fns))
                row["tflops"] = flop / (t.ms * 1e-3) / 1e12
                row["gbps"] = nbytes / (t.ms * 1e-3) / 1e9
            except Exception as e:
                row.update(status=classify(e), reason=f"{type(e).__name__}: {str(e)[:300]}")
                say(f"--- {cell.key} {n}\n{traceback.format_exc()}", to_log_only=True)
                if poisoned(e):
                    state["poisoned"] = f"CUDA context lost after {n} failed on {cell.key}"
            finally:
                xs = fns = None
                gc.collect()
                try:
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                except Exception as e2:
                    state["poisoned"] = state["poisoned"] or f"CUDA context lost: {e2}"
        row["wall_s"] = time.monotonic() - t_cell  # harness cost of this measurement, all included
        rows.append(row)
        ms = f"{row['ms']:.3f} ms" if row["status"] == "ok" else f"{row['status']}: {row['reason'][:100]}"
        say(f"{cell.mode:6s} {cell.heads:6s} {cell.qk_norm:13s} {lay.name:28s} {n:10s} {ms}"
            + (f"  (first {row['first_call_s']:.1f} s, {row['method'][:40]})" if row["status"] == "ok" else ""))

    # ---- the schedule: whatever is ready, in matrix order; wait for the warm-up otherwise ----
    # A contender's cells come after its check; a contender is timed on a head configuration
    # once its warm-up task for it has ended (or there is none: flashgdn, refused cells).
    queue = [("check", n) for n in names] if check is not None else []
    if not a.check_only:
        queue += [(i, n) for i in range(len(cells)) for n in names]
    checked = set()

    def is_ready(item) -> bool:
        what, n = item
        if what == "check":
            hq, hv, grads = check
            return loaded[n][0] is None or (ready(n, hq, hv, grads) and ready(n, hq, hv, False))
        if check is not None and n not in checked:
            return False
        cell = cells[what]
        return not_run(cell, n) is not None or ready(n, cell.Hq, cell.Hv, cell.mode != "fwd")

    bar = tqdm(total=sum(1 for q in queue if q[0] != "check"), file=sys.stderr, mininterval=2.0,
               dynamic_ncols=True) if tqdm else None
    def out_of_time() -> bool:
        return time.monotonic() - t_start + 20.0 > a.budget_s

    def skip(item):
        what, n = item
        if what != "check":
            row = base_row(cells[what], n)
            row.update(status="skipped", reason=f"time budget ({a.budget_s:.0f} s) reached", wall_s=0.0)
            rows.append(row)
            if bar:
                bar.update(1)

    def run(item):
        what, n = item
        if what == "check":
            run_check(n)
            checked.add(n)
        else:
            measure(what, n)
            if bar:
                bar.update(1)
        flush()

    def wait():
        if warm is None or not warm.pending():  # nothing can become ready: a bug, not a wait
            raise RuntimeError("gdnbench: items not ready with no warm-up task left")
        warm.wait(timeout=max(1.0, a.budget_s - (time.monotonic() - t_start)))

    # Everything imported so far (torch, the peers' compilers) stays alive to the end: freeze it,
    # so that the gc.collect() after each measurement scans only what the cells allocate (a full
    # collection over the peers' modules costs ~0.1-0.5 s, several times per cell).
    gc.collect()
    gc.freeze()
    drain(queue, is_ready, run, skip, out_of_time, wait)
    cur["sets"] = None
    inps.clear()  # free the check's tensors
    refs.clear()
    if bar:
        bar.close()
    if warm is not None:
        warm.close()  # tasks nobody waits for any more (e.g. all their cells skipped)
    hdr["wall_s"] = round(time.monotonic() - t_start, 1)
    flush(force=True)
    report.write_all(out_dir, hdr, rows, acc, plots=True)
    print(report.summary_text(hdr, rows, acc))
    print(f"\nresults: {out_dir}")
    return 0
