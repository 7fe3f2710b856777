"""States in float32, bfloat16 or float16: initial state, state pool, final state and their
gradients, each in its own dtype, on the CPU and (marked gpu, skipped without a device) on CUDA.

The recurrence is float32 whatever the state dtype: a 16-bit initial state is read exactly, a
16-bit final state (or pool row, or dh0) is the float32 one rounded once to nearest even. So
against the float64 oracle a 16-bit state's relative L2 error is bounded by the backend's float32
bound plus the unit roundoff u of its dtype (bf16 2^-8, fp16 2^-11); on the CPU, whose float32
state is ~1e-6 from the oracle, the error against the oracle's state rounded the same way must
also stay below u / 4 (a systematic error of size u, e.g. truncation, would not). The bitwise
properties (exact loads, rounded-once stores) are checked directly.
"""
import math

import pytest
import torch

import flashgdn
from flashgdn import chunk_gated_delta_rule, chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd
from flashgdn.reference import reference_forward, to_f64
from gdn_testutil import (DEVICES, _rel, bounds_for, check, loss_and_grads, make_case, nan_like, oracle_backward,
                          oracle_forward)

STATE_DTYPES = [torch.bfloat16, torch.float16]
IDS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
PACK = [300, 0, 1, 64, 130]


def _u(dtype: torch.dtype) -> float:
    """Unit roundoff of a storage dtype (0 for float32: no rounding beyond the arithmetic's)."""
    return {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}.get(dtype, 0.0)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _case(device, h0_dtype, seed=11, **kw):
    """bf16 q/k/v, K = V = 64 (both backends), a varlen pack, initial states in h0_dtype."""
    c = make_case(lengths=PACK, Hq=2, Hv=4, K=64, V=64, dtype=torch.bfloat16, device=device, seed=seed, **kw)
    c.initial_state = c.initial_state.to(h0_dtype)
    return c


def check_state(name, x, ref, c, device, context=""):
    """A state output stored in x.dtype against the oracle: the backend's float32 bound plus u; on
    the CPU also within u / 4 of the oracle rounded to x.dtype."""
    base = 1e-4 if device == "cpu" else bounds_for(c.q.dtype)[name]
    check(name, x, ref, c, base + _u(x.dtype), context=f"{context} {x.dtype}")
    if device == "cpu" and x.dtype != torch.float32:
        rounded = to_f64(torch.from_numpy(ref).to(torch.float32).to(x.dtype))
        err = _rel(to_f64(x), rounded)
        assert err <= _u(x.dtype) / 4, f"{name}: {err:.3e} from the rounded oracle {context}"


# ---- against the oracle -------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", STATE_DTYPES, ids=lambda d: IDS[d])
def test_lowlevel_states_vs_oracle(device, dtype):
    """Initial state, final state (allocated in final_state_dtype), d_final_state and dh0
    (allocated: the initial state's dtype) all in `dtype`."""
    c = _case(device, dtype, l2norm=True, gate_in_kernel=True)
    kw = c.lowlevel_kwargs()
    o, ht, _ = chunk_gated_delta_rule_fwd(*c.inputs(), output_final_state=True, final_state_dtype=dtype, **kw)
    _sync(device)
    assert ht.dtype == dtype
    ref = oracle_forward(c)
    check("o", o, ref["o"], c, bounds_for(c.q.dtype)["o"])
    check_state("final_state", ht, ref["final_state"], c, device)
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(o.shape, generator=gen).to(device=device, dtype=o.dtype)
    dht = torch.randn(ht.shape, generator=gen).to(device=device, dtype=dtype)
    gr = chunk_gated_delta_rule_bwd(*c.inputs(), do, dht, **kw)
    _sync(device)
    assert gr.dh0.dtype == dtype
    rb = oracle_backward(c, do, dht)
    check_state("dh0", gr.dh0, rb["dh0"], c, device)
    for name in ("dq", "dk", "dv", "dg", "dbeta"):
        check(name, getattr(gr, name), rb[name], c, bounds_for(c.q.dtype)[name])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", STATE_DTYPES, ids=lambda d: IDS[d])
