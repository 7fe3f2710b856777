"""Differential fuzzing of flashgdn's public call against the float64 oracle (issue 38).

A case is a `Spec`: plain data (JSON), drawn from a seeded generator (`draw`), from which
`build` makes the tensors deterministically (the same spec gives the same inputs on every
device). `run_case` calls the public entry point `flashgdn.chunk_gated_delta_rule` (forward,
and backward through autograd) on the spec's device and compares every output and gradient with
the oracle (`flashgdn.reference`) at the suite's documented bounds (`gdn_testutil.bounds_for`;
a 16-bit state gets the unit roundoff of its dtype on top, docs/api.md "State dtypes"). A
failing spec is shrunk (`shrink`: fewer sequences, tokens, heads and options while it still
fails) and printed as JSON, ready to be added to `fuzz_regressions.json`.

Nothing here depends on the backend: the harness sees the public call only, so it runs the CPU
backend on CPU tensors and the CUDA backend on CUDA tensors. The generator draws from what the
device accepts (float32 q/k/v and K != V on the CPU only).

Run a campaign (also how scripts/gpu_check.sh's `fuzz` step runs it):

    FLASHGDN_FUZZ_CASES=2000 FLASHGDN_FUZZ_SEED=7 python -m pytest tests/python/test_fuzz.py -k cuda

or directly, `python tests/python/gdn_fuzz.py --device cpu --cases 500 --seed 1`.
"""
from __future__ import annotations

import json
import math
import random
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

import flashgdn
from flashgdn.reference import reference_backward, reference_forward, to_f64
from gdn_testutil import Case, bounds_for, check

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Unit roundoff of a stored state's dtype (docs/api.md, "State dtypes").
STATE_U = {"fp32": 0.0, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11}

# Gate regimes, drawn per value head (docs/context-parallel.md: the ones that defeat a warm-up
# shortcut first): no decay, slow constant decay, decay that stops partway (or starts), regions
# alternating between none and strong, realistic gates (A in [0, 16]), strong decay (A = 16),
# and hard resets (g = -inf, and gates below the -128 floor).
GATE_REGIMES = ["zero", "slow", "stops", "starts", "alternating", "realistic", "strong", "reset"]
# Write strengths, per value head: uniform in (0, 1), near 0 (<= 1e-3), exactly 0 at some
# tokens, near 1, up to 2 (the largest value that keeps I - beta k k^T a contraction, FLA's
# allow_neg_eigval range), a mixture of these.
BETA_REGIMES = ["uniform", "near0", "zeros", "near1", "upto2", "mixed"]
# Varlen layouts: an edge mix (0, 1, 63, 64, 65 tokens), very unequal, many short, random, all empty.
LAYOUTS = ["dense", "edge", "unequal", "many_short", "random", "empty"]


@dataclass
class Spec:
    """One fuzz case, as plain data: the shapes, the options of the call and the input regimes.
    Tensors come from `build(spec, device)`, seeded by `seed`."""
    seed: int = 0
    layout: str = "dense"
    lengths: List[int] = field(default_factory=lambda: [64])  # per sequence; dense: B rows of lengths[0]
    Hq: int = 1
    G: int = 1  # Hv = Hq * G
    K: int = 64
    V: int = 64
    dtype: str = "bf16"
    g_dtype: str = "fp32"
    beta_dtype: str = "fp32"
    gates: List[str] = field(default_factory=lambda: ["realistic"])  # per value head
    betas: List[str] = field(default_factory=lambda: ["uniform"])  # per value head
    l2norm: bool = False
    key_norms: str = "unit"  # without l2norm: "unit" or "short" (norm in [0.3, 1]); with: "plain" or "wide"
    gate_in_kernel: bool = False
    dt_bias: bool = False
    h0: Optional[str] = None  # the initial state's dtype, or None
    state_v_first: bool = False
    pool: bool = False  # initial_state is a pool read (and written) through state_indices
    output_final_state: bool = True
    final_state_dtype: Optional[str] = None
    checkpoint_every: int = 0
    precision: str = "default"
    context_parallel: Optional[bool] = None
    cp_segment: int = 0
    scale: Optional[float] = None
    fused: bool = False  # q, k, v (and g, beta) as slices of one projection
    cu_dtype: str = "int32"
    cu_host: bool = False
    beta_sigmoid: int = 0  # 1: use_beta_sigmoid_in_kernel; 2: also allow_neg_eigval
    backward: bool = True
    dht: bool = True
    v_scale: float = 1.0

    @property
    def Hv(self) -> int:
        return self.Hq * self.G

    @property
    def varlen(self) -> bool:
        return self.layout != "dense"

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_dict(d: dict) -> "Spec":
        names = {f.name for f in fields(Spec)}
        return Spec(**{k: v for k, v in d.items() if k in names})

    def classes(self) -> List[str]:
        """The input classes this case belongs to (for the campaign's counts)."""
        out = [f"layout:{self.layout}", f"dtype:{self.dtype}", f"KV:{self.K}x{self.V}",
               f"g_dtype:{self.g_dtype}", f"beta_dtype:{self.beta_dtype}", f"heads:G{self.G}"]
        out += [f"gate:{r}" for r in sorted(set(self.gates))]
        out += [f"beta:{r}" for r in sorted(set(self.betas))]
        if len(set(self.gates)) > 1:
            out.append("gate:per-head-mixture")
        for name in ("l2norm", "gate_in_kernel", "dt_bias", "state_v_first", "pool", "fused", "cu_host"):
            if getattr(self, name):
                out.append(name)
        if self.l2norm:
            out.append(f"keys:{self.key_norms}")
        if self.h0:
            out.append(f"h0:{self.h0}")
        if self.final_state_dtype:
            out.append(f"final_state_dtype:{self.final_state_dtype}")
        if self.checkpoint_every:
            out.append(f"checkpoint_every:{self.checkpoint_every}")
        out.append(f"precision:{self.precision}")
        out.append(f"cp:{self.context_parallel}/{self.cp_segment}")
        if self.scale is not None:
            out.append("scale")
        if self.beta_sigmoid:
            out.append(f"beta_sigmoid:{self.beta_sigmoid}")
        out.append("backward" if self.backward else "forward-only")
        return out


