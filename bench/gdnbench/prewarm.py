"""Warm the peers' compile caches in worker processes, in the background of the timed run.

FlashQLA (TileLang), FLA (Triton) and FlashInfer (CuTe DSL) compile their kernels on first use,
per head configuration and per variant (one sequence / packed varlen / with gradients), and keep
the binaries in on-disk caches (~/.tilelang/cache, ~/.triton/cache, the CuTe DSL file cache).
Compiling is single-threaded per process: cold, one FlashQLA task takes ~4-6 min, and the full
matrix ~2 hours of CPU, which is most of a run. Here one task per (contender, Hq/Hv, forward or
forward+backward) runs in its own process (niceness 19), ``workers`` at a time, and calls the
contender once on every layout of the selection that the task covers, in each selected q/k
convention (the conventions share the kernels: the second call of a layout loads what the first
compiled); the timed process then loads the binaries from the caches.

The timed process does not wait for the whole warm-up (Warmup): it times every (cell,
contender) whose task has ended, and the others when theirs ends, so flashgdn (nothing to
compile) and the quick compilers are timed while FlashQLA still compiles. Those workers use the
GPU only for one call per layout after each compile, a few milliseconds now and then; each
timed number is the median of many replays, and each row records how many workers were running
when it was taken (``warmup_running``).

FLA's autotuning: in these processes Triton's autotuner runs each configuration once instead of
timing it (``_autotune_compiles_only``), nothing of it is kept (FLA_CACHE_RESULTS=0), and the
timed process autotunes for real, with the binaries already on disk.

    python bench/run.py prewarm --full --part 1/2 [--workers 12]   # standalone, same selection flags

Markers (opt-in: set FLASHGDN_PREWARM_DIR to a folder kept together with the compile caches,
as scripts/gpu_bench.sh does under /tmp/peer-cache): a task that completed writes a marker
named by the peer's version, heads, gradients, layouts and q/k conventions; a later run on a machine holding those
caches (the same machine, or caches carried from one) skips the tasks that have a marker.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from . import configs as C
from .calls import classify, make_fn

PEER_ORDER = ("flashqla", "fla", "flashinfer")  # slowest compilers first
RESULT_TAG = "PREWARM-RESULT "
MARKER_ENV = "FLASHGDN_PREWARM_DIR"
NICE = 19  # worker processes' niceness
_LIVE: set = set()  # worker processes running now, each leading its own process group
_LIVE_CV = threading.Condition()
_PAUSED = [False]    # while set (quiet), no worker process starts
DRAIN_S = 0.03       # after stopping the workers: the GPU work they queued (a few ms) drains
MAX_PAUSE_S = 60.0   # the workers continue after this long in any case
RUN_SCRIPT = Path(__file__).resolve().parents[1] / "run.py"  # what each worker process runs


def known_layouts() -> Dict[str, C.Layout]:
    out = {}
    for lay in C.FWD_LAYOUTS + C.BWD_LAYOUTS + [c.layout for c in C.quick_cells()] + [C.CHECK_LAYOUT]:
        out[lay.name] = lay
    return out


def plan(cells: Sequence[C.Cell], contenders: Sequence, refuses: Callable,
         check: Optional[Tuple[int, int, bool]] = None) -> List[Dict]:
    """Tasks: one per (peer, Hq, Hv, grad), each with the layouts (names) of its cells, smallest
    first: the compiles happen while a task holds little device memory (a dozen tasks share the
    GPU), and the large layouts then run briefly with the kernels already loaded. ``qk_norms``:
    the q/k conventions of its cells; the task calls every layout in each (they share the
    kernels, configs.py).
    ``refuses(name, cell)`` -> reason or None skips cells the contender refuses up front.
    ``check``: (Hq, Hv, grad) of the accuracy check; those tasks call the check shape first.

    Order (the timed process starts on whatever is ready): the check's tasks; then the slowest
    compiler's tasks (FlashQLA, ~4-6 min each cold: they set the warm-up's length), with
    gradients first; then the other peers' forward tasks and last their gradient tasks, which
    are skipped when that peer's backward was refused on the check (Warmup)."""
    groups: Dict[Tuple[str, int, int, bool], List[str]] = {}
    norms: Dict[Tuple[str, int, int, bool], set] = {}
    heads_rank: Dict[Tuple[int, int], int] = {}
    for c in cells:
        heads_rank.setdefault((c.Hq, c.Hv), len(heads_rank))
    for name in [n for n in PEER_ORDER if n in contenders]:
        for c in cells:
            if refuses(name, c) is not None:
                continue
            key = (name, c.Hq, c.Hv, c.mode != "fwd")
            lays = groups.setdefault(key, [])
            if c.layout.name not in lays:
                lays.append(c.layout.name)
            norms.setdefault(key, set()).add(c.qk_norm)
    lay_of = known_layouts()
    for lays in groups.values():
        lays.sort(key=lambda n: (lay_of[n].total, lay_of[n].nseq))
    checked = set()
    if check is not None:
        hq, hv, grad = check
        for name in [n for n in PEER_ORDER if n in contenders]:
            # With gradients where the peer has a gradient task there (else forward only: a peer
            # without a backward checks its forward).
            key = next((k for k in ((name, hq, hv, grad), (name, hq, hv, False)) if k in groups), None)
            if key is not None:
                groups[key].insert(0, C.CHECK_LAYOUT.name)
                checked.add(key)
    tasks = [dict(contender=name, Hq=hq, Hv=hv, grad=grad, layouts=lays,
                  qk_norms=[n for n in C.QK_NORMS if n in norms[(name, hq, hv, grad)]])
             for (name, hq, hv, grad), lays in groups.items()]

    def rank(t):
        c, h = t["contender"], heads_rank[(t["Hq"], t["Hv"])]
        if (c, t["Hq"], t["Hv"], t["grad"]) in checked:
            return (0, PEER_ORDER.index(c), 0, 0)
        if c == PEER_ORDER[0]:
            return (1, 0 if t["grad"] else 1, h, 0)
        return (2, 1 if t["grad"] else 0, h, PEER_ORDER.index(c))

    tasks.sort(key=rank)
    return tasks


