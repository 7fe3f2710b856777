"""The benchmark matrix: head configurations x layouts x modes x q/k conventions, the quick and
full selections, and the split of the full matrix into parts (``--part i/n``)."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

K = V = 128

# (Hq, Hv): Qwen3.5/3.6-style GVA head counts at TP1..TP8, plus two equal-head ones.
FWD_HEADS: List[Tuple[int, int]] = [(16, 64), (8, 32), (4, 16), (2, 8), (16, 48), (8, 24), (4, 12),
                                    (2, 6), (16, 32), (8, 16), (16, 16), (4, 4)]
BWD_HEADS: List[Tuple[int, int]] = [(16, 64), (16, 32), (8, 16), (2, 8), (2, 4)]

MODES = ("fwd", "bwd", "fwdbwd")
# Where q and k are L2-normalised. 'in_kernel': raw q, k and every contender normalises them in
# its call (use_qk_l2norm_in_kernel=True; FlashInfer's separate pass, timed). 'prenormalized': q
# and k normalised once when the inputs are made, outside the timed region, and no contender
# normalises (use_qk_l2norm_in_kernel=False; FlashInfer's native call).
QK_NORMS = ("in_kernel", "prenormalized")


@dataclass(frozen=True)
class Layout:
    """How the tokens are arranged. kind: 'seq' (one sequence, B = 1, no cu_seqlens), 'varlen'
    (B = 1, sequences packed along T with cu_seqlens) or 'batch' (dense [B, T], no cu_seqlens)."""

    kind: str
    lens: Tuple[int, ...]
    label: str = ""

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        n, t = len(self.lens), self.lens[0]
        if self.kind == "batch":
            return f"B{n}x{t}"
        return f"{n}x{t}"

    @property
    def total(self) -> int:
        return sum(self.lens)

    @property
    def nseq(self) -> int:
        return len(self.lens)

    @property
    def B(self) -> int:
        return self.nseq if self.kind == "batch" else 1

    @property
    def T(self) -> int:
        """Length of the time axis of the tensors ([B, T, ...])."""
        return self.lens[0] if self.kind == "batch" else self.total

    @property
    def cu_seqlens(self) -> Optional[List[int]]:
        if self.kind != "varlen":
            return None
        cu = [0]
        for n in self.lens:
            cu.append(cu[-1] + n)
        return cu

    @property
    def max_len(self) -> int:
        return max(self.lens)


def seq(T: int) -> Layout:
    return Layout("seq", (T,))


def varlen(n: int, T: int) -> Layout:
    return Layout("varlen", (T,) * n)


def batch(B: int, T: int) -> Layout:
    return Layout("batch", (T,) * B)


def split(total: int, n: int) -> Layout:
    """total tokens as n equal sequences: one sequence (no cu_seqlens) for n == 1, else packed."""
    return seq(total) if n == 1 else varlen(n, total // n)


def mixed(long: int = 16384, short_total: int = 16384, seed: int = 0) -> Layout:
    """One long sequence and many short ones of lengths 100..900 (not multiples of 64)."""
    rng = random.Random(seed)
    lens, left = [], short_total
    while left > 900 + 100:
        n = rng.randint(100, 900)
        lens.append(n)
        left -= n
    lens.append(left)
    total = long + short_total
    return Layout("varlen", (long,) + tuple(lens), label=f"mix{total}(1x{long}+{len(lens)}short)")


FWD_LAYOUTS: List[Layout] = (
    [seq(t) for t in (2048, 4096, 8192, 16384, 32768)]
    + [varlen(2, 16384), varlen(4, 8192), varlen(8, 4096), mixed()]
    + [batch(2, 8192), batch(8, 2048), batch(32, 512)]
)
BWD_LAYOUTS: List[Layout] = [split(t, n) for t in (8192, 32768) for n in (1, 2, 4, 8)]
# The accuracy check's shape: three packed sequences, none a multiple of the chunk size.
CHECK_LAYOUT = Layout("varlen", (101, 539, 384), label="3seq(101+539+384)")


@dataclass(frozen=True)
class Cell:
    Hq: int
    Hv: int
    layout: Layout
    mode: str  # 'fwd' (inference forward), 'bwd' (backward alone), 'fwdbwd' (forward + backward)
    qk_norm: str = "in_kernel"  # one of QK_NORMS

    @property
    def heads(self) -> str:
        return f"{self.Hq}/{self.Hv}"

    @property
    def key(self) -> str:
        return f"{self.mode}|{self.heads}|{self.layout.name}|{self.qk_norm}"


def norm_in_call(qk_norm: str) -> bool:
    """use_qk_l2norm_in_kernel for a contender's call in this convention."""
    if qk_norm not in QK_NORMS:
        raise ValueError(f"qk_norm: expected one of {', '.join(QK_NORMS)}, got {qk_norm!r}")
    return qk_norm == "in_kernel"


