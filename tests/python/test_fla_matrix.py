"""FLA's own test matrix of the chunked gated delta rule, run on flashgdn (issue 17).

The parameter lists, input distributions and tolerances are FLA's (fla-org/flash-linear-attention,
tests/ops/test_gated_delta.py at commit 0a8cd55: `test_chunk` and `test_chunk_varlen`); the
reference here is flashgdn's float64 oracle instead of FLA's float32 one, and the error measure
is FLA's (root-mean-square of the difference over root-mean-square of the reference, which is
the relative L2 error). Every case runs on the CPU backend and, where there is one, on the GPU.

Head dims flashgdn does not run (K = V = 100 anywhere; 32 and 256 on CUDA, whose kernels take
64 and 128) must be refused with a message that names what is supported, and nothing else.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flashgdn
from flashgdn.reference import reference_backward, reference_forward, to_f64
from gdn_testutil import DEVICES, _rel


# FLA's lists (test_gated_delta.py, not COMPILER_MODE).
FLA_B = 2
FLA_T = [1, 15, 63, 300]
FLA_H = 2
FLA_D = [64, 32, 100, 256]
FLA_GATE_NORMALIZER = [1, 0.1, 10]
FLA_SCALE = [1, 0.1]
FLA_MASK_P = [0, 0.5]
FLA_CU_SEQLENS = [0, 122, 229, 400, 1000]

# FLA's tolerances per tensor (same order as its assert_close calls).
CHUNK_TOL = {"o": 0.005, "ht": 0.005, "dq": 0.008, "dk": 0.008, "dv": 0.008, "dbeta": 0.02, "dg": 0.02,
             "dh0": 0.008}
VARLEN_TOL = {"o": 0.005, "ht": 0.005, "dq": 0.007, "dk": 0.008, "dv": 0.007, "dbeta": 0.015, "dg": 0.015,
              "dh0": 0.007}


def supported(device: str, D: int) -> bool:
    return D in ((64, 128) if device == "cuda" else (16, 32, 64, 128, 256))


def err_ratio(x: torch.Tensor, ref: np.ndarray) -> float:
    """FLA's measure: RMS(x - ref) / RMS(ref) (0 when both are zero)."""
    xa = to_f64(x)
    assert xa.shape == ref.shape, f"shape {xa.shape}, reference {ref.shape}"
    assert np.isfinite(xa).all(), "non-finite elements"
    return _rel(xa, ref)


def run_and_compare(device, q, k, v, g, beta, h0, scale, cu_seqlens, tol, dg_rule=False):
    """flashgdn through FLA's call (forward, then the backward of sum(o do) + sum(ht dht)) against
    the float64 oracle, each tensor within FLA's tolerance. ``dg_rule``: FLA's test_chunk checks dg
    only where its reference dg has a norm above 0.01 (and its caller only for normalizers >= 1)."""
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(v.shape, generator=gen).to(v.dtype)
    dht = torch.randn(h0.shape, generator=gen).to(torch.float32)
    leaves = [x.to(device).requires_grad_() for x in (q, k, v, g, beta, h0)]
    cu = None if cu_seqlens is None else cu_seqlens.to(device)
    o, ht = flashgdn.chunk_gated_delta_rule(*leaves[:5], scale=scale, initial_state=leaves[5],
                                            output_final_state=True, cu_seqlens=cu)
    assert o.dtype == q.dtype and ht.dtype == torch.float32  # FLA's return types
    grads = torch.autograd.grad((o, ht), leaves, (do.to(device), dht.to(device)))
    args = dict(scale=scale, initial_state=h0, cu_seqlens=cu_seqlens)
    ref = reference_forward(q, k, v, g, beta, **args)
    rb = reference_backward(q, k, v, g, beta, do, dht, **args)
    got = {"o": (o, ref["o"]), "ht": (ht, ref["final_state"])}
    for name, gr in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads):
        got[name] = (gr, rb[name])
    errors = {}
    for name, (x, r) in got.items():
        if name == "dg" and dg_rule and float(np.linalg.norm(r)) <= 0.01:
            continue
        errors[name] = err_ratio(x, r)
    bad = {n: e for n, e in errors.items() if e > tol[n]}
    assert not bad, f"over FLA's tolerance: {bad} (all: {errors})"


