"""Inputs in the canonical (FLA) layout, with realistic gates.

q, k: [B, T, Hq, K] bf16 from randn; with ``qk_norm='prenormalized'`` each q and k row is then
L2-normalised (in fp32, rounded to bf16) here, outside any timed region, and those normalised
tensors are the inputs (and, with gradients, the leaves); with 'in_kernel' they stay raw and the
calls normalise them. Every other tensor is the same in both conventions (same seed).
v: [B, T, Hv, V] bf16; g: [B, T, Hv] fp32 with g = -A_h * softplus(x + 1), A_h uniform in
[0, 16] per value head and A_0 = 0 (one head that never forgets); beta: [B, T, Hv] fp32 in (0, 1);
h0: [N, Hv, K, V] fp32; cu_seqlens int64 on the device and on the host for packed layouts.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .configs import K, V, Layout, norm_in_call


def make_inputs(Hq: int, Hv: int, layout: Layout, seed: int = 0, device="cuda",
                requires_grad: bool = False, cu: Optional[torch.Tensor] = None,
                with_grads_out: bool = False, qk_norm: str = "in_kernel") -> Dict:
    """One input set. ``cu``: reuse this device cu_seqlens tensor (FlashQLA caches plans by tensor
    identity, so all sets of a cell share one). ``with_grads_out``: also draw do and dht.
    ``qk_norm``: 'in_kernel' (raw q, k) or 'prenormalized' (q, k L2-normalised here)."""
    normalize = not norm_in_call(qk_norm)
    gen = torch.Generator(device=device).manual_seed(1000 + seed)
    B, T, N = layout.B, layout.T, layout.nseq
    f32 = dict(device=device, dtype=torch.float32)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    q = randn(B, T, Hq, K)
    k = randn(B, T, Hq, K)
    if normalize:  # as a user who normalises before the call: fp32 norm, bf16 result
        q, k = (torch.nn.functional.normalize(x.float(), dim=-1).to(x.dtype) for x in (q, k))
    v = randn(B, T, Hv, V)
    A = torch.rand(Hv, generator=gen, **f32) * 16
    A[0] = 0.0
    x = torch.randn(B, T, Hv, generator=gen, **f32)
    g = (-A * torch.nn.functional.softplus(x + 1.0)).contiguous()
    beta = torch.rand(B, T, Hv, generator=gen, **f32).clamp_(1e-3, 1 - 1e-3)
    h0 = 0.1 * torch.randn(N, Hv, K, V, generator=gen, **f32)
    cu_host = None
    if layout.cu_seqlens is not None:
        cu_host = torch.tensor(layout.cu_seqlens, dtype=torch.int64)
        if cu is None:
            cu = cu_host.to(device)
    else:
        cu = None
    d = dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0, cu=cu, cu_host=cu_host, layout=layout,
             Hq=Hq, Hv=Hv, scale=K ** -0.5, qk_norm=qk_norm)
    if requires_grad:
        for name in ("q", "k", "v", "g", "beta", "h0"):
            d[name].requires_grad_(True)
    if with_grads_out:
        d["do"] = randn(B, T, Hv, V)
        d["dht"] = 0.1 * torch.randn(N, Hv, K, V, generator=gen, **f32)
    return d


def set_bytes(d: Dict) -> int:
    """Bytes of one set's inputs and outputs (o and the final state), for sizing the rotation."""
    n = sum(d[x].numel() * d[x].element_size() for x in ("q", "k", "v", "g", "beta", "h0"))
    return n + d["v"].numel() * 2 + d["h0"].numel() * 4


# ---- the floor (gdn-math section 4) -------------------------------------------------------

FWD_FLOP_PER_TOKEN_HEAD = 181e3
# Backward, counted in bench/README.md: per chunk (C = 64) and value head, 8 products of
# C x K x V (2 recomputing the forward state pass, 2 for the dS carry, dVn, dq, dk, dW) and
# 15 of C x C x K (KK^T, the T-products, P^T dO, dP, dP K, dP^T Q, dA K, dA^T K, the T-chain):
# 8 * 2*64*128*128 + 15 * 2*64*64*128 = 32.5 MFLOP = 508 kFLOP per token and value head.
BWD_FLOP_PER_TOKEN_HEAD = (8 * 2 * 64 * K * V + 15 * 2 * 64 * 64 * K) / 64


def floor_counts(Hq: int, Hv: int, layout: Layout, mode: str):
    """(FLOPs, bytes) that the call must do / move at least."""
    T, N = layout.total, layout.nseq
    qk = 2 * T * Hq * K * 2          # q and k, bf16
    vv = T * Hv * V * 2              # one [T, Hv, V] bf16 tensor
    gb = 2 * T * Hv * 4              # g and beta, fp32
    st = N * Hv * K * V * 4          # one state set, fp32
    fwd_bytes = qk + 2 * vv + gb + 2 * st            # read q k v g beta h0, write o ht
    bwd_bytes = 2 * qk + 3 * vv + 2 * gb + 4 * st     # read q k v g beta do h0 dht, write dq dk dv dg dbeta dh0
    fwd_flop = FWD_FLOP_PER_TOKEN_HEAD * T * Hv
    bwd_flop = BWD_FLOP_PER_TOKEN_HEAD * T * Hv
    if mode == "fwd":
        return fwd_flop, fwd_bytes
    if mode == "bwd":
        return bwd_flop, bwd_bytes
    return fwd_flop + bwd_flop, fwd_bytes + bwd_bytes