def parse_qk_norms(spec: Optional[str]) -> Tuple[str, ...]:
    """'in_kernel,prenormalized' -> the conventions in QK_NORMS order; None or '' -> all of them."""
    if not spec:
        return QK_NORMS
    want = {x.strip() for x in spec.split(",") if x.strip()}
    bad = sorted(want - set(QK_NORMS))
    if bad or not want:
        raise ValueError(f"--qk-norm: expected a comma list of {', '.join(QK_NORMS)}, got {spec!r}")
    return tuple(n for n in QK_NORMS if n in want)


def _each_norm(base: List[Cell], qk_norms: Sequence[str]) -> List[Cell]:
    """Every cell in every convention, the conventions of one cell next to each other (measured
    close in time)."""
    return [Cell(c.Hq, c.Hv, c.layout, c.mode, n) for c in base for n in qk_norms]


def full_cells(qk_norms: Sequence[str] = QK_NORMS) -> List[Cell]:
    cells = [Cell(hq, hv, lay, "fwd") for hq, hv in FWD_HEADS for lay in FWD_LAYOUTS]
    for hq, hv in BWD_HEADS:
        for lay in BWD_LAYOUTS:
            cells.append(Cell(hq, hv, lay, "bwd"))
            cells.append(Cell(hq, hv, lay, "fwdbwd"))
    return _each_norm(cells, qk_norms)


def quick_cells(qk_norms: Sequence[str] = QK_NORMS) -> List[Cell]:
    cells = [Cell(hq, hv, lay, "fwd") for hq, hv in ((16, 64), (2, 8))
             for lay in (seq(8192), seq(32768), varlen(4, 8192))]
    cells.append(Cell(16, 64, seq(32768), "fwdbwd"))
    return _each_norm(cells, qk_norms)


# Cost model (seconds, H100 machine of 16 cores; bench/results/h100-2026-11-23/full-f7b609e):
# the peers compile per head configuration and per variant (with gradients or not). One warm-up
# task (prewarm.py) per (peer, heads, gradients) took, cold, with 16 tasks sharing the CPU:
# FlashQLA ~230-290 s forward / ~260-340 s with gradients, FLA ~60-140 s, FlashInfer ~20-40 s.
# The warm-up runs in the background, and stops while samples are taken and while FLA autotunes:
# ~1.1 s per cell. Timing: ~1.5 s per cell, all contenders together; after the warm-up ends,
# ~30 s of FlashQLA's last head configuration is left. Measured: 108 cells in 509 s, 116 in 470 s.
# The q/k conventions share the warm-up tasks: every peer's norm is a separate pass before the
# same kernels (FLA's and FlashQLA's l2norm_fwd, FlashInfer's pass), so the prenormalized calls
# compile nothing that the in_kernel ones do not; a task calls each layout in each convention
# and costs what one convention's did. Each convention's cell is timed: ~1.5 s per cell each
# (not measured yet with both conventions).
PREWARM_TASK_S = {("flashqla", False): 280.0, ("flashqla", True): 360.0, ("fla", False): 140.0,
                  ("fla", True): 140.0, ("flashinfer", False): 30.0}
