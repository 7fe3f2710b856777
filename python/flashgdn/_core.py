"""Low-level torch layer over the C ABI: tensor descriptors, output allocation, workspace, stream.

Nothing here is differentiable; ``flashgdn.ops`` builds the autograd-aware, torch.compile-able
operator on top. These functions allocate whatever output the caller does not pass, and write
into the outputs the caller does pass (handy for preallocated / poisoned buffers).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Tuple, Union

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


def has_cuda() -> bool:
    """True if this build of the library has the CUDA backend."""
    return bool(_C.has_cuda())


def _desc(name: str, t: Optional[torch.Tensor]):
    """The (data_ptr, dtype, shape, strides, device_type, device_id) descriptor of a tensor."""
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
        raise ValueError(f"{name}: tensors on device '{dev}' are not supported (cpu or cuda)")
    return (t.data_ptr(), code, tuple(t.shape), tuple(t.stride()), dtype, did)


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


def checkpoint_rows(B: int, T: int, checkpoint_every: int) -> int:
    """Rows of the checkpoint buffer flashgdn allocates: B * (T // checkpoint_every), an upper
    bound on sum_n floor(len_n / checkpoint_every) (exact for dense batches)."""
    return B * (T // checkpoint_every) if checkpoint_every > 0 else 0


def checkpoint_offsets(cu_seqlens: Union[torch.Tensor, Sequence[int]], checkpoint_every: int) -> torch.Tensor:
    """Row of the checkpoint buffer where each sequence's checkpoints start, [N + 1] int64 on the
    CPU: sequence n's j-th checkpoint (the state after (j + 1) * checkpoint_every of its tokens)
    is row offsets[n] + j; offsets[N] is the number of rows written."""
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int64, device="cpu")
    per_seq = torch.div(cu[1:] - cu[:-1], checkpoint_every, rounding_mode="floor")
    return torch.cat([cu.new_zeros(1), torch.cumsum(per_seq, 0)])


def _state_shape(N: int, Hv: int, K: int, V: int, state_v_first: bool) -> Tuple[int, int, int, int]:
    return (N, Hv, V, K) if state_v_first else (N, Hv, K, V)


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
            cu_seqlens_host, use_gate_in_kernel, A_log, dt_bias, state_indices, state_v_first) -> dict:
    return dict(
        q=_desc("q", q), k=_desc("k", k), v=_desc("v", v), g=_desc("g", g), beta=_desc("beta", beta),
        A_log=_desc("A_log", A_log), dt_bias=_desc("dt_bias", dt_bias),
        cu_seqlens=_desc("cu_seqlens", cu_seqlens),
        cu_seqlens_host=_desc("cu_seqlens_host", cu_seqlens_host),
        initial_state=_desc("initial_state", initial_state),
        state_indices=_desc("state_indices", state_indices),
        scale=None if scale is None else float(scale),
        use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
        gate_in_kernel=bool(use_gate_in_kernel),
        state_v_first=bool(state_v_first),
    )


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
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Forward pass, no autograd: returns ``(o, final_state, checkpoints)``.

    Arguments as ``flashgdn.chunk_gated_delta_rule``; ``scale=None`` means ``K ** -0.5``.
    ``o``, ``final_state``, ``checkpoints``: optional preallocated outputs, written in place;
    the ones not given are allocated. ``final_state`` is None unless ``output_final_state`` and
    no ``state_indices`` (with ``state_indices`` the final states go back into the pool rows of
    ``initial_state``). ``checkpoints`` is None unless ``checkpoint_every > 0``; when allocated
    here it has ``checkpoint_rows(B, T, checkpoint_every)`` rows, the rows past the ones written
    (varlen; see ``checkpoint_offsets``) zero. Nothing is written when an argument is rejected
    (ValueError naming it).
    """
    _need_dims("q", q, 4, "[B, T, Hq, K]")
    _need_dims("k", k, 4, "[B, T, Hq, K]")
    _need_dims("v", v, 4, "[B, T, Hv, V]")
    if cu_seqlens is not None:
        _need_dims("cu_seqlens", cu_seqlens, 1, "[N + 1]")
    _check_device(q)
    B, T, Hv, V = v.shape
    K = k.shape[-1]
    N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
    checkpoint_every = int(checkpoint_every)
    kw = _inputs(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
                 cu_seqlens_host, use_gate_in_kernel, A_log, dt_bias, state_indices, state_v_first)
    if o is None:
        o = torch.empty((B, T, Hv, V), dtype=q.dtype, device=q.device)
    want_final = bool(output_final_state) and state_indices is None
    if want_final and final_state is None:
        final_state = torch.empty(_state_shape(N, Hv, K, V, state_v_first), dtype=torch.float32,
                                  device=q.device)
    zero_tail = None
    if checkpoint_every > 0 and checkpoints is None:
        checkpoints = torch.empty((checkpoint_rows(B, T, checkpoint_every),) + _state_shape(1, Hv, K, V, state_v_first)[1:],
                                  dtype=torch.float32, device=q.device)
        if cu_seqlens is not None:
            cu_host = host_seqlens(cu_seqlens, cu_seqlens_host)
            if q.device.type == "cuda" and cu_seqlens_host is None:
                kw["cu_seqlens_host"] = _desc("cu_seqlens_host", cu_host)  # read back once, not twice
            zero_tail = cu_host
    if B * T == 0:  # no tokens: torch gives empty tensors a NULL data pointer, which the C ABI reads as absent
        return _fwd_no_tokens(o, final_state if want_final else None, checkpoints, initial_state,
                              state_indices, checkpoint_every)
    kw.update(
        output_final_state=bool(output_final_state),
        checkpoint_every=checkpoint_every,
        o=_desc("o", o),
        final_state=_desc("final_state", final_state) if want_final else None,
        checkpoints=_desc("checkpoints", checkpoints) if checkpoint_every > 0 else None,
    )
    _launch(_C.forward, _C.forward_workspace_size, kw, q.device)
    if zero_tail is not None:
        used = int(checkpoint_offsets(zero_tail, checkpoint_every)[-1])
        if used < checkpoints.shape[0]:
            checkpoints[used:].zero_()
    return o, (final_state if want_final else None), (checkpoints if checkpoint_every > 0 else None)


def _fwd_no_tokens(o, final_state, checkpoints, initial_state, state_indices, checkpoint_every):
    """B * T == 0: every sequence is empty, so each final state is its initial state (zero without
    one; a pool is left as it is) and there are no checkpoints."""
    if final_state is not None:
        if initial_state is not None and tuple(initial_state.shape) == tuple(final_state.shape):
            final_state.copy_(initial_state)
        else:
            final_state.zero_()
    if checkpoints is not None:
        checkpoints.zero_()
    return o, final_state, (checkpoints if checkpoint_every > 0 else None)


def _bwd_no_tokens(dht, dh0, dA_log, ddt_bias):
    if dh0 is not None:
        if dht is not None and tuple(dht.shape) == tuple(dh0.shape):
            dh0.copy_(dht)
        else:
            dh0.zero_()
    for t in (dA_log, ddt_bias):
        if t is not None:
            t.zero_()


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
) -> GDNGrads:
    """Backward pass, no autograd (recomputes the forward from the inputs).

    ``do``: gradient of o, ``dht``: gradient of the final state (None: zero). Returns
    ``GDNGrads(dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias)``: dq/dk/dv in the dtypes of q/k/v,
    dg (the gradient of the raw activation with ``use_gate_in_kernel``) and dbeta in the dtypes of
    g and beta; dh0 (float32, like initial_state) when ``initial_state`` is given and ``need_dh0``
    is not False; dA_log with ``use_gate_in_kernel``; ddt_bias when ``dt_bias`` is given. Gradient
    buffers may be passed preallocated; the others are allocated.
    """
    _need_dims("q", q, 4, "[B, T, Hq, K]")
    _need_dims("k", k, 4, "[B, T, Hq, K]")
    _need_dims("v", v, 4, "[B, T, Hv, V]")
    _check_device(q)
    if need_dh0 is None:
        need_dh0 = initial_state is not None
    need_dh0 = bool(need_dh0) and initial_state is not None
    kw = _inputs(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
                 cu_seqlens_host, use_gate_in_kernel, A_log, dt_bias, state_indices, state_v_first)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format) if dq is None else dq
    dk = torch.empty_like(k, memory_format=torch.contiguous_format) if dk is None else dk
    dv = torch.empty_like(v, memory_format=torch.contiguous_format) if dv is None else dv
    if dg is None:
        dg = torch.empty_like(g, memory_format=torch.contiguous_format) if isinstance(g, torch.Tensor) else None
    if dbeta is None:
        dbeta = (torch.empty_like(beta, memory_format=torch.contiguous_format)
                 if isinstance(beta, torch.Tensor) else None)
    if use_gate_in_kernel and dA_log is None and isinstance(A_log, torch.Tensor):
        dA_log = torch.empty(A_log.shape, dtype=torch.float32, device=A_log.device)
    if use_gate_in_kernel and dt_bias is not None and ddt_bias is None and isinstance(dt_bias, torch.Tensor):
        ddt_bias = torch.empty(dt_bias.shape, dtype=torch.float32, device=dt_bias.device)
    if need_dh0 and dh0 is None:
        B, T, Hv, V = v.shape
        K = k.shape[-1]
        N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
        dh0 = torch.empty(_state_shape(N, Hv, K, V, state_v_first), dtype=torch.float32, device=q.device)
    if v.shape[0] * v.shape[1] == 0:
        _bwd_no_tokens(dht, dh0 if need_dh0 else None, dA_log if use_gate_in_kernel else None,
                       ddt_bias if use_gate_in_kernel and dt_bias is not None else None)
        return GDNGrads(dq, dk, dv, dg, dbeta, dh0 if need_dh0 else None,
                        dA_log if use_gate_in_kernel else None,
                        ddt_bias if use_gate_in_kernel and dt_bias is not None else None)
    kw.update(
        d_o=_desc("do", do), d_final_state=_desc("dht", dht),
        dq=_desc("dq", dq), dk=_desc("dk", dk), dv=_desc("dv", dv), dg=_desc("dg", dg),
        dbeta=_desc("dbeta", dbeta),
        dA_log=_desc("dA_log", dA_log) if use_gate_in_kernel else None,
        ddt_bias=_desc("ddt_bias", ddt_bias) if use_gate_in_kernel and dt_bias is not None else None,
        dh0=_desc("dh0", dh0) if need_dh0 else None,
    )
    _launch(_C.backward, _C.backward_workspace_size, kw, q.device)
    return GDNGrads(
        dq, dk, dv, dg, dbeta,
        dh0 if need_dh0 else None,
        dA_log if use_gate_in_kernel else None,
        ddt_bias if use_gate_in_kernel and dt_bias is not None else None,
    )
