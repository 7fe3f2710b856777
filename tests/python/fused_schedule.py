"""The fused reverse kernel's stage plan as a checked table (bench/fused-backward.md, milestone 2).

chunk_form_fused.py states the backward's algebra (19 products a chunk). This file states where
the kernel computes each piece: in which of 16 stages, by which role (C the carry of dS, D the
dk/dv role, R the recompute role), from which shared-memory tiles or role registers, into which.
`run` executes the table on float64 arrays, chunk by chunk in reverse, and `hazards` checks it the
way the kernel's barriers will have to hold it:

- the roles of one stage run concurrently: a buffer one role writes in a stage is neither read
  nor written by another role in that stage (a rendezvous ends every stage);
- a role's registers are its own; every access an op makes is one it declares (checked while
  `run` executes, so a declaration cannot hide a read);
- the producer reloads q, k, v, S0 for the next chunk once stage 10 ends, ar and dO once stage 13
  ends and the gate vectors once stage 14 ends (RELOADED_AFTER): nothing reads them after;
- the store warp reads `out` from the stage after it is written until the one named in STORES.

test_fused_schedule.py checks the table against chunk_form_fused.backward (the same roundings
at the same points, any rounding policy) and that the checker catches moved ops. Shapes: tiles
of 64 tokens, K x V states; the kernel's are K = V = 128 (bf16 tiles, 128-byte swizzle)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from chunk_form_fused import _chunks, _gates, _inverse, exact, forward

STAGES = 16
ROLES = ("C", "D", "R")
# Shared-memory tiles: loaded (q, k, v, dO [64 x D], S0 [K x V], ar [64 x 64], gv the gate and
# beta vectors), dS's 16-bit mirror dsm [K x V], scratch t11, t12, t13 [64 x 64] and t21, t22, t23
# [64 x D], out (the output tile the store warp ships), and per-role vectors for dg's and dbeta's
# token terms (dc_D, dc_R, dcL_C, dbeta_R).
RELOADED_AFTER = {"q": 10, "k": 10, "v": 10, "S0": 10, "ar": 13, "dO": 13, "gv": 14}
# The output tile: written in stage w, read by the store warp in stages w + 1 .. last.
STORES = {0: 3, 4: 9, 10: 15}


@dataclass(frozen=True)
class Op:
    stage: int
    role: str
    name: str
    reads: Tuple[str, ...]
    writes: Tuple[str, ...]
    fn: Callable[["Env"], None]


class Env:
    """The buffers of one CTA; records every access of the op that runs."""

    def __init__(self, rnd: Callable):
        self.buf: Dict[str, np.ndarray] = {}
        self.rnd = rnd
        self.read: set = set()
        self.written: set = set()

    def __getitem__(self, name):
        self.read.add(name)
        return self.buf[name]

    def __setitem__(self, name, value):
        self.written.add(name)
        self.buf[name] = value


def _g(e: Env):
    return e["gv"]


def _op(stage, role, name, reads, writes):
    def wrap(fn):
        return Op(stage, role, name, tuple(reads), tuple(writes), fn)
    return wrap


# ---- the table --------------------------------------------------------------------------------
# Gate vectors in gv: c (chunk-local cumulative gates), gam (Gam, lower with diagonal), ec = e^c,
# eL = e^{c_L}, beta, scale. Staged names (chunk_form_fused.STAGED) are rounded by e.rnd.

@_op(0, "R", "P1: R.p = Q K^T", ["q", "k"], ["R.p"])
def _p1(e):
    e["R.p"] = e["q"] @ e["k"].T


@_op(0, "D", "the chunk after's dK to out", ["D.acc"], ["out"])
def _emit_dk(e):
    e["out"] = e.rnd("out", e["D.acc"])


@_op(1, "R", "P staged: t11 = scale lower(P) (.) Gam", ["R.p", "gv"], ["t11"])
def _p_staged(e):
    g = _g(e)
    e["t11"] = e.rnd("P", g["scale"] * np.tril(e["R.p"]) * g["gam"])


@_op(1, "D", "P2: D.acc = e^{c_L - c} (.) (K dsm)", ["k", "dsm", "gv"], ["D.acc"])
def _p2(e):
    g = _g(e)
    e["D.acc"] = np.exp(g["c"][-1] - g["c"])[:, None] * (e["k"] @ e["dsm"])


@_op(1, "C", "decay: C.dS = e^{c_L} dS", ["C.dS", "gv"], ["C.dS"])
def _decay(e):
    e["C.dS"] = _g(e)["eL"] * e["C.dS"]


@_op(2, "R", "Tb staged: t12 = Gam (.) Ar diag(beta)", ["ar", "gv"], ["t12"])
def _tb(e):
    g = _g(e)
    e["t12"] = e.rnd("Tb", (g["gam"] * e["ar"]) * g["beta"][None, :])


@_op(2, "D", "P3: D.acc += P^T dO", ["D.acc", "t11", "dO"], ["D.acc"])
def _p3(e):
    e["D.acc"] = e["D.acc"] + e["t11"].T @ e["dO"]


@_op(3, "R", "P4: R.wide = K S0", ["k", "S0"], ["R.wide"])
def _p4(e):
    e["R.wide"] = e["k"] @ e["S0"]


@_op(3, "D", "dVn staged: t21 = D.acc", ["D.acc"], ["t21"])
def _dvn(e):
    e["t21"] = e.rnd("dVn", e["D.acc"])


@_op(4, "R", "KS, R staged: t23 = K S0, t22 = V - e^c (.) K S0", ["R.wide", "v", "gv"], ["t23", "t22"])
def _r(e):
    ks = e.rnd("KS", e["R.wide"])
    e["t23"] = ks
    e["t22"] = e.rnd("R", e["v"] - _g(e)["ec"][:, None] * ks)


@_op(4, "D", "P5: D.acc = Tb^T dVn (= dR = dv); dv to out", ["t12", "t21"], ["D.acc", "out"])
def _p5(e):
    dr = e["t12"].T @ e["t21"]
    e["D.acc"] = dr
    e["out"] = e.rnd("out", dr)


@_op(4, "C", "<dS, S0> for dg: dcL_C", ["C.dS", "S0"], ["dcL_C"])
def _dcl(e):
    e["dcL_C"] = (e["C.dS"] * e["S0"]).sum()


@_op(5, "R", "P6: R.x = dVn R^T; P7: Vn = Tb R staged in t21", ["t21", "t22", "t12"], ["R.x", "R.wide", "t21"])
def _p6_p7(e):
    e["R.x"] = e["t21"] @ e["t22"].T
    vn = e["t12"] @ e["t22"]
    e["R.wide"] = vn
    e["t21"] = e.rnd("Vn", vn)


@_op(5, "D", "dVg staged: t23 = -e^c (.) dR; dg's R term", ["D.acc", "t23", "gv"], ["t23", "dc_D"])
def _dvg(e):
    ec = _g(e)["ec"]
    dr = e["D.acc"]
    e["dc_D"] = (dr * (-ec[:, None] * e["t23"])).sum(1)  # dR (.) (R - V), R - V = -e^c K S0
    e["t23"] = e.rnd("dVg", -ec[:, None] * dr)


@_op(6, "R", "P8: R.p = dO Vn^T", ["dO", "t21"], ["R.p"])
def _p8(e):
    e["R.p"] = e["dO"] @ e["t21"].T


@_op(6, "D", "K copied to t22 (k is reloaded after stage 10)", ["k"], ["t22"])
def _kcopy(e):
    e["t22"] = e["k"].copy()


@_op(7, "R", "dP staged in t11; Gam terms of dg; dT; dAr in R.x; dbeta's T term (column sums via t13)",
     ["R.p", "t11", "R.x", "ar", "gv"], ["t11", "R.x", "dc_R", "dbeta_R", "t13"])
def _dp(e):
    g = _g(e)
    dpm, p, dtb = e["R.p"], e["t11"], e["R.x"]
    pp = np.tril(dpm) * p
    t = g["gam"] * e["ar"]
    dt = dtb * g["beta"][None, :]
    tt = np.tril(dt * t, -1)
    e["dc_R"] = pp.sum(1) - pp.sum(0) + tt.sum(1) - tt.sum(0)
    e["dbeta_R"] = (dtb * t).sum(0)
    e["t11"] = e.rnd("dP", g["scale"] * np.tril(dpm) * g["gam"])
    e["R.x"] = np.tril(dt * g["gam"], -1)
    e["t13"] = None  # the kernel's fp32 scratch for the per-warp column sums


@_op(7, "D", "P9: D.acc = Vn dsm^T (dK~)", ["t21", "dsm"], ["D.acc"])
def _p9(e):
    e["D.acc"] = e["t21"] @ e["dsm"].T


@_op(8, "R", "P10: R.wide = dO S0^T (dQ~)", ["dO", "S0"], ["R.wide"])
def _p10(e):
    e["R.wide"] = e["dO"] @ e["S0"].T


@_op(8, "D", "dK~ to dK: rows by e^{c_L - c}; dg's K~ term", ["D.acc", "t22", "gv", "dc_D"], ["D.acc", "dc_D"])
def _dktil(e):
    c = _g(e)["c"]
    f = np.exp(c[-1] - c)
    kt = (e["D.acc"] * (f[:, None] * e["t22"])).sum(1)
    dc = e["dc_D"] - kt
    dc[-1] += kt.sum()
    e["dc_D"] = dc
    e["D.acc"] = f[:, None] * e["D.acc"]


@_op(9, "R", "dQ~ to dQ: rows by scale e^c; dg's Q~ term; Q copied to t21",
     ["R.wide", "q", "gv", "dc_R"], ["R.wide", "dc_R", "t21"])
def _dq_scale(e):
    g = _g(e)
    f = g["scale"] * g["ec"]
    e["dc_R"] = e["dc_R"] + (e["R.wide"] * (f[:, None] * e["q"])).sum(1)
    e["R.wide"] = f[:, None] * e["R.wide"]
    e["t21"] = e["q"].copy()


@_op(9, "D", "P11: D.acc += dVg S0^T", ["D.acc", "t23", "S0"], ["D.acc"])
def _p11(e):
    e["D.acc"] = e["D.acc"] + e["t23"] @ e["S0"].T


@_op(10, "R", "P12: R.wide += dP K; dq to out", ["R.wide", "t11", "t22"], ["R.wide", "out"])
def _p12(e):
    dq = e["R.wide"] + e["t11"] @ e["t22"]
    e["R.wide"] = dq
    e["out"] = e.rnd("out", dq)


@_op(11, "R", "dAr staged in t13", ["R.x"], ["t13"])
def _dar(e):
    e["t13"] = e.rnd("dAr", e["R.x"])


@_op(11, "C", "P13: C.dS += K^T dVg", ["C.dS", "t22", "t23"], ["C.dS"])
def _p13(e):
    e["C.dS"] = e["C.dS"] + e["t22"].T @ e["t23"]


@_op(12, "R", "P15: X = Ar^T dAr staged in t12", ["ar", "t13"], ["t12"])
def _p15(e):
    e["t12"] = e.rnd("X", e["ar"].T @ e["t13"])


@_op(12, "D", "P14: D.acc += dP^T Q", ["D.acc", "t11", "t21"], ["D.acc"])
def _p14(e):
    e["D.acc"] = e["D.acc"] + e["t11"].T @ e["t21"]


@_op(13, "R", "P16: R.x = -lower(X Ar^T); P17: R.p = K K^T", ["t12", "ar", "t22"], ["R.x", "R.p"])
def _p16_p17(e):
    e["R.x"] = -np.tril(e["t12"] @ e["ar"].T, -1)
    e["R.p"] = e["t22"] @ e["t22"].T


@_op(13, "D", "dOg staged in t23: scale e^c (.) dO", ["dO", "gv"], ["t23"])
def _dog(e):
    g = _g(e)
    e["t23"] = e.rnd("dOg", g["scale"] * g["ec"][:, None] * e["dO"])


@_op(14, "R", "dAs staged in t12 (dkk's transpose through t11, t13 in fp32); dbeta's A0 term",
     ["R.x", "R.p", "gv", "dbeta_R", "t13", "t11"], ["t12", "t13", "t11", "dbeta_R"])
def _das(e):
    da0, kk = e["R.x"], e["R.p"]
    e["dbeta_R"] = e["dbeta_R"] + (da0 * kk).sum(1)
    dkk = da0 * _g(e)["beta"][:, None]
    e["t13"] = dkk  # (the kernel: columns 32-63 here in fp32, 0-31 in t11; the transpose is exact)
    e["t11"] = np.zeros_like(dkk)
    e["t12"] = e.rnd("dAs", dkk + e["t13"].T + e["t11"].T)


@_op(14, "C", "P18: C.dS += Q^T dOg", ["C.dS", "t21", "t23"], ["C.dS"])
def _p18(e):
    e["C.dS"] = e["C.dS"] + e["t21"].T @ e["t23"]


@_op(15, "D", "P19: D.acc += dAs K", ["D.acc", "t12", "t22"], ["D.acc"])
def _p19(e):
    e["D.acc"] = e["D.acc"] + e["t12"] @ e["t22"]


@_op(15, "C", "dS mirror: dsm = C.dS", ["C.dS"], ["dsm"])
def _mirror(e):
    e["dsm"] = e.rnd("dS_mirror", e["C.dS"])


@_op(15, "R", "dg: reverse cumulative sum of the token terms", ["dc_R", "dc_D", "dcL_C"], ["R.dg"])
def _dg(e):
    dc = e["dc_R"] + e["dc_D"]
    dc[-1] += e["dcL_C"]
    e["R.dg"] = np.cumsum(dc[::-1])[::-1]


SCHEDULE: List[Op] = [v for v in list(globals().values()) if isinstance(v, Op)]


# `default` runs the same table: its staging policy (chunk_form_fused.island) stages Tb, dVn and R
# in fp16 tiles instead of bf16 (the kernel's kF16Island), which moves no op.


# ---- the checks -------------------------------------------------------------------------------

def _owner(buf: str) -> Optional[str]:
    return buf.split(".")[0] if "." in buf else None


def hazards(schedule: List[Op]) -> List[str]:
    """What the table breaks of the rules in the module's docstring (empty: none)."""
    out = []
    for op in schedule:
        if not (0 <= op.stage < STAGES and op.role in ROLES):
            out.append(f"{op.name}: stage {op.stage}, role {op.role}")
        for b in op.reads + op.writes:
            if _owner(b) not in (None, op.role):
                out.append(f"{op.name}: role {op.role} touches {b}, another role's registers")
        for b in op.reads:
            if b in RELOADED_AFTER and op.stage > RELOADED_AFTER[b]:
                out.append(f"{op.name}: reads {b} in stage {op.stage}, after its reload for the next chunk")
        for w, last in STORES.items():
            if "out" in op.writes and w < op.stage <= last:
                out.append(f"{op.name}: writes out in stage {op.stage} while the store warp reads it")
        if "out" in op.writes and op.stage not in STORES:
            out.append(f"{op.name}: writes out in stage {op.stage}, where no store follows")
    for s in range(STAGES):
        ops = [op for op in schedule if op.stage == s]
        for a in ops:
            for b in ops:
                if a.role != b.role:
                    clash = set(a.writes) & (set(b.reads) | set(b.writes))
                    if clash:
                        out.append(f"stage {s}: {a.role} writes {sorted(clash)} that {b.role} uses ({a.name} / {b.name})")
    return out


