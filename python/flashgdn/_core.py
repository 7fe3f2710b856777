"""Low-level torch layer over the C ABI: tensor descriptors, output allocation, workspace, stream.

Nothing here is differentiable; ``flashgdn.ops`` builds the autograd-aware, torch.compile-able
operator on top. These functions allocate whatever output the caller does not pass, and write
into the outputs the caller does pass (handy for preallocated / poisoned buffers).
"""
from __future__ import annotations

import operator
import os
import re
import threading
import weakref
from collections import OrderedDict
from contextlib import nullcontext as _nullcontext
from typing import Callable, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from . import _C

__all__ = [
    "chunk_gated_delta_rule_fwd",
    "chunk_gated_delta_rule_bwd",
    "GDNGrads",
    "checkpoint_rows",
    "checkpoint_offsets",
    "has_cuda",
]

_DTYPES = {
    torch.float32: _C.FLOAT32,
    torch.float16: _C.FLOAT16,
    torch.bfloat16: _C.BFLOAT16,
    torch.int32: _C.INT32,
    torch.int64: _C.INT64,
}


# The dtypes a state tensor (initial state or pool, final state, their gradients) may have.
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def has_cuda() -> bool:
    """True if this build of the library has the CUDA backend."""
    return bool(_C.has_cuda())


