"""The contenders, each behind one small adapter.

An adapter converts the canonical inputs (inputs.make_inputs) to its own layout outside the
timed region (``convert``), calls the operator (``call`` -> raw outputs), and maps the raw
outputs back to (o [B, T, Hv, V], final state [N, Hv, K, V]) for the accuracy check
(``canon``). ``grad_leaves`` names the tensors that autograd differentiates with respect to
(the canonical leaves: no contender converts a differentiable input). Every call passes
scale = K^-0.5, the initial state, output_final_state=True and use_qk_l2norm_in_kernel as the
inputs' q/k convention says (``qk_norm``: True for 'in_kernel', False for 'prenormalized',
whose q and k inputs.make_inputs normalised).

A contender that does not import gives Unavailable (its cells say "not installed: ..."); one that
refuses a cell up front returns the reason from ``refuses``; an exception at call time becomes a
"refused" or "failed" cell (calls.classify).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from typing import Dict, Optional

import torch

from .configs import Cell, norm_in_call


class Unavailable(Exception):
    pass


def _dist_version(*names: str) -> str:
    from importlib import metadata

    for n in names:
        try:
            return metadata.version(n)
        except Exception:
            pass
    return "?"


class Contender:
    name = "?"
    has_backward = True
    tunes_on_first_call = False  # times candidate kernels on its first call per shape (autotuning)
    graph_note = ""  # why CUDA graphs may not apply, filled in by the run

    def load(self) -> None:
        raise NotImplementedError

    def version(self) -> str:
        return "?"

    def refuses(self, cell: Cell) -> Optional[str]:
        if cell.mode != "fwd" and not self.has_backward:
            return f"{self.name} has no backward"
        return None

    def convert(self, inp: Dict) -> Dict:
        return inp

    def call(self, x: Dict):
        raise NotImplementedError

    def canon(self, out, x: Dict):
        o, ht = out
        return o, ht


def _norm(x: Dict) -> bool:
    """use_qk_l2norm_in_kernel for this converted input set."""
    return norm_in_call(x.get("qk_norm", "in_kernel"))


class FlashGDN(Contender):
    name = "flashgdn"
    precision = "default"  # the level its calls take (--flashgdn-precision), the forward's and the backward's
    # Its context parallelism (--flashgdn-cp: None automatic, True on, False off; --flashgdn-cp-segment),
    # the forward's and, through autograd, the backward's reverse pass.
    context_parallel = None
    cp_segment = 0

    def load(self):
        try:
            import flashgdn  # noqa: WPS433
            self.mod = flashgdn
        except Exception as e:
            raise Unavailable(f"{type(e).__name__}: {e}")

    def version(self):
        v = getattr(self.mod, "__version__", "?")
        try:
            v += f" (lib {self.mod.library_version()})"
        except Exception:
            pass
        return v

    def call(self, x):
        return self.mod.chunk_gated_delta_rule(
            x["q"], x["k"], x["v"], x["g"], x["beta"], scale=x["scale"], initial_state=x["h0"],
            output_final_state=True, use_qk_l2norm_in_kernel=_norm(x), cu_seqlens=x["cu"],
            cu_seqlens_cpu=x["cu_host"], precision=self.precision, context_parallel=self.context_parallel,
            cp_segment=self.cp_segment)


class FlashQLA(Contender):
    name = "flashqla"

    def load(self):
        try:
            import flash_qla  # noqa: WPS433
            self.mod = flash_qla
        except Exception as e:
            raise Unavailable(f"{type(e).__name__}: {e}")

    def version(self):
        return (f"flash-qla {getattr(self.mod, '__version__', _dist_version('flash-qla'))}, "
                f"tilelang {_dist_version('tilelang')}")

    def call(self, x):
        return self.mod.chunk_gated_delta_rule(
            x["q"], x["k"], x["v"], x["g"], x["beta"], scale=x["scale"], initial_state=x["h0"],
            output_final_state=True, use_qk_l2norm_in_kernel=_norm(x), cu_seqlens=x["cu"])


class FLA(Contender):
    name = "fla"
    tunes_on_first_call = True  # Triton's autotuner: the harness keeps the GPU to itself meanwhile

    def load(self):
        os.environ["FLA_DISABLE_BACKEND_DISPATCH"] = "1"  # time FLA's own Triton kernels
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: WPS433
            self.fn = chunk_gated_delta_rule
        except Exception as e:
            raise Unavailable(f"{type(e).__name__}: {e}")

    def version(self):
        import triton

        return f"fla-core {_dist_version('fla-core')}, triton {triton.__version__}, FLA_DISABLE_BACKEND_DISPATCH=1"

    def call(self, x):
        return self.fn(
            x["q"], x["k"], x["v"], x["g"], x["beta"], scale=x["scale"], initial_state=x["h0"],
            output_final_state=True, use_qk_l2norm_in_kernel=_norm(x), cu_seqlens=x["cu"],
            cu_seqlens_cpu=x["cu_host"])


def _import_flashinfer_gdn():
    """flashinfer.gdn_prefill, without flashinfer/__init__ (which imports every module it has,
    some needing packages the GDN path does not) when the plain import fails."""
    try:
        return importlib.import_module("flashinfer.gdn_prefill"), "package import"
    except Exception as e:
        first = f"{type(e).__name__}: {e}"
    for m in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")]:
        del sys.modules[m]
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("flashinfer not found")
    pkg = types.ModuleType("flashinfer")
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__spec__ = spec
    pkg.__file__ = spec.origin
    pkg.__version__ = _dist_version("flashinfer-python", "flashinfer")
    sys.modules["flashinfer"] = pkg
    try:
        return importlib.import_module("flashinfer.gdn_prefill"), f"module import (package import failed: {first[:160]})"
    except Exception as e:
        raise Unavailable(f"{type(e).__name__}: {e} (package import: {first[:200]})")


class FlashInfer(Contender):
    """flashinfer.gdn_prefill.chunk_gated_delta_rule: packed [T, H, D] without a batch axis,
    cu_seqlens required, linear gate alpha = exp(g) fp32, state [N, H, V, K]; forward only. Its
    use_qk_l2norm_in_kernel is a separate normalisation pass before the kernel (timed with the
    call in the 'in_kernel' convention; 'prenormalized' is its native call, no pass)."""

    name = "flashinfer"
    has_backward = False

    def load(self):
        self.mod, self.how = _import_flashinfer_gdn()

    def version(self):
        return (f"flashinfer-python {_dist_version('flashinfer-python', 'flashinfer')}, "
                f"nvidia-cutlass-dsl {_dist_version('nvidia-cutlass-dsl', 'nvidia-cutlass-dsl-libs-base')}, "
                f"imported by {self.how}")

    def convert(self, inp):
        lay = inp["layout"]
        B, T = inp["q"].shape[:2]
        flat = lambda t: t.detach().reshape(B * T, *t.shape[2:]).contiguous()  # noqa: E731
        cu = inp["cu"]
        if cu is None:
            cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int64, device=inp["q"].device)
        return dict(q=flat(inp["q"]), k=flat(inp["k"]), v=flat(inp["v"]),
                    alpha=flat(inp["g"]).exp().float(), beta=flat(inp["beta"]).float(),
                    h0=inp["h0"].detach().transpose(-1, -2).contiguous(), cu=cu,
                    scale=inp["scale"], max_seqlen=int(lay.max_len), B=B, T=T,
                    qk_norm=inp.get("qk_norm", "in_kernel"))

    def call(self, x):
        return self.mod.chunk_gated_delta_rule(
            x["q"], x["k"], x["v"], g=x["alpha"], beta=x["beta"], scale=x["scale"],
            initial_state=x["h0"], output_final_state=True, cu_seqlens=x["cu"],
            use_qk_l2norm_in_kernel=_norm(x), max_seqlen=x["max_seqlen"])

    def canon(self, out, x):
        o, ht = out
        return o.reshape(x["B"], x["T"], *o.shape[1:]), ht.transpose(-1, -2)


ALL = {"flashgdn": FlashGDN, "flashqla": FlashQLA, "flashinfer": FlashInfer, "fla": FLA}
PEERS = ("flashqla", "flashinfer", "fla")