def test_autograd_16bit_initial_state(device, dtype):
    """chunk_gated_delta_rule with a 16-bit initial state and final_state_dtype of its dtype:
    the final state and the gradient of the initial state in that dtype, both against the
    oracle."""
    c = _case(device, dtype, seed=12)
    h0 = c.initial_state.detach().clone().requires_grad_()
    q = c.q.detach().clone().requires_grad_()
    kw = c.kwargs()
    kw["initial_state"] = h0
    o, ht = chunk_gated_delta_rule(q, *c.inputs()[1:], output_final_state=True, cu_seqlens_cpu=c.cu_seqlens_host,
                                   final_state_dtype=dtype, **kw)
    assert ht.dtype == dtype
    gen = torch.Generator().manual_seed(6)
    do = torch.randn(o.shape, generator=gen).to(device=device, dtype=o.dtype)
    dht = torch.randn(ht.shape, generator=gen).to(device=device, dtype=dtype)
    dq, dh0 = torch.autograd.grad((o, ht), [q, h0], (do, dht))
    _sync(device)
    assert dh0.dtype == dtype and dh0.shape == h0.shape
    ref = oracle_forward(c)
    check_state("final_state", ht, ref["final_state"], c, device, context="autograd")
    rb = oracle_backward(c, do, dht)
    check_state("dh0", dh0, rb["dh0"], c, device, context="autograd")
    check("dq", dq, rb["dq"], c, bounds_for(c.q.dtype)["dq"], context="autograd")


# ---- the dtype of the final state -----------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_final_state_dtype_rule(device):
    """FLA 0.6's rule (fla-core 0.6.0 allocates its final state in float32 whatever the initial
    state's dtype, fla/ops/common/chunk_delta_h.py): float32 without an initial state and from a
    float32, bfloat16 or float16 one, through the FLA call and the low-level forward alike.
    final_state_dtype overrides it; any other dtype of the final state is the float32 one rounded
    once, and a 16-bit initial state is read exactly."""
    c = _case(device, torch.float32, seed=13)
    q, k, v, g, beta = c.inputs()
    kw = dict(cu_seqlens=c.cu_seqlens, cu_seqlens_cpu=c.cu_seqlens_host)
    _, ht = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, **kw)
    assert ht.dtype == torch.float32
    h0 = c.initial_state
    _, ht32 = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    assert ht32.dtype == torch.float32
    for dt in STATE_DTYPES:
        _, ht16 = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                         final_state_dtype=dt, **kw)
        assert ht16.dtype == dt
        assert torch.equal(ht16, ht32.to(dt)), f"{dt}: not the float32 final state rounded once"
        h0_16 = h0.to(dt)
        _, a = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0_16, output_final_state=True, **kw)
        _, a16 = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0_16, output_final_state=True,
                                        final_state_dtype=dt, **kw)
        _, b = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0_16.float(), output_final_state=True, **kw)
        assert a.dtype == torch.float32, f"{dt} initial state: FLA returns a float32 final state, got {a.dtype}"
        assert a16.dtype == dt
        assert torch.equal(a, b), f"{dt}: a 16-bit initial state is not read exactly"
        assert torch.equal(a16, a.to(dt))
        _, lo, _ = chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state=h0_16, output_final_state=True,
                                              cu_seqlens=c.cu_seqlens, cu_seqlens_host=c.cu_seqlens_host)
        assert lo.dtype == torch.float32 and torch.equal(lo, a)
    for bad in (torch.float64, torch.int32, "bfloat16"):
        with pytest.raises(ValueError, match="final_state_dtype"):
            chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   final_state_dtype=bad, **kw)
        with pytest.raises(ValueError, match="final_state_dtype"):
            chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                       cu_seqlens=c.cu_seqlens, final_state_dtype=bad)


