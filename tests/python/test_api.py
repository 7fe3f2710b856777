"""CPU tests of the Python package: the binding, the FLA-compatible function, autograd,
torch.compile, validation. Every numeric check is against the float64 oracle."""
import importlib.metadata
import inspect
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flashgdn
from flashgdn import _C, chunk_gated_delta_rule, chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd
from flashgdn.reference import reference_backward, reference_forward, to_f64
from gdn_testutil import (OPTIONS, bounds_for, check, check_all, lowlevel_fwd_bwd, make_case, nan_like,
                          option_kwargs, oracle_backward, oracle_forward)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---- module basics -----------------------------------------------------------------------------


def test_exports_and_version():
    # One version, the file VERSION: the package, the library it loaded and the installed
    # distribution's metadata (scikit-build-core's regex provider) all say it.
    version = (Path(__file__).resolve().parents[2] / "VERSION").read_text().strip()
    assert flashgdn.__version__ == version
    assert _C.version() == version
    assert flashgdn.library_version() == version
    assert importlib.metadata.version("flashgdn") == version
    assert isinstance(flashgdn.has_cuda(), bool)
    for name in ("chunk_gated_delta_rule", "chunk_gated_delta_rule_fwd", "chunk_gated_delta_rule_bwd",
                 "__version__", "has_cuda"):
        assert hasattr(flashgdn, name), name
    assert hasattr(torch.ops.flashgdn, "chunk_gated_delta_rule_fwd")
    assert hasattr(torch.ops.flashgdn, "chunk_gated_delta_rule_bwd")


# FLA 0.6's parameters of chunk_gated_delta_rule in its order (fla-core 0.6.0,
# fla/ops/gated_delta_rule/chunk.py), all positional-or-keyword, then **kwargs.
FLA_POSITIONAL = ["q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
                  "use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
                  "state_v_first", "cu_seqlens", "cu_seqlens_cpu", "chunk_indices", "cp_context"]
# The keywords FLA 0.6 reads from its **kwargs.
FLA_KWARGS = ["use_gate_in_kernel", "A_log", "dt_bias", "chunk_size", "head_first", "transpose_state_layout"]
FLASHGDN_ONLY = ["chunk_offsets", "cu_seqlens_host", "state_indices", "checkpoint_every", "check_inputs",
                 "precision", "final_state_dtype"]


def test_fla_signature_names():
    """FLA 0.6's positional order and defaults; FLA's **kwargs options and flashgdn's own
    arguments keyword-only."""
    params = inspect.signature(chunk_gated_delta_rule).parameters
    names = list(params)
    assert names[:len(FLA_POSITIONAL)] == FLA_POSITIONAL
    for name in FLA_POSITIONAL:
        assert params[name].kind == inspect.Parameter.POSITIONAL_OR_KEYWORD, name
    for name in FLA_POSITIONAL[5:]:
        assert params[name].default in (None, False), name
    for name in FLA_KWARGS[:-1] + FLASHGDN_ONLY:
        assert params[name].kind == inspect.Parameter.KEYWORD_ONLY, name
    assert names[-1] == "kwargs"  # transpose_state_layout, as FLA
    assert params["scale"].default is None
    assert params["chunk_size"].default == 64


def test_fla_positional_meaning():
    """A positional call in FLA's order means what it means to FLA: the 10th argument is
    use_beta_sigmoid_in_kernel, the 12th state_v_first, the 13th cu_seqlens."""
    c = make_case(lengths=[40, 70], Hq=1, Hv=2, K=32, V=32, dtype=torch.float32, state_v_first=True)
    q, k, v, g, beta = c.inputs()
    logits = torch.logit(beta)
    o1, ht1 = chunk_gated_delta_rule(q, k, v, g, logits, None, c.initial_state, True, False, True, False, True,
                                     c.cu_seqlens, c.cu_seqlens_host, None, None)
    o2, ht2 = chunk_gated_delta_rule(q, k, v, g, torch.sigmoid(logits), initial_state=c.initial_state,
                                     output_final_state=True, state_v_first=True, cu_seqlens=c.cu_seqlens)
    assert torch.equal(o1, o2) and torch.equal(ht1, ht2)
    ref = oracle_forward(c)
    check("o", o1, ref["o"], c, 1e-4)
    check("final_state", ht1, ref["final_state"], c, 1e-4)
    # allow_neg_eigval (11th): beta = 2 sigmoid(logits)
    o3, _ = chunk_gated_delta_rule(q, k, v, g, logits, None, c.initial_state, False, False, True, True, True,
                                   c.cu_seqlens)
    o4, _ = chunk_gated_delta_rule(q, k, v, g, 2 * torch.sigmoid(logits), initial_state=c.initial_state,
                                   state_v_first=True, cu_seqlens=c.cu_seqlens)
    assert torch.equal(o3, o4)
    assert not torch.equal(o3, o1)