S_PER_CELL = {"fwd": 1.5, "bwd": 1.5, "fwdbwd": 1.5}
S_STOPPED_PER_CELL = 1.1  # the warm-up's processes stopped while a cell is measured
S_TAIL = 30.0             # timing left when the warm-up ends
S_START = 30.0            # imports, device ceilings, the oracle


def _warmup_tasks(cells: Sequence[Cell]):
    """The warm-up's tasks as (peer, Hq, Hv, with gradients); FlashInfer has no backward."""
    return {(n, c.Hq, c.Hv, c.mode != "fwd") for c in cells for n in ("flashqla", "fla", "flashinfer")
            if not (n == "flashinfer" and c.mode != "fwd")}


def estimate_s(cells: Sequence[Cell], workers: int = 16) -> float:
    """Cold-cache estimate. The warm-up runs in the background (prewarm.Warmup): its length is
    the longer of its longest task and its CPU work spread over ``workers``, plus the time it is
    stopped for measurements; the cells are timed meanwhile as their tasks end."""
    tasks = _warmup_tasks(cells)
    costs = [PREWARM_TASK_S[(n, g)] for n, _, _, g in tasks]
    warm = max([sum(costs) / max(1, workers)] + costs) if costs else 0.0
    timed = sum(S_PER_CELL[c.mode] for c in cells)
    if not costs:
        return S_START + timed
    return S_START + max(warm + S_STOPPED_PER_CELL * len(cells) + S_TAIL, timed)


def _work_s(cells: Sequence[Cell], workers: int = 16) -> float:
    """What a group of cells adds to a run: its warm-up CPU over ``workers`` and its timing."""
    tasks = _warmup_tasks(cells)
    return sum(PREWARM_TASK_S[(n, g)] for n, _, _, g in tasks) / workers + sum(S_PER_CELL[c.mode] for c in cells)


def part_of(cells: List[Cell], i: int, n: int) -> List[Cell]:
    """Cells of part i (1-based) of n: whole head configurations, greedily balanced by estimate."""
    groups = {}
    for c in cells:
        groups.setdefault((c.Hq, c.Hv), []).append(c)
    order = sorted(groups, key=lambda h: -_work_s(groups[h]))
    load = [0.0] * n
    owner = {}
    for h in order:
        j = min(range(n), key=lambda p: load[p])
        owner[h] = j
        load[j] += _work_s(groups[h])
    return [c for c in cells if owner[(c.Hq, c.Hv)] == i - 1]


def parse_heads(spec: str) -> List[Tuple[int, int]]:
    """'16/64,2/8' -> [(16, 64), (2, 8)]."""
    out = []
    for tok in spec.split(","):
        tok = tok.strip()
        if tok:
            a, b = tok.replace("x", "/").split("/")
            out.append((int(a), int(b)))
    return out


def filter_cells(cells: List[Cell], configs: Optional[str] = None, modes: Optional[str] = None,
                 layouts: Optional[str] = None) -> List[Cell]:
    """--configs '16/64,2/8', --modes 'fwd,fwdbwd', --layouts '1x8192,4x8192' (substring match)."""
    if configs:
        want = set(parse_heads(configs))
        cells = [c for c in cells if (c.Hq, c.Hv) in want]
    if modes:
        m = {x.strip() for x in modes.split(",") if x.strip()}
        cells = [c for c in cells if c.mode in m]
    if layouts:
        subs = [x.strip() for x in layouts.split(",") if x.strip()]
        cells = [c for c in cells if any(s == c.layout.name or s in c.layout.name for s in subs)]
    return cells


@dataclass
class Selection:
    cells: List[Cell] = field(default_factory=list)
    label: str = ""
