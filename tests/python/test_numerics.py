"""Numerics of the call contract through the PyTorch package (docs/api.md, "Numerics"): fp16
outputs of tiny magnitude, g = -inf (a reset) and in-kernel gates that overflow float32, q / k
rows whose sum of squares overflows float32 with use_qk_l2norm_in_kernel, and how far a NaN or
infinity in one input element reaches. Each test runs on the CPU backend and on the GPU (skipped
without one). Bounds are those of gdn_testutil.check_all.
"""
import functools

import numpy as np
import pytest
import torch

from flashgdn.reference import to_f64
from gdn_testutil import (DEVICES, GPU, bounds_for, check_all, lowlevel_fwd_bwd, make_case, oracle_backward,
                          oracle_forward)

INF, NAN = float("inf"), float("nan")


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _token(c, n, t):
    """Flat token index (batch row 0) of token t of sequence n."""
    return sum(c.lengths[:n]) + t


# ---- fp16 outputs of tiny magnitude --------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_tiny_scale_forward_elementwise(device):
    """scale = 1e-9: o ~ 1e-9, which an fp16 conversion that shifted a 32-bit value by 32 or more
    places turned into -54688 or NaN. Every element must be the oracle's up to the fp16 rounding
    (2^-25 absolute below 2^-14) and the float32 arithmetic."""
    c = make_case(lengths=[100, 130], Hq=1, Hv=2, K=64, V=64, dtype=torch.float16, device=device,
                  scale=1e-9, seed=3)
    o, ht, _, _, _, _ = lowlevel_fwd_bwd(c, seed=4)
    _sync(device)
    ref = oracle_forward(c)["o"]
    got = to_f64(o)
    assert np.isfinite(got).all()
    bound = 2.0**-11 * np.abs(ref) + 2.0**-25 + 1e-3 * np.abs(ref).max()
    bad = np.argwhere(np.abs(got - ref) > bound)
    assert bad.size == 0, f"{len(bad)} elements of o off, e.g. {got[tuple(bad[0])]} vs {ref[tuple(bad[0])]}"


# ---- g = -inf: a hard reset ------------------------------------------------------------------------

# (sequence, value head, first token, end): the first token, mid-chunk, the last token of a chunk,
# two in one chunk, every token of a partial chunk, every token of a full chunk, the last token.
RESETS = [(0, 0, 0, 1), (0, 1, 30, 31), (0, 1, 63, 64), (0, 0, 100, 101), (0, 0, 120, 121),
          (1, 1, 0, 60), (2, 0, 64, 128), (2, 1, 199, 200)]


def _set_activation(c, run, x):
    """a such that a + dt_bias = x on the tokens of run."""
    n, h, t0, t1 = run
    bias = 0.0 if c.dt_bias is None else float(c.dt_bias[h])
    c.g[0, _token(c, n, t0):_token(c, n, t1), h] = x - bias


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["g", "g_no_initial_state", "gate_in_kernel"])
def test_neg_inf_gate_is_a_reset(device, mode):
    """g = -inf at the RESETS (or, in the kernel, A_log = 100 for head 0: exp(A_log) = inf in
    float32, every token a reset, except where a + dt_bias = -200: no decay; head 1 with
    a + dt_bias = +200 and -200 at a few tokens): every output and gradient matches the oracle
    and is finite."""
    gik = mode == "gate_in_kernel"
    c = make_case(lengths=[200, 60, 200], Hq=1, Hv=2, K=64, V=64, dtype=torch.bfloat16, device=device,
                  initial_state=mode != "g_no_initial_state", gate_in_kernel=gik, l2norm=gik, seed=5)
    if not gik:
        for n, h, t0, t1 in RESETS:
            c.g[0, _token(c, n, t0):_token(c, n, t1), h] = -INF
    else:
        c.A_log[0] = 100.0
        for run in [(0, 0, 10, 41), (2, 0, 150, 200), (0, 1, 6, 7), (2, 1, 80, 82)]:
            _set_activation(c, run, -200.0)
        for run in [(0, 1, 5, 6), (0, 1, 70, 72), (1, 1, 59, 60)]:
            _set_activation(c, run, 200.0)
    o, ht, ck, do, dht, gr = lowlevel_fwd_bwd(c, checkpoint_every=64, seed=6)
    _sync(device)
    assert torch.isfinite(ck).all()
    check_all(c, o, ht, do, dht, gr, ctx=f"{device} {mode}")


# ---- q / k rows whose sum of squares overflows float32 --------------------------------------------

# (q or k, flat token, q/k head, norm). Several huge rows in one chunk (CPU), and one per chunk with
# no huge query after a huge key of its chunk (GPU: its forward forms the raw Gram products in
# float32, which overflow for two rows of norm 1e30 in one chunk; docs/api.md).
HUGE_DENSE = [("k", 3, 0, 1e19), ("k", 5, 1, 3e19), ("k", 70, 0, 1e30), ("k", 71, 0, 1e30),
              ("q", 71, 0, 1e30), ("q", 160, 1, 3e19), ("q", 200, 0, 1e19), ("k", 299, 1, 1e30)]
HUGE_SPARSE = [("k", 10, 0, 1e30), ("q", 70, 0, 1e30), ("k", 140, 1, 3e19), ("q", 200, 1, 3e19),
               ("k", 260, 0, 1e19)]


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32), ("cpu", torch.bfloat16),
                                          pytest.param(*GPU.values, torch.bfloat16, marks=GPU.marks)])
