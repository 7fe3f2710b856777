"""flashgdn: gated delta rule (GDN) chunked prefill, forward and backward, on CPU and CUDA.

    from flashgdn import chunk_gated_delta_rule
    o, final_state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                            output_final_state=True, cu_seqlens=cu_seqlens)

``chunk_gated_delta_rule`` takes FLA 0.6's call (fla.ops.gated_delta_rule: its positional order
and keywords) and is differentiable and torch.compile-able (custom ops ``torch.ops.flashgdn.*``).
``chunk_gated_delta_rule_fwd`` / ``chunk_gated_delta_rule_bwd`` are the low-level passes without
autograd (optionally into preallocated outputs). ``flashgdn.engines`` takes vLLM's and SGLang's
prefill calls as written. ``flashgdn.reference`` is the float64 oracle (needs numpy).

When FLA >= 0.6 is installed, flashgdn registers as a backend of FLA's ``chunk_gated_delta_rule``
as soon as FLA loads its backend registry (``flashgdn.fla_backend``; ``FLASHGDN_FLA_BACKEND=0``
turns it off).
Importing flashgdn needs torch and nothing else (not numpy, not FLA).
"""
from . import _C
from ._core import (
    GDNGrads,
    checkpoint_offsets,
    checkpoint_rows,
    chunk_gated_delta_rule_bwd,
    chunk_gated_delta_rule_fwd,
    has_cuda,
)
from .ops import chunk_gated_delta_rule
from . import engines, fla_backend

# The bundled library's version: built from the same VERSION file as the wheel's metadata, and
# always that of the code imported (also from a --target install on PYTHONPATH, where
# importlib.metadata may find another installed copy's dist-info first).
__version__ = _C.version()
chunk_gdn = chunk_gated_delta_rule


def library_version() -> str:
    """The version string of the loaded libflashgdn."""
    return _C.version()


__all__ = [
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_fwd",
    "chunk_gated_delta_rule_bwd",
    "chunk_gdn",
    "GDNGrads",
    "checkpoint_offsets",
    "checkpoint_rows",
    "has_cuda",
    "library_version",
    "engines",
    "fla_backend",
    "__version__",
]

fla_backend.register_if_installed()
