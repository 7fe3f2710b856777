"""The chunk form of the gated delta rule, forward and backward, in float64 numpy, written in the
order and algebra the fused reverse kernel is planned to use (bench/fused-backward.md): the
chunk's inverse without gates, Ar = (I + strictly_lower(diag(beta) K K^T))^-1, gated elementwise
(T = Gam (.) Ar, Gam_ij = e^{c_i - c_j}); the corrected values as Vn = T diag(beta) R with
R = V - diag(e^c) K S0 (so W = T diag(beta e^c) K is never formed); and the backward's 19 matrix
products per chunk, each named P1..P19 where it is formed; and the reverse context parallelism's
form (a chunk's carry as an affine map, segments composed and scanned); and a chunk split over
blocks of the value columns (two CTAs a chain: what they exchange and sum). test_chunk_form_fused.py
checks every gradient against the float64 recurrence (flashgdn.reference). One sequence, one head;
q and k as given (the l2 norm's backward is separate); S is [K][V]."""
from __future__ import annotations

import numpy as np

C = 64  # tokens a chunk


def _chunks(T: int):
    return [(s, min(s + C, T)) for s in range(0, T, C)]


def _gates(g: np.ndarray):
    """Chunk-local cumulative gates c and Gam (lower, diagonal included)."""
    c = np.cumsum(g)
    gam = np.tril(np.exp(np.minimum(c[:, None] - c[None, :], 0.0)))
    return c, gam


def _inverse(k: np.ndarray, beta: np.ndarray):
    kk = k @ k.T
    a0 = np.tril(beta[:, None] * kk, -1)
    return np.linalg.inv(np.eye(len(beta)) + a0), kk


def forward(q, k, v, g, beta, scale, s0):
    """o [T, V], the final state [K, V] and the chunk-start states (the backward's S0s)."""
    S = s0.copy()
    o = np.zeros((q.shape[0], v.shape[1]))
    starts = []
    for a, b in _chunks(q.shape[0]):
        starts.append(S.copy())
        c, gam = _gates(g[a:b])
        ar, _ = _inverse(k[a:b], beta[a:b])
        tb = (gam * ar) * beta[a:b][None, :]
        r = v[a:b] - np.exp(c)[:, None] * (k[a:b] @ S)
        vn = tb @ r
        p = scale * np.tril(q[a:b] @ k[a:b].T) * gam
        o[a:b] = scale * np.exp(c)[:, None] * (q[a:b] @ S) + p @ vn
        S = np.exp(c[-1]) * S + (k[a:b] * np.exp(c[-1] - c)[:, None]).T @ vn
    return o, S, starts


# Where a kernel stores an intermediate in 16 bits between products (the peer's choices at every
# one of them, bench/fused-backward.md "Precision"): the chunk-start state S0, the saved Ar, the
# staged P, T diag(beta), K S0, R, Vn, dS's mirror (for P2, P9), dVn, dVg, dP, dAr, X, dAs, the
# carry's dOg, and the outputs dq, dk, dv. `rnd(name, x)` rounds x where the policy says so.
STAGED = ("S0", "Ar", "P", "Tb", "KS", "R", "Vn", "dS_mirror", "dVn", "dVg", "dP", "dAr", "X", "dAs",
          "dOg", "out")


def exact(name, x):
    return x