# ---- the generator --------------------------------------------------------------------------------


def _draw_lengths(r: random.Random, layout: str, max_tokens: int) -> List[int]:
    if layout == "dense":
        B = r.choice([1, 1, 2, 3])
        T = r.choice([0, 1, 63, 64, 65, 128, r.randint(1, max_tokens // B)])
        return [min(T, max_tokens // B)] * B
    if layout == "edge":
        out = [r.choice([0, 1, 63, 64, 65, r.randint(2, 130)]) for _ in range(r.randint(2, 6))]
    elif layout == "unequal":
        out = [r.randint(max_tokens // 2, max_tokens)] + [r.choice([0, 1, 2, 5]) for _ in range(r.randint(1, 5))]
        r.shuffle(out)
    elif layout == "many_short":
        out = [r.choice([0, 1, 1, 2, 3, 5, 8]) for _ in range(r.randint(20, 80))]
    elif layout == "random":
        out = [r.randint(0, 160) for _ in range(r.randint(1, 6))]
    else:  # "empty": sequences without tokens only (T = 0)
        out = [0] * r.randint(1, 4)
    while sum(out) > max_tokens:  # keep the case small
        i = max(range(len(out)), key=lambda j: out[j])
        out[i] //= 2
    return out


def draw(seed: int, device: str = "cpu", max_tokens: int = 300) -> Spec:
    """A random case the device accepts, from `seed` alone."""
    r = random.Random(seed)
    cpu = device == "cpu"
    layout = r.choice(LAYOUTS[:-1] * 4 + ["empty"])
    Hq = r.choice([1, 1, 2, 3, 4])
    G = r.choice([1, 1, 2, 3, 4])
    K = r.choice([64, 128])
    V = r.choice([64, 128]) if cpu else K
    dtype = r.choice(["bf16", "bf16", "fp16", "fp32"] if cpu else ["bf16", "bf16", "fp16"])
    Hv = Hq * G
    if r.random() < 0.3:  # every head in one regime (e.g. no decay anywhere)
        gates = [r.choice(GATE_REGIMES)] * Hv
    else:
        gates = [r.choice(GATE_REGIMES) for _ in range(Hv)]
    betas = [r.choice(BETA_REGIMES) for _ in range(Hv)]
    for h in range(Hv):  # strong decay with beta near 0: the pair the warm-up must survive
        if gates[h] == "strong" and r.random() < 0.5:
            betas[h] = "near0"
    l2norm = r.random() < 0.5
    gate_in_kernel = r.random() < 0.35
    h0 = r.choice([None, "fp32", "fp32", "bf16", "fp16"])
    pool = h0 is not None and r.random() < 0.2
    output_final_state = r.random() < 0.8
    checkpoint_every = r.choice([0, 0, 64, 128, 192])
    s = Spec(
        seed=seed, layout=layout, lengths=_draw_lengths(r, layout, max_tokens), Hq=Hq, G=G, K=K, V=V,
        dtype=dtype, g_dtype=r.choice(["fp32", "fp32", "bf16", "fp16"]),
        beta_dtype=r.choice(["fp32", "fp32", "bf16", "fp16"]), gates=gates, betas=betas,
        l2norm=l2norm, key_norms=r.choice(["plain", "wide"] if l2norm else ["unit", "short"]),
        gate_in_kernel=gate_in_kernel, dt_bias=gate_in_kernel and r.random() < 0.7, h0=h0,
        state_v_first=r.random() < 0.25, pool=pool, output_final_state=output_final_state,
        final_state_dtype=(r.choice([None, None, "fp32", "bf16", "fp16"])
                           if output_final_state and not pool else None),
        checkpoint_every=checkpoint_every, precision=r.choice(["default", "fast", "high"]),
        context_parallel=r.choice([None, True, False]), cp_segment=r.choice([0, 0, 64, 128, 256]),
        scale=r.choice([None, None, 0.05, 0.3, 1.0]), fused=r.random() < 0.2,
        cu_dtype=r.choice(["int32", "int64"]), cu_host=r.random() < 0.5,
        beta_sigmoid=r.choice([0, 0, 0, 0, 1, 2]), backward=not pool and r.random() < 0.85,
        dht=r.random() < 0.7, v_scale=r.choice([1.0, 1.0, 0.1, 10.0]),
    )
    if s.beta_sigmoid:  # beta is then sigmoid(the tensor): the regimes are the raw values'
        s.betas = ["uniform"] * Hv
    if s.layout == "dense" and s.lengths[0] == 0 and r.random() < 0.5:
        s.lengths = []  # B = 0
    return s


# ---- building the tensors -----------------------------------------------------------------------


def _runs(gen: torch.Generator, L: int, lo: int, hi: int) -> List[Tuple[int, int]]:
    """[(start, end)] of alternating regions of [0, L), each lo..hi tokens long."""
    out, t = [], 0
    while t < L:
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        out.append((t, min(L, t + n)))
        t += n
    return out


def _gate_profile(gen, regime: str, L: int) -> Tuple[torch.Tensor, float, torch.Tensor]:
    """(decay mask in {0, 1} per token, the head's strength A, the extra-reset mask) of one
    sequence and head: a token with mask 1 decays at strength A (g ~ -A softplus(x)), one with
    mask 0 not at all (g = 0)."""
    on = torch.ones(L)
    reset = torch.zeros(L, dtype=torch.bool)
    u = float(torch.rand((), generator=gen))
    if regime == "zero":
        return torch.zeros(L), 0.0, reset
    if regime == "slow":
        return on, 10.0 ** (-4 + 2 * u), reset
    if regime in ("stops", "starts"):
        cut = int(torch.randint(0, L + 1, (1,), generator=gen)) if L else 0
        on[cut:] = 0.0
        if regime == "starts":
            on = 1.0 - on
        return on, 1.0 + 15.0 * u, reset
    if regime == "alternating":
        first = int(torch.randint(0, 2, (1,), generator=gen))
        for i, (a, b) in enumerate(_runs(gen, L, 1, 80)):
            on[a:b] = float((i + first) % 2)
        return on, 1.0 + 15.0 * u, reset
    if regime == "strong":
        return on, 16.0, reset
    if regime == "reset":
        reset = torch.rand(L, generator=gen) < 0.03
        return on, 16.0 * u, reset
    return on, 16.0 * u, reset  # realistic


def _beta_profile(gen, regime: str, L: int) -> torch.Tensor:
    u = torch.rand(L, generator=gen)
    if regime == "near0":
        return 1e-3 * u
    if regime == "zeros":
        return torch.where(torch.rand(L, generator=gen) < 0.3, torch.zeros(L), u)
    if regime == "near1":
        return 1.0 - 1e-3 * u
    if regime == "upto2":
        return 2.0 * u
    if regime == "mixed":
        pick = torch.randint(0, 4, (L,), generator=gen)
        return torch.stack([u, 1e-3 * u, torch.zeros(L), 2.0 * u])[pick, torch.arange(L)]
    return u.clamp(0.02, 0.98)  # uniform


@dataclass
class Built:
    """The tensors of one case on its device, and what the oracle needs."""
    spec: Spec
    case: Case  # the inputs as the library gets them (gdn_testutil's Case: the checks' slices)
    leaves: Dict[str, torch.Tensor]  # tensors autograd differentiates, by name
    beta_raw: torch.Tensor  # the beta tensor passed (before the sigmoid option)
    kwargs: dict  # the call's keyword arguments
    do: torch.Tensor
    dht: Optional[torch.Tensor]
    pool_before: Optional[torch.Tensor]


def _seq_slices(s: Spec):
    """[(batch row, first token, length)] per sequence."""
    if not s.varlen:
        return [(b, 0, L) for b, L in enumerate(s.lengths)]
    out, t = [], 0
    for L in s.lengths:
        out.append((0, t, L))
        t += L
    return out


def build(s: Spec, device: str) -> Built:
    gen = torch.Generator().manual_seed(s.seed)
    dev = torch.device(device)
    B, T = (1, s.tokens) if s.varlen else (len(s.lengths), s.lengths[0] if s.lengths else 0)
    N = len(s.lengths)
    Hq, Hv, K, V = s.Hq, s.Hv, s.K, s.V
    dt = DTYPES[s.dtype]

    q = torch.randn(B, T, Hq, K, generator=gen)
    k = torch.randn(B, T, Hq, K, generator=gen)
    if s.l2norm:
        if s.key_norms == "wide":  # raw rows of norms 1e-3 .. 1e3, normalised in the kernel
            q = q * 10.0 ** (6 * torch.rand(B, T, Hq, 1, generator=gen) - 3)
            k = k * 10.0 ** (6 * torch.rand(B, T, Hq, 1, generator=gen) - 3)
        else:
            q, k = 3.0 * q, 2.0 * k
    else:
        k = F.normalize(k, dim=-1)
        if s.key_norms == "short":
            k = k * (0.3 + 0.7 * torch.rand(B, T, Hq, 1, generator=gen))
    v = s.v_scale * torch.randn(B, T, Hv, V, generator=gen)

    g = torch.zeros(B, T, Hv)
    beta = torch.zeros(B, T, Hv)
    A_log = dt_bias = None
    if s.gate_in_kernel:
        A_log = torch.zeros(Hv)
        dt_bias = 0.5 * torch.randn(Hv, generator=gen) if s.dt_bias else torch.zeros(Hv)
    for b, t0, L in _seq_slices(s):
        for h in range(Hv):
            on, A, reset = _gate_profile(gen, s.gates[h], L)
            x = torch.randn(L, generator=gen)
            if s.gate_in_kernel:
                # a such that a + dt_bias is x (decaying) or -60 (softplus ~ 1e-26: g ~ 0); A in
                # exp(A_log), A = 0 as exp(-30); a reset as a = +inf.
                A_log[h] = math.log(A) if A > 0 else -30.0
                a = torch.where(on > 0, x, torch.full((L,), -60.0)) - dt_bias[h]
                a[reset] = math.inf
                g[b, t0:t0 + L, h] = a
            else:
                gl = -A * on * F.softplus(x + 1.0)
                gl[reset] = torch.where(torch.rand(int(reset.sum()), generator=gen) < 0.5,
                                        torch.tensor(-math.inf), torch.tensor(-1e4))
                g[b, t0:t0 + L, h] = gl
            if s.beta_sigmoid:
                beta[b, t0:t0 + L, h] = 3.0 * torch.randn(L, generator=gen)
            else:
                beta[b, t0:t0 + L, h] = _beta_profile(gen, s.betas[h], L)
    if s.gate_in_kernel and not s.dt_bias:
        dt_bias = None

    h0 = pool = indices = None
    if s.h0 is not None:
        st = (V, K) if s.state_v_first else (K, V)
        if s.pool:
            P = N + 3
            pool = (0.5 * torch.randn(P, Hv, *st, generator=gen)).to(DTYPES[s.h0])
            rows = torch.randperm(P, generator=gen)[:N]
            if not s.output_final_state and N > 1:  # read-only: several sequences may share a row
                rows[-1] = rows[0]
            rows[torch.rand(N, generator=gen) < 0.25] = -1  # no state: start from zero
            indices = rows.to(torch.int64 if s.cu_dtype == "int64" else torch.int32)
        else:
            h0 = (0.5 * torch.randn(N, Hv, *st, generator=gen)).to(DTYPES[s.h0])

    do = torch.randn(B, T, Hv, V, generator=gen).to(dt)
    st_dt = DTYPES[s.final_state_dtype or "fp32"]
    dht_shape = (N, Hv, V, K) if s.state_v_first else (N, Hv, K, V)
    dht = torch.randn(dht_shape, generator=gen).to(st_dt) if s.dht and s.output_final_state else None

    # On the device, in the storage dtypes; fused: q, k, v (and g, beta) are views of one buffer.
    to = lambda x, d=None: None if x is None else x.to(device=dev, dtype=d or x.dtype)  # noqa: E731
    leaves = {}
    if s.fused:
        qkv = torch.cat([q.reshape(B, T, Hq * K), k.reshape(B, T, Hq * K), v.reshape(B, T, Hv * V)], -1)
        qkv = to(qkv, dt).requires_grad_(s.backward)
        leaves["qkv"] = qkv
        n1, n2 = Hq * K, 2 * Hq * K
        qd = qkv[..., :n1].unflatten(-1, (Hq, K))
        kd = qkv[..., n1:n2].unflatten(-1, (Hq, K))
        vd = qkv[..., n2:].unflatten(-1, (Hv, V))
    else:
        qd, kd, vd = (to(x, dt).requires_grad_(s.backward) for x in (q, k, v))
        leaves.update(q=qd, k=kd, v=vd)
    if s.fused and s.g_dtype == s.beta_dtype:
        gb = to(torch.cat([g, beta], -1), DTYPES[s.g_dtype]).requires_grad_(s.backward)
        leaves["gb"] = gb
        gd, betad = gb[..., :Hv], gb[..., Hv:]
    else:
        gd = to(g, DTYPES[s.g_dtype]).requires_grad_(s.backward)
        betad = to(beta, DTYPES[s.beta_dtype]).requires_grad_(s.backward)
        leaves.update(g=gd, beta=betad)
    A_logd, dt_biasd = to(A_log), to(dt_bias)
    for name, x in (("A_log", A_logd), ("dt_bias", dt_biasd)):
        if x is not None:
            x.requires_grad_(s.backward)
            leaves[name] = x
    h0d = to(h0)
    if h0d is not None:
        h0d.requires_grad_(s.backward)
        leaves["initial_state"] = h0d
    poold, indd = to(pool), to(indices)
    cu = cu_host = None
    if s.varlen:
        cu_host = torch.tensor([0] + list(np.cumsum(s.lengths, dtype=np.int64)), dtype=torch.int64)
        cu = cu_host.to(device=dev, dtype=getattr(torch, s.cu_dtype))

    beta_eff = betad
    if s.beta_sigmoid:  # what the package applies before the kernel (docs/api.md): the oracle's beta
        beta_eff = torch.sigmoid(betad.detach()) * (2 if s.beta_sigmoid == 2 else 1)
    case = Case(q=qd.detach(), k=kd.detach(), v=vd.detach(), g=gd.detach(), beta=beta_eff.detach(),
                cu_seqlens=cu, cu_seqlens_host=cu_host,
                initial_state=poold.clone() if s.pool else (None if h0d is None else h0d.detach()),
                A_log=None if A_logd is None else A_logd.detach(),
                dt_bias=None if dt_biasd is None else dt_biasd.detach(), state_indices=indd,
                scale=s.scale, use_qk_l2norm_in_kernel=s.l2norm, use_gate_in_kernel=s.gate_in_kernel,
                state_v_first=s.state_v_first, lengths=list(s.lengths), seed=s.seed)
    kwargs = dict(scale=s.scale, initial_state=poold if s.pool else h0d, output_final_state=s.output_final_state,
                  use_qk_l2norm_in_kernel=s.l2norm, use_beta_sigmoid_in_kernel=s.beta_sigmoid > 0,
                  allow_neg_eigval=s.beta_sigmoid == 2, state_v_first=s.state_v_first, cu_seqlens=cu,
                  cu_seqlens_cpu=cu_host if s.cu_host else None, use_gate_in_kernel=s.gate_in_kernel,
                  A_log=A_logd, dt_bias=dt_biasd, state_indices=indd, checkpoint_every=s.checkpoint_every,
                  precision=s.precision, context_parallel=s.context_parallel, cp_segment=s.cp_segment,
                  final_state_dtype=DTYPES[s.final_state_dtype] if s.final_state_dtype else None)
    return Built(spec=s, case=case, leaves=leaves, beta_raw=betad, kwargs=kwargs,
                 do=to(do), dht=to(dht), pool_before=None if poold is None else poold.clone())


# ---- one case: call, compare ------------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_case(s: Spec, device: str = "cpu") -> Dict[str, float]:
    """Runs one case; raises AssertionError (or the library's exception) on a failure. Returns
    the measured relative errors by output name."""
    bt = build(s, device)
    c = bt.case
    ctx = f"spec={s.to_json()}"
    bounds = bounds_for(c.q.dtype)
    errs: Dict[str, float] = {}
    grad_ctx = torch.enable_grad() if s.backward else torch.no_grad()
    with grad_ctx:
        out = flashgdn.chunk_gated_delta_rule(_view(bt, "q"), _view(bt, "k"), _view(bt, "v"), _view(bt, "g"),
                                              bt.beta_raw, **bt.kwargs)
    o, ht = out[0], out[1]
    ck = out[2] if s.checkpoint_every else None
    _sync(device)
    assert len(out) == (3 if s.checkpoint_every else 2), f"{len(out)} return values {ctx}"
    assert o.dtype == c.q.dtype and tuple(o.shape) == tuple(c.v.shape), f"o: {o.dtype} {tuple(o.shape)} {ctx}"

    if not s.lengths:  # B = 0 (the oracle needs a batch row): every output is empty
        assert o.numel() == 0 and (ht is None or ht.shape[0] == 0), f"B = 0: {tuple(o.shape)} {ctx}"
        assert ck is None or ck.numel() == 0, f"B = 0: checkpoints {tuple(ck.shape)} {ctx}"
        if s.backward and o.requires_grad:
            torch.autograd.backward([o], [bt.do])
            for name, x in _grads(bt).items():
                assert x is None or x.numel() == 0 or not x.any(), f"B = 0: {name} {ctx}"
        return errs
    ref = reference_forward(*c.inputs(), checkpoint_every=s.checkpoint_every, **c.kwargs())
    errs["o"] = check("o", o, ref["o"], c, bounds["o"], context=ctx)

    state_bound = lambda name, dtype_key: bounds[name] + STATE_U[dtype_key]  # noqa: E731
    if s.pool:
        assert ht is None, f"final_state with a pool {ctx}"
        _check_pool(bt, ref, state_bound("final_state", s.h0), ctx, errs)
    elif s.output_final_state:
        want = DTYPES[s.final_state_dtype or "fp32"]
        assert ht is not None and ht.dtype == want, f"final_state: {None if ht is None else ht.dtype} {ctx}"
        errs["final_state"] = check("final_state", ht, ref["final_state"], c,
                                    state_bound("final_state", s.final_state_dtype or "fp32"), context=ctx)
    else:
        assert ht is None, f"final_state without output_final_state {ctx}"
    if s.checkpoint_every:
        rows = ref["checkpoints"].shape[0]
        assert ck.dtype == torch.float32 and ck.shape[0] >= rows, f"checkpoints: {ck.dtype} {tuple(ck.shape)} {ctx}"
        if rows:
            errs["checkpoints"] = check("checkpoints", ck[:rows], ref["checkpoints"], c, bounds["checkpoints"],
                                        sliced=False, context=ctx)
        assert not ck[rows:].any(), f"checkpoints: rows past the {rows} written are not zero {ctx}"

    if not s.backward:
        return errs
    outs, grads_in = [o], [bt.do]
    if ht is not None and bt.dht is not None:
        outs.append(ht)
        grads_in.append(bt.dht)
    if o.requires_grad:
        torch.autograd.backward(outs, grads_in)
    _sync(device)
    rb = reference_backward(*c.inputs(), bt.do, bt.dht if ht is not None else None, **c.kwargs())
    got = _grads(bt)
    if s.beta_sigmoid:
        # The package applies sigmoid (times 2) as a torch op in beta's dtype: the expected
        # gradient of the raw beta is torch's backward of that op applied to the oracle's dbeta
        # (rounded once to beta's dtype, which _storage_u accounts for).
        raw = bt.beta_raw.detach().clone().requires_grad_(True)
        with torch.enable_grad():
            eff = torch.sigmoid(raw) * (2 if s.beta_sigmoid == 2 else 1)
            want = torch.from_numpy(rb["dbeta"]).to(device=raw.device, dtype=raw.dtype)
            rb["dbeta"] = to_f64(torch.autograd.grad(eff, raw, want)[0])
    for name in ("dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias"):
        want = rb.get(name)
        if want is None:
            continue
        x = got.get(name)
        if not c.q.shape[1] * c.q.shape[0] and x is None:  # no tokens: no graph to a token tensor
            x = torch.zeros(want.shape)
        assert x is not None, f"{name}: no gradient {ctx}"
        bound = bounds[name] + _storage_u(c.q.dtype, x.dtype, name)
        try:
            errs[name] = check(name, x, want, c, bound, context=ctx)
        except AssertionError as e:
            if (name in ("dg", "dA_log", "ddt_bias") and s.gate_in_kernel
                    and _log_gate_passes(bt, bt.dht if ht is not None else None, bounds["dg"])):
                raise KnownDefect("D1", f"{e} (with the gate precomputed, the log-space gate's "
                                        "gradient passes)") from None
            raise
    return errs


# The order in which run_case checks a case's outputs; it raises at the first one that fails.
CHECK_ORDER = ("o", "final_state", "pool", "checkpoints", "dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log",
               "ddt_bias")


def failing_output(message: str) -> Optional[str]:
    """The output a failure's message names (`AssertionError: final_state: relative L2 error ...`,
    `KnownDefect: known defect D1: dA_log: ...`), or None when it names none of CHECK_ORDER."""
    m = re.match(r"(?:\w+: )?(?:known defect \w+: )?(\w+):", message)
    return m.group(1) if m and m.group(1) in CHECK_ORDER else None


def _passes(s: Spec, device: str, output: Optional[str] = None) -> bool:
    """Does the case pass, or, given `output`, pass that output? A case that fails first on an output
    checked after `output` (another known defect's, say: D1's dA_log) has passed `output`."""
    msg = failure(s, device)
    if msg is None:
        return True
    later = failing_output(msg)
    return (output in CHECK_ORDER and later is not None
            and CHECK_ORDER.index(later) > CHECK_ORDER.index(output))


def _fp16_range_explains(s: Spec, device: str, message: str = "") -> bool:
    """D2: on CUDA, a failure of an fp16 call (on the output `message` names) that the same case in
    bf16 (the same values, float32's exponent range for the tensor-core operands the kernel
    computes) does not have."""
    return (device == "cuda" and s.dtype == "fp16"
            and _passes(replace(s, dtype="bf16"), device, failing_output(message)))


def _d5_shape(s: Spec) -> bool:
    """D5's inputs: a backward below `high` with a chunk of at most 4 tokens that starts from a
    nonzero state (a sequence's last chunk after a full one, or its only chunk with an initial
    state), where a dot product over the chunk's few tokens does not average the 16-bit
    intermediates' roundings down (docs/reliability.md, D5)."""
    if not s.backward or s.precision == "high":
        return False
    lengths = s.lengths[:1] if not s.varlen else s.lengths
    return any(0 < n % 64 <= 4 and (n > 64 or s.h0 is not None) for n in lengths)


def _short_chunk_explains(s: Spec, device: str, message: str = "") -> bool:
    """D5: on CUDA, a failure of a call of D5's shape (on the output `message` names) that the same
    case at `high` (split operands: none of those 16-bit intermediates) does not have."""
    return (device == "cuda" and _d5_shape(s)
            and _passes(replace(s, precision="high"), device, failing_output(message)))


class KnownDefect(AssertionError):
    """A failure that a defect of KNOWN_DEFECTS explains."""

    def __init__(self, key: str, message: str):
        super().__init__(f"known defect {key}: {message}")
        self.key = key


def _log_gate_passes(bt: Built, dht, bound: float) -> bool:
    """With the gate in the kernel: does the same problem pass with the gate precomputed, i.e.
    g = -exp(A_log) softplus(a + dt_bias) (float64, rounded to float32) passed as the log-space
    gate? Then a failure of dg, dA_log or ddt_bias is the chain rule's reweighting (D1)."""
    c = bt.case
    a = c.g.double() + (0.0 if c.dt_bias is None else c.dt_bias.double())
    g = (-torch.exp(c.A_log.double()) * F.softplus(a)).float()
    kw = dict(c.kwargs(), use_gate_in_kernel=False, A_log=None, dt_bias=None)
    gr = flashgdn.chunk_gated_delta_rule_bwd(c.q, c.k, c.v, g, c.beta, bt.do, dht,
                                             cu_seqlens_host=c.cu_seqlens_host,
                                             precision=bt.spec.precision, **kw)
    _sync(str(c.q.device))
    rb = reference_backward(c.q, c.k, c.v, g, c.beta, bt.do, dht, **kw)
    try:
        check("dg", gr.dg, rb["dg"], c, bound, context="the same call with the gate precomputed")
    except AssertionError:
        return False
    return True


def _storage_u(call_dtype: torch.dtype, out_dtype: torch.dtype, name: str) -> float:
    """What a bound adds for an output stored in a 16-bit dtype: a state (docs/api.md, "State
    dtypes": the backend's bound plus the unit roundoff of the state's dtype) always; a gradient
    of g or beta in 16 bits when the call is float32 (its bound, 1e-4, is float32 arithmetic with
    float32 outputs; the 16-bit calls' bounds already hold 16-bit outputs)."""
    key = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(out_dtype, "fp32")
    if name in ("final_state", "dh0") or call_dtype == torch.float32:
        return STATE_U[key]
    return 0.0


def _view(bt: Built, name: str) -> torch.Tensor:
    """The tensor passed as `name` (a view of the fused buffer, or the leaf itself)."""
    s = bt.spec
    if name in ("q", "k", "v") and s.fused:
        B, T = bt.leaves["qkv"].shape[:2]
        n1, n2 = s.Hq * s.K, 2 * s.Hq * s.K
        x = bt.leaves["qkv"]
        return {"q": x[..., :n1].unflatten(-1, (s.Hq, s.K)), "k": x[..., n1:n2].unflatten(-1, (s.Hq, s.K)),
                "v": x[..., n2:].unflatten(-1, (s.Hv, s.V))}[name]
    if name == "g" and "gb" in bt.leaves:
        return bt.leaves["gb"][..., :s.Hv]
    return bt.leaves[name]


def _grads(bt: Built) -> Dict[str, Optional[torch.Tensor]]:
    s, L = bt.spec, bt.leaves
    out = {}
    if s.fused:
        gq = L["qkv"].grad
        n1, n2 = s.Hq * s.K, 2 * s.Hq * s.K
        if gq is not None:
            out["dq"] = gq[..., :n1].unflatten(-1, (s.Hq, s.K))
            out["dk"] = gq[..., n1:n2].unflatten(-1, (s.Hq, s.K))
            out["dv"] = gq[..., n2:].unflatten(-1, (s.Hv, s.V))
    else:
        out.update(dq=L["q"].grad, dk=L["k"].grad, dv=L["v"].grad)
    if "gb" in L:
        ggb = L["gb"].grad
        if ggb is not None:
            out["dg"], out["dbeta"] = ggb[..., :s.Hv], ggb[..., s.Hv:]
    else:
        out.update(dg=L["g"].grad, dbeta=L["beta"].grad)
    for name, leaf in (("dh0", "initial_state"), ("dA_log", "A_log"), ("ddt_bias", "dt_bias")):
        if leaf in L:
            out[name] = L[leaf].grad
    return out


def _check_pool(bt: Built, ref: dict, bound: float, ctx: str, errs: dict) -> None:
    """A pool after the call: each sequence's row (non-negative index) holds its final state
    when the call writes the pool; every other row, and every row of a read-only call, is
    bitwise what it was."""
    s, c = bt.spec, bt.case
    pool, before = bt.kwargs["initial_state"].cpu(), bt.pool_before.cpu()
    idx = [int(i) for i in c.state_indices.cpu().tolist()]
    written = [i for i in idx if i >= 0] if s.output_final_state else []
    others = [r for r in range(pool.shape[0]) if r not in written]
    bits = torch.int32 if pool.dtype == torch.float32 else torch.int16
    assert torch.equal(pool[others].view(bits), before[others].view(bits)), f"pool rows not selected changed {ctx}"
    seqs = [n for n, i in enumerate(idx) if i >= 0 and s.output_final_state]
    if seqs:
        # The check's (sequence, head) slices of the selected sequences: a case of their lengths.
        lens = [s.lengths[n] for n in seqs]
        sub = Case(q=torch.zeros(1, sum(lens), 1, 1), k=c.k, v=c.v, g=c.g, beta=c.beta, lengths=lens,
                   cu_seqlens=torch.tensor([0] + list(np.cumsum(lens, dtype=np.int64))))
        got = pool[[idx[n] for n in seqs]]
        errs["pool"] = check("final_state", got, ref["final_state"][seqs], sub, bound, context=f"pool {ctx}")


# ---- known defects ---------------------------------------------------------------------------

# Defects the fuzzer found that are not fixed yet (docs/reliability.md, "Defects found"): a
# failure they explain is counted apart, not as a new failure. Each has its regression case in
# fuzz_regressions.json, marked xfail(strict) there, so the fix shows as an XPASS to clear.
KNOWN_DEFECTS = {
    "D1": ("use_gate_in_kernel: dg (the gradient of the activation a), dA_log and ddt_bias exceed "
           "their bound when a sequence mixes tokens of ~no decay (a + dt_bias << 0) with decaying "
           "ones: the log-space gate's gradient has an error absolute to its largest entries (float32 "
           "cancellation; e.g. -1.9e-7 where it is exactly 0, at a sequence's first token without an "
           "initial state), which the chain factor -exp(A_log) sigmoid(a + dt_bias) keeps where it "
           "is O(1) and removes where the true values are (~1e-26)"),
    "D2": ("CUDA, fp16 q/k/v, `fast`: where a (sequence, head)'s updates are tiny (beta near 0, keys of "
           "tiny norm), the operands the kernel computes and rounds to fp16 for the tensor cores "
           "(beta-weighted values, corrected values) fall in fp16's subnormal range: that slice's state "
           "and outputs carry up to ~30% relative error (absolute errors stay at the size of those "
           "tiny updates). The same case in bf16 passes (found by the first GPU campaign, 2026-11-27)"),
    "D3": ("CUDA `fast`, bf16, beta = 2 on every token (each update the reflection I - 2 k k^T, no "
           "decay to damp rounding): o's relative error 6.3e-3 against the forward's 6e-3 bound "
           "(test_extreme.py::test_beta_extremes[2.0-cuda], 2026-11-27)"),
    "D5": ("CUDA backward below `high`: a chunk of a few tokens that starts from a nonzero state (one "
           "token with an initial state; 65 tokens): dq, dk, dbeta or dg above their bound (dk 1.02e-2 "
           "against 8e-3) from the 16-bit intermediates (V_new, the staged S0, the WY operands), whose "
           "roundings a dot product over so few tokens does not average down; `high` passes "
           "(found by the H200 campaign of 2026-11-28; cause: docs/reliability.md)"),
}


# ---- the shrinker -------------------------------------------------------------------------------


def failure(s: Spec, device: str) -> Optional[str]:
    """None if the case passes, else the failure's message."""
    try:
        run_case(s, device)
    except Exception as e:  # noqa: BLE001 - any exception of a valid call is a failure
        return f"{type(e).__name__}: {e}"
    return None


def _smaller(s: Spec) -> List[Spec]:
    """Candidate simplifications of a spec, the most drastic first."""
    out = []
    L = s.lengths
    if s.varlen:
        for i in range(len(L)):
            if len(L) > 1:
                out.append(replace(s, lengths=L[:i] + L[i + 1:]))
        if len(L) > 2:
            out.append(replace(s, lengths=L[: len(L) // 2]))
            out.append(replace(s, lengths=L[len(L) // 2:]))
    elif len(L) > 1:
        out.append(replace(s, lengths=L[:-1]))
    for i, n in enumerate(L):
        for m in (n // 2, n - 64, n - 1):
            if 0 <= m < n:
                new = list(L)
                new[i] = m
                if not s.varlen:
                    new = [m] * len(L)
                out.append(replace(s, lengths=new))
    if s.Hq > 1:
        out.append(_heads(s, 1, s.G))
    if s.G > 1:
        out.append(_heads(s, s.Hq, 1))
    if s.K != 64:
        out.append(replace(s, K=64, V=64 if s.V == s.K else s.V))
    if s.V != 64 and s.V != s.K:
        out.append(replace(s, V=64))
    simpler = dict(backward=False, dht=False, pool=False, fused=False, state_v_first=False, checkpoint_every=0,
                   beta_sigmoid=0, scale=None, final_state_dtype=None, precision="default",
                   context_parallel=None, cp_segment=0, cu_host=False, cu_dtype="int32", dt_bias=False,
                   gate_in_kernel=False, l2norm=False, h0=None, g_dtype="fp32", beta_dtype="fp32",
                   v_scale=1.0, output_final_state=False)
    for name, value in simpler.items():
        if getattr(s, name) != value:
            new = replace(s, **{name: value})
            if name == "l2norm":
                new.key_norms = "unit"
            if name == "h0":
                new.pool = False
            if name == "gate_in_kernel":
                new.dt_bias = False
            out.append(new)
    for h in range(s.Hv):
        for r in ("zero", "realistic"):
            if s.gates[h] != r and s.gates[h] not in ("zero",):
                out.append(replace(s, gates=s.gates[:h] + [r] + s.gates[h + 1:]))
        if s.betas[h] != "uniform":
            out.append(replace(s, betas=s.betas[:h] + ["uniform"] + s.betas[h + 1:]))
    return out


def _heads(s: Spec, Hq: int, G: int) -> Spec:
    Hv = Hq * G
    keep = [h for h in range(s.Hv) if (h // s.G) < Hq and (h % s.G) < G][:Hv]
    return replace(s, Hq=Hq, G=G, gates=[s.gates[h] for h in keep], betas=[s.betas[h] for h in keep])


def shrink(s: Spec, device: str, is_failing: Optional[Callable[[Spec], bool]] = None,
           budget: int = 300) -> Tuple[Spec, int]:
    """Greedy shrinking: takes the first simpler spec that still fails, until none does or the
    budget of runs is spent. Returns (the smallest failing spec, runs used)."""
    if is_failing is None:
        is_failing = lambda x: failure(x, device) is not None  # noqa: E731
    runs = 0
    progress = True
    while progress and runs < budget:
        progress = False
        for cand in _smaller(s):
            runs += 1
            if is_failing(cand):
                s, progress = cand, True
                break
            if runs >= budget:
                break
    return s, runs


# ---- a campaign ---------------------------------------------------------------------------------


@dataclass
class Report:
    device: str
    seed: int
    cases: int = 0
    seconds: float = 0.0
    classes: Counter = field(default_factory=Counter)
    worst: Dict[str, float] = field(default_factory=dict)
    failures: List[dict] = field(default_factory=list)
    known: Counter = field(default_factory=Counter)  # failures explained by KNOWN_DEFECTS

    def summary(self) -> str:
        lines = [f"fuzz on {self.device}: {self.cases} cases from seed {self.seed} in {self.seconds:.1f} s, "
                 f"{len(self.failures)} failing" +
                 (f" (and known defects: {dict(self.known)})" if self.known else "")]
        lines.append("worst relative L2 error per output: " +
                     ", ".join(f"{k} {v:.2e}" for k, v in sorted(self.worst.items())))
        lines.append("cases per class: " + ", ".join(f"{k} {v}" for k, v in sorted(self.classes.items())))
        for f in self.failures:
            lines.append(f"FAILING (seed {f['seed']}): {f['error'][:400]}")
            lines.append(f"  minimal case ({f['shrink_runs']} shrink runs): {f['minimal']}")
            lines.append(f"  its failure: {f['minimal_error'][:400]}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return dict(device=self.device, seed=self.seed, cases=self.cases, seconds=self.seconds,
                    classes=dict(self.classes), worst=self.worst, failures=self.failures,
                    known=dict(self.known))


def campaign(device: str, cases: int, seed: int = 0, max_tokens: int = 300,
             time_limit: Optional[float] = None, shrink_budget: int = 300) -> Report:
    """`cases` random cases from seeds seed * 1_000_003 + i; failures shrunk. time_limit (s) stops
    early (the report says how many ran)."""
    rep = Report(device=device, seed=seed)
    t0 = time.time()
    for i in range(cases):
        if time_limit is not None and time.time() - t0 > time_limit:
            break
        s = draw(seed * 1_000_003 + i, device, max_tokens)
        rep.cases += 1
        rep.classes.update(s.classes())
        try:
            errs = run_case(s, device)
            for k, v in errs.items():
                rep.worst[k] = max(rep.worst.get(k, 0.0), v)
        except Exception as e:  # noqa: BLE001
            if isinstance(e, KnownDefect):
                rep.known[e.key] += 1
                continue
            err = f"{type(e).__name__}: {e}"
            if isinstance(e, AssertionError) and _fp16_range_explains(s, device, err):
                rep.known["D2"] += 1
                continue
            if isinstance(e, AssertionError) and _short_chunk_explains(s, device, err):
                rep.known["D5"] += 1
                continue
            small, runs = shrink(s, device, budget=shrink_budget)
            rep.failures.append(dict(seed=s.seed, spec=asdict(s), error=err, minimal=small.to_json(),
                                     minimal_error=failure(small, device) or "(passes now)", shrink_runs=runs))
    rep.seconds = time.time() - t0
    return rep


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--cases", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds: start no case after this (the report says how many ran)")
    p.add_argument("--json", help="write the report here")
    a = p.parse_args(argv)
    rep = campaign(a.device, a.cases, a.seed, a.max_tokens, time_limit=a.time_limit)
    print(rep.summary())
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep.to_json(), f, indent=1)
    return 1 if rep.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
