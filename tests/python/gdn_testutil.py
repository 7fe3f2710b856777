"""Shared helpers of the Python tests: realistic random inputs, the float64 oracle, error checks.

Errors are relative L2 errors ||x - ref|| / ||ref|| over a whole tensor, and per (sequence, head)
slice for sequences of at least 64 tokens. Every measured error is printed and recorded; with
FLASHGDN_ERROR_LOG set, conftest.py writes the records there as JSON at the end of the session.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flashgdn
from flashgdn import chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd
from flashgdn.reference import reference_backward, reference_forward, to_f64

# The marks of a test that needs the GPU: `pytest -m gpu` selects it; it skips with a reason
# where there is no CUDA device or no CUDA backend.
GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)"),
    pytest.mark.skipif(not flashgdn.has_cuda(), reason="flashgdn was built without the CUDA backend"),
]
GPU = pytest.param("cuda", marks=GPU_MARKS)
# Tests parametrised over both backends.
DEVICES = ["cpu", GPU]

# Records of every check: {"test", "tensor", "rel_l2", "worst_slice", "bound", ...}.
ERROR_RECORDS: List[dict] = []

# Bounds of the issue (whole tensor); per (sequence, head) slices get twice these.
BOUNDS_LOWP = {"o": 6e-3, "final_state": 6e-3, "checkpoints": 6e-3, "dq": 8e-3, "dk": 8e-3, "dv": 8e-3,
               "dbeta": 8e-3, "dh0": 8e-3, "dg": 1.2e-2, "dA_log": 1.2e-2, "ddt_bias": 1.2e-2}
# float32 inputs (CPU backend only): float32 arithmetic throughout.
BOUNDS_FP32 = {k: 1e-4 for k in BOUNDS_LOWP}
# Tensors checked per (sequence, head) slice too.
SLICED = ("o", "dq", "dk", "dv", "final_state", "dh0")


def bounds_for(dtype: torch.dtype) -> Dict[str, float]:
    return BOUNDS_FP32 if dtype == torch.float32 else BOUNDS_LOWP


def fused_backward_taken(dtype: torch.dtype, K: int, V: int, precision: str = "default",
                         gate_in_kernel: bool = False) -> bool:
    """Whether the CUDA backward takes the fused kernel (csrc/sm90/bwd_fused.cu,
    fused_backward_applies): `fast` and `default`, bf16, K = V = 128 (at `default` not with the
    gate in the kernel), unless FLASHGDN_BWD_FUSED reads as 0 (std::atoi, as the library reads it)."""
    if gate_in_kernel and precision == "default":
        return False
    e = os.environ.get("FLASHGDN_BWD_FUSED")
    m = re.match(r"\s*([+-]?\d+)", e or "")
    off = e is not None and (m is None or int(m.group(1)) == 0)
    return not off and precision != "high" and dtype == torch.bfloat16 and K == 128 and V == 128


@dataclass
class Case:
    """One problem: inputs (torch, on `device`) and the options of the call."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    cu_seqlens: Optional[torch.Tensor] = None
    cu_seqlens_host: Optional[torch.Tensor] = None
    initial_state: Optional[torch.Tensor] = None
    A_log: Optional[torch.Tensor] = None
    dt_bias: Optional[torch.Tensor] = None
    state_indices: Optional[torch.Tensor] = None
    scale: Optional[float] = None
    use_qk_l2norm_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    state_v_first: bool = False
    lengths: List[int] = field(default_factory=list)
    seed: int = 0

    @property
    def dims(self):
        B, T, Hq, K = self.q.shape
        return B, T, Hq, self.v.shape[2], K, self.v.shape[3]

    @property
    def N(self) -> int:
        return len(self.lengths)

    def seqs(self):
        """[(batch row, first token, length)] per sequence."""
        B, T = self.q.shape[:2]
        if self.cu_seqlens is None:
            return [(b, 0, T) for b in range(B)]
        cu = self.cu_seqlens.cpu().tolist()
        return [(0, cu[n], cu[n + 1] - cu[n]) for n in range(len(cu) - 1)]

    def kwargs(self) -> dict:
        """Keyword arguments shared by the flashgdn calls and the oracle."""
        return dict(scale=self.scale, initial_state=self.initial_state,
                    use_qk_l2norm_in_kernel=self.use_qk_l2norm_in_kernel, cu_seqlens=self.cu_seqlens,
                    use_gate_in_kernel=self.use_gate_in_kernel, A_log=self.A_log, dt_bias=self.dt_bias,
                    state_v_first=self.state_v_first, state_indices=self.state_indices)

    def lowlevel_kwargs(self) -> dict:
        kw = self.kwargs()
        kw["cu_seqlens_host"] = self.cu_seqlens_host
        return kw

    def inputs(self):
        return self.q, self.k, self.v, self.g, self.beta