def round_bf16(x):
    """x rounded to bf16 (nearest, ties to even), returned as float64: a kernel's 16-bit staging."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return u.view(np.float32).astype(np.float64)


def staged(points=STAGED):
    """The rounding policy that rounds to bf16 at the named staging points, exact elsewhere."""
    points = set(points)
    return lambda name, x: round_bf16(x) if name in points else x


def round_fp16_tile(x):
    """x staged as the kernel's fp16 island stages a tile: scaled by s = 2^(14 - e), e = floor(log2
    max|x|) (the biased exponent clamped to [1, 253]; s = 1 for zeros, inf or NaN), rounded to fp16
    (nearest, ties to even, subnormals as the hardware's), scaled back: both scalings exact."""
    x = np.asarray(x, dtype=np.float64)
    m = np.abs(x).max() if x.size else 0.0
    if not (0.0 < m < np.inf):
        return x.astype(np.float16).astype(np.float64)
    e = int(np.frexp(np.float32(m))[1]) - 1  # m in [2^e, 2^(e + 1))
    b = min(max(127 + 14 - e, 1), 253)
    s = 2.0 ** (b - 127)
    return (x * s).astype(np.float32).astype(np.float16).astype(np.float64) / s


# `default`'s fp16 tiles (bwd_fused_kernel.cuh, kF16Island): the operands of P5 (Tb^T dVn), P6
# (dVn R^T) and P7 (Tb R), each a tile scaled into fp16's range; every other staging stays bf16.
F16_ISLAND = ("Tb", "dVn", "R")


def island(points=STAGED):
    """The fused `default`'s policy: fp16 tiles (round_fp16_tile) at F16_ISLAND, bf16 at the other
    named staging points, exact elsewhere."""
    points = set(points)
    return lambda name, x: (round_fp16_tile(x) if name in F16_ISLAND else round_bf16(x)) if name in points else x


def chunk_backward(Q, K, V, gc, B, dO, S0, dS, scale, rnd=exact):
    """One chunk of the reverse walk: its dq, dk, dv, dg, dbeta and the carry dS at its start,
    from its inputs, its start state S0 and dS at its end."""
    c, gam = _gates(gc)
    ec, eL = np.exp(c), np.exp(c[-1])
    ktil = K * np.exp(c[-1] - c)[:, None]  # K~ = e^{c_L - c} (.) K
    qtil = scale * ec[:, None] * Q         # Q~ = scale e^c (.) Q
    S0 = rnd("S0", S0)
    # Recomputed ahead of dS: P = Q K^T, Ar (saved by the forward in the kernel), R, Vn.
    qk = Q @ K.T                                   # P1
    p = rnd("P", scale * np.tril(qk) * gam)
    ar, kk = _inverse(K, B)                        # (the saved Ar); P17 is K K^T
    ar = rnd("Ar", ar)
    t = gam * ar
    tb = rnd("Tb", t * B[None, :])
    ks = rnd("KS", K @ S0)                         # P4
    r = rnd("R", V - ec[:, None] * ks)
    vn = rnd("Vn", tb @ r)                         # P7
    # dVn = K~ dS + P^T dO (the dk/dv role; in the kernel dS comes as its 16-bit mirror).
    dsm = rnd("dS_mirror", dS)
    dvn = ktil @ dsm                               # P2
    dvn = rnd("dVn", dvn + p.T @ dO)               # P3
    dr = tb.T @ dvn                                # P5: dR = (T diag(beta))^T dVn
    dtb = dvn @ r.T                                # P6: d(T diag(beta)) = dVn R^T
    dpm = dO @ vn.T                                # P8: dP (masked below)
    dktil = vn @ dsm.T                             # P9: dK~ = Vn dS^T
    dqt = dO @ S0.T                                # P10: dQ~ = dO S0^T
    dvg = rnd("dVg", -ec[:, None] * dr)            # dR through R = V - e^c (.) K S0
    dk_c = dvg @ S0.T                              # P11: dK += (-e^c dR) S0^T
    gp = rnd("dP", scale * np.tril(dpm) * gam)     # dP through P = scale lower(Q K^T) (.) Gam
    dq_c = gp @ K                                  # P12
    dS_prev = eL * dS + K.T @ dvg                  # P13 (the carry)
    dk_c += gp.T @ Q                               # P14
    dt = dtb * B[None, :]
    dar = rnd("dAr", np.tril(dt * gam, -1))        # T = Gam (.) Ar; Ar's diagonal is 1
    x = rnd("X", ar.T @ dar)                       # P15
    da0 = -np.tril(x @ ar.T, -1)                   # P16: dA0 = -Ar^T dAr Ar^T, strictly lower
    dS_prev += Q.T @ rnd("dOg", scale * ec[:, None] * dO)  # P18 (the carry): Q~^T dO
    dkk = da0 * B[:, None]                         # A0 = strictly_lower(diag(beta) K K^T)
    dk_c += rnd("dAs", dkk + dkk.T) @ K            # P19
    # Outputs other than the products' own.
    dq = rnd("out", dq_c + scale * ec[:, None] * dqt)
    dk = rnd("out", dk_c + np.exp(c[-1] - c)[:, None] * dktil)
    dv = rnd("out", dr)
    dbeta = (dtb * t).sum(0) + (da0 * kk).sum(1)
    # dc_i: every factor e^{c_i}, e^{-c_j}, e^{c_L} of the chunk, then dg by a reverse cumsum.
    dc = np.zeros(len(gc))
    dc += (dqt * qtil).sum(1)                      # Q~
    dc -= (dr * (ec[:, None] * ks)).sum(1)         # R = V - e^c (.) K S0
    pp = np.tril(dpm) * p
    dc += pp.sum(1) - pp.sum(0)                    # Gam in P
    tt = np.tril(dt * t, -1)
    dc += tt.sum(1) - tt.sum(0)                    # Gam in T
    kt = (dktil * ktil).sum(1)
    dc -= kt                                       # K~ = e^{c_L - c} K
    dc[-1] += kt.sum() + eL * (dS * S0).sum()      # K~'s e^{c_L} and S_C's e^{c_L} S0
    dg = np.cumsum(dc[::-1])[::-1]
    return dq, dk, dv, dg, dbeta, dS_prev


def backward(q, k, v, g, beta, scale, s0, do, dht, rnd=exact):
    """dq, dk, dv, dg, dbeta, dh0: chunks last to first, dS carried in between (fp32 in a kernel:
    never rounded here). rnd(name, x): the 16-bit staging policy (STAGED); exact by default."""
    _, _, starts = forward(q, k, v, g, beta, scale, s0)
    return _walk(q, k, v, g, beta, scale, starts, do, {len(starts): dht}, rnd)


def _walk(q, k, v, g, beta, scale, starts, do, seeds, rnd):
    """The reverse walk over every chunk; seeds[n]: dS at the end of chunk n - 1 where the walk
    takes it from outside (n = the chunk count: dht), else the carry of chunk n."""
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dg, dbeta = np.zeros_like(g), np.zeros_like(beta)
    spans = _chunks(q.shape[0])
    dS = None
    for n in reversed(range(len(spans))):
        a, b = spans[n]
        dS = seeds.get(n + 1, dS)
        dq[a:b], dk[a:b], dv[a:b], dg[a:b], dbeta[a:b], dS = chunk_backward(
            q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], do[a:b], starts[n], dS, scale, rnd)
    return dq, dk, dv, dg, dbeta, dS


