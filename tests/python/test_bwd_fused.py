"""The fused Hopper backward (csrc/sm90/bwd_fused*, issue 36) while it is validated behind
FLASHGDN_BWD_FUSED=1: at precision "fast", bf16, K = V = 128, every gradient against the float64
oracle within the suite's bounds (whole tensor and per (sequence, head) slice), for each option
the backward has; and the same bits on a second run. GPU only."""
import os

import pytest
import torch

from gdn_testutil import (GPU_MARKS, OPTIONS, _rel, bounds_for, check, make_case, oracle_backward, option_kwargs,
                          poisoned_grads)
from flashgdn import chunk_gated_delta_rule_bwd
from flashgdn.reference import to_f64

pytestmark = GPU_MARKS
DEV = "cuda"
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias")


@pytest.fixture(autouse=True)
def fused(monkeypatch):
    monkeypatch.setenv("FLASHGDN_BWD_FUSED", "1")


def backward(c, do, dht):
    """The low-level backward at "fast" into NaN-poisoned buffers (an element not written shows)."""
    return chunk_gated_delta_rule_bwd(*c.inputs(), do, dht, precision="fast", **c.lowlevel_kwargs(),
                                      **poisoned_grads(c))


def inputs_of(c, seed=7):
    B, T, Hq, Hv, K, V = c.dims
    gen = torch.Generator().manual_seed(seed)
    st = (c.N, Hv, V, K) if c.state_v_first else (c.N, Hv, K, V)
    do = torch.randn(c.v.shape, generator=gen).to(device=DEV, dtype=c.q.dtype)
    dht = torch.randn(st, generator=gen).to(DEV)
    return do, dht


def check_grads(c, gr, do, dht, ctx):
    """Every gradient against the oracle within the suite's bounds; dA_log and ddt_bias (the token
    sums that cancel, docs/reliability.md D1: `fast`'s staged backward exceeds 1.2e-2 on some seeds
    too, up to 4.5e-2 on 10 seeds of H200, 2026-11-28) within the bound or 1.5x the staged
    backward's error on the same inputs."""
    bounds = bounds_for(c.q.dtype)
    ref = oracle_backward(c, do, dht)
    staged = None
    for name in GRADS:
        x = getattr(gr, name)
        if ref[name] is None:
            assert x is None, name
            continue
        bound = bounds[name]
        if name in ("dA_log", "ddt_bias"):
            if staged is None:
                os.environ["FLASHGDN_BWD_FUSED"] = "0"
                staged = backward(c, do, dht)
                os.environ["FLASHGDN_BWD_FUSED"] = "1"
            bound = max(bound, 1.5 * _rel(to_f64(getattr(staged, name)), ref[name]))
        check(name, x, ref[name], c, bound, context=f"{ctx} seed={c.seed}")


@pytest.mark.parametrize("opt", ["plain"] + OPTIONS)
def test_fused_options_varlen_gva(opt):
    """Varlen with an empty sequence, one-token and partial chunks; GVA (two value heads a q/k head)."""
    c = make_case(Hq=2, Hv=4, K=128, V=128, lengths=[130, 0, 64, 1, 257], device=DEV,
                  **option_kwargs(opt, 0.07))
    do, dht = inputs_of(c)
    check_grads(c, backward(c, do, dht), do, dht, opt)


@pytest.mark.parametrize("B,T,Hq,Hv", [(2, 300, 2, 4), (1, 1024, 4, 4), (3, 64, 1, 2)])
def test_fused_dense(B, T, Hq, Hv):
    c = make_case(B=B, T=T, Hq=Hq, Hv=Hv, K=128, V=128, device=DEV, l2norm=True)
    do, dht = inputs_of(c)
    check_grads(c, backward(c, do, dht), do, dht, f"dense {B}x{T} {Hq}/{Hv}")


def test_fused_dense_head_first():
    """v and dO stored head-first ([B, H, T, D] memory seen as [B, T, H, D]): the kernel's tile maps
    of the user's tensors in the other dimension order."""
    c = make_case(B=2, T=200, Hq=2, Hv=4, K=128, V=128, device=DEV)
    c.v = c.v.transpose(1, 2).contiguous().transpose(1, 2)
    do, dht = inputs_of(c)
    do = do.transpose(1, 2).contiguous().transpose(1, 2)
    check_grads(c, backward(c, do, dht), do, dht, "head-first v, dO")


def test_fused_state_pool_and_no_dht(monkeypatch):
    """Initial states from a bf16 pool through state_indices (a negative index: its dh0 zero), no
    dht: the gradients against the oracle, dh0 against the staged backward's (same call)."""
    c = make_case(Hq=2, Hv=4, K=128, V=128, lengths=[200, 70, 5], device=DEV, initial_state=False)
    pool = (0.5 * torch.randn(6, 4, 128, 128, device=DEV)).to(torch.bfloat16)
    idx = torch.tensor([4, -1, 1], device=DEV, dtype=torch.int32)
    do, _ = inputs_of(c)
    kw = dict(c.lowlevel_kwargs(), initial_state=pool, state_indices=idx)
    gr = chunk_gated_delta_rule_bwd(*c.inputs(), do, None, precision="fast", **kw)
    monkeypatch.setenv("FLASHGDN_BWD_FUSED", "0")
    staged = chunk_gated_delta_rule_bwd(*c.inputs(), do, None, precision="fast", **kw)
    assert gr.dh0.shape == staged.dh0.shape and bool((gr.dh0[1] == 0).all())
    bounds = bounds_for(c.q.dtype)
    for name in ("dq", "dk", "dv", "dg", "dbeta", "dh0"):
        check(name, getattr(gr, name), to_f64(getattr(staged, name)), c, bounds[name],
              context="pool, against the staged backward")


def test_fused_same_bits():
    c = make_case(Hq=2, Hv=4, K=128, V=128, lengths=[300, 77], device=DEV, l2norm=True, gate_in_kernel=True)
    do, dht = inputs_of(c)
    a, b = backward(c, do, dht), backward(c, do, dht)
    for name in GRADS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None and y is None) or torch.equal(x, y), name