def test_fla_hints_and_kwargs():
    """FLA's performance hints are accepted and ignored; every FLA keyword is taken; anything
    else is a TypeError naming it and saying what is supported."""
    c = make_case(lengths=[64, 30], Hq=1, Hv=2, K=32, V=32)
    base = chunk_gated_delta_rule(*c.inputs(), cu_seqlens=c.cu_seqlens, output_final_state=True)
    chunk_indices = torch.tensor([[0, 0], [1, 0]], dtype=torch.int32)
    chunk_offsets = torch.tensor([0, 1, 2], dtype=torch.int32)
    for cs in (16, 32, 64):
        out = chunk_gated_delta_rule(*c.inputs(), cu_seqlens=c.cu_seqlens, output_final_state=True,
                                     chunk_indices=chunk_indices, chunk_offsets=chunk_offsets, chunk_size=cs,
                                     head_first=False, cp_context=None)
        assert torch.equal(base[0], out[0]) and torch.equal(base[1], out[1])
    with pytest.raises(TypeError, match="chunk_offsets"):
        chunk_gated_delta_rule(*c.inputs(), cu_seqlens=c.cu_seqlens, chunk_offsets=[0, 1, 2])
    with pytest.raises(TypeError, match=r"'output_final_sate'.*takes FLA 0.6"):
        chunk_gated_delta_rule(*c.inputs(), cu_seqlens=c.cu_seqlens, output_final_sate=True)
    with pytest.raises(TypeError):  # flashgdn's own arguments are keyword-only
        chunk_gated_delta_rule(*c.inputs(), None, None, False, False, False, False, False, c.cu_seqlens,
                               None, None, None, 0)