# Named option sets of the option tests (CPU and GPU): make_case keywords for each.
OPTIONS = ["no_initial_state", "l2norm", "gate", "gate_no_dt_bias", "scale", "v_first", "bf16_gates", "fp16_gates",
           "int64_cu", "all"]


def option_kwargs(opt: str, scale: float) -> dict:
    kw = {}
    if opt == "no_initial_state":
        kw["initial_state"] = False
    if opt in ("l2norm", "all"):
        kw["l2norm"] = True
    if opt in ("gate", "gate_no_dt_bias", "all"):
        kw["gate_in_kernel"] = True
        kw["dt_bias"] = opt != "gate_no_dt_bias"
    if opt in ("scale", "all"):
        kw["scale"] = scale
    if opt in ("v_first", "all"):
        kw["state_v_first"] = True
    if opt == "bf16_gates":
        kw["g_dtype"] = kw["beta_dtype"] = torch.bfloat16
    if opt == "fp16_gates":
        kw["g_dtype"] = kw["beta_dtype"] = torch.float16
    if opt == "int64_cu":
        kw["cu_dtype"] = torch.int64
    return kw


def make_case(B: int = 1, T: int = 0, Hq: int = 2, Hv: int = 4, K: int = 64, V: int = 64,
              dtype=torch.bfloat16, device="cpu", lengths: Optional[Sequence[int]] = None,
              initial_state: bool = True, l2norm: bool = False, gate_in_kernel: bool = False,
              dt_bias: bool = True, scale: Optional[float] = None, state_v_first: bool = False,
              g_dtype=torch.float32, beta_dtype=torch.float32, seed: Optional[int] = None,
              cu_dtype=torch.int32) -> Case:
    """Random inputs with realistic gates: per value head A in [0, 16] with head 0 at A = 0 (no
    decay), g = -A * softplus(x + 1); keys unit-norm (or raw with l2norm), beta in (0, 1).
    lengths: varlen pack (B = 1, T = sum); else B dense sequences of T tokens. seed None: fresh."""
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, dtype=torch.float32)

    if lengths is not None:
        lengths = [int(x) for x in lengths]
        B, T = 1, sum(lengths)
        cu_host = torch.tensor([0] + list(np.cumsum(lengths)), dtype=torch.int64)
    else:
        lengths = [T] * B
        cu_host = None
    q = randn(B, T, Hq, K)
    k = randn(B, T, Hq, K)
    if l2norm:
        q, k = q * 3.0, k * 2.0  # raw: normalised in the kernel
    else:
        k = F.normalize(k, dim=-1)
    v = randn(B, T, Hv, V)
    beta = rand(B, T, Hv).clamp_(0.02, 0.98)
    A_log = dtb = None
    if gate_in_kernel:
        A = 1.0 + 15.0 * rand(Hv)
        A_log = torch.log(A)
        A_log[0] = -12.0  # A ~ 6e-6: (almost) no decay
        g = randn(B, T, Hv)  # the raw activation a
        dtb = 0.5 * randn(Hv) if dt_bias else None
    else:
        A = 16.0 * rand(Hv)
        A[0] = 0.0
        g = -A * F.softplus(randn(B, T, Hv) + 1.0)
    h0 = 0.5 * randn(len(lengths), Hv, K, V) if initial_state else None
    if h0 is not None and state_v_first:
        h0 = h0.transpose(-1, -2).contiguous()

    dev = torch.device(device)
    to = lambda x, dt=None: None if x is None else x.to(device=dev, dtype=dt or x.dtype).contiguous()  # noqa: E731
    return Case(
        q=to(q, dtype), k=to(k, dtype), v=to(v, dtype), g=to(g, g_dtype), beta=to(beta, beta_dtype),
        cu_seqlens=None if cu_host is None else cu_host.to(device=dev, dtype=cu_dtype),
        cu_seqlens_host=cu_host, initial_state=to(h0), A_log=to(A_log), dt_bias=to(dtb),
        scale=scale, use_qk_l2norm_in_kernel=l2norm, use_gate_in_kernel=gate_in_kernel,
        state_v_first=state_v_first, lengths=lengths, seed=gen.initial_seed(),
    )


