"""What the fused reverse kernel's 16-bit staging would cost in accuracy, before it is written:
tests/python/chunk_form_fused.py's backward (its algebra checked against the recurrence) run in
float64 with chosen intermediates rounded to bf16 (chunk_form_fused.STAGED), against the same
backward without rounding, on flashgdn_run's inputs (q, k normal and normalised, v and dO normal,
all bf16; g = -A softplus(x + 1) with A = 0 on head 0, 16 U(0, 1) on the others; beta U(0, 1); h0,
dht 0.1 normal). Prints each gradient's relative L2 error over all heads, as flashgdn_run --check
prints them, per policy. --keys identical / alternating (one unit key for every token, or one key
with alternating signs) and --beta b (every beta = b) give the degenerate inputs where a 16-bit
inverse loses the gradient (bench/fused-backward.md, "Precision"). --halves prices instead what two
CTAs a chain (one per half of the value columns) add to dq: its output written as two bf16
partials, summed, then rounded, against one rounding of the whole.

--dalog prices the fused `default`'s dg and what the gate in the kernel makes of it: per head
sum_t dg_t g_t (dA_log's sum, as d g_t / d A_log = g_t), with one more staged value kept exact at a
time (docs/reliability.md D7), over --seeds draws. The fused `default` stages Tb, dVn and R as fp16
tiles (chunk_form_fused.island), every other staged value in bf16.

--states prices the chunk-start states the backward reads (the forward's, under autograd) by how
the forward's state recurrence rounds its operands: per chunk KS = K S, Vn = Tb (V - e^c KS), S' =
e^{c_L} S + K^T (e^{c_L - c} Vn), where `fast` rounds the wgmma operands S, Y = beta (V - e^c KS),
the inverse and e^{c_L - c} Vn to bf16, `high` splits them (taken as exact here) and the candidates
split some; every state is then stored in bf16 and walked by the fused `default` backward (the island).

    python bench/fused_precision.py [--T 2048] [--heads 8] [--K 128] [--keys normal] [--beta B] [--halves]
    python bench/fused_precision.py --states [--T 2048] [--heads 8] [--seeds 2]
    python bench/fused_precision.py --dalog [--T 257] [--heads 4] [--seeds 4]
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))
import chunk_form_fused as cf  # noqa: E402

bf16 = cf.round_bf16


POLICIES = {
    "outputs only (the floor)": {"out"},
    "every staged value (the peer's)": set(cf.STAGED),
    "the peer's, S0 in fp32": set(cf.STAGED) - {"S0"},
    "the peer's, the carry's operands exact (dS mirror, dVg, dOg)": set(cf.STAGED) - {"dS_mirror", "dVg", "dOg"},
    "the peer's, S0 fp32 and the carry's operands exact": set(cf.STAGED) - {"S0", "dS_mirror", "dVg", "dOg"},
    "as the last, and dVn, T diag(beta) exact (a `default` candidate)":
        set(cf.STAGED) - {"S0", "dS_mirror", "dVg", "dOg", "dVn", "Tb"},
    "as the last, and Ar exact": set(cf.STAGED) - {"S0", "dS_mirror", "dVg", "dOg", "dVn", "Tb", "Ar"},
}
# Policies with the fp16 island (Tb, dVn, R as fp16 tiles; chunk_form_fused.island): points -> policy.
ISLAND_POLICIES = {
    "the fused `default`: every staged value, Tb, dVn, R as fp16 tiles": set(cf.STAGED),
}


def head_inputs(rng, T, K, A, keys="normal", beta_value=None):
    def unit(x):
        return x / np.sqrt((x * x).sum(1, keepdims=True) + 1e-6)
    q, k = bf16(unit(rng.standard_normal((T, K)))), bf16(unit(rng.standard_normal((T, K))))
    if keys != "normal":
        sign = np.where(np.arange(T) % 2, -1.0, 1.0) if keys == "alternating" else np.ones(T)
        k = np.repeat(k[:1], T, 0) * sign[:, None]
    v, do = bf16(rng.standard_normal((T, K))), bf16(rng.standard_normal((T, K)))
    g = -A * np.log1p(np.exp(rng.standard_normal(T) + 1.0))
    beta = rng.uniform(0.0, 1.0, T) if beta_value is None else np.full(T, beta_value)
    s0, dht = 0.1 * rng.standard_normal((K, K)), 0.1 * rng.standard_normal((K, K))
    return q, k, v, g, beta, K ** -0.5, s0, do, dht


DALOG_POLICIES = {
    "fused `default` (every staged value; Tb, dVn, R as fp16 tiles)": (),
    "+ S0 exact": ("S0",),
    "+ dS mirror exact": ("dS_mirror",),
    "+ S0, dS mirror exact": ("S0", "dS_mirror"),
    "+ S0, dS mirror, dVg, dOg exact": ("S0", "dS_mirror", "dVg", "dOg"),
    "+ P, dP exact": ("P", "dP"),
    "+ KS, R, Vn exact": ("KS", "R", "Vn"),
    "+ dAr, X, dAs exact": ("dAr", "X", "dAs"),
}


def dalog_table(T, n_heads, K, seeds):
    """dg's and sum_t dg_t g_t's relative L2 errors against the unrounded backward, median (max)
    over the seeds, per policy (the fused `default`'s staging, less the named values)."""
    res = {label: ([], []) for label in DALOG_POLICIES}
    for seed in range(seeds):
        rng = np.random.default_rng(100 + seed)
        A = [0.0] + list(16.0 * rng.uniform(0.0, 1.0, n_heads - 1))
        heads = [head_inputs(rng, T, K, A[h]) for h in range(n_heads)]
        exact = [cf.backward(*x) for x in heads]
        da_exact = np.array([(e[3] * x[3]).sum() for e, x in zip(exact, heads)])
        for label, keep in DALOG_POLICIES.items():
            got = [cf.backward(*x, rnd=cf.island(set(cf.STAGED) - set(keep))) for x in heads]
            dg = np.sqrt(sum(((g[3] - e[3]) ** 2).sum() for g, e in zip(got, exact)) /
                         sum((e[3] ** 2).sum() for e in exact))
            da = np.array([(g[3] * x[3]).sum() for g, x in zip(got, heads)])
            res[label][0].append(dg)
            res[label][1].append(np.linalg.norm(da - da_exact) / np.linalg.norm(da_exact))
    print(f"T {T}, {n_heads} heads (A = 0 on head 0, 16 U(0, 1) on the others), K = V = {K}, {seeds} seeds; "
          "relative L2 against the unrounded backward, median (max)")
    print("| policy | dg | sum_t dg_t g_t a head (dA_log's) |")
    print("|---|---|---|")
    for label, (dg, da) in res.items():
        print(f"| {label} | {np.median(dg):.2e} ({max(dg):.2e}) | {np.median(da):.2e} ({max(da):.2e}) |")


# The forward's state recurrence (fwd_state.cuh): which wgmma operands stay exact (split into
# hi + lo), the rest rounded to bf16. S: the state as X = K S's operand; Y = beta (V - e^c X) and T
# (Tb's gate-free part with Gam) as Vn = T Y's; Vd = e^{c_L - c} (.) Vn as the update's
# (S' = e^{c_L} S + K^T Vd, K the input). `high` splits all four, `fast` none.
STATE_POLICIES = {
    "`high` (every operand split)": {"S", "Y", "T", "Vd"},
    "`fast` (every operand bf16)": set(),
    "S split": {"S"},
    "Vd split (one more 128 x 128 x 64 product a chunk)": {"Vd"},
    "S, Vd split": {"S", "Vd"},
    "Y, T split": {"Y", "T"},
    "Y, T, Vd split": {"Y", "T", "Vd"},
}


def forward_states(q, k, v, g, beta, s0, split):
    """The chunk-start states of the forward's recurrence with the operands not in `split` rounded
    to bf16 (accumulation exact: the kernel's fp32 accumulators are not modelled)."""
    r = lambda name, x: x if name in split else bf16(x)  # noqa: E731
    S, starts = s0.copy(), []
    for a, b in cf._chunks(q.shape[0]):
        starts.append(S.copy())
        c, gam = cf._gates(g[a:b])
        ar, _ = cf._inverse(k[a:b], beta[a:b])
        y = beta[a:b][:, None] * (v[a:b] - np.exp(c)[:, None] * (k[a:b] @ r("S", S)))
        vn = r("T", gam * ar) @ r("Y", y)
        vd = np.exp(c[-1] - c)[:, None] * vn
        S = np.exp(c[-1]) * S + k[a:b].T @ r("Vd", vd)
    return starts


def states_table(T, n_heads, K, seeds):
    """Each gradient's relative L2 error (against the unrounded backward) of the fused `default`
    walk on the states of each STATE_POLICIES recurrence, over all heads and seeds."""
    names = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
    acc = {label: [[0.0, 0.0] for _ in names] for label in STATE_POLICIES}
    for seed in range(seeds):
        rng = np.random.default_rng(200 + seed)
        A = [0.0] + list(16.0 * rng.uniform(0.0, 1.0, n_heads - 1))
        for h in range(n_heads):
            q, k, v, g, beta, scale, s0, do, dht = head_inputs(rng, T, K, A[h])
            ex = cf.backward(q, k, v, g, beta, scale, s0, do, dht)
            for label, split in STATE_POLICIES.items():
                starts = forward_states(q, k, v, g, beta, s0, split)
                got = cf._walk(q, k, v, g, beta, scale, starts, do, {len(starts): dht}, cf.island())
                for i in range(len(names)):
                    acc[label][i][0] += ((got[i] - ex[i]) ** 2).sum()
                    acc[label][i][1] += (ex[i] ** 2).sum()
    print(f"T {T}, {n_heads} heads (A = 0 on head 0, 16 U(0, 1) on the others), K = V = {K}, {seeds} seeds; "
          "the fused `default` walk on each recurrence's states (stored bf16); relative L2 against the "
          "unrounded backward")
    print("| the forward's states | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for label, errs in acc.items():
        print(f"| {label} | " + " | ".join(f"{np.sqrt(n / d):.2e}" for n, d in errs) + " |")


def halves_dq(x):
    """dq exact, rounded once, and as the two value halves' bf16 partials summed and rounded: per
    chunk, half b's part of dQ~ = dO S0^T (its columns), block 0 also the terms without V."""
    q, k, v, g, beta, scale, s0, do, dht = x
    dq = cf.backward(*x)[0]
    _, _, starts = cf.forward(q, k, v, g, beta, scale, s0)
    cols = np.array_split(np.arange(v.shape[1]), 2)
    halves = np.zeros_like(dq)
    for n, (a, b) in enumerate(cf._chunks(q.shape[0])):
        f = scale * np.exp(cf._gates(g[a:b])[0])[:, None]
        parts = [f * (do[a:b, j] @ starts[n][:, j].T) for j in cols]
        parts[0] = parts[0] + dq[a:b] - sum(parts)
        halves[a:b] = bf16(sum(bf16(p) for p in parts))
    return dq, bf16(dq), halves


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--keys", choices=("normal", "identical", "alternating"), default="normal")
    ap.add_argument("--beta", type=float, default=None)
    ap.add_argument("--halves", action="store_true")
    ap.add_argument("--dalog", action="store_true")
    ap.add_argument("--states", action="store_true")
    ap.add_argument("--seeds", type=int, default=4)
    a = ap.parse_args()
    if a.dalog:
        dalog_table(a.T, a.heads, a.K, a.seeds)
        return
    if a.states:
        states_table(a.T, a.heads, a.K, a.seeds)
        return
    rng = np.random.default_rng(2026)
    A = [0.0] + list(16.0 * rng.uniform(0.0, 1.0, a.heads - 1))
    heads = [head_inputs(rng, a.T, a.K, A[h], a.keys, a.beta) for h in range(a.heads)]
    if a.halves:
        got = [halves_dq(x) for x in heads]
        err = lambda i: np.sqrt(sum(((r[i] - r[0]) ** 2).sum() for r in got) / sum((r[0] ** 2).sum() for r in got))  # noqa: E731
        print(f"T {a.T}, {a.heads} heads, K = V = {a.K}: dq's output rounding, relative L2 against exact: "
              f"one bf16 rounding {err(1):.2e}, two bf16 value halves summed then rounded {err(2):.2e}")
        return
    names = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
    exact = [cf.backward(*x) for x in heads]
    print(f"T {a.T}, {a.heads} heads, K = V = {a.K}, keys {a.keys}, beta {a.beta if a.beta is not None else 'U(0, 1)'}; "
          "relative L2 error against the unrounded backward")
    print("| policy | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    policies = [(label, cf.staged(points)) for label, points in POLICIES.items()]
    policies += [(label, cf.island(points)) for label, points in ISLAND_POLICIES.items()]
    for label, rnd in policies:
        got = [cf.backward(*x, rnd=rnd) for x in heads]
        errs = []
        for i in range(len(names)):
            num = sum(((g[i] - e[i]) ** 2).sum() for g, e in zip(got, exact))
            den = sum((e[i] ** 2).sum() for e in exact)
            errs.append(np.sqrt(num / den))
        print(f"| {label} | " + " | ".join(f"{e:.2e}" for e in errs) + " |")


if __name__ == "__main__":
    main()