# ---- the waits: a role waits for another only where it uses what that role made or used ---------
# The kernel (bwd_fused_kernel.cuh, kStageWaits) gives each role a barrier per stage that it alone
# arrives on when the stage ends. Before stage s a role X waits on role Y's barrier of stage t only
# where the table orders an access of a shared buffer after one of Y's: a read after Y's last
# write of it (RAW), a write after Y's reads or write of its current value (WAR, WAW). The loaded
# buffers are ordered by the producer, `out` by the store warp's barriers (STORES). A role starts
# chunk i only once every role has ended stage CHUNK_FENCE of chunk i - 1 (the full barriers: the
# producer issues the loads of chunk i after it), so no wait on an earlier stage of the chunk before
# is needed, and the roles stay less than a chunk apart: each barrier's phase parity is unambiguous.
CHUNK_FENCE = max(RELOADED_AFTER.values())

Wait = Tuple[int, int]  # (stage t, chunk offset: 0 this chunk, -1 the chunk before)


def _shared_accesses(schedule: List[Op]) -> Dict[Tuple[int, str], Tuple[set, set]]:
    """(stage, role) -> (buffers read, buffers written), of the buffers the roles share and order
    among themselves (not a role's registers, not the loaded buffers, not `out`)."""
    acc: Dict[Tuple[int, str], Tuple[set, set]] = {}
    for op in schedule:
        r, w = acc.setdefault((op.stage, op.role), (set(), set()))
        keep = lambda b: _owner(b) is None and b not in RELOADED_AFTER and b != "out"  # noqa: E731
        r.update(b for b in op.reads if keep(b))
        w.update(b for b in op.writes if keep(b))
    return acc