def test_l2norm_huge_rows(device, dtype):
    """Rows of norm 1e19 (sum of squares 1e38), 3e19 (overflows float32) and 1e30 are normalised
    like every other row: all outputs match the oracle, and so does each huge row's own gradient
    (~1 / norm, invisible in an error over the whole tensor)."""
    rows = HUGE_DENSE if device == "cpu" else HUGE_SPARSE
    c = make_case(lengths=[150, 150], Hq=2, Hv=4, K=64, V=64, dtype=dtype, device=device, l2norm=True, seed=7)
    for which, tok, hq, norm in rows:
        x = getattr(c, which)
        row = x[0, tok, hq].float()
        x[0, tok, hq] = (row * (norm / row.norm())).to(dtype)
    o, ht, _, do, dht, gr = lowlevel_fwd_bwd(c, seed=8)
    _sync(device)
    check_all(c, o, ht, do, dht, gr, ctx=f"{device} {dtype}")
    ref = oracle_backward(c, do, dht)
    bound = 2 * bounds_for(dtype)["dq"]
    for which, tok, hq, norm in rows:
        got, want = to_f64(getattr(gr, "d" + which))[0, tok, hq], ref["d" + which][0, tok, hq]
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err <= bound, f"d{which} of the row of norm {norm:g} at token {tok}, head {hq}: {err:.3e}"


# ---- how far a non-finite input reaches --------------------------------------------------------------

# The poisoned element: token T_POISON of sequence 1 (its second chunk), value head 1 (v, g, beta,
# the initial state) or q/k head 1 (q, k: value heads 2 and 3), element 3 of the row.
LENGTHS, HQ, HV, D, T_POISON = [150, 150, 100], 2, 4, 64, 80
OUTPUTS = ["o", "final_state", "checkpoints", "dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias"]


def _poison_case(device, config):
    return make_case(lengths=LENGTHS, Hq=HQ, Hv=HV, K=D, V=D, dtype=torch.bfloat16, device=device,
                     l2norm=config != "plain", gate_in_kernel=config == "gate_in_kernel", seed=9)


def _run_all(c):
    o, ht, ck, _, _, gr = lowlevel_fwd_bwd(c, checkpoint_every=64, seed=10)
    out = dict(o=o, final_state=ht, checkpoints=ck)
    out.update({name: getattr(gr, name) for name in OUTPUTS[3:]})
    return {k: v.cpu() for k, v in out.items() if v is not None}


@functools.lru_cache(maxsize=None)
def _clean(device, config):
    return _run_all(_poison_case(device, config))


def _reach(c, which, name, shape):
    """The documented reach (docs/api.md, "Non-finite values") of the poisoned element in output
    `name`: a boolean mask of its elements that may differ from the run without it."""
    G = HV // HQ
    qk = which in ("q", "k")
    hq = 1 if qk else 1 // G
    heads = list(range(hq * G, hq * G + G)) if qk else [1]
    first = sum(LENGTHS[:1])
    end = first + LENGTHS[1]
    chunk0 = first + T_POISON // 64 * 64
    m = torch.zeros(shape, dtype=torch.bool)
    if name in ("dA_log", "ddt_bias"):
        m[heads] = True
    elif name in ("dq", "dk"):
        m[0, first:end, hq] = True
    elif name in ("dv", "dg", "dbeta"):
        m[0, first:end, heads] = True
    elif name == "dh0":
        m[1, heads] = True
    elif name == "o":
        if which == "q":
            m[0, first + T_POISON, heads] = True
        else:
            m[0, (first if which == "initial_state" else chunk0):end, heads] = True
    elif name == "final_state":
        m[1, heads] = which != "q"
    elif name == "checkpoints":  # rows of sequence 1: after 64 and 128 of its tokens
        row0 = LENGTHS[0] // 64
        for j in range(LENGTHS[1] // 64):
            m[row0 + j, heads] = which != "q" and (which == "initial_state" or (j + 1) * 64 > T_POISON)
    return m


def _bits(x):
    return x.view(torch.int32 if x.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", ["plain", "l2norm", "gate_in_kernel"])
@pytest.mark.parametrize("which", ["q", "k", "v", "g", "beta", "initial_state"])
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_non_finite_reach(device, config, which, value):
    """A NaN or infinity in one element: every output outside the documented reach is finite and
    bitwise the run without it (other sequences, other heads, and the forward before the
    element's chunk), and it does reach o at its own token. g = -inf (and, in the kernel, a gate
    activation of +-inf) is no poison but a reset (or no decay): everything stays finite."""
    c = _poison_case(device, config)
    tok = _token(c, 1, T_POISON)
    if which in ("q", "k"):
        getattr(c, which)[0, tok, 1, 3] = value
    elif which == "v":
        c.v[0, tok, 1, 3] = value
    elif which == "initial_state":
        c.initial_state[1, 1, 3, 5] = value
    else:
        getattr(c, which)[0, tok, 1] = value
    got = _run_all(c)
    reset = which == "g" and (value == -INF or (config == "gate_in_kernel" and value == INF))
    if reset:
        for name, x in got.items():
            assert torch.isfinite(x).all(), f"{name} is not finite"
        return
    clean = _clean(device, config)
    for name, x in got.items():
        assert torch.isfinite(clean[name]).all(), f"{name} of the clean run is not finite"
        outside = ~_reach(c, which, name, x.shape)
        changed = (_bits(x) != _bits(clean[name])) & outside
        assert not changed.any(), (f"{name}: {int(changed.sum())} elements outside the documented reach "
                                   f"changed, first at {changed.nonzero()[0].tolist()}")
    heads = [2, 3] if which in ("q", "k") else [1]
    at = _token(c, 1, 0 if which == "initial_state" else T_POISON)
    assert not torch.isfinite(got["o"][0, at, heads]).all(), "the poison did not reach o"
