"""The float64 oracle (reference/gdn_reference.cpp) with the package's conventions.

``reference_forward`` / ``reference_backward`` take torch tensors or numpy arrays in the layouts
of ``flashgdn.chunk_gated_delta_rule`` (any dtype; converted to float64) and return dicts of
float64 numpy arrays. The oracle runs its (sequence, value head) pairs on every core
(FLASHGDN_NUM_THREADS overrides the thread count) and the binding releases the GIL.

State options are mapped onto the oracle's plain [N, Hv, K, V] states here: ``state_v_first``
transposes, ``state_indices`` gathers each sequence's initial state from the pool (zero for a
negative index); the returned ``final_state`` and ``dh0`` are per sequence, [N, Hv, K, V]
(or [N, Hv, V, K] with ``state_v_first``).

numpy is needed here only (the binding returns the oracle's results as numpy arrays); ``import
flashgdn`` does not import this module, and the package does not require numpy
(its ``oracle`` extra, ``pip install ".[oracle]"`` from a clone, adds it).
"""
from __future__ import annotations

from typing import Optional

try:
    import numpy as np
except ImportError as e:  # numpy is optional for flashgdn; the oracle needs it (the oracle extra)
    raise ImportError("flashgdn.reference (the float64 oracle) needs numpy, which flashgdn does not "
                      "require: pip install numpy (or the 'oracle' extra: pip install \".[oracle]\" in a clone)") from e

from . import _C

__all__ = ["reference_forward", "reference_backward", "to_f64"]


def to_f64(x) -> Optional[np.ndarray]:
    """A C-contiguous float64 numpy copy of a torch tensor / numpy array (None stays None)."""
    if x is None:
        return None
    if hasattr(x, "detach"):  # torch.Tensor
        import torch

        x = x.detach().to(device="cpu", dtype=torch.float64).numpy()
    return np.ascontiguousarray(np.asarray(x, dtype=np.float64))


def _seqs(B: int, T: int, cu_seqlens):
    """[(batch row, first token, length)] per sequence, and cu_seqlens as a list (or None)."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)], None
    cu = [int(c) for c in (cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else cu_seqlens)]
    return [(0, cu[n], cu[n + 1] - cu[n]) for n in range(len(cu) - 1)], cu


class _Prep:
    def __init__(self, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
                 use_gate_in_kernel, A_log, dt_bias, state_v_first, state_indices):
        q, k, v = to_f64(q), to_f64(k), to_f64(v)
        B, T, Hq, K = q.shape
        Hv, V = v.shape[2], v.shape[3]
        seqs, cu = _seqs(B, T, cu_seqlens)
        self.N = len(seqs)
        self.v_first = bool(state_v_first)
        self.kw = dict(B=B, T=T, Hq=Hq, Hv=Hv, K=K, V=V, q=q, k=k, v=v, g=to_f64(g), beta=to_f64(beta),
                       scale=float(scale) if scale is not None else None,
                       use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
                       gate_in_kernel=bool(use_gate_in_kernel))
        if cu is not None:
            self.kw["cu_seqlens"] = cu
        if use_gate_in_kernel:
            self.kw["A_log"] = to_f64(A_log)
            if dt_bias is not None:
                self.kw["dt_bias"] = to_f64(dt_bias)
        h0 = self.state_in(to_f64(initial_state))
        if h0 is not None and state_indices is not None:
            idx = [int(i) for i in to_f64(state_indices).astype(np.int64).tolist()]
            pool, h0 = h0, np.zeros((self.N, Hv, K, V))
            for n, i in enumerate(idx):
                if i >= 0:
                    h0[n] = pool[i]
        if h0 is not None:
            self.kw["h0"] = np.ascontiguousarray(h0)

    def state_in(self, s: Optional[np.ndarray]) -> Optional[np.ndarray]:
        if s is None or not self.v_first:
            return s
        return np.ascontiguousarray(np.swapaxes(s, -1, -2))

    def state_out(self, s: Optional[np.ndarray]) -> Optional[np.ndarray]:
        return self.state_in(s)


def reference_forward(q, k, v, g, beta, scale=None, initial_state=None, use_qk_l2norm_in_kernel=False,
                      cu_seqlens=None, *, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                      state_v_first=False, state_indices=None, checkpoint_every=0) -> dict:
    """float64 forward: {'o' [B, T, Hv, V], 'final_state' [N, Hv, K, V], 'checkpoints'
    [sum_n floor(len_n / checkpoint_every), Hv, K, V]}."""
    p = _Prep(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
              use_gate_in_kernel, A_log, dt_bias, state_v_first, state_indices)
    r = _C.reference_forward(**p.kw, checkpoint_every=int(checkpoint_every))
    return {"o": r["o"], "final_state": p.state_out(r["final_state"]),
            "checkpoints": p.state_out(r["checkpoints"])}


def reference_backward(q, k, v, g, beta, do, dht=None, scale=None, initial_state=None,
                       use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, use_gate_in_kernel=False,
                       A_log=None, dt_bias=None, state_v_first=False, state_indices=None) -> dict:
    """float64 backward: {'dq', 'dk', 'dv', 'dg', 'dbeta', 'dh0' (None without initial_state),
    'dA_log', 'ddt_bias' (None without the in-kernel gate / dt_bias)}. dht: gradient of the
    per-sequence final state (None: zero)."""
    p = _Prep(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
              use_gate_in_kernel, A_log, dt_bias, state_v_first, state_indices)
    kw = dict(p.kw, do=to_f64(do))
    if dht is not None:
        kw["dht"] = p.state_in(to_f64(dht))
    r = _C.reference_backward(**kw)
    r["dh0"] = p.state_out(r["dh0"])
    if not (use_gate_in_kernel and dt_bias is not None):
        r["ddt_bias"] = None
    return r