def waits(schedule: Optional[List[Op]] = None) -> Dict[Tuple[str, int], Dict[str, Wait]]:
    """(role X, stage s) -> {role Y: (t, offset)}: before stage s of chunk i, X waits until Y has
    ended stage t of chunk i + offset. The latest such stage of each Y only (Y's earlier stages
    precede it), nothing the chunk fence, X's own earlier waits of the chunk or a chain through a
    third role already imply."""
    schedule = SCHEDULE if schedule is None else schedule
    acc = _shared_accesses(schedule)
    none: Tuple[set, set] = (set(), set())

    def before(s):  # the positions before stage s of chunk i, latest first
        yield from ((t, 0) for t in range(s - 1, -1, -1))
        yield from ((t, -1) for t in range(STAGES - 1, s - 1, -1))

    out: Dict[Tuple[str, int], Dict[str, Wait]] = {}
    for x in ROLES:
        known: Dict[str, Wait] = {}  # what X's earlier waits of this chunk imply
        for s in range(STAGES):
            reads, writes = acc.get((s, x), none)
            need: Dict[str, Wait] = {}

            def add(y, t, off):
                if y != x and (y not in need or (off, t) > need[y][::-1]):
                    need[y] = (t, off)

            for b in reads:  # RAW: the last write before
                for t, off in before(s):
                    ws = [y for y in ROLES if b in acc.get((t, y), none)[1]]
                    if ws:
                        for y in ws:
                            add(y, t, off)
                        break
            for b in writes:  # WAR and WAW: back to the last write, its readers on the way
                for t, off in before(s):
                    rs = [y for y in ROLES if b in acc.get((t, y), none)[0]]
                    ws = [y for y in ROLES if b in acc.get((t, y), none)[1]]
                    for y in rs + ws:
                        add(y, t, off)
                    if ws:
                        break
            kept = {}
            for y, (t, off) in need.items():
                implied = (off == -1 and t <= CHUNK_FENCE) or (y in known and known[y][::-1] >= (off, t))
                if not implied:
                    kept[y] = (t, off)
                    known[y] = (t, off)
            out[(x, s)] = kept
    # Left out, last to first: a wait another one implies through a third role (unordered() finds
    # nothing without it).
    for key in sorted(out, key=lambda k: (-k[1], ROLES.index(k[0]))):
        for y in sorted(out[key], key=ROLES.index):
            trial = {k: dict(v) for k, v in out.items()}
            del trial[key][y]
            if not unordered(schedule, trial):
                out = trial
    return out