# ---- pools --------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", STATE_DTYPES, ids=lambda d: IDS[d])
def test_pool_16bit_v_major_in_place(device, dtype):
    """A pool [P, Hv, V, K] (vLLM's layout) in `dtype`, read and written in place through
    state_indices: written rows are the float32 final states rounded once (and within the
    oracle's bound), the other rows keep their bits; checkpoints stay float32."""
    c = make_case(lengths=PACK, Hq=2, Hv=4, K=64, V=64, dtype=torch.bfloat16, device=device, initial_state=False,
                  state_v_first=True, seed=14)
    P = 8
    pool = (0.5 * torch.randn(P, 4, 64, 64, generator=torch.Generator().manual_seed(7))).to(device=device, dtype=dtype)
    idx = torch.tensor([6, -1, 0, 3, 5], dtype=torch.int32, device=device)
    pool0 = pool.clone()
    kw = c.kwargs()
    kw.update(initial_state=pool, state_indices=idx)
    with torch.no_grad():
        o, ht, ck = chunk_gated_delta_rule(*c.inputs(), output_final_state=True, cu_seqlens_cpu=c.cu_seqlens_host,
                                           checkpoint_every=64, **kw)
    _sync(device)
    assert ht is None and pool.dtype == dtype and ck.dtype == torch.float32
    ref = reference_forward(*c.inputs(), **dict(kw, initial_state=pool0))
    check("o", o, ref["o"], c, bounds_for(c.q.dtype)["o"], context="pool")
    for n, i in enumerate(idx.tolist()):
        if i >= 0:
            check("final_state", pool[i:i + 1], ref["final_state"][n:n + 1], c,
                  (1e-4 if device == "cpu" else bounds_for(c.q.dtype)["final_state"]) + _u(dtype), sliced=False,
                  context=f"pool row {i} {dtype}")
    untouched = [r for r in range(P) if r not in idx.tolist()]
    assert torch.equal(pool[untouched].view(torch.int16), pool0[untouched].view(torch.int16))
    # The same sequences from per-sequence initial states (the rows read, zero for -1), a float32
    # final state: the pool rows are it rounded once; o and the checkpoints are identical.
    h0 = torch.stack([pool0[i] if i >= 0 else torch.zeros_like(pool0[0]) for i in idx.tolist()])
    kw2 = c.kwargs()
    kw2["initial_state"] = h0
    with torch.no_grad():
        o2, ht2, ck2 = chunk_gated_delta_rule(*c.inputs(), output_final_state=True, cu_seqlens_cpu=c.cu_seqlens_host,
                                              checkpoint_every=64, final_state_dtype=torch.float32, **kw2)
    _sync(device)
    assert torch.equal(o2, o) and torch.equal(ck2, ck)
    for n, i in enumerate(idx.tolist()):
        if i >= 0:
            assert torch.equal(pool[i], ht2[n].to(dtype)), f"pool row {i}: not rounded once"
    # final_state_dtype has no meaning with a pool
    with pytest.raises(ValueError, match="final_state_dtype"), torch.no_grad():
        chunk_gated_delta_rule(*c.inputs(), output_final_state=True, final_state_dtype=dtype, **kw)


# ---- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_other_state_dtypes_refused_and_nothing_written(device):
    c = _case(device, torch.float32, seed=15)
    B, T, Hq, Hv, K, V = c.dims
    kw = c.lowlevel_kwargs()
    o = nan_like(c.v)
    for bad in (torch.float64, torch.int32):
        with pytest.raises(ValueError, match="initial_state.*float32, torch.bfloat16 or torch.float16"):
            chunk_gated_delta_rule_fwd(*c.inputs(), **dict(kw, initial_state=c.initial_state.to(bad)), o=o)
        with pytest.raises(ValueError, match="final_state.*float32, torch.bfloat16 or torch.float16"):
            chunk_gated_delta_rule_fwd(*c.inputs(), output_final_state=True, o=o,
                                       final_state=torch.zeros(c.N, Hv, K, V, dtype=bad, device=device), **kw)
        with pytest.raises(ValueError, match="dht"):
            chunk_gated_delta_rule_bwd(*c.inputs(), torch.zeros_like(o), torch.zeros(c.N, Hv, K, V, dtype=bad,
                                                                                     device=device), **kw)
        dh0 = torch.zeros(c.N, Hv, K, V, dtype=bad, device=device)
        dq = nan_like(c.q)
        with pytest.raises(ValueError, match="dh0"):
            chunk_gated_delta_rule_bwd(*c.inputs(), torch.zeros_like(o), None, dq=dq, dh0=dh0, **kw)
        assert torch.isnan(dq.float()).all()
        pool = torch.zeros(3, Hv, K, V, dtype=bad, device=device)
        with pytest.raises(ValueError, match="initial_state"), torch.no_grad():
            chunk_gated_delta_rule(*c.inputs(), initial_state=pool, cu_seqlens=c.cu_seqlens,
                                   state_indices=torch.tensor([0, 1, 2, -1, -1], dtype=torch.int32, device=device),
                                   output_final_state=True)
    assert torch.isnan(o.float()).all()
    # The library's own message, through the binding (no Python-side check): C ABI dtype codes.
    from flashgdn import _C
    from flashgdn._core import _desc, _inputs
    args = _inputs(*c.inputs(), None, c.initial_state, False, c.cu_seqlens, c.cu_seqlens_host, False, None,
                   None, None, False, False)
    args["initial_state"] = _desc("initial_state", c.initial_state.to(torch.int32))
    args.update(output_final_state=False, checkpoint_every=0, precision=0, o=_desc("o", o), final_state=None,
                checkpoints=None)
    with pytest.raises(ValueError, match="'initial_state': expected dtype float32 or bfloat16 or float16, got "
                                         "dtype int32"):
        _C.forward_workspace_size(**args)