# ---- numerics against the oracle (low-level API, NaN-poisoned outputs) --------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("heads", [(1, 1), (2, 4), (2, 2), (1, 3)], ids=lambda h: f"Hq{h[0]}Hv{h[1]}")
def test_dense_vs_oracle(dtype, heads):
    c = make_case(B=2, T=150, Hq=heads[0], Hv=heads[1], K=32, V=64, dtype=dtype)
    o, ht, _, do, dht, gr = lowlevel_fwd_bwd(c)
    check_all(c, o, ht, do, dht, gr, ctx=f"{dtype} {heads}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_varlen_vs_oracle(dtype, cu_dtype):
    c = make_case(lengths=[0, 1, 63, 64, 65, 0, 130, 1, 7], Hq=2, Hv=4, K=64, V=32, dtype=dtype,
                  cu_dtype=cu_dtype)
    o, ht, _, do, dht, gr = lowlevel_fwd_bwd(c)
    check_all(c, o, ht, do, dht, gr, ctx=f"varlen {dtype}")


def test_head_dim_128_no_initial_state():
    c = make_case(B=1, T=100, Hq=1, Hv=2, K=128, V=128, initial_state=False)
    o, ht, _, do, dht, gr = lowlevel_fwd_bwd(c)
    assert gr.dh0 is None
    check_all(c, o, ht, do, dht, gr)


@pytest.mark.parametrize("opt", OPTIONS)
def test_options_vs_oracle(opt):
    kw = dict(lengths=[70, 0, 129, 5], Hq=2, Hv=4, K=32, V=32)
    kw.update(option_kwargs(opt, scale=0.37))
    c = make_case(**kw)
    o, ht, _, do, dht, gr = lowlevel_fwd_bwd(c)
    check_all(c, o, ht, do, dht, gr, ctx=opt)


@pytest.mark.parametrize("varlen", [False, True])
def test_checkpoints(varlen):
    every = 64
    if varlen:
        c = make_case(lengths=[130, 0, 63, 200, 64], Hq=1, Hv=2, K=32, V=32)
    else:
        c = make_case(B=2, T=200, Hq=1, Hv=2, K=32, V=32)
    B, T = c.q.shape[:2]
    ref = oracle_forward(c, checkpoint_every=every)
    R = ref["checkpoints"].shape[0]
    # Functional API: B * (T // every) rows, the ones past R zero; a third return value.
    o, ht, ck = chunk_gated_delta_rule(*c.inputs(), output_final_state=True, checkpoint_every=every, **c.kwargs())
    assert ck.shape == (B * (T // every), 2, 32, 32) and ck.dtype == torch.float32
    assert ck.shape[0] == flashgdn.checkpoint_rows(B, T, every)
    if varlen:
        offs = flashgdn.checkpoint_offsets(c.cu_seqlens, every)
        assert int(offs[-1]) == R
    check("checkpoints", ck[:R], ref["checkpoints"], c, bounds_for(c.q.dtype)["checkpoints"], sliced=False)
    assert torch.all(ck[R:] == 0)
    check("o", o, ref["o"], c, bounds_for(c.q.dtype)["o"])
    # Without checkpoints: a pair, identical outputs.
    o2, ht2 = chunk_gated_delta_rule(*c.inputs(), output_final_state=True, **c.kwargs())
    assert torch.equal(o, o2) and torch.equal(ht, ht2)


def test_state_pool_in_place():
    """state_indices: initial states read from pool rows, final states written back in place;
    a negative index starts from zero and writes nothing."""
    c = make_case(lengths=[80, 3, 0, 70], Hq=1, Hv=2, K=32, V=32, initial_state=False)
    P = 6
    pool = 0.5 * torch.randn(P, 2, 32, 32)
    idx = torch.tensor([4, -1, 0, 2], dtype=torch.int32)
    pool0 = pool.clone()
    kw = c.kwargs()
    kw.update(initial_state=pool, state_indices=idx)
    with torch.no_grad():
        o, ht = chunk_gated_delta_rule(*c.inputs(), output_final_state=True, **kw)
    assert ht is None
    ref = reference_forward(*c.inputs(), **(kw | {"initial_state": pool0}))
    check("o", o, ref["o"], c, bounds_for(c.q.dtype)["o"])
    for n, i in enumerate(idx.tolist()):
        if i >= 0:
            check("final_state", pool[i:i + 1], ref["final_state"][n:n + 1], c, 6e-3, sliced=False,
                  context=f"pool row {i}")
    untouched = [r for r in range(P) if r not in idx.tolist()]
    assert torch.equal(pool[untouched], pool0[untouched])
    # Read only (no output_final_state): the pool is not written.
    pool1 = pool.clone()
    with torch.no_grad():
        chunk_gated_delta_rule(*c.inputs(), **kw)
    assert torch.equal(pool, pool1)
    # Autograd through a pool: a clear error.
    q = c.q.clone().requires_grad_()
    with pytest.raises(NotImplementedError, match="state_indices"):
        chunk_gated_delta_rule(q, *c.inputs()[1:], **kw)


# ---- FLA-signature behaviour ----------------------------------------------------------------


def test_defaults_and_return_values():
    c = make_case(B=2, T=70, Hq=2, Hv=4, K=32, V=32, dtype=torch.bfloat16)
    q, k, v, g, beta = c.inputs()
    out = chunk_gated_delta_rule(q, k, v, g, beta)
    assert isinstance(out, tuple) and len(out) == 2
    o, ht = out
    assert ht is None
    assert o.shape == v.shape and o.dtype == q.dtype and o.device == q.device
    # scale defaults to K ** -0.5
    o2, _ = chunk_gated_delta_rule(q, k, v, g, beta, scale=32 ** -0.5)
    assert torch.equal(o, o2)
    # positional FLA order: scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
    # use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens
    o3, ht3 = chunk_gated_delta_rule(q, k, v, g, beta, None, c.initial_state, True, False, False, False, False, None)
    assert ht3.shape == (2, 4, 32, 32) and ht3.dtype == torch.float32
    ref = oracle_forward(c)
    check("o", o3, ref["o"], c, 6e-3)
    check("final_state", ht3, ref["final_state"], c, 6e-3)
    # FLA's beta-sigmoid option equals passing sigmoid(beta)
    logits = torch.logit(beta)
    o4, _ = chunk_gated_delta_rule(q, k, v, g, logits, use_beta_sigmoid_in_kernel=True)
    o5, _ = chunk_gated_delta_rule(q, k, v, g, torch.sigmoid(logits))
    assert torch.equal(o4, o5)
    # accepted and ignored: chunk_indices, chunk_size=64, head_first=False
    o6, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_indices=None, chunk_size=64, head_first=False)
    assert torch.equal(o, o6)
    # deprecated alias of state_v_first
    with pytest.warns(DeprecationWarning):
        chunk_gated_delta_rule(q, k, v, g, beta, transpose_state_layout=False)


def test_fla_errors():
    c = make_case(B=2, T=40, Hq=2, Hv=4, K=32, V=32)
    q, k, v, g, beta = c.inputs()
    with pytest.raises(ValueError, match="head_first"):
        chunk_gated_delta_rule(q, k, v, g, beta, head_first=True)
    with pytest.raises(TypeError, match="no_such_option"):
        chunk_gated_delta_rule(q, k, v, g, beta, no_such_option=1)
    with pytest.raises(ValueError, match="batch size"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 40]))
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=128)
    with pytest.raises(NotImplementedError, match="cp_context"):
        chunk_gated_delta_rule(q, k, v, g, beta, cp_context=object())
    with pytest.raises(ValueError, match="A_log"):
        chunk_gated_delta_rule(q, k, v, g, beta, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="A_log"):
        chunk_gated_delta_rule(q, k, v, g, beta, A_log=torch.zeros(4))
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        chunk_gated_delta_rule(q, k, v, g, beta, allow_neg_eigval=True)
    c1 = make_case(lengths=[10, 30], Hq=2, Hv=4, K=32, V=32)
    with pytest.raises(ValueError, match="cu_seqlens_host"):
        chunk_gated_delta_rule(*c1.inputs(), cu_seqlens=c1.cu_seqlens, cu_seqlens_cpu=c1.cu_seqlens_host,
                               cu_seqlens_host=c1.cu_seqlens_host)


def test_cu_seqlens_host_hint():
    """cu_seqlens_cpu / cu_seqlens_host (tensor or list) give the same result; a wrong hint is
    rejected naming it."""
    c = make_case(lengths=[33, 100, 1], Hq=1, Hv=2, K=32, V=32)
    base = chunk_gated_delta_rule(*c.inputs(), cu_seqlens=c.cu_seqlens, output_final_state=True)
    for kw in (dict(cu_seqlens_cpu=c.cu_seqlens_host), dict(cu_seqlens_host=c.cu_seqlens_host),
               dict(cu_seqlens_host=c.cu_seqlens_host.tolist())):
        out = chunk_gated_delta_rule(*c.inputs(), cu_seqlens=c.cu_seqlens, output_final_state=True, **kw)
        assert torch.equal(base[0], out[0]) and torch.equal(base[1], out[1])
    for bad in ([0, 30, 134], [0, 30, 133, 135], [0, 40, 30, 134]):
        with pytest.raises(ValueError, match="cu_seqlens_host"):
            chunk_gated_delta_rule(*c.inputs(), cu_seqlens=c.cu_seqlens, cu_seqlens_host=bad)
    with pytest.raises(ValueError, match="cu_seqlens_host"):
        chunk_gated_delta_rule(*c.inputs(), cu_seqlens_host=c.cu_seqlens_host)