def oracle_forward(c: Case, checkpoint_every: int = 0) -> dict:
    return reference_forward(*c.inputs(), checkpoint_every=checkpoint_every, **c.kwargs())


def oracle_backward(c: Case, do, dht=None) -> dict:
    return reference_backward(*c.inputs(), do, dht, **c.kwargs())


def _tiny(dtype) -> float:
    """Smallest normal number of a storage dtype (float16: 6.1e-5; bfloat16/float32: 1.2e-38)."""
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return float(torch.finfo(dtype).tiny)
    return float(torch.finfo(torch.float32).tiny)


def _overflow(dtype) -> float:
    """The magnitude from which a value rounds to infinity in a storage dtype: its largest finite
    value plus half a unit in the last place there (float16: 65520)."""
    fi = torch.finfo(dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32)
    return float(fi.max) + 0.5 * float(fi.eps) * 2.0 ** math.floor(math.log2(float(fi.max)))


def _rel(x: np.ndarray, ref: np.ndarray, floor: float = 0.0) -> float:
    """||x - ref|| / max(||ref||, floor)."""
    d = float(np.linalg.norm((x - ref).ravel()))
    n = max(float(np.linalg.norm(ref.ravel())), floor)
    if n == 0.0:
        return 0.0 if d == 0.0 else math.inf
    return d / n


# A (sequence, head) slice's error is relative to max(||ref_slice||, SLICE_FLOOR * its share of
# ||ref|| (||ref|| * sqrt(slice size / size)), smallest normal of the dtype * sqrt(slice size)):
# slices whose true values lie 12 orders of magnitude below the rest of the tensor (e.g. the
# initial-state gradient of a strongly decaying head when only the final state is used: e^-500)
# cannot be represented in float32 and carry no information; everything above is checked.
SLICE_FLOOR = 1e-12


def _slices(name: str, shape, c: Case, min_len: int = 64):
    """(label, index) per (sequence, head) slice of a tensor, sequences of >= min_len tokens."""
    out = []
    seqs = c.seqs()
    if name in ("final_state", "dh0"):
        for n, (_, _, L) in enumerate(seqs):
            if L >= min_len:
                for h in range(shape[1]):
                    out.append((f"seq{n}/h{h}", (n, h)))
    elif len(shape) == 4:  # [B, T, H, D]
        for n, (b, t0, L) in enumerate(seqs):
            if L >= min_len:
                for h in range(shape[2]):
                    out.append((f"seq{n}/h{h}", (b, slice(t0, t0 + L), h)))
    return out


def check(name: str, x, ref: np.ndarray, c: Case, bound: float, sliced: Optional[bool] = None,
          context: str = "") -> float:
    """Asserts every element of x is finite, the whole-tensor relative L2 error <= bound and,
    for SLICED tensors, every (sequence, head) slice of >= 64 tokens <= 2 * bound. An element
    whose exact value lies beyond x's dtype (|ref| >= _overflow: e.g. an fp16 dk of 7.8e4 from a
    key of norm 1e-2, dk scaling as 1 / ||k|| through the in-kernel norm) must instead be the
    largest finite value or infinity with ref's sign, and is then compared as ref (it is the
    rounded exact value)."""
    xa = to_f64(x)
    assert xa.shape == ref.shape, f"{name}: shape {xa.shape}, oracle {ref.shape}"
    over = np.abs(ref) >= _overflow(getattr(x, "dtype", None))
    if over.any():
        dt = getattr(x, "dtype", None)
        top = float(torch.finfo(dt if isinstance(dt, torch.dtype) and dt.is_floating_point else torch.float32).max)
        ok = (np.sign(xa[over]) == np.sign(ref[over])) & (np.abs(xa[over]) >= top)
        assert ok.all(), (f"{name}: {int((~ok).sum())} of the {int(over.sum())} elements beyond the dtype's "
                          f"range are not its largest value or infinity with the oracle's sign {context}")
        xa = np.where(over, ref, xa)
    n_bad = int(np.size(xa) - np.isfinite(xa).sum())
    assert n_bad == 0, f"{name}: {n_bad} non-finite elements (of {xa.size}) {context}"
    tiny = _tiny(getattr(x, "dtype", None))
    err = _rel(xa, ref, tiny * math.sqrt(max(ref.size, 1)))
    total = float(np.linalg.norm(ref.ravel()))
    worst, worst_at = 0.0, ""
    if sliced is None:
        sliced = name in SLICED
    if sliced:
        for label, idx in _slices(name, ref.shape, c):
            r = ref[idx]
            floor = max(SLICE_FLOOR * total * math.sqrt(r.size / ref.size), tiny * math.sqrt(r.size))
            e = _rel(xa[idx], r, floor)
            if e > worst:
                worst, worst_at = e, label
    rec = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0], "tensor": name,
           "rel_l2": err, "worst_slice": worst if sliced else None, "worst_slice_at": worst_at or None,
           "bound": bound, "dtype": str(getattr(x, "dtype", "")), "shape": list(xa.shape),
           "context": context}
    ERROR_RECORDS.append(rec)
    print(f"[err] {name:12s} rel_l2={err:.3e} worst_slice={worst:.3e} {worst_at:12s} bound={bound:.1e} {context}")
    assert err <= bound, f"{name}: relative L2 error {err:.3e} > {bound:.1e} {context}"
    if sliced:
        assert worst <= 2 * bound, (f"{name}: relative L2 error {worst:.3e} on slice {worst_at} "
                                    f"> {2 * bound:.1e} {context}")
    return err