# ---- torch.compile and fake tensors ---------------------------------------------------------------


def test_opcheck_16bit_states():
    """The fake (meta) implementations give the real dtypes: a float32 final state (FLA's) and
    a dh0 in the bf16 initial state's dtype; final_state_dtype is honoured."""
    c = make_case(lengths=[70, 10], Hq=1, Hv=2, K=32, V=32, dtype=torch.float32, seed=16)
    h0 = c.initial_state.to(torch.bfloat16).requires_grad_()
    q = c.q.clone().requires_grad_()
    for fsd in (None, torch.float16, torch.float32):
        args = (q, c.k, c.v, c.g, c.beta, None, None, c.cu_seqlens, c.cu_seqlens_host, h0, None, None, False,
                False, False, True, 64, False, "default", fsd)
        torch.library.opcheck(torch.ops.flashgdn.chunk_gated_delta_rule_fwd.default, args)
        _, ht, _, _ = torch.ops.flashgdn.chunk_gated_delta_rule_fwd(*args)
        assert ht.dtype == (fsd or torch.float32)
    bwd_args = (c.q, c.k, c.v, c.g, c.beta, None, None, c.cu_seqlens, c.cu_seqlens_host, h0.detach(), None, None,
                False, False, False, torch.randn(c.v.shape), torch.randn(h0.shape).to(torch.bfloat16), True, False)
    torch.library.opcheck(torch.ops.flashgdn.chunk_gated_delta_rule_bwd.default, bwd_args)
    assert torch.ops.flashgdn.chunk_gated_delta_rule_bwd(*bwd_args)[7].dtype == torch.bfloat16
    # Fake tensors alone: no data, the dtypes of the real call.
    from torch._subclasses.fake_tensor import FakeTensorMode
    h0_fp16 = torch.zeros(2, 2, 32, 32, dtype=torch.float16)
    with FakeTensorMode() as mode:
        f = [mode.from_tensor(x) for x in (c.q, c.k, c.v, c.g, c.beta, c.cu_seqlens, h0_fp16)]
        _, ht, _, _ = torch.ops.flashgdn.chunk_gated_delta_rule_fwd(
            *f[:5], None, None, f[5], None, f[6], None, None, False, False, False, True, 0, False)
        dh0 = torch.ops.flashgdn.chunk_gated_delta_rule_bwd(
            *f[:5], None, None, f[5], None, f[6], None, None, False, False, False, mode.from_tensor(c.v), ht,
            True, False)[7]
    assert ht.dtype == torch.float32 and dh0.dtype == torch.float16


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fsd", [None, torch.bfloat16], ids=["fsd_default", "fsd_bf16"])
def test_torch_compile_16bit_initial_state(device, fsd):
    """fullgraph compile with a bf16 initial state: the same loss and gradients (dh0 in bf16) as
    eager, bitwise; the final state float32 by default (FLA's), bf16 when final_state_dtype says
    so, compiled as in eager (the loss counts the expected dtype)."""
    c = _case(device, torch.bfloat16, seed=17)
    leaves = [x.detach().clone().requires_grad_() for x in (c.q, c.v, c.initial_state)]
    want = fsd or torch.float32

    def f(q, v, h0):
        o, ht = chunk_gated_delta_rule(q, c.k, v, c.g, c.beta, initial_state=h0, output_final_state=True,
                                       cu_seqlens=c.cu_seqlens, cu_seqlens_cpu=c.cu_seqlens_host,
                                       final_state_dtype=fsd)
        return o.float().square().sum() + ht.float().square().sum() + 1000 * (ht.dtype == want)

    torch._dynamo.reset()
    ref = loss_and_grads(f, leaves)
    got = loss_and_grads(torch.compile(f, fullgraph=True, backend="aot_eager"), leaves)
    assert got[3].dtype == torch.bfloat16
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert math.isfinite(float(ref[0])) and float(ref[0]) >= 1000, "the final state's dtype is not the expected one"