def test_strided_inputs():
    """Views of a fused projection (strided rows) and a transposed head-first tensor give the
    same bits as contiguous copies."""
    B, T, Hq, Hv, K, V = 2, 90, 2, 4, 32, 32
    c = make_case(B=B, T=T, Hq=Hq, Hv=Hv, K=K, V=V, dtype=torch.bfloat16)
    fused = torch.cat([c.q.flatten(2), c.k.flatten(2), c.v.flatten(2)], dim=-1)
    q = fused[..., :Hq * K].view(B, T, Hq, K)
    k = fused[..., Hq * K:2 * Hq * K].view(B, T, Hq, K)
    v = fused[..., 2 * Hq * K:].view(B, T, Hv, V)
    assert not q.is_contiguous()
    v_hf = c.v.transpose(1, 2).contiguous().transpose(1, 2)  # [B, T, H, V] view of head-first storage
    o_ref, ht_ref = chunk_gated_delta_rule(*c.inputs(), initial_state=c.initial_state, output_final_state=True)
    o1, ht1 = chunk_gated_delta_rule(q, k, v, c.g, c.beta, initial_state=c.initial_state, output_final_state=True)
    o2, ht2 = chunk_gated_delta_rule(c.q, c.k, v_hf, c.g, c.beta, initial_state=c.initial_state,
                                     output_final_state=True)
    assert torch.equal(o_ref, o1) and torch.equal(ht_ref, ht1)
    assert torch.equal(o_ref, o2) and torch.equal(ht_ref, ht2)
    # last dimension not unit-stride: made contiguous by the wrapper
    qt = c.q.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert qt.stride(-1) != 1
    o3, _ = chunk_gated_delta_rule(qt, c.k, c.v, c.g, c.beta, initial_state=c.initial_state)
    assert torch.equal(o_ref, o3)


# ---- autograd ----------------------------------------------------------------------------------


@pytest.mark.parametrize("opt", ["plain_fp32", "plain_bf16", "varlen_l2norm_gate", "v_first_scale"])
def test_autograd_vs_oracle(opt):
    """torch.autograd.grad through chunk_gated_delta_rule against the oracle's reverse mode."""
    if opt == "plain_fp32":
        c = make_case(B=2, T=100, Hq=2, Hv=4, K=32, V=32, dtype=torch.float32)
    elif opt == "plain_bf16":
        c = make_case(B=2, T=100, Hq=2, Hv=4, K=32, V=32, dtype=torch.bfloat16)
    elif opt == "varlen_l2norm_gate":
        c = make_case(lengths=[65, 0, 1, 120], Hq=1, Hv=2, K=64, V=32, dtype=torch.bfloat16, l2norm=True,
                      gate_in_kernel=True)
    else:
        c = make_case(B=1, T=130, Hq=2, Hv=2, K=32, V=64, dtype=torch.float32, state_v_first=True, scale=0.2)
    leaves = {n: getattr(c, n).detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")}
    extra = {}
    if c.use_gate_in_kernel:
        extra = {n: getattr(c, n).detach().clone().requires_grad_() for n in ("A_log", "dt_bias")}
    kw = c.kwargs()
    kw.update({"initial_state": leaves["initial_state"], **extra})
    o, ht = chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                                   output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=gen).to(o.dtype)
    dht = torch.randn(ht.shape, generator=gen)
    names = list(leaves) + list(extra)
    grads = torch.autograd.grad((o, ht), [leaves[n] for n in leaves] + [extra[n] for n in extra], (do, dht))
    rb = oracle_backward(c, do, dht)
    bounds = bounds_for(c.q.dtype)
    for n, gr in zip(names, grads):
        key = {"initial_state": "dh0", "beta": "dbeta", "A_log": "dA_log", "dt_bias": "ddt_bias"}.get(n, "d" + n)
        assert gr.dtype == leaves.get(n, extra.get(n)).dtype
        check(key, gr, rb[key], c, bounds[key], context=opt)