def expect_refusal(device, q, k, v, g, beta, h0, scale, cu_seqlens=None):
    D = q.shape[-1]
    with pytest.raises((ValueError, RuntimeError, NotImplementedError)) as e:
        flashgdn.chunk_gated_delta_rule(q.to(device), k.to(device), v.to(device), g.to(device), beta.to(device),
                                        scale=scale, initial_state=h0.to(device), output_final_state=True,
                                        cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(device))
    msg = str(e.value)
    assert str(D) in msg and ("64" in msg and "128" in msg), f"refusal of K = V = {D} names no supported dims: {msg}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_p", FLA_MASK_P)
@pytest.mark.parametrize("scale", FLA_SCALE)
@pytest.mark.parametrize("gate_logit_normalizer", FLA_GATE_NORMALIZER)
@pytest.mark.parametrize("D", FLA_D)
@pytest.mark.parametrize("T", FLA_T)
def test_fla_chunk_matrix(T, D, gate_logit_normalizer, scale, mask_p, device):
    """FLA's test_chunk: fp16 q/k/v/beta (beta all ones), fp32 g = logsigmoid(u) / normalizer with
    a fraction mask_p of gates zeroed, k L2-normalised outside the kernel, zero fp32 h0."""
    torch.manual_seed(42)
    B, H, dtype = FLA_B, FLA_H, torch.float16
    q = torch.randn(B, T, H, D, dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, D, dtype=torch.float32), p=2, dim=-1).to(dtype)
    v = torch.randn(B, T, H, D, dtype=dtype)
    beta = torch.rand(B, T, H, dtype=dtype).sigmoid().fill_(1)
    g = F.logsigmoid(torch.rand(B, T, H, dtype=torch.float32)) / gate_logit_normalizer
    g = g * (torch.rand_like(g) > mask_p)
    h0 = torch.zeros(B, H, D, D, dtype=torch.float32)
    if not supported(device, D):
        expect_refusal(device, q, k, v, g, beta, h0, scale)
        return
    tol = CHUNK_TOL if gate_logit_normalizer >= 1 else {**CHUNK_TOL, "dg": float("inf")}  # FLA: dg unchecked
    run_and_compare(device, q, k, v, g, beta, h0, scale, None, tol, dg_rule=True)


@pytest.mark.parametrize("device", DEVICES)
def test_fla_chunk_varlen_matrix(device):
    """FLA's test_chunk_varlen: four sequences packed in one row, fp16 everywhere (g, beta and the
    initial states included), half the gates zeroed, K = V = 128."""
    torch.manual_seed(42)
    H, D, dtype, scale, mask_p = 2, 128, torch.float16, 1.0, 0.5
    cu_seqlens = torch.tensor(FLA_CU_SEQLENS, dtype=torch.int64)
    T, N = FLA_CU_SEQLENS[-1], len(FLA_CU_SEQLENS) - 1
    q = torch.randn(1, T, H, D, dtype=dtype)
    k = F.normalize(torch.randn(1, T, H, D, dtype=torch.float32), p=2, dim=-1).to(dtype)
    v = torch.randn(1, T, H, D, dtype=dtype)
    g = F.logsigmoid(torch.rand(1, T, H, dtype=dtype))
    g = g * (torch.rand_like(g) > mask_p)
    beta = torch.rand(1, T, H, dtype=dtype).sigmoid()
    h0 = torch.randn(N, H, D, D, dtype=dtype)
    run_and_compare(device, q, k, v, g, beta, h0, scale, cu_seqlens, VARLEN_TOL)
