"""flashgdn: gated delta rule (GDN) chunked prefill, forward and backward, on CPU and CUDA.

    from flashgdn import chunk_gated_delta_rule
    o, final_state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                            output_final_state=True, cu_seqlens=cu_seqlens)

``chunk_gated_delta_rule`` follows FLA's signature (fla.ops.gated_delta_rule) and is
differentiable and torch.compile-able (custom ops ``torch.ops.flashgdn.*``).
``chunk_gated_delta_rule_fwd`` / ``chunk_gated_delta_rule_bwd`` are the low-level passes without
autograd (optionally into preallocated outputs). ``flashgdn.reference`` is the float64 oracle.
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
    "__version__",
]