@pytest.mark.parametrize("gate_dtype", [torch.float16, torch.bfloat16, torch.float32],
                         ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("gate_in_kernel", [False, True], ids=["log_gate", "gate_in_kernel"])
def test_gate_dtypes_vs_oracle(gate_dtype, gate_in_kernel):
    """g and beta in every dtype FLA takes (float32, bfloat16, float16), through autograd: the
    forward and every gradient against the oracle (which sees the same rounded g and beta), dg
    and dbeta in g's and beta's dtypes."""
    c = make_case(lengths=[70, 1, 100], Hq=1, Hv=2, K=32, V=32, dtype=torch.bfloat16, g_dtype=gate_dtype,
                  beta_dtype=gate_dtype, gate_in_kernel=gate_in_kernel)
    assert c.g.dtype == gate_dtype and c.beta.dtype == gate_dtype
    g = c.g.detach().clone().requires_grad_()
    beta = c.beta.detach().clone().requires_grad_()
    kw = c.kwargs()
    o, ht = chunk_gated_delta_rule(c.q, c.k, c.v, g, beta, output_final_state=True, **kw)
    ref = oracle_forward(c)
    check("o", o, ref["o"], c, 6e-3, context=str(gate_dtype))
    check("final_state", ht, ref["final_state"], c, 6e-3, context=str(gate_dtype))
    gen = torch.Generator().manual_seed(2)
    do = torch.randn(o.shape, generator=gen).to(o.dtype)
    dg, dbeta = torch.autograd.grad(o, [g, beta], do)
    assert dg.dtype == gate_dtype and dbeta.dtype == gate_dtype
    rb = oracle_backward(c, do, None)
    check("dg", dg, rb["dg"], c, 1.2e-2, context=str(gate_dtype))
    check("dbeta", dbeta, rb["dbeta"], c, 8e-3, context=str(gate_dtype))


def test_autograd_unused_outputs():
    """Only o in the loss (final state unused), or only the final state."""
    c = make_case(B=1, T=80, Hq=1, Hv=2, K=32, V=32, dtype=torch.float32)
    q = c.q.clone().requires_grad_()
    h0 = c.initial_state.clone().requires_grad_()
    o, ht = chunk_gated_delta_rule(q, c.k, c.v, c.g, c.beta, initial_state=h0, output_final_state=True)
    (o.float() * 2).sum().backward()
    rb = reference_backward(*c.inputs(), torch.full(o.shape, 2.0), None, initial_state=c.initial_state)
    check("dq", q.grad, rb["dq"], c, 1e-4)
    check("dh0", h0.grad, rb["dh0"], c, 1e-4)
    q.grad = h0.grad = None
    o, ht = chunk_gated_delta_rule(q, c.k, c.v, c.g, c.beta, initial_state=h0, output_final_state=True)
    ht.sum().backward()
    rb = reference_backward(*c.inputs(), torch.zeros(o.shape), torch.ones(ht.shape), initial_state=c.initial_state)
    check("dq", q.grad, rb["dq"], c, 1e-4)
    check("dh0", h0.grad, rb["dh0"], c, 1e-4)
    # No initial_state gradient wanted: none computed, the others still right.
    o, _ = chunk_gated_delta_rule(q, c.k, c.v, c.g, c.beta, initial_state=c.initial_state)
    (dq,) = torch.autograd.grad(o.sum(), [q])
    rb = reference_backward(*c.inputs(), torch.ones(o.shape), None, initial_state=c.initial_state)
    check("dq", dq, rb["dq"], c, 1e-4)


def test_opcheck():
    """torch.library.opcheck: schema, fake (meta) kernels, autograd registration, AOT dispatch."""
    c = make_case(lengths=[70, 10], Hq=1, Hv=2, K=32, V=32, dtype=torch.float32, gate_in_kernel=True)
    args = (c.q.requires_grad_(), c.k, c.v, c.g.requires_grad_(), c.beta, c.A_log, c.dt_bias, c.cu_seqlens,
            c.cu_seqlens_host, c.initial_state, None, 0.2, True, True, False, True, 64, True)
    torch.library.opcheck(torch.ops.flashgdn.chunk_gated_delta_rule_fwd.default, args)
    bwd_args = (c.q.detach(), c.k, c.v, c.g.detach(), c.beta, c.A_log, c.dt_bias, c.cu_seqlens,
                c.cu_seqlens_host, c.initial_state, None, None, True, True, False,
                torch.randn(c.v.shape), torch.randn(c.initial_state.shape), True, False)
    torch.library.opcheck(torch.ops.flashgdn.chunk_gated_delta_rule_bwd.default, bwd_args)


# ---- torch.compile -----------------------------------------------------------------------------


class _TinyGDN(torch.nn.Module):
    """A GDN layer shaped like Qwen3-Next's: fused projection, in-kernel gate and l2norm."""

    def __init__(self, d=32, Hq=2, Hv=4, K=32, V=32):
        super().__init__()
        self.Hq, self.Hv, self.K, self.V = Hq, Hv, K, V
        self.proj = torch.nn.Linear(d, 2 * Hq * K + Hv * V + 2 * Hv)
        self.A_log = torch.nn.Parameter(torch.log(torch.linspace(1, 16, Hv)))
        self.dt_bias = torch.nn.Parameter(torch.zeros(Hv))
        self.out = torch.nn.Linear(Hv * V, d)

    def forward(self, x, cu_seqlens, cu_seqlens_cpu, h0):
        Hq, Hv, K, V = self.Hq, self.Hv, self.K, self.V
        q, k, v, a, b = torch.split(self.proj(x), [Hq * K, Hq * K, Hv * V, Hv, Hv], dim=-1)
        B, T = x.shape[:2]
        o, ht = chunk_gated_delta_rule(
            q.view(B, T, Hq, K), k.view(B, T, Hq, K), v.reshape(B, T, Hv, V), a, b.sigmoid(),
            initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu, use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias)
        return self.out(o.flatten(2)).square().mean() + ht.square().mean()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph(backend, dynamic):
    torch.manual_seed(0)
    m = _TinyGDN()
    x = torch.randn(1, 150, 32)
    cu = torch.tensor([0, 10, 80, 150], dtype=torch.int32)
    h0 = torch.randn(3, 4, 32, 32, requires_grad=True)

    def run(fn):
        for p in list(m.parameters()) + [h0]:
            p.grad = None
        loss = fn(x, cu, cu.long(), h0)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in m.parameters()] + [h0.grad.clone()]

    torch._dynamo.reset()
    l_eager, g_eager = run(m)
    compiled = torch.compile(m, fullgraph=True, backend=backend, dynamic=dynamic)
    l_comp, g_comp = run(compiled)
    torch.testing.assert_close(l_comp, l_eager, rtol=1e-6, atol=0)
    for a, b in zip(g_comp, g_eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # a second shape: recompiles (static) or reuses the dynamic graph, still right
    x2 = torch.randn(1, 97, 32)
    cu2 = torch.tensor([0, 64, 97], dtype=torch.int32)
    h02 = h0[:2].detach()
    torch.testing.assert_close(compiled(x2, cu2, cu2.long(), h02), m(x2, cu2, cu2.long(), h02), rtol=1e-6, atol=0)


def test_torch_compile_checkpoints_and_inference():
    c = make_case(lengths=[130, 64, 5], Hq=1, Hv=2, K=32, V=32)

    def f(q, k, v, g, beta, cu, cuh):
        return chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=cuh, output_final_state=True,
                                      checkpoint_every=64)

    torch._dynamo.reset()
    with torch.no_grad():
        ref = f(*c.inputs(), c.cu_seqlens, c.cu_seqlens_host)
        out = torch.compile(f, fullgraph=True, backend="aot_eager")(*c.inputs(), c.cu_seqlens, c.cu_seqlens_host)
    for a, b in zip(out, ref):
        assert torch.equal(a, b)