def unordered(schedule: Optional[List[Op]] = None, table: Optional[Dict[Tuple[str, int], Dict[str, Wait]]] = None,
              chunks: int = 3) -> List[str]:
    """What the waits leave to chance, over `chunks` chunks walked one after another: pairs of
    accesses by two roles to one shared buffer, one of them a write, the later not ordered after the
    earlier by program order, the table's waits and the chunk fence; and waits whose barrier could
    still be two phases behind (its parity would then pass a phase too early). Empty: none."""
    schedule = SCHEDULE if schedule is None else schedule
    table = waits(schedule) if table is None else table
    acc = _shared_accesses(schedule)
    none: Tuple[set, set] = (set(), set())
    # known[(x, i, s)][y]: the latest (chunk, stage) of role y ended before x starts stage s of
    # chunk i (by program order, the waits and the fence; the walk's start orders everything before).
    known: Dict[Tuple[str, int, int], Dict[str, Tuple[int, int]]] = {}
    problems = []

    def ended(y, i, t):  # what is ordered before the end of y's stage t of chunk i
        k = dict(known[(y, i, t)])
        k[y] = max(k.get(y, (-1, 0)), (i, t))
        return k

    def merge(into, k):
        for y, v in k.items():
            if v > into.get(y, (-1, 0)):
                into[y] = v

    for i in range(chunks):
        for s in range(STAGES):
            for x in ROLES:
                k: Dict[str, Tuple[int, int]] = {}
                if s > 0:
                    merge(k, ended(x, i, s - 1))
                elif i > 0:
                    merge(k, ended(x, i - 1, STAGES - 1))
                    for y in ROLES:
                        merge(k, ended(y, i - 1, CHUNK_FENCE))
                for y, (t, off) in table.get((x, s), {}).items():
                    j = i + off
                    if j < 0:
                        continue  # the walk's first chunk: the rendezvous before it
                    if j >= 1 and k.get(y, (-1, 0)) < (j - 1, t):
                        problems.append(f"{x} stage {s} of chunk {i} waits on {y}'s stage {t} of chunk {j} "
                                        f"while {y} may not have ended it in chunk {j - 1}")
                    merge(k, ended(y, j, t))
                known[(x, i, s)] = k
    accesses = [(i, s, y, b, w) for i in range(chunks) for s in range(STAGES) for y in ROLES
                for w, bufs in enumerate(acc.get((s, y), none)) for b in bufs]
    for (i, s, x, b, w) in accesses:
        for (j, t, y, c, v) in accesses:
            if c != b or y == x or not (w or v) or (j, t) >= (i, s):
                continue
            if known[(x, i, s)].get(y, (-1, 0)) < (j, t):
                problems.append(f"{x} {'writes' if w else 'reads'} {b} in stage {s} of chunk {i} unordered after "
                                f"{y}'s {'write' if v else 'read'} in stage {t} of chunk {j}")
    return problems