def _desc(name: str, t: Optional[torch.Tensor]):
    """The (data_ptr, dtype, shape, strides, device_type, device_id) descriptor of a tensor; None
    (absent: ndim 0 at the C ABI) for None. An empty tensor is present, whatever its data_ptr."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")
    code = _DTYPES.get(t.dtype)
    if code is None:
        raise ValueError(
            f"{name}: dtype {t.dtype} is not supported "
            "(flashgdn takes float32, float16, bfloat16, int32 and int64 tensors)"
        )
    dev = t.device
    if dev.type == "cpu":
        dtype, did = _C.CPU, 0
    elif dev.type == "cuda":
        dtype, did = _C.CUDA, dev.index if dev.index is not None else torch.cuda.current_device()
    else:
        raise ValueError(f"{name}: expected a tensor on cpu or cuda, got a tensor on {dev}")
    return (t.data_ptr(), code, tuple(t.shape), tuple(t.stride()), dtype, did)


def _state_desc(name: str, t: Optional[torch.Tensor]):
    """_desc of a state tensor (initial state or pool, final state, their gradients): float32,
    bfloat16 or float16, each in its own dtype."""
    if isinstance(t, torch.Tensor) and t.dtype not in STATE_DTYPES:
        raise ValueError(f"{name}: expected a state of dtype torch.float32, torch.bfloat16 or "
                         f"torch.float16, got {t.dtype}")
    return _desc(name, t)


_INT64_MAX = 2**63 - 1


def _index(name: str, x, lo: int = -_INT64_MAX - 1) -> int:
    """An integer argument, never truncated: an int (or anything with __index__, not a float or a
    bool) in [lo, 2**63)."""
    if isinstance(x, bool):
        raise TypeError(f"{name}: expected an int, got a bool ({x})")
    try:
        i = operator.index(x)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(x).__name__} {x!r}") from None
    if not lo <= i <= _INT64_MAX:
        raise ValueError(f"{name}: expected an int in [{lo}, 2**63), got {i}")
    return i


def _flag(name: str, x) -> bool:
    """A boolean argument: True, False, or an integer 0 or 1 (nothing else is read as a flag)."""
    if isinstance(x, bool):
        return x
    try:
        i = operator.index(x)
    except TypeError:
        i = None
    if i not in (0, 1):
        raise TypeError(f"{name}: expected a bool, got {type(x).__name__} {x!r}")
    return bool(i)


def _scale(x) -> Optional[float]:
    """scale: None (1/sqrt(K), computed by the library) or a real number; the library refuses
    a non-finite one."""
    if x is None:
        return None
    # A number (float, int, numpy or torch scalar), not a bool and not a string that float()
    # would parse.
    if isinstance(x, bool) or not hasattr(type(x), "__float__"):
        raise TypeError(f"scale: expected a float or None, got {type(x).__name__} {x!r}")
    return float(x)


def _need_dims(name: str, t, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {layout}, got shape {tuple(t.shape)}")


def host_seqlens(
    cu_seqlens: Optional[torch.Tensor], cu_seqlens_host: Optional[torch.Tensor]
) -> Optional[torch.Tensor]:
    """cu_seqlens as an int64 CPU tensor: the host hint, cu_seqlens itself when on the CPU,
    or (one host synchronisation) a copy read back from the device."""
    if cu_seqlens is None:
        return None
    if cu_seqlens_host is not None:
        return cu_seqlens_host
    if cu_seqlens.device.type == "cpu":
        return cu_seqlens.to(torch.int64)
    return cu_seqlens.to(device="cpu", dtype=torch.int64)


# Host copies of device cu_seqlens read by earlier calls, for the calls a CUDA graph captures
# (which may not read a device tensor back): per tensor, with its data pointer, version counter
# and shape, so that a tensor changed in place since, or another tensor at the same address,
# finds nothing.
_SEQLENS_SEEN: "OrderedDict[int, tuple]" = OrderedDict()
_SEQLENS_SEEN_MAX = 64
_SEQLENS_LOCK = threading.Lock()  # calls from several threads share the table


def _seqlens_stamp(cu: torch.Tensor) -> tuple:
    try:
        version = cu._version
    except RuntimeError:  # an inference tensor (torch.inference_mode) keeps no version counter
        version = None
    return (cu.data_ptr(), version, tuple(cu.shape), cu.dtype)


def resolve_host_seqlens(q: torch.Tensor, cu_seqlens, cu_seqlens_host, T: int):
    """The host copy of cu_seqlens a CUDA call passes to the library. Given: as it is. A device
    cu_seqlens without one: outside graph capture read back here (the call's one host
    synchronisation, as the library's own read would be) and remembered; under capture, the copy
    remembered from an earlier call with the same, unchanged tensor, else a ValueError before
    anything is enqueued. A copy that is not a valid layout of T tokens is not passed: the
    library reads cu_seqlens itself and names what is wrong."""
    if (cu_seqlens_host is not None or not isinstance(cu_seqlens, torch.Tensor)
            or cu_seqlens.device.type != "cuda" or q.device.type != "cuda"):
        return cu_seqlens_host
    with torch.cuda.device(q.device):  # the call runs on the current stream of q's device
        capturing = torch.cuda.is_current_stream_capturing()
    if capturing:
        with _SEQLENS_LOCK:
            seen = _SEQLENS_SEEN.get(id(cu_seqlens))
            if seen is not None:
                _SEQLENS_SEEN.move_to_end(id(cu_seqlens))
        if seen is None or seen[0]() is not cu_seqlens or seen[1] != _seqlens_stamp(cu_seqlens):
            raise ValueError(
                "cu_seqlens: a call captured in a CUDA graph needs the sequence boundaries on the "
                "host: pass cu_seqlens_cpu= (the host copy), or make one call with this same "
                "tensor, unchanged since, before capturing (flashgdn keeps the copy it read then)")
        return seen[2]
    fresh = cu_seqlens.to(device="cpu", dtype=torch.int64)
    valid = (fresh.dim() == 1 and fresh.numel() >= 1 and int(fresh[0]) == 0 and int(fresh[-1]) == T
             and bool((fresh[1:] >= fresh[:-1]).all()))
    if not valid:
        return None
    with _SEQLENS_LOCK:
        _SEQLENS_SEEN[id(cu_seqlens)] = (weakref.ref(cu_seqlens), _seqlens_stamp(cu_seqlens), fresh)
        _SEQLENS_SEEN.move_to_end(id(cu_seqlens))
        while len(_SEQLENS_SEEN) > _SEQLENS_SEEN_MAX:
            _SEQLENS_SEEN.popitem(last=False)
    return fresh


def checkpoint_rows(B: int, T: int, checkpoint_every: int) -> int:
    """Rows of the checkpoint buffer flashgdn allocates: B * (T // checkpoint_every), an upper
    bound on sum_n floor(len_n / checkpoint_every) (exact for dense batches)."""
    return B * (T // checkpoint_every) if checkpoint_every > 0 else 0


def _num_seqs(B: int, cu_seqlens) -> int:
    """N for allocating per-sequence outputs; never negative, so that a bad cu_seqlens reaches
    the library's validation (which names it) instead of failing in torch.empty."""
    if cu_seqlens is None:
        return B
    return max(cu_seqlens.shape[0] - 1, 0) if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1 else 0


def checkpoint_offsets(cu_seqlens: Union[torch.Tensor, Sequence[int]], checkpoint_every: int) -> torch.Tensor:
    """Row of the checkpoint buffer where each sequence's checkpoints start, [N + 1] int64 on the
    CPU: sequence n's j-th checkpoint (the state after (j + 1) * checkpoint_every of its tokens)
    is row offsets[n] + j; offsets[N] is the number of rows written."""
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int64, device="cpu")
    per_seq = torch.div(cu[1:] - cu[:-1], checkpoint_every, rounding_mode="floor")
    return torch.cat([cu.new_zeros(1), torch.cumsum(per_seq, 0)])


def _state_shape(N: int, Hv: int, K: int, V: int, state_v_first: bool) -> Tuple[int, int, int, int]:
    return (N, Hv, V, K) if state_v_first else (N, Hv, K, V)


def resolve_final_state_dtype(dtype: Optional[torch.dtype] = None,
                              state_indices: Optional[torch.Tensor] = None) -> torch.dtype:
    """The dtype of a final state the library allocates: ``dtype`` when given (float32, bfloat16
    or float16), else float32 whatever the initial state's dtype, as FLA 0.6 returns it
    (docs/api.md, "State dtypes"). With ``state_indices`` the final states go into the pool in
    its own dtype, so ``dtype`` must be None."""
    if dtype is not None:
        if not isinstance(dtype, torch.dtype) or dtype not in STATE_DTYPES:
            raise ValueError("final_state_dtype: expected None, torch.float32, torch.bfloat16 or "
                             f"torch.float16, got {dtype!r}")
        if state_indices is not None:
            raise ValueError("final_state_dtype: must be None with state_indices (the final states "
                             "are written back into the pool, in the pool's dtype)")
        return dtype
    return torch.float32


def grad_state_dtype(initial_state: torch.Tensor) -> torch.dtype:
    """The dtype of the initial state's gradient dh0: the initial state's (what autograd needs)."""
    return initial_state.dtype if initial_state.dtype in STATE_DTYPES else torch.float32


def _check_device(q: torch.Tensor) -> None:
    if q.device.type == "cuda" and not _C.has_cuda():
        raise NotImplementedError(
            "flashgdn: this build has no CUDA backend, so CUDA tensors cannot run "
            "(rebuild with nvcc on PATH, or move the tensors to the CPU)"
        )


def _launch(fn, size_fn, kw: dict, device: torch.device) -> None:
    """Runs a C ABI entry point: on CUDA with a workspace from torch's caching allocator on the
    current stream of the tensors' device; on the CPU directly."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            nbytes = int(size_fn(**kw))
            ws = torch.empty(nbytes, dtype=torch.uint8, device=device) if nbytes > 0 else None
            stream = torch.cuda.current_stream(device).cuda_stream
            fn(**kw, workspace=ws.data_ptr() if ws is not None else 0, workspace_bytes=nbytes,
               stream=stream)
            # ws goes back to the caching allocator, which reuses it only in order on this stream.
    else:
        fn(**kw)


def _inputs(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
            cu_seqlens_host, use_gate_in_kernel, A_log, dt_bias, state_indices, state_v_first,
            check_inputs) -> dict:
    return dict(
        q=_desc("q", q), k=_desc("k", k), v=_desc("v", v), g=_desc("g", g), beta=_desc("beta", beta),
        A_log=_desc("A_log", A_log), dt_bias=_desc("dt_bias", dt_bias),
        cu_seqlens=_desc("cu_seqlens", cu_seqlens),
        cu_seqlens_host=_desc("cu_seqlens_host", cu_seqlens_host),
        initial_state=_state_desc("initial_state", initial_state),
        state_indices=_desc("state_indices", state_indices),
        scale=_scale(scale),
        use_qk_l2norm_in_kernel=_flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel),
        gate_in_kernel=_flag("use_gate_in_kernel", use_gate_in_kernel),
        state_v_first=_flag("state_v_first", state_v_first),
        check_inputs=_flag("check_inputs", check_inputs),
    )


# The C ABI's fgdn_precision codes of the CUDA forward's and backward's arithmetic (docs/api.md).
PRECISIONS = {"default": 0, "fast": 1, "high": 2}


def _precision(value) -> int:
    if not isinstance(value, str) or value not in PRECISIONS:
        raise ValueError(f"precision: expected one of {sorted(PRECISIONS)}, got {value!r}")
    return PRECISIONS[value]


# The C ABI's fgdn_context_parallel codes (docs/context-parallel.md): None is automatic.
def _context_parallel(value) -> int:
    if value is None:
        return 0
    if isinstance(value, bool):
        return 2 if value else 1
    raise ValueError(f"context_parallel: expected None (automatic), True or False, got {value!r}")


def chunk_gated_delta_rule_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    *,
    cu_seqlens_host: Optional[torch.Tensor] = None,
    use_gate_in_kernel: bool = False,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    state_indices: Optional[torch.Tensor] = None,
    state_v_first: bool = False,
    checkpoint_every: int = 0,
    o: Optional[torch.Tensor] = None,
    final_state: Optional[torch.Tensor] = None,
    checkpoints: Optional[torch.Tensor] = None,
    check_inputs: bool = False,
    precision: str = "default",
    final_state_dtype: Optional[torch.dtype] = None,
    context_parallel: Optional[bool] = None,
    cp_segment: int = 0,
    before_launch: Optional[Callable[[], None]] = None,
    saved_states: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Forward pass, no autograd: returns ``(o, final_state, checkpoints)``.

    Arguments as ``flashgdn.chunk_gated_delta_rule``; ``scale=None`` means ``K ** -0.5``.
    ``o``, ``final_state``, ``checkpoints``: optional preallocated outputs, written in place
    with their own strides (never through a copy: a layout the library cannot write is refused);
    the ones not given are allocated. ``final_state`` is None unless ``output_final_state`` and
    no ``state_indices`` (with ``state_indices`` the final states go back into the pool rows of
    ``initial_state``); when allocated here its dtype is ``final_state_dtype``, by default
    float32 whatever the initial state's dtype (FLA's; ``resolve_final_state_dtype``), and a final
    state passed in may have any state dtype (float32, bfloat16, float16), independently of the
    initial state's. ``checkpoints`` (float32) is None unless ``checkpoint_every > 0``; when allocated
    here it has ``checkpoint_rows(B, T, checkpoint_every)`` rows, the rows past the ones written
    (varlen; see ``checkpoint_offsets``) zero. ``check_inputs``: check mode (docs/api.md).
    ``precision``: ``"default"``, ``"fast"`` or ``"high"`` (the CUDA forward's arithmetic;
    docs/api.md). ``context_parallel``: None (automatic), True or False, and ``cp_segment``
    (tokens per segment, a multiple of 64; 0: the cost model's choice): the CUDA forward's
    intra-card context parallelism (docs/context-parallel.md; the CPU ignores them).
    Nothing is written when an argument is rejected (ValueError naming it).
    ``saved_states``: a ``[saved_states_rows(...), Hv, K, V]`` bfloat16 output (contiguous) for
    the chunk-start states the backward of the same call then reads instead of recomputing
    them (``chunk_gated_delta_rule_bwd(saved_states=...)``; CUDA, where the backward takes them;
    written by the forward's ``"fast"`` kernel at ``"fast"``, at ``"default"`` by the one that
    splits the state recurrence's operands, whose o then differs in its last bits from the
    forward without saved states; docs/api.md).
    ``before_launch``: called once every argument but the tensors' values has been validated
    (the workspace query), just before the library runs; the engines' entry points
    (``flashgdn.engines``) check the values they need and zero fresh pool rows there.
    """
    _need_dims("q", q, 4, "[B, T, Hq, K]")
    _need_dims("k", k, 4, "[B, T, Hq, K]")
    _need_dims("v", v, 4, "[B, T, Hv, V]")
    _check_device(q)
    B, T, Hv, V = v.shape
    K = k.shape[-1]
    N = _num_seqs(B, cu_seqlens)
    checkpoint_every = _index("checkpoint_every", checkpoint_every, lo=0)
    output_final_state = _flag("output_final_state", output_final_state)
    cu_seqlens_host = resolve_host_seqlens(q, cu_seqlens, cu_seqlens_host, T)
    kw = _inputs(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
                 cu_seqlens_host, use_gate_in_kernel, A_log, dt_bias, state_indices, state_v_first,
                 check_inputs)
    state_v_first = kw["state_v_first"]
    if o is None:
        o = torch.empty((B, T, Hv, V), dtype=q.dtype, device=q.device)
    want_final = output_final_state and state_indices is None
    ht_dtype = resolve_final_state_dtype(final_state_dtype, state_indices)
    if want_final and final_state is None:
        final_state = torch.empty(_state_shape(N, Hv, K, V, state_v_first), dtype=ht_dtype,
                                  device=q.device)
    zero_tail = None
    if checkpoint_every > 0 and checkpoints is None:
        checkpoints = torch.empty((checkpoint_rows(B, T, checkpoint_every),) + _state_shape(1, Hv, K, V, state_v_first)[1:],
                                  dtype=torch.float32, device=q.device)
        if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device == q.device:
            # The rows past the ones written are zeroed below, from the host copy (on CUDA
            # resolved above, or read here where it was no valid layout: the library refuses it).
            zero_tail = host_seqlens(cu_seqlens, cu_seqlens_host)
    kw.update(
        output_final_state=output_final_state,
        checkpoint_every=checkpoint_every,
        precision=_precision(precision),
        context_parallel=_context_parallel(context_parallel),
        cp_segment=_index("cp_segment", cp_segment, lo=0),
        o=_desc("o", o),
        final_state=_state_desc("final_state", final_state) if want_final else None,
        checkpoints=_desc("checkpoints", checkpoints) if checkpoint_every > 0 else None,
        saved_states=_desc("saved_states", saved_states) if saved_states is not None else None,
    )
    if before_launch is not None:
        with torch.cuda.device(q.device) if q.device.type == "cuda" else _nullcontext():
            _C.forward_workspace_size(**kw)  # validates everything but values, writes nothing
        before_launch()
    _launch(_C.forward, _C.forward_workspace_size, kw, q.device)
    if zero_tail is not None:
        used = int(checkpoint_offsets(zero_tail, checkpoint_every)[-1])
        if used < checkpoints.shape[0]:
            checkpoints[used:].zero_()
    return o, (final_state if want_final else None), (checkpoints if checkpoint_every > 0 else None)


def saved_states_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
                      precision: str = "default", use_gate_in_kernel: bool = False,
                      state_indices: Optional[torch.Tensor] = None, checkpoint_every: int = 0) -> int:
    """Rows of the chunk-start states a forward call may save for its backward (the library's
    fgdn_saved_states_rows, from the shapes alone, so that the operator's fake implementation
    gives the same shape): where the CUDA backward takes the fused kernel (bf16, K = V = 128,
    ``"fast"`` or ``"default"``, not ``"default"`` with the gate in the kernel, unless
    FLASHGDN_BWD_FUSED reads as 0), without a state pool or checkpoints; else 0. The library
    refuses a saved_states tensor of any other row count."""
    if q.device.type != "cuda" or q.dtype != torch.bfloat16 or k.shape[-1] != 128 or v.shape[-1] != 128:
        return 0
    if precision == "high" or (precision == "default" and use_gate_in_kernel):
        return 0
    if state_indices is not None or checkpoint_every > 0:
        return 0
    env = os.environ.get("FLASHGDN_BWD_FUSED")
    m = re.match(r"\s*([+-]?\d+)", env or "")
    if env is not None and (m is None or int(m.group(1)) == 0):
        return 0
    B, T, Hv = v.shape[0], v.shape[1], v.shape[2]
    chunks = -(-T // 64)
    slots = chunks + (cu_seqlens.shape[0] - 1) if cu_seqlens is not None else B * chunks
    if (slots + 1) * Hv * 128 >= 1 << 31:  # the fused kernel's 32-bit unit rows
        return 0
    return slots + 1


class GDNGrads(NamedTuple):
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    dh0: Optional[torch.Tensor]
    dA_log: Optional[torch.Tensor]
    ddt_bias: Optional[torch.Tensor]


def chunk_gated_delta_rule_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    dht: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    *,
    cu_seqlens_host: Optional[torch.Tensor] = None,
    use_gate_in_kernel: bool = False,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    state_indices: Optional[torch.Tensor] = None,
    state_v_first: bool = False,
    need_dh0: Optional[bool] = None,
    dq: Optional[torch.Tensor] = None,
    dk: Optional[torch.Tensor] = None,
    dv: Optional[torch.Tensor] = None,
    dg: Optional[torch.Tensor] = None,
    dbeta: Optional[torch.Tensor] = None,
    dh0: Optional[torch.Tensor] = None,
    dA_log: Optional[torch.Tensor] = None,
    ddt_bias: Optional[torch.Tensor] = None,
    check_inputs: bool = False,
    precision: str = "default",
    context_parallel: Optional[bool] = None,
    cp_segment: int = 0,
    saved_states: Optional[torch.Tensor] = None,
    saved_states_scratch: bool = False,
) -> GDNGrads:
    """Backward pass, no autograd (recomputes the forward from the inputs).

    ``do``: gradient of o, ``dht``: gradient of the final state (None: zero; float32, bfloat16 or
    float16). Returns ``GDNGrads(dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias)``: dq/dk/dv in the
    dtypes of q/k/v, dg (the gradient of the raw activation with ``use_gate_in_kernel``) and dbeta
    in the dtypes of g and beta; dh0 (allocated in initial_state's dtype) when ``initial_state``
    is given and ``need_dh0`` is not False; dA_log with ``use_gate_in_kernel``; ddt_bias when
    ``dt_bias`` is given. Gradient buffers may be passed preallocated (written in place with their
    own strides, never through a copy); the others are allocated. ``check_inputs``: check mode
    (docs/api.md). ``precision``: ``"default"``, ``"fast"`` or ``"high"`` (the CUDA backward's
    arithmetic, as the forward's: ``"high"`` splits the computed operands, the backward at the
    rounding floor; ``"default"`` and ``"fast"`` take single 16-bit products with float32
    accumulation in its per-chunk gradient steps, the other steps still split; the CPU backend
    computes in float32 always; docs/api.md). ``context_parallel`` and ``cp_segment``: the CUDA
    backward's reverse state-gradient pass split into segments, as the forward's (None:
    automatic; False: one CTA per sequence and head, a sequence's bits independent of the other
    sequences; docs/context-parallel.md). ``saved_states``: the forward's (same inputs, same
    precision), read instead of recomputing the chunk-start states; ``saved_states_scratch``:
    True lets the backward overwrite them once read (their values are then undefined; its
    workspace is smaller by their size, 1.07 GB at 64 value heads and 32768 tokens), True only
    with ``saved_states``. Nothing is written when an argument is rejected (ValueError naming it).
    """
    _need_dims("q", q, 4, "[B, T, Hq, K]")
    _need_dims("k", k, 4, "[B, T, Hq, K]")
    _need_dims("v", v, 4, "[B, T, Hv, V]")
    _check_device(q)
    precision = _precision(precision)
    if need_dh0 is None:
        need_dh0 = initial_state is not None
    need_dh0 = _flag("need_dh0", need_dh0) and initial_state is not None
    cu_seqlens_host = resolve_host_seqlens(q, cu_seqlens, cu_seqlens_host, v.shape[1])
    kw = _inputs(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
                 cu_seqlens_host, use_gate_in_kernel, A_log, dt_bias, state_indices, state_v_first,
                 check_inputs)
    gate = kw["gate_in_kernel"]
    dq = torch.empty_like(q, memory_format=torch.contiguous_format) if dq is None else dq
    dk = torch.empty_like(k, memory_format=torch.contiguous_format) if dk is None else dk
    dv = torch.empty_like(v, memory_format=torch.contiguous_format) if dv is None else dv
    if dg is None:
        dg = torch.empty_like(g, memory_format=torch.contiguous_format) if isinstance(g, torch.Tensor) else None
    if dbeta is None:
        dbeta = (torch.empty_like(beta, memory_format=torch.contiguous_format)
                 if isinstance(beta, torch.Tensor) else None)
    if gate and dA_log is None and isinstance(A_log, torch.Tensor):
        dA_log = torch.empty(A_log.shape, dtype=torch.float32, device=A_log.device)
    if gate and dt_bias is not None and ddt_bias is None and isinstance(dt_bias, torch.Tensor):
        ddt_bias = torch.empty(dt_bias.shape, dtype=torch.float32, device=dt_bias.device)
    if need_dh0 and dh0 is None:
        B, T, Hv, V = v.shape
        K = k.shape[-1]
        dh0 = torch.empty(_state_shape(_num_seqs(B, cu_seqlens), Hv, K, V, kw["state_v_first"]),
                          dtype=grad_state_dtype(initial_state), device=q.device)
    kw.update(
        d_o=_desc("do", do), d_final_state=_state_desc("dht", dht),
        dq=_desc("dq", dq), dk=_desc("dk", dk), dv=_desc("dv", dv), dg=_desc("dg", dg),
        dbeta=_desc("dbeta", dbeta),
        dA_log=_desc("dA_log", dA_log) if gate else None,
        ddt_bias=_desc("ddt_bias", ddt_bias) if gate and dt_bias is not None else None,
        dh0=_state_desc("dh0", dh0) if need_dh0 else None,
        precision=precision,
        context_parallel=_context_parallel(context_parallel),
        cp_segment=_index("cp_segment", cp_segment, lo=0),
        saved_states=_desc("saved_states", saved_states) if saved_states is not None else None,
        saved_states_scratch=_flag("saved_states_scratch", saved_states_scratch),
    )
    _launch(_C.backward, _C.backward_workspace_size, kw, q.device)
    return GDNGrads(
        dq, dk, dv, dg, dbeta,
        dh0 if need_dh0 else None,
        dA_log if gate else None,
        ddt_bias if gate and dt_bias is not None else None,
    )