# ---- validation ----------------------------------------------------------------------------------


def _bad_variants(c):
    """(argument named in the message, kwargs overrides for the low-level forward)."""
    B, T, Hq, Hv, K, V = c.dims
    return [
        ("beta", dict(beta=c.beta[:, :, :2])),
        ("g", dict(g=c.g.double())),
        ("k", dict(k=c.k.half())),
        ("v", dict(v=c.v[:, :, :3])),
        ("initial_state", dict(initial_state=c.initial_state[:, :, :, :16])),
        ("initial_state", dict(initial_state=c.initial_state.to(torch.int32))),
        ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 50, 40, T], dtype=torch.int32))),
        ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 50, 80, T - 1], dtype=torch.int32))),
        ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 50, T], dtype=torch.float32))),
        ("state_indices", dict(state_indices=torch.tensor([0, 9, 1], dtype=torch.int32))),
        ("checkpoint_every", dict(checkpoint_every=48)),
        ("scale", dict(scale=float("nan"))),
        ("A_log", dict(use_gate_in_kernel=True)),
        ("o", dict(o=torch.empty(B, T, Hv, V, dtype=torch.float16))),
        ("final_state", dict(final_state=torch.empty(3, Hv, K, V + 1))),
    ]


@pytest.mark.parametrize("i", range(15))
def test_validation_error_names_argument_and_writes_nothing(i):
    c = make_case(lengths=[50, 30, 20], Hq=2, Hv=4, K=32, V=32, dtype=torch.bfloat16)
    B, T, Hq, Hv, K, V = c.dims
    name, bad = _bad_variants(c)[i]
    o = nan_like(c.v)
    ht = torch.full((3, Hv, K, V), float("nan"))
    ck = torch.full((1, Hv, K, V), float("nan"))
    kw = c.lowlevel_kwargs()
    kw.update(cu_seqlens_host=None, output_final_state=True, checkpoint_every=64, o=o, final_state=ht,
              checkpoints=ck)
    kw.update(bad)
    args = [kw.pop(n) if n in kw else getattr(c, n) for n in ("q", "k", "v", "g", "beta")]
    if name == "state_indices":
        kw["output_final_state"] = False
        kw["final_state"] = None
    with pytest.raises(ValueError) as e:
        chunk_gated_delta_rule_fwd(*args, **kw)
    assert name in str(e.value), str(e.value)
    if name != "o":
        assert torch.isnan(o.float()).all()
    if name != "final_state":
        assert torch.isnan(ht).all()
    assert torch.isnan(ck).all()


def test_backward_validation_writes_nothing():
    c = make_case(B=1, T=40, Hq=1, Hv=2, K=32, V=32)
    dq = nan_like(c.q)
    with pytest.raises(ValueError, match="d_o"):
        chunk_gated_delta_rule_bwd(*c.inputs(), torch.zeros(1, 40, 2, 16), dq=dq)
    assert torch.isnan(dq).all()


def test_functional_validation_errors():
    c = make_case(B=2, T=40, Hq=2, Hv=4, K=32, V=32)
    q, k, v, g, beta = c.inputs()
    with pytest.raises(ValueError, match="beta"):
        chunk_gated_delta_rule(q, k, v, g, beta[..., :3])
    with pytest.raises(ValueError, match="beta"):
        chunk_gated_delta_rule(q, k, v, g, beta[0])
    with pytest.raises(ValueError, match="'v'"):
        chunk_gated_delta_rule(q, k, v[:, :, :3], g[..., :3], beta[..., :3])
    with pytest.raises(ValueError, match="'initial_state'"):
        chunk_gated_delta_rule(q, k, v, g, beta, initial_state=torch.zeros(3, 4, 32, 32))
    with pytest.raises(ValueError, match="q"):
        chunk_gated_delta_rule(q.double(), k, v, g, beta)


