"""The float64 oracle for the accuracy check and the relative L2 error.

Uses ``flashgdn.reference`` (the C++ float64 recurrence, ``flashgdn._C.reference_forward`` /
``reference_backward``) when flashgdn imports; otherwise a float64 torch recurrence of its own
(on the GPU, differentiated by autograd):
S~ = exp(g) S; S = S~ + beta k (v - S~^T k)^T; o = scale S^T q, with q and k L2-normalised in
the oracle for inputs of the 'in_kernel' convention (raw q, k), and taken as they are for
'prenormalized' inputs (already normalised by inputs.make_inputs; the gradients are then with
respect to those normalised tensors, as the contenders' are).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .configs import norm_in_call


def rel_l2(x, ref) -> float:
    """||x - ref|| / ||ref|| in float64 (NaN if shapes differ or x holds non-finite values)."""
    if x is None or ref is None:
        return float("nan")
    x = torch.as_tensor(x).detach().to("cpu", torch.float64)
    ref = torch.as_tensor(ref).detach().to("cpu", torch.float64)
    if x.shape != ref.shape:
        return float("nan")
    den = torch.linalg.vector_norm(ref).item()
    num = torch.linalg.vector_norm(x - ref).item()
    return num / den if den > 0 else num


def _torch_recurrence(q, k, v, g, beta, h0, scale, cu, normalize=True):
    """float64 forward of one batch; returns o [B, T, Hv, V] and ht [N, Hv, K, V]. ``normalize``:
    L2-normalise q and k first (the 'in_kernel' convention)."""
    B, T, Hq, Kd = q.shape
    Hv = v.shape[2]
    grp = Hv // Hq
    if normalize:
        q = q / torch.linalg.vector_norm(q, dim=-1, keepdim=True)
        k = k / torch.linalg.vector_norm(k, dim=-1, keepdim=True)
    q = q.repeat_interleave(grp, dim=2)
    k = k.repeat_interleave(grp, dim=2)
    if cu is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        c = [int(x) for x in cu.tolist()]
        spans = [(0, c[n], c[n + 1]) for n in range(len(c) - 1)]
    outs, finals = [[] for _ in range(B)], []
    for n, (b, t0, t1) in enumerate(spans):
        S = h0[n] if h0 is not None else q.new_zeros(Hv, Kd, v.shape[3])
        for t in range(t0, t1):
            S = torch.exp(g[b, t])[:, None, None] * S
            kt = k[b, t]
            r = v[b, t] - torch.einsum("hk,hkv->hv", kt, S)
            S = S + beta[b, t][:, None, None] * kt[:, :, None] * r[:, None, :]
            outs[b].append(scale * torch.einsum("hk,hkv->hv", q[b, t], S))
        finals.append(S)
    o = torch.stack([torch.stack(x) for x in outs])
    return o, torch.stack(finals)


def oracle(inp: Dict, with_grads: bool) -> Dict[str, Optional[torch.Tensor]]:
    """float64 reference: {'o', 'ht'} and, with_grads, {'dq', 'dk', 'dv', 'dg', 'dbeta', 'dh0'}
    for the loss <o, do> + <ht, dht>. Also 'oracle': which implementation answered. The norm is
    the oracle's for 'in_kernel' inputs and absent for 'prenormalized' ones (inp['qk_norm'])."""
    normalize = norm_in_call(inp.get("qk_norm", "in_kernel"))
    try:
        from flashgdn import reference as fref  # noqa: WPS433

        kw = dict(scale=inp["scale"], initial_state=inp["h0"], use_qk_l2norm_in_kernel=normalize,
                  cu_seqlens=inp["cu_host"])
        args = [inp[x].detach() for x in ("q", "k", "v", "g", "beta")]
        f = fref.reference_forward(*args, **kw)
        out = {"o": torch.from_numpy(f["o"]), "ht": torch.from_numpy(f["final_state"]),
               "oracle": "flashgdn.reference (C++ float64)"}
        if with_grads:
            r = fref.reference_backward(*args, inp["do"].detach(), inp["dht"].detach(), **kw)
            for name, key in (("dq", "dq"), ("dk", "dk"), ("dv", "dv"), ("dg", "dg"),
                              ("dbeta", "dbeta"), ("dh0", "dh0")):
                out[name] = torch.from_numpy(r[key]) if r.get(key) is not None else None
        return out
    except Exception as e:  # flashgdn not built (or its reference missing): torch float64
        why = f"{type(e).__name__}: {e}"
    leaves = {x: inp[x].detach().to(torch.float64).requires_grad_(with_grads)
              for x in ("q", "k", "v", "g", "beta", "h0")}
    with torch.enable_grad():
        o, ht = _torch_recurrence(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                                  leaves["h0"], inp["scale"], inp["cu_host"], normalize=normalize)
        out = {"o": o.detach(), "ht": ht.detach(),
               "oracle": f"torch float64 recurrence (flashgdn.reference unavailable: {why[:120]})"}
        if with_grads:
            loss = (o * inp["do"].to(torch.float64)).sum() + (ht * inp["dht"].to(torch.float64)).sum()
            grads = torch.autograd.grad(loss, [leaves[x] for x in ("q", "k", "v", "g", "beta", "h0")])
            for name, gr in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads):
                out[name] = gr.detach()
    return out