def task_norms(spec: Dict) -> List[str]:
    """The q/k conventions a task calls (a task of a run before the conventions: in_kernel)."""
    return list(spec.get("qk_norms") or ["in_kernel"])


def run_task(spec: Dict) -> Dict:
    """In a worker process: one call per layout and q/k convention; stops a grad task at its first
    refusal (the backward's refusal does not depend on the layout)."""
    import torch

    from .contenders import ALL
    from .inputs import make_inputs

    t_all = time.perf_counter()
    obj = ALL[spec["contender"]]()
    obj.load()
    if spec["contender"] == "fla":
        _autotune_compiles_only()
    lay_of = known_layouts()
    stream = torch.cuda.Stream()
    mode = "fwdbwd" if spec["grad"] else "fwd"
    done = []
    for name, qk in [(n, q) for n in spec["layouts"] for q in task_norms(spec)]:
        t0 = time.perf_counter()
        status = "ok"
        try:
            inp = make_inputs(spec["Hq"], spec["Hv"], lay_of[name], seed=0, requires_grad=spec["grad"],
                              with_grads_out=spec["grad"], qk_norm=qk)
            fn = make_fn(torch, obj, obj.convert(inp), mode, stream)
            out = fn()
            torch.cuda.synchronize()
            del out, fn, inp
        except Exception as e:  # reported, not raised: the timed run meets it again and says so
            status = f"{classify(e)}: {type(e).__name__}: {str(e)[:200]}"
        torch.cuda.empty_cache()
        done.append(dict(layout=name, qk_norm=qk, s=round(time.perf_counter() - t0, 2), status=status))
        if status.startswith("refused") and spec["grad"]:
            break
    return dict(spec, s=round(time.perf_counter() - t_all, 1), calls=done)


def _autotune_compiles_only() -> None:
    """Triton's autotuner here runs each configuration once instead of timing it: the point of
    this process is to put every configuration's binary in the cache, and its timings (taken
    while other processes share the GPU) are neither kept (FLA_CACHE_RESULTS=0) nor used. The
    timed process autotunes for real, with the binaries on disk."""
    try:
        from triton.runtime import autotuner
    except Exception:
        return

    def once(kernel_call, quantiles=None):
        kernel_call()
        return [1.0, 1.0, 1.0] if quantiles else 1.0

    autotuner.Autotuner.do_bench = property(lambda self: once)


