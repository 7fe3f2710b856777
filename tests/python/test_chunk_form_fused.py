"""The fused reverse kernel's algebra (chunk_form_fused.py: the gate-free inverse gated
elementwise, the corrected values without W, the backward's 19 products a chunk) against the
float64 recurrence, before any kernel implements it (bench/fused-backward.md). float64 on both
sides: every output within 1e-9 of the oracle's, relative to its largest entry. The check is of
the algebra, not of rounding: one input moved by one part in a million already fails it
(test_the_bound_is_tight), while float64's own rounding stays below 1e-9 even where dg is a
difference of nearly cancelling gate terms (2.3e-10 on a one-token chunk with strong decay)."""
import numpy as np
import pytest
import torch

import chunk_form_fused as cf
from flashgdn.reference import reference_backward, reference_forward

GATES = {
    "none": lambda rng, T: np.zeros(T),
    "realistic": lambda rng, T: -rng.uniform(0.0, 0.5, T),
    "strong": lambda rng, T: -rng.uniform(2.0, 16.0, T),
    "stops": lambda rng, T: np.where(np.arange(T) < T // 2, -rng.uniform(0.5, 4.0, T), 0.0),
}


def _case(T, K, V, gates, beta_max, seed):
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)
    q, k = unit(rng.standard_normal((T, K))), unit(rng.standard_normal((T, K)))
    v = rng.standard_normal((T, V))
    g, beta = GATES[gates](rng, T), rng.uniform(0.0, beta_max, T)
    s0, dht = 0.5 * rng.standard_normal((K, V)), rng.standard_normal((K, V))
    do = rng.standard_normal((T, V))
    return q, k, v, g, beta, K ** -0.5, s0, do, dht


def _oracle(q, k, v, g, beta, scale, s0, do, dht):
    t = lambda x: torch.tensor(x)
    seq = lambda x: t(x)[None, :, None]  # [B = 1, T, H = 1, ...]
    args = dict(q=seq(q), k=seq(k), v=seq(v), g=seq(g), beta=seq(beta), scale=scale,
                initial_state=t(s0)[None, None])
    fwd = reference_forward(**args)
    bwd = reference_backward(**args, do=seq(do), dht=t(dht)[None, None])
    grads = [bwd[n][0, :, 0] for n in ("dq", "dk", "dv", "dg", "dbeta")] + [bwd["dh0"][0, 0]]
    return fwd["o"][0, :, 0], fwd["final_state"][0, 0], grads


@pytest.mark.parametrize("gates", sorted(GATES))
@pytest.mark.parametrize("T,K,V,beta_max", [(150, 16, 12, 1.0), (64, 32, 32, 2.0), (1, 8, 8, 1.0),
                                             (257, 128, 128, 2.0)])
def test_chunk_form_matches_the_recurrence(gates, T, K, V, beta_max):
    case = _case(T, K, V, gates, beta_max, seed=T + K)
    o_ref, s_ref, grads_ref = _oracle(*case)
    o, s, _ = cf.forward(*case[:7])
    assert np.abs(o - o_ref).max() <= 1e-9 * np.abs(o_ref).max()
    assert np.abs(s - s_ref).max() <= 1e-9 * np.abs(s_ref).max()
    for name, mine, ref in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), cf.backward(*case), grads_ref):
        err = np.abs(mine - ref).max() / max(np.abs(ref).max(), 1e-300)
        assert err <= 1e-9, f"{name}: {err:.3e}"


def test_the_bound_is_tight():
    """1e-9 is far below any algebra error: beta moved by one part in a million on a single
    token already moves dh0 past it."""
    case = _case(150, 16, 12, "realistic", 1.0, seed=7)
    _, _, grads_ref = _oracle(*case)
    q, k, v, g, beta, scale, s0, do, dht = case
    beta2 = beta.copy()
    beta2[3] *= 1.0 + 1e-6
    dh0 = cf.backward(q, k, v, g, beta, scale, s0, do, dht)[5]
    dh0_moved = cf.backward(q, k, v, g, beta2, scale, s0, do, dht)[5]
    scale_ref = np.abs(grads_ref[5]).max()
    assert np.abs(dh0 - grads_ref[5]).max() <= 1e-9 * scale_ref
    assert np.abs(dh0_moved - grads_ref[5]).max() > 1e-9 * scale_ref