def waits_table_cpp(table: Optional[Dict[Tuple[str, int], Dict[str, Wait]]] = None) -> str:
    """The waits as kStageWaits' initializer (bwd_fused_kernel.cuh): [stage][role X][role Y], -1 no
    wait, t the end of Y's stage t of this chunk, 16 + t of the chunk before; roles C, D, R."""
    table = waits() if table is None else table
    rows = []
    for s in range(STAGES):
        cells = []
        for x in ROLES:
            w = table.get((x, s), {})
            vals = [(-1 if y not in w else (w[y][0] if w[y][1] == 0 else STAGES + w[y][0])) for y in ROLES]
            cells.append("{" + ", ".join(f"{v:2d}" for v in vals) + "}")
        rows.append("    {" + ", ".join(cells) + "},  // stage " + str(s))
    return "\n".join(rows)


def run(q, k, v, g, beta, scale, s0, do, dht, rnd=exact, schedule: Optional[List[Op]] = None):
    """dq, dk, dv, dg, dbeta, dh0 by executing the table (stages in order, roles of a stage one
    after another: hazards() makes that order irrelevant). Raises if an op touches a buffer it
    does not declare."""
    schedule = SCHEDULE if schedule is None else schedule
    order = sorted(schedule, key=lambda op: (op.stage, ROLES.index(op.role)))
    _, _, starts = forward(q, k, v, g, beta, scale, s0)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dg, dbeta = np.zeros_like(g), np.zeros_like(beta)
    e = Env(rnd)
    e.buf["C.dS"] = dht.copy()
    e.buf["dsm"] = rnd("dS_mirror", dht.copy())
    pending_dk = None  # (rows) of the chunk whose dK D still holds
    for (a, b), S0 in reversed(list(zip(_chunks(q.shape[0]), starts))):
        c, gam = _gates(g[a:b])
        ar, _ = _inverse(k[a:b], beta[a:b])
        e.buf.update(q=q[a:b], k=k[a:b], v=v[a:b], dO=do[a:b], S0=rnd("S0", S0), ar=rnd("Ar", ar),
                     gv=dict(c=c, gam=gam, ec=np.exp(c), eL=np.exp(c[-1]), beta=beta[a:b], scale=scale))
        for op in order:
            if op.name == _emit_dk.name and pending_dk is None:
                continue  # the walk's first chunk: no dK yet
            e.read, e.written = set(), set()
            op.fn(e)
            undeclared = (e.read - set(op.reads)) | (e.written - set(op.writes))
            if undeclared:
                raise AssertionError(f"{op.name}: touches {sorted(undeclared)} without declaring it")
            if "out" in op.writes:  # what the store warp ships after this stage
                if op.name == _emit_dk.name:
                    dk[pending_dk[0]:pending_dk[1]] = e.buf["out"]
                elif op.name == _p5.name:
                    dv[a:b] = e.buf["out"]
                else:
                    dq[a:b] = e.buf["out"]
        dg[a:b] = e.buf["R.dg"]
        dbeta[a:b] = e.buf["dbeta_R"]
        pending_dk = (a, b)
    if pending_dk is not None:  # the epilogue: the last chunk's dK
        dk[pending_dk[0]:pending_dk[1]] = rnd("out", e.buf["D.acc"])
    return dq, dk, dv, dg, dbeta, e.buf["C.dS"]