def test_cuda_tensors_need_cuda_build():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: nothing to check")
    if flashgdn.has_cuda():
        pytest.skip("this build has the CUDA backend")
    c = make_case(B=1, T=8, Hq=1, Hv=1, K=64, V=64, device="cuda")
    with pytest.raises(NotImplementedError, match="CUDA"):
        chunk_gated_delta_rule(*c.inputs())


# ---- the oracle binding --------------------------------------------------------------------


def test_oracle_binding_checks():
    q = np.zeros((1, 4, 1, 16))
    ok = dict(B=1, T=4, Hq=1, Hv=1, K=16, V=16, q=q, k=q, v=q, g=np.zeros((1, 4, 1)), beta=np.zeros((1, 4, 1)))
    r = _C.reference_forward(**ok)
    assert r["o"].shape == (1, 4, 1, 16) and r["final_state"].shape == (1, 1, 16, 16)
    with pytest.raises(ValueError, match="beta"):
        _C.reference_forward(**(ok | {"beta": np.zeros((1, 3, 1))}))
    with pytest.raises(TypeError, match="bogus"):
        _C.reference_forward(**ok, bogus=1)
    with pytest.raises(TypeError, match="q"):
        _C.reference_forward(**(ok | {"q": "not an array"}))
    with pytest.raises(ValueError, match="cu_seqlens"):
        _C.reference_forward(**ok, cu_seqlens=[0, 3])


def test_oracle_matches_naive_recurrence():
    """The oracle through the binding against a few lines of numpy (section 1 of gdn-math)."""
    c = make_case(lengths=[5, 0, 9], Hq=1, Hv=2, K=16, V=16, dtype=torch.float32, seed=3)
    ref = oracle_forward(c)
    q, k, v, g, beta = (to_f64(x) for x in c.inputs())
    h0 = to_f64(c.initial_state)
    o = np.zeros_like(v)
    scale = 16 ** -0.5
    for n, (_, t0, L) in enumerate(c.seqs()):
        for h in range(2):
            S = h0[n, h].copy()
            for t in range(t0, t0 + L):
                S *= math.exp(g[0, t, h])
                r = v[0, t, h] - S.T @ k[0, t, 0]
                S += beta[0, t, h] * np.outer(k[0, t, 0], r)
                o[0, t, h] = scale * S.T @ q[0, t, 0]
            np.testing.assert_allclose(ref["final_state"][n, h], S, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ref["o"], o, rtol=1e-10, atol=1e-12)


def test_pytest_collects_tests():
    """A guard: this file is collected (a run that collects nothing must fail)."""
    assert True