# ---- the reverse context parallelism (bench/fused-backward.md, "Reverse CP") -------------------
def carry_map(q, k, g, beta, scale, do):
    """A chunk's carry as an affine map of dS at its end: dS_start = M dS + b with
        M = e^{c_L} I - K^T diag(e^c) Tb^T K~                    (K x K)
        b = Q~^T dO - K^T diag(e^c) Tb^T P^T dO                 (K x V)
    (chunk_backward's P13 and P18 with dVn = K~ dS + P^T dO expanded). Neither depends on dS or on
    the chunk's start state: every chunk's map is known before the walk."""
    c, gam = _gates(g)
    ec, eL = np.exp(c), np.exp(c[-1])
    ktil = k * np.exp(c[-1] - c)[:, None]
    ar, _ = _inverse(k, beta)
    tb = (gam * ar) * beta[None, :]
    p = scale * np.tril(q @ k.T) * gam
    lead = -(k * ec[:, None]).T @ tb.T            # -K^T diag(e^c) Tb^T   (K x C)
    M = eL * np.eye(k.shape[1]) + lead @ ktil
    b = (scale * ec[:, None] * q).T @ do + lead @ (p.T @ do)
    return M, b


def backward_segments(q, k, v, g, beta, scale, s0, do, dht, seg_chunks, rnd=exact):
    """The same outputs as backward(), by segments of seg_chunks chunks as the reverse CP runs
    them: (1) each segment's map dS_start = A_s dS_end + B_s, composed from its chunks' maps (a
    kernel gets B_s by walking the segment from dS = 0, and A_s by walking it from dS = I with
    dO = 0); (2) a scan over the segments, last first, from dht; (3) every segment walked from the
    dS the scan gave its end, independently."""
    _, _, starts = forward(q, k, v, g, beta, scale, s0)
    spans = _chunks(q.shape[0])
    bounds = list(range(0, len(spans), seg_chunks)) + [len(spans)]
    maps = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        A, B = np.eye(k.shape[1]), np.zeros_like(dht)
        for n in range(lo, hi):  # dS_start(lo) = M_lo (M_lo+1 (... dS_end + b) + ...) + b_lo
            a, e = spans[n]
            M, b = carry_map(q[a:e], k[a:e], g[a:e], beta[a:e], scale, do[a:e])
            A, B = A @ M, A @ b + B
        maps.append((A, B))
    seeds, dS = {}, dht
    for (lo, hi), (A, B) in reversed(list(zip(zip(bounds[:-1], bounds[1:]), maps))):
        seeds[hi] = dS
        dS = A @ dS + B
    return _walk(q, k, v, g, beta, scale, starts, do, seeds, rnd)