def run_concurrent(q, k, v, g, beta, scale, s0, do, dht, rnd=exact, schedule: Optional[List[Op]] = None,
                   table: Optional[Dict[Tuple[str, int], Dict[str, Wait]]] = None, seed: int = 0):
    """run()'s gradients with the kernel's actors interleaved at random (seed): the three roles, each
    op at a time, waiting only where `table` says (and for the full barriers and `out`); the
    producer loading a chunk's tiles once every role has ended the stage after which they are
    reloaded (RELOADED_AFTER); the store warp shipping `out` once its writer ended the stage
    (STORES) and freeing it for the next write. Wherever the waits leave a pair of accesses
    unordered, some interleaving computes other values than run()."""
    schedule = SCHEDULE if schedule is None else schedule
    table = waits(schedule) if table is None else table
    rng = np.random.default_rng(seed)
    _, _, starts = forward(q, k, v, g, beta, scale, s0)
    bounds = list(reversed(_chunks(q.shape[0])))
    starts = list(reversed(starts))
    n_chunks = len(bounds)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dg, dbeta = np.zeros_like(g), np.zeros_like(beta)
    e = Env(rnd)
    done = set()          # (role, chunk, stage) ended
    freed = set()         # (j, chunk): the store warp shipped out_written(j)'s out
    loaded = set()        # (group, chunk): "qkvS0", "arO", "gv"
    written = {0: 0, 1: 4, 2: 10}
    writer = {0: "D", 1: "D", 2: "R"}

    def tiles(i):
        a, b = bounds[i]
        c, gam = _gates(g[a:b])
        ar, _ = _inverse(k[a:b], beta[a:b])
        return {"qkvS0": dict(q=q[a:b], k=k[a:b], v=v[a:b], S0=rnd("S0", starts[i])),
                "arO": dict(ar=rnd("Ar", ar), dO=do[a:b]),
                "gv": dict(gv=dict(c=c, gam=gam, ec=np.exp(c), eL=np.exp(c[-1]), beta=beta[a:b], scale=scale))}

    def producer():
        for i in range(n_chunks):
            t = tiles(i)
            for grp, after in (("qkvS0", RELOADED_AFTER["q"]), ("arO", RELOADED_AFTER["ar"]),
                               ("gv", RELOADED_AFTER["gv"])):
                if i > 0:
                    yield lambda i=i, after=after: all((y, i - 1, after) in done for y in ROLES)
                e.buf.update(t[grp])
                loaded.add((grp, i))
                yield None

    def store_warp():
        for i in range(n_chunks):
            for j in range(3):
                yield lambda i=i, j=j: (writer[j], i, written[j]) in done
                a, b = bounds[i]
                if j == 0 and i > 0:
                    pa, pb = bounds[i - 1]
                    dk[pa:pb] = e.buf["out"]
                elif j == 1:
                    dv[a:b] = e.buf["out"]
                elif j == 2:
                    dq[a:b] = e.buf["out"]
                freed.add((j, i))
                yield None

    def role(x):
        for i in range(n_chunks):
            yield lambda i=i: all((grp, i) in loaded for grp in ("qkvS0", "arO", "gv"))
            for st in range(STAGES):
                for y, (t, off) in table.get((x, st), {}).items():
                    if i + off >= 0:
                        yield lambda y=y, t=t, j=i + off: (y, j, t) in done
                for j in range(3):
                    if written[j] == st and writer[j] == x:
                        prev, chunk = (2, i - 1) if j == 0 else (j - 1, i)
                        if chunk >= 0:
                            yield lambda prev=prev, chunk=chunk: (prev, chunk) in freed
                for op in [o for o in schedule if o.stage == st and o.role == x]:
                    if op.name == _emit_dk.name and i == 0:
                        continue
                    e.read, e.written = set(), set()
                    op.fn(e)
                    yield None
                if x == "R" and st == STAGES - 1:
                    a, b = bounds[i]
                    dg[a:b] = e.buf["R.dg"]
                    dbeta[a:b] = e.buf["dbeta_R"]
                done.add((x, i, st))
                yield None
        if x == "D" and n_chunks > 0:
            yield lambda: (2, n_chunks - 1) in freed
            a, b = bounds[-1]
            dk[a:b] = rnd("out", e.buf["D.acc"])

    e.buf["C.dS"] = dht.copy()
    e.buf["dsm"] = rnd("dS_mirror", dht.copy())  # the carry's first mirror, before the walk's rendezvous
    actors = [producer(), store_warp()] + [role(x) for x in ROLES]
    # Each actor a speed of its own (log-uniform over e^-6 .. e^6): one far behind the others is
    # what exposes a missing wait, and a uniform choice rarely leaves one behind for long.
    speed = np.exp(rng.uniform(-6.0, 6.0, len(actors)))
    pending = [next(a, "end") for a in actors]
    while any(p != "end" for p in pending):
        ready = [n for n, p in enumerate(pending) if p != "end" and (p is None or p())]
        if not ready:
            raise AssertionError("deadlock: no actor can proceed")
        w = speed[ready] / speed[ready].sum()
        n = ready[rng.choice(len(ready), p=w)]
        pending[n] = next(actors[n], "end")
    return dq, dk, dv, dg, dbeta, e.buf["C.dS"]


def markdown(schedule: Optional[List[Op]] = None) -> str:
    """The table as bench/fused-backward.md shows it: a row a stage, a column a role."""
    schedule = SCHEDULE if schedule is None else schedule
    rows = ["| stage | C (carry, 176 registers) | D (dk/dv, 112) | R (recompute, 192) |", "|---|---|---|---|"]
    for s in range(STAGES):
        cells = ["; ".join(op.name for op in schedule if op.stage == s and op.role == r) for r in ROLES]
        rows.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    import sys
    print(waits_table_cpp() if "--waits" in sys.argv[1:] else markdown())
