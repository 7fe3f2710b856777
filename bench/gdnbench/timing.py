"""Timing: device ceilings, first-call time, peak memory, and the median time per call, in a
CUDA graph where the contender allows it (else eagerly, with the reason)."""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch


# GPU work queued ahead of each timed sample: the start event is recorded behind a short sleep
# kernel, so the GPU is still busy while the host enqueues the event and the call, and the host's
# launch latency (larger while warm-up processes compile on the CPU) stays out of the sample.
LEAD_CYCLES = 200_000  # ~0.1 ms at the H100's clocks


def _lead() -> None:
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(LEAD_CYCLES)


def _events_ms(fn: Callable, reps: int) -> List[float]:
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _lead()
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def measure_ceilings() -> dict:
    """Copy bandwidth (bytes read + written per second, 1 GiB device-to-device) and the dense
    bf16 matmul rate (8192^3 on random data), medians of 10 after 3 warm-ups."""
    def copy_ms():
        x = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
        x.random_()
        y = torch.empty_like(x)
        for _ in range(3):
            y.copy_(x)
        return statistics.median(_events_ms(lambda: y.copy_(x), 10))

    def matmul_ms():
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        for _ in range(3):
            a @ b
        return statistics.median(_events_ms(lambda: a @ b, 10))

    c_ms, mm_ms = copy_ms(), matmul_ms()
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": 2 * 2 ** 30 / (c_ms * 1e-3),
            "bf16_flop_per_s": 2 * 8192 ** 3 / (mm_ms * 1e-3)}


@dataclass
class Timed:
    ms: float
    method: str      # 'graph' or 'eager (<why>)'
    reps: int
    spread: float    # (p90 - p10) / median of the samples
    mem_mib: float


def first_call_s(fn: Callable) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    del out
    return time.perf_counter() - t0


def peak_mem_mib(fn: Callable) -> float:
    """Extra device memory of one call: max_memory_allocated during it minus what was allocated
    before (outputs included, freed after)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2 ** 20


def _spread(xs: List[float]) -> float:
    if len(xs) < 3:
        return float("nan")
    s = sorted(xs)
    med = statistics.median(s)
    p10, p90 = s[int(0.1 * (len(s) - 1))], s[int(0.9 * (len(s) - 1))]
    return (p90 - p10) / med if med > 0 else float("nan")


def time_calls(calls: List[Callable], use_graph: bool = True, target_ms: float = 300.0,
               min_reps: int = 10, max_reps: int = 200, stream: Optional[torch.cuda.Stream] = None,
               mem_call: Optional[Callable] = None, quiet: Optional[Callable] = None) -> Timed:
    """Median ms per call over ``calls`` (one per input set, rotated so the working set exceeds
    L2). Graph: one graph holds one call on every set; a replay's time / len(calls) is a sample.
    ``stream``: run warm-up and capture on it (the backward-only mode runs its forward there
    first, so that autograd's backward ops land on the capturing stream). ``quiet``: a context
    manager held while the samples are taken (the compile warm-up's processes stopped)."""
    quiet = quiet or contextlib.nullcontext
    n = len(calls)
    s = stream or torch.cuda.Stream()
    cur = torch.cuda.current_stream()
    s.wait_stream(cur)
    with torch.cuda.stream(s):
        t0 = time.perf_counter()
        for c in calls:
            c()
        s.synchronize()
        est_ms = max((time.perf_counter() - t0) * 1e3 / n, 1e-3)
    cur.wait_stream(s)
    mem = peak_mem_mib(mem_call or calls[0])
    why = "graphs off"
    if use_graph:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=s):
                keep = [c() for c in calls]  # outputs live in the graph's pool
            graph.replay()
            torch.cuda.synchronize()
            reps = int(min(max_reps, max(5, target_ms / (est_ms * n))))
            with quiet():
                for _ in range(2):
                    graph.replay()
                samples = [t / n for t in _events_ms(graph.replay, reps)]
            del keep
            del graph
            return Timed(statistics.median(samples), "graph", reps, _spread(samples), mem)
        except Exception as e:  # host sync / non-capturable work inside the call
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            try:
                del graph
            except Exception:
                pass
            torch.cuda.synchronize()
    reps = int(min(max_reps, max(min_reps, target_ms / est_ms)))
    i = [0]

    def one():
        calls[i[0] % n]()
        i[0] += 1

    with torch.cuda.stream(s), quiet():
        samples = _events_ms(one, reps)
    torch.cuda.synchronize()
    return Timed(statistics.median(samples), f"eager ({why})", reps, _spread(samples), mem)