def task_main(arg: str) -> int:
    spec = json.loads(arg)
    try:  # compiling yields the CPU to the timed process, which may be timing meanwhile
        os.nice(NICE)
    except OSError:
        pass
    try:
        res = run_task(spec)
    except Exception as e:
        res = dict(spec, s=float("nan"), calls=[], error=f"{type(e).__name__}: {str(e)[:300]}")
    print(RESULT_TAG + json.dumps(res), flush=True)
    return 0


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _run_one(spec: Dict, timeout_s: float) -> Dict:
    env = dict(os.environ, FLA_CACHE_RESULTS="0")
    # bench/run.py, however the timed process was started (it or ``python -m gdnbench``).
    cmd = [sys.executable, str(RUN_SCRIPT), "prewarm-task", json.dumps(spec)]
    t0 = time.perf_counter()
    with _LIVE_CV:
        _LIVE_CV.wait_for(lambda: not _PAUSED[0])
        # Its own process group: quiet() stops it with the compilers it starts (nvcc, ptxas).
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
        _LIVE.add(p)
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _signal_group(p, signal.SIGKILL)
        p.communicate()
        return dict(spec, s=round(time.perf_counter() - t0, 1), calls=[], error=f"timed out after {timeout_s:.0f} s")
    finally:
        with _LIVE_CV:
            _LIVE.discard(p)
    for line in reversed(out.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = (err or out).strip().splitlines()[-3:]
    return dict(spec, s=round(time.perf_counter() - t0, 1), calls=[],
                error=f"exit {p.returncode}: {' | '.join(tail)[:300]}")


def marker_path(task: Dict, version: str) -> Optional[Path]:
    """Where the marker of ``task`` lives, or None when markers are off (no FLASHGDN_PREWARM_DIR)."""
    root = os.environ.get(MARKER_ENV)
    if not root:
        return None
    what = json.dumps([version, task["contender"], task["Hq"], task["Hv"], bool(task["grad"]), task["layouts"],
                       task_norms(task)])
    digest = hashlib.sha1(what.encode()).hexdigest()[:16]
    return Path(root) / f"{task['contender']}-{task['Hq']}-{task['Hv']}-{'grad' if task['grad'] else 'fwd'}-{digest}.json"


def completed(result: Dict) -> bool:
    """Every call ran, or a task with gradients stopped at a refusal (which does not depend on
    the layout): the caches hold what the timed run will ask for."""
    calls = result.get("calls") or []
    if result.get("error") or not calls:
        return False
    if all(c["status"] == "ok" for c in calls) and len(calls) == len(result["layouts"]) * len(task_norms(result)):
        return True
    return bool(result["grad"]) and calls[-1]["status"].startswith("refused") and \
        all(c["status"] == "ok" for c in calls[:-1])


def default_workers() -> int:
    return max(1, min(16, os.cpu_count() or 1))


class Warmup:
    """The tasks running in the background, ``workers`` processes at a time (tasks with a marker
    count as done at once), while the caller goes on: the timed process times what is ready
    (``ready``) and waits (``wait``) only when nothing is. A gradient task whose peer's backward
    was refused on an earlier task is skipped (the refusal does not depend on the shape)."""

    def __init__(self, tasks: List[Dict], workers: int, timeout_s: float, say: Optional[Callable] = None,
                 versions: Optional[Dict[str, str]] = None):
        self.say = say or (lambda m: print(m, file=sys.stderr))
        self.versions = versions or {}
        self.workers = workers
        self.t0 = time.perf_counter()
        self.t_end = self.t0
        self.tasks = list(tasks)
        self._cv = threading.Condition()
        self._results: Dict[int, Dict] = {}
        self._running = 0
        self._refused_grad: Dict[str, str] = {}
        self._index = {(t["contender"], t["Hq"], t["Hv"], bool(t["grad"])): i for i, t in enumerate(tasks)}
        todo = []
        for i, t in enumerate(tasks):
            mark = marker_path(t, self.versions.get(t["contender"], "?"))
            if mark is not None and mark.is_file():
                self._results[i] = dict(t, s=0.0, calls=[], cached=str(mark))
            else:
                todo.append(i)
        if self._results:
            self.say(f"# prewarm: {len(self._results)} tasks already done on this machine's caches "
                     f"(markers in ${MARKER_ENV})")
        self._ex = None
        if todo:
            self.say(f"# prewarm: {len(todo)} tasks on {workers} processes in the background "
                     f"(compile caches only; nothing is timed there)")
            self._ex = ThreadPoolExecutor(max_workers=workers)
            for i in todo:
                self._ex.submit(self._run, i, timeout_s)

    def _run(self, i: int, timeout_s: float) -> None:
        t = self.tasks[i]
        with self._cv:
            refused = self._refused_grad.get(t["contender"]) if t["grad"] else None
            self._running += refused is None
        if refused is not None:
            r = dict(t, s=0.0, calls=[], skipped=f"backward refused on an earlier task: {refused[:120]}")
        else:
            try:
                r = _run_one(t, timeout_s)
            except Exception as e:  # the pool must not lose a task: it would be waited for forever
                r = dict(t, s=float("nan"), calls=[], error=f"{type(e).__name__}: {str(e)[:300]}")
        calls = r.get("calls") or []
        bad = [c for c in calls if c["status"] != "ok"]
        self.say(f"  prewarm {r['contender']:10s} {r['Hq']}/{r['Hv']} {'fwd+bwd' if r['grad'] else 'fwd'}: "
                 + (r["skipped"] if r.get("skipped") else f"{r.get('s', float('nan'))} s, {len(calls)} calls")
                 + (f", {len(bad)} not ok ({bad[0]['status'][:80]})" if bad else "")
                 + (f"; {r['error']}" if r.get("error") else ""))
        mark = marker_path(r, self.versions.get(r["contender"], "?"))
        if mark is not None and completed(r):
            mark.parent.mkdir(parents=True, exist_ok=True)
            mark.write_text(json.dumps(dict(r, version=self.versions.get(r["contender"], "?"))))
        with self._cv:
            if r["grad"] and bad and bad[-1]["status"].startswith("refused"):
                self._refused_grad.setdefault(r["contender"], bad[-1]["status"])
            self._running -= refused is None
            self._results[i] = r
            self.t_end = time.perf_counter()
            self._cv.notify_all()

    def ready(self, contender: str, Hq: int, Hv: int, grad: bool) -> bool:
        """The task for this key has ended (or there is none)."""
        i = self._index.get((contender, Hq, Hv, bool(grad)))
        with self._cv:
            return i is None or i in self._results

    def running(self) -> int:
        """Worker processes running now."""
        with self._cv:
            return self._running

    def pending(self) -> int:
        """Tasks not ended."""
        with self._cv:
            return len(self.tasks) - len(self._results)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Until one more task ends (False on timeout or when none is left)."""
        with self._cv:
            n = len(self._results)
            if n == len(self.tasks):
                return False
            return self._cv.wait_for(lambda: len(self._results) > n, timeout)

    def join(self) -> None:
        if self._ex is not None:
            self._ex.shutdown(wait=True)

    def close(self) -> None:
        """Drops the tasks not started and kills the running ones (the caller's time is up)."""
        if self._ex is not None:
            self._ex.shutdown(wait=False, cancel_futures=True)
        with _LIVE_CV:
            for p in list(_LIVE):
                _signal_group(p, signal.SIGKILL)
        self.join()

    @contextlib.contextmanager
    def quiet(self):
        """Inside, no warm-up process runs: every worker's process group is stopped (SIGSTOP) and
        the GPU work they had queued drains (DRAIN_S) before the caller goes on; they continue
        (SIGCONT) on the way out, or after MAX_PAUSE_S should the caller hang. No worker starts
        meanwhile. For what is timed: the samples of a measurement, and FLA's autotuning."""
        with _LIVE_CV:
            _PAUSED[0] = True
            stopped = [p for p in _LIVE if p.poll() is None]
            for p in stopped:
                _signal_group(p, signal.SIGSTOP)

        def resume():
            with _LIVE_CV:
                if not _PAUSED[0]:
                    return
                for p in stopped:
                    _signal_group(p, signal.SIGCONT)
                _PAUSED[0] = False
                _LIVE_CV.notify_all()

        timer = threading.Timer(MAX_PAUSE_S, resume)
        timer.daemon = True
        timer.start()
        try:
            if stopped:
                time.sleep(DRAIN_S)
            yield len(stopped)
        finally:
            timer.cancel()
            resume()

    def summary(self) -> Dict:
        with self._cv:
            done = [self._results[i] for i in sorted(self._results)]
            left = [dict(t, s=float("nan"), calls=[], error="not run: the timed run ended first")
                    for i, t in enumerate(self.tasks) if i not in self._results]
            return dict(workers=self.workers, wall_s=round(self.t_end - self.t0, 1), tasks=done + left)


def prewarm(tasks: List[Dict], workers: int, timeout_s: float, say: Optional[Callable] = None,
            versions: Optional[Dict[str, str]] = None) -> Dict:
    """All the tasks, waited for (the standalone ``prewarm`` command); a summary for the header."""
    w = Warmup(tasks, workers, timeout_s, say=say, versions=versions)
    w.join()
    return w.summary()


def warmed(summary: Optional[Dict]) -> set:
    """{(contender, Hq, Hv, grad)} whose task ran every call without an error of its own."""
    out = set()
    for r in (summary or {}).get("tasks", []):
        if r.get("cached") or (not r.get("error") and r.get("calls")):
            out.add((r["contender"], r["Hq"], r["Hv"], bool(r["grad"])))
    return out