def loss_and_grads(fn, leaves):
    """[loss, grad of each leaf] of loss = fn(*leaves), gradients cleared first (eager or compiled
    fn alike)."""
    for x in leaves:
        x.grad = None
    loss = fn(*leaves)
    loss.backward()
    return [loss.detach()] + [x.grad.clone() for x in leaves]


def nan_like(x: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
    return torch.full(tuple(shape if shape is not None else x.shape), float("nan"),
                      dtype=dtype or x.dtype, device=x.device)


def poisoned_grads(c: Case) -> dict:
    """The backward's gradient buffers for c, filled with NaN (an element the library does not
    write shows)."""
    grads = dict(dq=nan_like(c.q), dk=nan_like(c.k), dv=nan_like(c.v), dg=nan_like(c.g), dbeta=nan_like(c.beta))
    if c.initial_state is not None:
        grads["dh0"] = nan_like(c.initial_state)
    if c.use_gate_in_kernel:
        grads["dA_log"] = nan_like(c.A_log)
        if c.dt_bias is not None:
            grads["ddt_bias"] = nan_like(c.dt_bias)
    return grads


def lowlevel_fwd_bwd(c: Case, checkpoint_every: int = 0, output_final_state: bool = True,
                     seed: Optional[int] = None):
    """Forward and backward through the low-level API, into outputs and gradient buffers
    poisoned with NaN (so an element the library does not write shows). do, dht random."""
    B, T, Hq, Hv, K, V = c.dims
    kw = c.lowlevel_kwargs()
    st_shape = (c.N, Hv, V, K) if c.state_v_first else (c.N, Hv, K, V)
    o = nan_like(c.v, dtype=c.q.dtype)
    ht = nan_like(c.v, st_shape, torch.float32) if output_final_state else None
    o2, ht2, ck = chunk_gated_delta_rule_fwd(*c.inputs(), output_final_state=output_final_state,
                                             checkpoint_every=checkpoint_every, o=o, final_state=ht, **kw)
    assert o2 is o and ht2 is ht
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    do = torch.randn(o.shape, generator=gen).to(device=o.device, dtype=o.dtype)
    dht = torch.randn(st_shape, generator=gen).to(o.device) if output_final_state else None
    grads = poisoned_grads(c)
    gr = chunk_gated_delta_rule_bwd(*c.inputs(), do, dht, **kw, **grads)
    for name, buf in grads.items():
        assert getattr(gr, name) is buf, name
    return o, ht, ck, do, dht, gr


def check_all(c: Case, o, ht, do, dht, gr, ctx: str = ""):
    """o, the final state and every gradient against the oracle (bounds_for the dtype)."""
    ctx = f"{ctx} seed={c.seed}".strip()
    bounds = bounds_for(c.q.dtype)
    ref = oracle_forward(c)
    check("o", o, ref["o"], c, bounds["o"], context=ctx)
    if ht is not None:
        check("final_state", ht, ref["final_state"], c, bounds["final_state"], context=ctx)
    rb = oracle_backward(c, do, dht)
    for name in ("dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias"):
        x = getattr(gr, name)
        if rb[name] is None:
            assert x is None, name
            continue
        check(name, x, rb[name], c, bounds[name], context=ctx)