@pytest.mark.parametrize("varlen", [False, True])
def test_no_tokens(varlen):
    """T == 0 (or only empty sequences): o is empty, each final state is its initial state, and
    the initial state's gradient is the final state's."""
    q = torch.zeros(1 if varlen else 2, 0, 2, 32)
    v = torch.zeros(q.shape[0], 0, 4, 32)
    g = torch.zeros(q.shape[0], 0, 4)
    cu = torch.tensor([0, 0, 0]) if varlen else None
    h0 = torch.randn(2, 4, 32, 32, requires_grad=True)
    o, ht = chunk_gated_delta_rule(q, q, v, g, g, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert o.shape == v.shape and torch.equal(ht, h0)
    dht = torch.randn_like(ht)
    (dh0,) = torch.autograd.grad(ht, [h0], dht)
    assert torch.equal(dh0, dht)
    o, ht = chunk_gated_delta_rule(q, q, v, g, g, output_final_state=True, cu_seqlens=cu)
    assert ht.shape == (2, 4, 32, 32) and torch.all(ht == 0)


def test_precision_keyword():
    """precision selects the CUDA forward's arithmetic; the CPU backend takes every level (it
    computes in float32 always) and refuses anything else, naming the argument."""
    c = make_case(B=1, T=100, Hq=1, Hv=2, K=32, V=32, dtype=torch.bfloat16)
    outs = [chunk_gated_delta_rule(*c.inputs(), precision=p)[0] for p in ("default", "fast", "high")]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    for bad in ("turbo", 1, None):
        with pytest.raises(ValueError, match="precision"):
            chunk_gated_delta_rule(*c.inputs(), precision=bad)
        with pytest.raises(ValueError, match="precision"):
            chunk_gated_delta_rule_fwd(*c.inputs(), precision=bad)


def test_backward_precision_keyword():
    """precision selects the CUDA backward's arithmetic too; the CPU backend takes every level
    (the same gradients: it computes in float32 always) and refuses anything else, naming the
    argument and writing nothing."""
    c = make_case(B=1, T=100, Hq=1, Hv=2, K=32, V=32, dtype=torch.bfloat16, seed=3)
    gen = torch.Generator().manual_seed(4)
    do = torch.randn(c.v.shape, generator=gen).to(c.q.dtype)
    dht = torch.randn(c.initial_state.shape, generator=gen)
    kw = c.lowlevel_kwargs()
    grads = [chunk_gated_delta_rule_bwd(*c.inputs(), do, dht, **kw, precision=p)
             for p in ("default", "fast", "high")]
    for gr in grads[1:]:
        for name, a, b in zip(gr._fields, grads[0], gr):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
    for bad in ("bogus", 1, None):
        dq = torch.full_like(c.q, 7.0)
        dh0 = torch.full_like(c.initial_state, 7.0)
        with pytest.raises(ValueError, match="precision"):
            chunk_gated_delta_rule_bwd(*c.inputs(), do, dht, **kw, dq=dq, dh0=dh0, precision=bad)
        assert torch.all(dq == 7.0) and torch.all(dh0 == 7.0)


def test_backward_context_parallel_keyword():
    """context_parallel and cp_segment split the CUDA backward's reverse pass as the forward's;
    the CPU backend takes every setting (the same gradients: it has no pass to split) and refuses
    anything else, naming the argument and writing nothing."""
    c = make_case(B=1, T=130, Hq=1, Hv=2, K=32, V=32, dtype=torch.bfloat16, seed=5)
    gen = torch.Generator().manual_seed(6)
    do = torch.randn(c.v.shape, generator=gen).to(c.q.dtype)
    dht = torch.randn(c.initial_state.shape, generator=gen)
    kw = c.lowlevel_kwargs()
    ref = chunk_gated_delta_rule_bwd(*c.inputs(), do, dht, **kw)
    for cp, seg in ((False, 0), (True, 64), (None, 128)):
        gr = chunk_gated_delta_rule_bwd(*c.inputs(), do, dht, **kw, context_parallel=cp, cp_segment=seg)
        for name, a, b in zip(gr._fields, ref, gr):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (name, cp, seg)
    for bad in ({"context_parallel": "yes"}, {"cp_segment": 100}, {"cp_segment": -64}):
        dq = torch.full_like(c.q, 7.0)
        with pytest.raises(ValueError, match=next(iter(bad))):
            chunk_gated_delta_rule_bwd(*c.inputs(), do, dht, **kw, dq=dq, **bad)
        assert torch.all(dq == 7.0)


def test_backward_precision_in_the_binding():
    """The C ABI's fgdn_bwd_args.precision through the binding: a code other than 0, 1 or 2 is
    refused by the library's validation with the forward's wording, before anything is written;
    the query refuses it too."""
    c = make_case(B=1, T=70, Hq=1, Hv=2, K=16, V=16, dtype=torch.float32, seed=6, initial_state=False)
    do = torch.randn_like(c.v)
    dq, dk, dv = torch.full_like(c.q, 7.0), torch.full_like(c.k, 7.0), torch.full_like(c.v, 7.0)
    dg, dbeta = torch.full_like(c.g, 7.0), torch.full_like(c.beta, 7.0)
    d = flashgdn._core._desc
    kw = dict(q=d("q", c.q), k=d("k", c.k), v=d("v", c.v), g=d("g", c.g), beta=d("beta", c.beta),
              d_o=d("do", do), dq=d("dq", dq), dk=d("dk", dk), dv=d("dv", dv), dg=d("dg", dg),
              dbeta=d("dbeta", dbeta))
    for bad in (3, 7, -1):
        for fn in (_C.backward, _C.backward_workspace_size):
            with pytest.raises(ValueError, match=r"fgdn_backward: argument 'precision': expected "
                               r"FGDN_PRECISION_DEFAULT \(0\), FGDN_PRECISION_FAST \(1\) or "
                               rf"FGDN_PRECISION_HIGH \(2\), got {bad}"):
                fn(**kw, precision=bad)
        assert all(torch.all(t == 7.0) for t in (dq, dk, dv, dg, dbeta))
    for level in (0, 1, 2):
        assert _C.backward_workspace_size(**kw, precision=level) == 0
    _C.backward(**kw, precision=2)
    assert not torch.all(dq == 7.0)


def test_autograd_backward_takes_the_forward_precision(monkeypatch):
    """The autograd Function runs the backward at the precision the forward was called with
    (on the CPU the gradients are the same at every level)."""
    seen = []
    bwd = flashgdn._core.chunk_gated_delta_rule_bwd

    def spy(*args, **kwargs):
        seen.append(kwargs.get("precision"))
        return bwd(*args, **kwargs)

    monkeypatch.setattr(flashgdn._core, "chunk_gated_delta_rule_bwd", spy)
    c = make_case(B=1, T=80, Hq=1, Hv=2, K=32, V=32, dtype=torch.bfloat16, seed=8)
    grads = {}
    for p in ("default", "high"):
        q, k, v = (x.detach().clone().requires_grad_() for x in (c.q, c.k, c.v))
        h0 = c.initial_state.detach().clone().requires_grad_()
        o, ht = chunk_gated_delta_rule(q, k, v, c.g, c.beta, initial_state=h0, output_final_state=True,
                                       precision=p)
        (o.float().sum() + ht.sum()).backward()
        grads[p] = (q.grad, k.grad, v.grad, h0.grad)
    assert seen == ["default", "high"]
    assert all(torch.equal(a, b) for a, b in zip(grads["default"], grads["high"]))