# ---- the reverse context parallelism's algebra (bench/fused-backward.md, "Reverse CP") ---------
@pytest.mark.parametrize("gates", sorted(GATES))
def test_carry_is_the_chunk_map(gates):
    """A chunk's carry is affine in dS with the map carry_map gives: M dS + b for any dS."""
    q, k, v, g, beta, scale, s0, do, dht = _case(64, 16, 12, gates, 1.0, seed=3)
    M, b = cf.carry_map(q, k, g, beta, scale, do)
    for seed in (0, 1):
        dS = np.random.default_rng(seed).standard_normal(dht.shape)
        carry = cf.chunk_backward(q, k, v, g, beta, do, s0, dS, scale)[5]
        assert np.abs(carry - (M @ dS + b)).max() <= 1e-9 * np.abs(carry).max()


@pytest.mark.parametrize("gates", sorted(GATES))
@pytest.mark.parametrize("seg_chunks", [1, 2, 3])
def test_segments_give_the_walk(gates, seg_chunks):
    """Segments composed from their chunks' maps, a scan over them, then each walked alone: every
    output of the one walk, within float64's rounding (1e-9 of each output's largest entry)."""
    case = _case(450, 16, 12, gates, 1.0, seed=11)
    whole = cf.backward(*case)
    parts = cf.backward_segments(*case, seg_chunks=seg_chunks)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), whole, parts):
        assert np.abs(a - b).max() <= 1e-9 * max(np.abs(a).max(), 1e-300), name


# ---- two CTAs a chain, one per half of the value columns -----------------------------------------
@pytest.mark.parametrize("gates", sorted(GATES))
@pytest.mark.parametrize("halves", [2, 4])
@pytest.mark.parametrize("how", ["exchange", "partials"])
def test_value_halves_give_the_chunk(gates, halves, how):
    """A chunk's backward split over blocks of the value columns, with the exchange or with each
    block's own partial dT~ and dP (no exchange: the terms after them are linear in them), and the
    partial sums chunk_backward_halves names, gives chunk_backward's six outputs (carry included)
    within float64's rounding, on chunks of 64 tokens and of 1, under every gate regime."""
    for T, seed in ((64, 5), (1, 6), (37, 8)):
        q, k, v, g, beta, scale, s0, do, dht = _case(T, 32, 32, gates, 1.0, seed=seed)
        whole = cf.chunk_backward(q, k, v, g, beta, do, s0, dht, scale)
        split = cf.chunk_backward_halves(q, k, v, g, beta, do, s0, dht, scale, halves=halves,
                                         partials=how == "partials")
        for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dS"), whole, split):
            assert np.abs(a - b).max() <= 1e-9 * max(np.abs(a).max(), 1e-300), f"{name} T={T}"


def test_value_halves_need_the_exchange_or_the_partials():
    """With neither (block 0 forming dT~ and dP from its own columns, the others nothing after them)
    dq, dk, dg and dbeta are wrong: the test above would catch a kernel that skipped both. dv and the
    carry do not use them."""
    q, k, v, g, beta, scale, s0, do, dht = _case(64, 32, 32, "realistic", 1.0, seed=5)
    whole = cf.chunk_backward(q, k, v, g, beta, do, s0, dht, scale)
    alone = cf.chunk_backward_halves(q, k, v, g, beta, do, s0, dht, scale, exchange=False)
    for n in (0, 1, 3, 4):
        assert np.abs(whole[n] - alone[n]).max() > 1e-3 * np.abs(whole[n]).max(), n
    for n in (2, 5):
        assert np.abs(whole[n] - alone[n]).max() <= 1e-9 * np.abs(whole[n]).max(), n