# ---- two CTAs a chain, one per half of the value columns (bench/fused-backward.md) -------------
def chunk_backward_halves(Q, K, V, gc, B, dO, S0, dS, scale, halves=2, exchange=True, partials=False):
    """chunk_backward's outputs as `halves` CTAs of one chain would form them, each owning a block
    of the value columns (V, dO, S0, dS and every V-wide intermediate of its block): dS's columns
    evolve independently, so the carry, dv and the V-wide products stay in their block. What mixes
    the blocks is dT~ = dVn R^T (P6) and dP = dO Vn^T (P8), which contract over V, and the partial
    products that contract over V (P9's dK~, P10's dQ~, P11's dK term) with the dc terms made of
    them (<dS, S0>, dR's row sums), summed over the blocks as dq, dk and dc partials.
    Two ways to form the terms after dT~ and dP (P12, P14-P16, P19, dbeta, Gam's dc terms):
    exchange=True: the blocks exchange Vn, dVn and R (or their partial dT~, dP) and block 0 forms
    those terms once from the whole dT~ and dP. partials=True: no exchange; every term after dT~ and
    dP is linear in them, so each block forms them from its own partial dT~_j = dVn_j R_j^T and
    dP_j = dO_j Vn_j^T, and the blocks' dq, dk, dbeta, dc partials are summed (the V-free products
    done once a block). exchange=False, partials=False: block 0 forms them from its own columns
    alone (what a kernel that skipped both would compute; tests show it is wrong)."""
    c, gam = _gates(gc)
    ec, eL = np.exp(c), np.exp(c[-1])
    ktil = K * np.exp(c[-1] - c)[:, None]
    qtil = scale * ec[:, None] * Q
    p = scale * np.tril(Q @ K.T) * gam
    ar, kk = _inverse(K, B)
    t = gam * ar
    tb = t * B[None, :]
    cols = np.array_split(np.arange(V.shape[1]), halves)
    own = []  # each block's own V-wide values
    for j in cols:
        ks = K @ S0[:, j]
        r = V[:, j] - ec[:, None] * ks
        dvn = ktil @ dS[:, j] + p.T @ dO[:, j]
        own.append(dict(j=j, ks=ks, r=r, vn=tb @ r, dvn=dvn))

    def tail(dtb, dpm):
        """The terms after dT~ and dP, all linear in them: dq, dk, dc and dbeta contributions."""
        gp = scale * np.tril(dpm) * gam
        dt = dtb * B[None, :]
        dar = np.tril(dt * gam, -1)
        da0 = -np.tril((ar.T @ dar) @ ar.T, -1)
        dkk = da0 * B[:, None]
        pp = np.tril(dpm) * p
        tt = np.tril(dt * t, -1)
        dc = pp.sum(1) - pp.sum(0) + tt.sum(1) - tt.sum(0)
        dbeta = (dtb * t).sum(0) + (da0 * kk).sum(1)
        return gp @ K, gp.T @ Q + (dkk + dkk.T) @ K, dc, dbeta     # P12; P14, P19

    def partial(blocks):
        """dT~ and dP from the named blocks' columns."""
        dvn = np.concatenate([o["dvn"] for o in blocks], 1)
        r = np.concatenate([o["r"] for o in blocks], 1)
        vn = np.concatenate([o["vn"] for o in blocks], 1)
        return dvn @ r.T, dO[:, np.concatenate([o["j"] for o in blocks])] @ vn.T  # P6, P8

    if partials:
        tails = [tail(*partial([o])) for o in own]
    else:
        tails = [tail(*partial(own if exchange else own[:1]))]
    dq = sum(x[0] for x in tails)
    dk = sum(x[1] for x in tails)
    dc = sum(x[2] for x in tails)
    dbeta = sum(x[3] for x in tails)
    dv = np.zeros_like(V)
    dS_prev = np.zeros_like(dS)
    for o in own:
        j = o["j"]
        dr = tb.T @ o["dvn"]                         # P5 (own columns): dv
        dv[:, j] = dr
        dvg = -ec[:, None] * dr
        dktil = o["vn"] @ dS[:, j].T                 # P9 partial
        dqt = dO[:, j] @ S0[:, j].T                  # P10 partial
        dq = dq + scale * ec[:, None] * dqt
        dk = dk + dvg @ S0[:, j].T + np.exp(c[-1] - c)[:, None] * dktil  # P11 partial, dK~ partial
        dS_prev[:, j] = eL * dS[:, j] + K.T @ dvg + Q.T @ (scale * ec[:, None] * dO[:, j])  # P13, P18
        dc = dc + (dqt * qtil).sum(1) - (dr * (ec[:, None] * o["ks"])).sum(1)
        kt = (dktil * ktil).sum(1)
        dc = dc - kt
        dc[-1] += kt.sum() + eL * (dS[:, j] * S0[:, j]).sum()
    dg = np.cumsum(dc[::-1])[::-1]
    return dq, dk, dv, dg, dbeta, dS_prev
