"""Warm the peers' compile caches in parallel processes before anything is timed.

FlashQLA (TileLang), FLA (Triton) and FlashInfer (CuTe DSL) compile their kernels on first use,
per head configuration and per variant (one sequence / packed varlen / with gradients), and keep
the binaries in on-disk caches (~/.tilelang/cache, ~/.triton/cache, the CuTe DSL file cache).
Compiling is single-threaded per process and takes 10-150 s per (contender, heads, variant): for
the full matrix that is about an hour in one process, which is most of the run. Here one task per
(contender, Hq/Hv, forward or forward+backward) runs in its own process, ``workers`` at a time,
and calls the contender once on every layout of the selection that the task covers; the timed
process then loads the binaries from the caches.

What this does not change: every timed number comes from the timed process after its own warm-up
(timing.time_calls). FLA's autotuning results are not kept from these processes (they time
configurations while other processes share the GPU): FLA_CACHE_RESULTS=0 here, so the timed
process autotunes on an otherwise idle GPU, with the compiled binaries already on disk.

    python -m flashgdn.bench prewarm --full --part 1/2 [--workers 12]   # standalone, same selection flags

Markers (opt-in: set FLASHGDN_PREWARM_DIR to a folder kept together with the compile caches,
as scripts/gpu_bench.sh does under /tmp/peer-cache): a task that completed writes a marker
named by the peer's version, heads, gradients and layouts; a later run on a machine holding those
caches (the same machine, or caches carried from one) skips the tasks that have a marker.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from . import configs as C

PEER_ORDER = ("flashqla", "fla", "flashinfer")  # slowest compilers first
RESULT_TAG = "PREWARM-RESULT "
MARKER_ENV = "FLASHGDN_PREWARM_DIR"


def known_layouts() -> Dict[str, C.Layout]:
    out = {}
    for lay in C.FWD_LAYOUTS + C.BWD_LAYOUTS + [c.layout for c in C.quick_cells()]:
        out[lay.name] = lay
    return out


def plan(cells: Sequence[C.Cell], contenders: Sequence, refuses: Callable) -> List[Dict]:
    """Tasks: one per (peer, Hq, Hv, grad), each with the layouts (names) of its cells, smallest
    first: the compiles happen while a task holds little device memory (a dozen tasks share the
    GPU), and the large layouts then run briefly with the kernels already loaded.
    ``refuses(name, cell)`` -> reason or None skips cells the contender refuses up front."""
    groups: Dict[Tuple[str, int, int, bool], List[str]] = {}
    for name in [n for n in PEER_ORDER if n in contenders]:
        for c in cells:
            if refuses(name, c) is not None:
                continue
            key = (name, c.Hq, c.Hv, c.mode != "fwd")
            lays = groups.setdefault(key, [])
            if c.layout.name not in lays:
                lays.append(c.layout.name)
    tasks = []
    lay_of = known_layouts()
    for (name, hq, hv, grad), lays in groups.items():
        lays.sort(key=lambda n: (lay_of[n].total, lay_of[n].nseq))
        tasks.append(dict(contender=name, Hq=hq, Hv=hv, grad=grad, layouts=lays))
    # Grad tasks (more kernels) and the slow compilers start first; the pool then fills in.
    tasks.sort(key=lambda t: (not t["grad"], PEER_ORDER.index(t["contender"]), -t["Hv"]))
    return tasks


def run_task(spec: Dict) -> Dict:
    """In a worker process: one call per layout; stops a grad task at its first refusal (the
    backward's refusal does not depend on the layout)."""
    import torch

    from .cli import classify, make_fn
    from .contenders import ALL
    from .inputs import make_inputs

    t_all = time.perf_counter()
    obj = ALL[spec["contender"]]()
    obj.load()
    lay_of = known_layouts()
    stream = torch.cuda.Stream()
    mode = "fwdbwd" if spec["grad"] else "fwd"
    done = []
    for name in spec["layouts"]:
        t0 = time.perf_counter()
        status = "ok"
        try:
            inp = make_inputs(spec["Hq"], spec["Hv"], lay_of[name], seed=0, requires_grad=spec["grad"],
                              with_grads_out=spec["grad"])
            fn = make_fn(torch, obj, obj.convert(inp), mode, stream)
            out = fn()
            torch.cuda.synchronize()
            del out, fn, inp
        except Exception as e:  # reported, not raised: the timed run meets it again and says so
            status = f"{classify(e)}: {type(e).__name__}: {str(e)[:200]}"
        torch.cuda.empty_cache()
        done.append(dict(layout=name, s=round(time.perf_counter() - t0, 2), status=status))
        if status.startswith("refused") and spec["grad"]:
            break
    return dict(spec, s=round(time.perf_counter() - t_all, 1), calls=done)


def task_main(arg: str) -> int:
    spec = json.loads(arg)
    try:
        res = run_task(spec)
    except Exception as e:
        res = dict(spec, s=float("nan"), calls=[], error=f"{type(e).__name__}: {str(e)[:300]}")
    print(RESULT_TAG + json.dumps(res), flush=True)
    return 0


def _run_one(spec: Dict, timeout_s: float) -> Dict:
    env = dict(os.environ, FLA_CACHE_RESULTS="0")
    # ``python -m flashgdn.bench`` normally; by path (``python python/flashgdn/bench``) where
    # flashgdn is not built and this package is loaded as "flashgdn_bench".
    entry = ["-m", __package__] if __package__ == "flashgdn.bench" else [os.path.dirname(os.path.abspath(__file__))]
    cmd = [sys.executable, *entry, "prewarm-task", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return dict(spec, s=round(time.perf_counter() - t0, 1), calls=[], error=f"timed out after {timeout_s:.0f} s")
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
    return dict(spec, s=round(time.perf_counter() - t0, 1), calls=[],
                error=f"exit {p.returncode}: {' | '.join(tail)[:300]}")


def marker_path(task: Dict, version: str) -> Optional[Path]:
    """Where the marker of ``task`` lives, or None when markers are off (no FLASHGDN_PREWARM_DIR)."""
    root = os.environ.get(MARKER_ENV)
    if not root:
        return None
    what = json.dumps([version, task["contender"], task["Hq"], task["Hv"], bool(task["grad"]), task["layouts"]])
    digest = hashlib.sha1(what.encode()).hexdigest()[:16]
    return Path(root) / f"{task['contender']}-{task['Hq']}-{task['Hv']}-{'grad' if task['grad'] else 'fwd'}-{digest}.json"


def completed(result: Dict) -> bool:
    """Every call ran, or a task with gradients stopped at a refusal (which does not depend on
    the layout): the caches hold what the timed run will ask for."""
    calls = result.get("calls") or []
    if result.get("error") or not calls:
        return False
    if all(c["status"] == "ok" for c in calls) and len(calls) == len(result["layouts"]):
        return True
    return bool(result["grad"]) and calls[-1]["status"].startswith("refused") and \
        all(c["status"] == "ok" for c in calls[:-1])


def default_workers() -> int:
    return max(1, min(16, os.cpu_count() or 1))


def prewarm(tasks: List[Dict], workers: int, timeout_s: float, say: Optional[Callable] = None,
            versions: Optional[Dict[str, str]] = None) -> Dict:
    """Runs the tasks, ``workers`` processes at a time, skipping those with a marker; returns a
    summary for the header."""
    say = say or (lambda m: print(m, file=sys.stderr))
    versions = versions or {}
    t0 = time.perf_counter()
    results = []
    todo = []
    for t in tasks:
        mark = marker_path(t, versions.get(t["contender"], "?"))
        if mark is not None and mark.is_file():
            results.append(dict(t, s=0.0, calls=[], cached=str(mark)))
        else:
            todo.append(t)
    if results:
        say(f"# prewarm: {len(results)} tasks already done on this machine's caches (markers in ${MARKER_ENV})")
    tasks = todo
    if tasks:
        say(f"# prewarm: {len(tasks)} tasks on {workers} processes (compile caches only; nothing is timed)")
        done = []
        with ThreadPoolExecutor(max_workers=workers) as ex:
            futures = {ex.submit(_run_one, t, timeout_s): i for i, t in enumerate(tasks)}
            # As each task ends (not in submission order): a run cut short keeps the markers of
            # every task that finished.
            for fut in as_completed(futures):
                r = fut.result()
                done.append((futures[fut], r))
                bad = [c for c in r.get("calls", []) if c["status"] != "ok"]
                say(f"  prewarm {r['contender']:10s} {r['Hq']}/{r['Hv']} {'fwd+bwd' if r['grad'] else 'fwd'}: "
                    f"{r.get('s', float('nan'))} s, {len(r.get('calls', []))} calls"
                    + (f", {len(bad)} not ok ({bad[0]['status'][:80]})" if bad else "")
                    + (f"; {r['error']}" if r.get("error") else ""))
                mark = marker_path(r, versions.get(r["contender"], "?"))
                if mark is not None and completed(r):
                    mark.parent.mkdir(parents=True, exist_ok=True)
                    mark.write_text(json.dumps(dict(r, version=versions.get(r["contender"], "?"))))
        results += [r for _, r in sorted(done, key=lambda x: x[0])]
    return dict(workers=workers, wall_s=round(time.perf_counter() - t0, 1), tasks=results)


def warmed(summary: Optional[Dict]) -> set:
    """{(contender, Hq, Hv, grad)} whose task ran every call without an error of its own."""
    out = set()
    for r in (summary or {}).get("tasks", []):
        if r.get("cached") or (not r.get("error") and r.get("calls")):
            out.add((r["contender"], r["Hq"], r["Hv"], bool(r["grad"])))
    return out
