"""The differentiable, torch.compile-able operator: ``chunk_gated_delta_rule``.

Three ``torch.library.custom_op`` operators in the ``flashgdn`` namespace:

* ``flashgdn::chunk_gated_delta_rule_fwd``  (functional) -> (o, final_state, checkpoints,
  saved_states: the chunk-start states written for the backward when ``save_states``, else empty)
* ``flashgdn::chunk_gated_delta_rule_bwd``  (functional, but with ``saved_states_scratch``,
  which overwrites ``saved_states``: the autograd backward that releases its graph) -> (dq, dk,
  dv, dg, dbeta, dA_log, ddt_bias, dh0)
* ``flashgdn::chunk_gated_delta_rule_fwd_pool_`` (writes final states back into the rows of a
  state pool, ``initial_state``, selected by ``state_indices``; inference only) -> (o, checkpoints)

Each has a ``register_fake`` implementation (shapes only, no data), so torch.compile traces a
model that calls them with ``fullgraph=True``; the forward op has ``register_autograd``, whose
backward calls the backward op (which recomputes from the saved inputs, taking ``do`` and the
gradient of the final state, and the forward's saved states where it wrote them). Absent outputs
are empty tensors at the op level; the Python wrapper turns them into None. The operators never synchronise the host with a CUDA device when
the host copy of ``cu_seqlens`` is given (``cu_seqlens_cpu`` / ``cu_seqlens_host``).
"""

import warnings
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import _core

__all__ = ["chunk_gated_delta_rule"]


def _empty(like: Tensor) -> Tensor:
    return like.new_empty((0,), dtype=torch.float32)


def _state_shape(v: Tensor, k: Tensor, N, state_v_first: bool):
    Hv, V, K = v.shape[2], v.shape[3], k.shape[3]
    return (N, Hv, V, K) if state_v_first else (N, Hv, K, V)


def _num_seqs(v: Tensor, cu_seqlens: Optional[Tensor]):
    return cu_seqlens.shape[0] - 1 if cu_seqlens is not None else v.shape[0]


def _ckpt_shape(v: Tensor, k: Tensor, checkpoint_every: int, state_v_first: bool):
    B, T = v.shape[0], v.shape[1]
    return _state_shape(v, k, B * (T // checkpoint_every), state_v_first)


# ---- forward --------------------------------------------------------------------------------


def _saved_rows(q, k, v, cu_seqlens, state_indices, checkpoint_every, precision, use_gate_in_kernel,
                save_states) -> int:
    """Rows of the chunk-start states the forward saves for autograd's backward (0: none)."""
    if not save_states:
        return 0
    return _core.saved_states_rows(q, k, v, cu_seqlens, precision, use_gate_in_kernel, state_indices,
                                   checkpoint_every)


@torch.library.custom_op("flashgdn::chunk_gated_delta_rule_fwd", mutates_args=())
def _fwd_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor],
    cu_seqlens: Optional[Tensor], cu_seqlens_host: Optional[Tensor],
    initial_state: Optional[Tensor], state_indices: Optional[Tensor],
    scale: Optional[float], use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool,
    state_v_first: bool, output_final_state: bool, checkpoint_every: int, check_inputs: bool,
    precision: str = "default", final_state_dtype: Optional[torch.dtype] = None,
    context_parallel: Optional[bool] = None, cp_segment: int = 0, save_states: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    rows = _saved_rows(q, k, v, cu_seqlens, state_indices, checkpoint_every, precision, use_gate_in_kernel,
                       save_states)
    saved = (torch.empty((rows, v.shape[2], k.shape[3], v.shape[3]), dtype=torch.bfloat16, device=q.device)
             if rows > 0 else None)
    o, ht, ckpt = _core.chunk_gated_delta_rule_fwd(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens, cu_seqlens_host=cu_seqlens_host,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
        state_indices=state_indices, state_v_first=state_v_first, checkpoint_every=checkpoint_every,
        check_inputs=check_inputs, precision=precision, final_state_dtype=final_state_dtype,
        context_parallel=context_parallel, cp_segment=cp_segment, saved_states=saved,
    )
    return (o, (ht if ht is not None else _empty(q)), (ckpt if ckpt is not None else _empty(q)),
            (saved if saved is not None else _empty(q)))


@_fwd_op.register_fake
def _fwd_fake(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, cu_seqlens_host, initial_state,
              state_indices, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, state_v_first,
              output_final_state, checkpoint_every, check_inputs, precision="default",
              final_state_dtype=None, context_parallel=None, cp_segment=0, save_states=False):
    o = q.new_empty(tuple(v.shape))
    if output_final_state and state_indices is None:
        ht = q.new_empty(_state_shape(v, k, _num_seqs(v, cu_seqlens), state_v_first),
                         dtype=_core.resolve_final_state_dtype(final_state_dtype, state_indices))
    else:
        ht = _empty(q)
    ckpt = (q.new_empty(_ckpt_shape(v, k, checkpoint_every, state_v_first), dtype=torch.float32)
            if checkpoint_every > 0 else _empty(q))
    rows = _saved_rows(q, k, v, cu_seqlens, state_indices, checkpoint_every, precision, use_gate_in_kernel,
                       save_states)
    saved = q.new_empty((rows, v.shape[2], k.shape[3], v.shape[3]), dtype=torch.bfloat16) if rows > 0 else _empty(q)
    return o, ht, ckpt, saved


# ---- backward -------------------------------------------------------------------------------


# With saved_states_scratch the op overwrites saved_states once it has read them. Not declared as
# a mutation on purpose: a declared one makes torch.compile copy them first (1.07 GB at 16/64,
# 32768 tokens: the saving gone) and bumps their version, so that a second backward through the
# graph could not unpack its saved tensors at all. The autograd backward below passes it only
# where its graph is released after it (no retain_graph: nothing reads the states again) and never
# while tracing (a traced graph may be replayed).
@torch.library.custom_op("flashgdn::chunk_gated_delta_rule_bwd", mutates_args=())
def _bwd_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor],
    cu_seqlens: Optional[Tensor], cu_seqlens_host: Optional[Tensor],
    initial_state: Optional[Tensor], state_indices: Optional[Tensor],
    scale: Optional[float], use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool,
    state_v_first: bool, do: Tensor, dht: Optional[Tensor], need_dh0: bool, check_inputs: bool,
    precision: str = "default", context_parallel: Optional[bool] = None, cp_segment: int = 0,
    saved_states: Optional[Tensor] = None, saved_states_scratch: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    gr = _core.chunk_gated_delta_rule_bwd(
        q, k, v, g, beta, do, dht, scale=scale, initial_state=initial_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
        cu_seqlens_host=cu_seqlens_host, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
        dt_bias=dt_bias, state_indices=state_indices, state_v_first=state_v_first,
        need_dh0=need_dh0, check_inputs=check_inputs, precision=precision,
        context_parallel=context_parallel, cp_segment=cp_segment, saved_states=saved_states,
        saved_states_scratch=saved_states_scratch,
    )
    e = _empty(q)
    return (gr.dq, gr.dk, gr.dv, gr.dg, gr.dbeta,
            gr.dA_log if gr.dA_log is not None else e,
            gr.ddt_bias if gr.ddt_bias is not None else e.clone(),
            gr.dh0 if gr.dh0 is not None else e.clone())


@_bwd_op.register_fake
def _bwd_fake(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, cu_seqlens_host, initial_state,
              state_indices, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, state_v_first,
              do, dht, need_dh0, check_inputs, precision="default", context_parallel=None, cp_segment=0,
              saved_states=None, saved_states_scratch=False):
    c = torch.contiguous_format
    dA = (A_log.new_empty(tuple(A_log.shape), dtype=torch.float32)
          if use_gate_in_kernel and A_log is not None else _empty(q))
    ddt = (dt_bias.new_empty(tuple(dt_bias.shape), dtype=torch.float32)
           if use_gate_in_kernel and dt_bias is not None else _empty(q))
    dh0 = (q.new_empty(_state_shape(v, k, _num_seqs(v, cu_seqlens), state_v_first),
                       dtype=_core.grad_state_dtype(initial_state))
           if need_dh0 and initial_state is not None else _empty(q))
    return (torch.empty_like(q, memory_format=c), torch.empty_like(k, memory_format=c),
            torch.empty_like(v, memory_format=c), torch.empty_like(g, memory_format=c),
            torch.empty_like(beta, memory_format=c), dA, ddt, dh0)


# ---- autograd -------------------------------------------------------------------------------

_N_FWD_ARGS = 23


def _setup_context(ctx, inputs, output):
    (q, k, v, g, beta, A_log, dt_bias, cu_seqlens, cu_seqlens_host, initial_state, state_indices,
     scale, l2norm, gate, v_first, _output_final_state, _checkpoint_every, check_inputs,
     precision, _final_state_dtype, context_parallel, cp_segment, _save_states) = inputs
    # the chunk-start states the forward wrote for the backward (save_states), if any: saved as the
    # inputs are (checkpointing's and offloading's hooks see them), the scratch of the backward that
    # releases the graph
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, cu_seqlens_host,
                          initial_state, state_indices, output[3] if output[3].numel() > 0 else None)
    # the backward's too: its arithmetic and its reverse pass's context parallelism
    ctx.flags = (scale, l2norm, gate, v_first, check_inputs, precision, context_parallel, cp_segment)
    ctx.mark_non_differentiable(output[2], output[3])  # checkpoints, saved states
    # No zeros for the gradients the backward ignores: autograd would otherwise fill one for each
    # output not differentiated (the saved states alone are 1.07 GB at 16/64, 32768 tokens: 0.32 ms).
    ctx.set_materialize_grads(False)


def _graph_retained() -> bool:
    """Whether the running backward keeps its graph (retain_graph=True), so that a later one reads
    the saved tensors again. PyTorch's own flag of the running graph task; where a build lacks it,
    assumed kept (the states then only read)."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep_graph is None else bool(keep_graph())


def _backward(ctx, do, dht, _dckpt, _dsaved):
    (q, k, v, g, beta, A_log, dt_bias, cu_seqlens, cu_seqlens_host, initial_state,
     state_indices, saved) = ctx.saved_tensors
    # An eager backward that releases the graph takes the saved states as its scratch once read
    # (its workspace 1.07 GB smaller at 16/64, 32768 tokens): no later backward reads them. With
    # retain_graph, or while tracing (torch.compile: a traced backward may be replayed), they are
    # only read.
    scratch = saved is not None and not torch.compiler.is_compiling() and not _graph_retained()
    scale, l2norm, gate, v_first, check_inputs, precision, context_parallel, cp_segment = ctx.flags
    if state_indices is not None:
        raise NotImplementedError("flashgdn: no backward with state_indices (an inference option)")
    if do is None:
        do = torch.zeros_like(v, dtype=q.dtype)
    do = do.contiguous()
    if dht is not None:
        dht = None if dht.numel() == 0 else dht.contiguous()
    need = ctx.needs_input_grad
    need_dh0 = initial_state is not None and bool(need[9])
    dq, dk, dv, dg, dbeta, dA, ddt, dh0 = _bwd_op(
        q, k, v, g, beta, A_log, dt_bias, cu_seqlens, cu_seqlens_host, initial_state, state_indices,
        scale, l2norm, gate, v_first, do, dht, need_dh0, check_inputs, precision, context_parallel, cp_segment,
        saved, scratch)
    grads = (dq, dk, dv, dg, dbeta,
             dA if gate and A_log is not None else None,
             ddt if gate and dt_bias is not None else None,
             None, None,
             dh0 if need_dh0 else None)
    return grads + (None,) * (_N_FWD_ARGS - len(grads))


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ---- pool write-back (inference) ------------------------------------------------------------


@torch.library.custom_op("flashgdn::chunk_gated_delta_rule_fwd_pool_", mutates_args=("initial_state",))
def _fwd_pool_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor],
    cu_seqlens: Optional[Tensor], cu_seqlens_host: Optional[Tensor],
    initial_state: Tensor, state_indices: Tensor,
    scale: Optional[float], use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool,
    state_v_first: bool, checkpoint_every: int, check_inputs: bool, precision: str = "default",
    context_parallel: Optional[bool] = None, cp_segment: int = 0,
) -> Tuple[Tensor, Tensor]:
    o, _, ckpt = _core.chunk_gated_delta_rule_fwd(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
        cu_seqlens_host=cu_seqlens_host, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
        dt_bias=dt_bias, state_indices=state_indices, state_v_first=state_v_first,
        checkpoint_every=checkpoint_every, check_inputs=check_inputs, precision=precision,
        context_parallel=context_parallel, cp_segment=cp_segment,
    )
    return o, (ckpt if ckpt is not None else _empty(q))


@_fwd_pool_op.register_fake
def _fwd_pool_fake(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, cu_seqlens_host, initial_state,
                   state_indices, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, state_v_first,
                   checkpoint_every, check_inputs, precision="default", context_parallel=None,
                   cp_segment=0):
    o = q.new_empty(tuple(v.shape))
    ckpt = (q.new_empty(_ckpt_shape(v, k, checkpoint_every, state_v_first), dtype=torch.float32)
            if checkpoint_every > 0 else _empty(q))
    return o, ckpt


# ---- the public function --------------------------------------------------------------------


def _as_host_seqlens(name: str, x) -> Optional[Tensor]:
    if x is None:
        return None
    if isinstance(x, Tensor):
        if x.device.type != "cpu":
            raise ValueError(f"{name}: the host copy of cu_seqlens must be a CPU tensor, got device {x.device}")
        return x if x.dtype == torch.int64 else x.to(torch.int64)
    return torch.tensor(list(x), dtype=torch.int64)


def _unit_last(x: Optional[Tensor]) -> Optional[Tensor]:
    """A read-only input with a strided last dimension, made contiguous (the library takes any
    strides but a unit stride in the last dimension). Never applied to a tensor the call writes:
    that would write into the copy."""
    if x is not None and isinstance(x, Tensor) and x.dim() > 0 and x.shape[-1] > 1 and x.stride(-1) != 1:
        return x.contiguous()
    return x


def _check_devices(q: Tensor, tensors: dict) -> None:
    """Every tensor argument on q's device, checked before dispatch: torch.library would send a
    call with one meta tensor to the fake implementation, which returns uninitialised memory."""
    for name, t in tensors.items():
        if isinstance(t, Tensor) and t.device != q.device:
            raise ValueError(f"{name}: expected a tensor on {q.device} (the device of q), "
                             f"got a tensor on {t.device}")


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    cu_seqlens_cpu: Optional[Union[Tensor, Sequence[int]]] = None,
    chunk_indices: Optional[Tensor] = None,
    cp_context=None,
    *,
    use_gate_in_kernel: bool = False,
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    chunk_size: int = 64,
    head_first: bool = False,
    chunk_offsets: Optional[Tensor] = None,
    cu_seqlens_host: Optional[Union[Tensor, Sequence[int]]] = None,
    state_indices: Optional[Tensor] = None,
    checkpoint_every: int = 0,
    check_inputs: bool = False,
    precision: str = "default",
    final_state_dtype: Optional[torch.dtype] = None,
    context_parallel: Optional[bool] = None,
    cp_segment: int = 0,
    **kwargs,
):
    r"""Gated delta rule, chunked: FLA's ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``.

    Per sequence and value head, with state ``S`` (K x V, float32 during the recurrence):
    ``S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T``, ``o_t = scale S_t^T q_t``.

    The parameters up to ``cp_context`` are FLA 0.6's, in FLA's positional order and with FLA's
    meaning (``fla-core`` 0.6.0); the keyword-only ones after them are FLA's ``**kwargs`` options
    (``use_gate_in_kernel``, ``A_log``, ``dt_bias``, ``chunk_size``, ``head_first``,
    ``transpose_state_layout``), then flashgdn's own.

    Args:
        q, k: ``[B, T, Hq, K]``; v: ``[B, T, Hv, V]`` (``Hv`` a multiple of ``Hq``: value head
            ``h`` reads q/k head ``h // (Hv // Hq)``). bfloat16, float16 or float32 (float32 on
            the CPU backend only), one dtype.
        g: ``[B, T, Hv]`` float32, bfloat16 or float16, log-space gate (``<= 0``); with
            ``use_gate_in_kernel`` the raw activation ``a`` (``g = -exp(A_log) * softplus(a + dt_bias)``).
        beta: ``[B, T, Hv]`` float32, bfloat16 or float16.
        scale: default ``K ** -0.5``.
        initial_state: ``[N, Hv, K, V]`` float32, bfloat16 or float16 (``[N, Hv, V, K]`` with
            ``state_v_first``); with ``state_indices`` a pool ``[P, Hv, K, V]``, read and written
            in its own dtype. Converted to float32 on load (exact); its gradient has its dtype.
        output_final_state: return the final state ``[N, Hv, K, V]``: float32 whatever the
            initial state's dtype, as FLA 0.6 returns it, or the dtype ``final_state_dtype``
            names (rounded to nearest even from the float32 state).
        use_qk_l2norm_in_kernel: L2-normalise q and k per token inside the kernel.
        use_beta_sigmoid_in_kernel, allow_neg_eigval: ``beta <- sigmoid(beta)`` (times 2 with
            ``allow_neg_eigval``, which requires ``use_beta_sigmoid_in_kernel``), applied as a
            torch op before the kernel.
        state_v_first: states (initial, final, checkpoints, their gradients) are ``[.., V, K]``.
        cu_seqlens: ``[N + 1]`` int32/int64 (``B == 1``): N sequences packed along T.
        cu_seqlens_cpu: host copy of ``cu_seqlens`` (CPU tensor or list): with it a CUDA call
            never reads ``cu_seqlens`` back (no host synchronisation, CUDA-graph safe).
        chunk_indices: FLA's precomputed chunk index table: accepted and ignored (flashgdn
            derives its layout from ``cu_seqlens`` or its host copy).
        cp_context: FLA's context-parallel context: only None; anything else raises
            NotImplementedError (flashgdn runs one device's sequences whole).

    Keyword-only, FLA's ``**kwargs`` options:
        use_gate_in_kernel, A_log (``[Hv]``), dt_bias (``[Hv]``, optional): compute the gate in the
            kernel from the raw activation passed as ``g``; ``g``'s gradient is then ``da``.
        chunk_size: 16, 32 or 64, accepted and ignored (flashgdn always uses 64; the result
            differs from FLA's at another chunk size only by rounding).
        head_first: only False (FLA 0.6 removed head-first inputs); True raises ValueError.
        transpose_state_layout: FLA's deprecated alias of ``state_v_first`` (DeprecationWarning).
        chunk_offsets: a precomputed chunk offset table (vLLM's FLA copy passes one): accepted
            and ignored.

    Keyword-only, flashgdn's own:
        cu_seqlens_host: alias of ``cu_seqlens_cpu``.
        state_indices: ``[N]`` int32/int64 rows of the pool ``initial_state`` per sequence
            (negative: start from zero, write nothing back). With ``output_final_state`` the final
            states are written back in place into those pool rows and ``final_state`` is returned
            as None. Inference only (no autograd).
        checkpoint_every: 0, or a multiple of 64: also return the state after every
            ``checkpoint_every`` tokens of each sequence, as a third return value
            ``checkpoints`` ``[B * (T // checkpoint_every), Hv, K, V]`` float32 (whatever the
            state dtypes): sequence ``n``'s ``j``-th checkpoint (after
            ``(j + 1) * checkpoint_every`` of its tokens) is row ``offset_n + j`` with
            ``offset_n = sum_{m < n} floor(len_m / checkpoint_every)``
            (``flashgdn.checkpoint_offsets``); rows past the last one written are zero.
            Checkpoints are not differentiable.
        final_state_dtype: None (float32, FLA's), torch.float32, torch.bfloat16 or
            torch.float16: the dtype of the returned final state, e.g. bfloat16 to keep a state
            that is stored in bfloat16 without a cast. Must be None with ``state_indices`` (the
            pool keeps its dtype).
        precision: the CUDA forward's arithmetic: ``"default"`` (the fastest scheme whose error
            stays at or below the peers'), ``"fast"`` (every tensor-core operand one 16-bit
            value) or ``"high"`` (computed operands split in two halves: o at the rounding floor
            of its dtype, slower). Autograd's backward runs at the same level: ``"high"`` the
            backward at the rounding floor (split products), ``"default"`` and ``"fast"`` single
            16-bit products with float32 accumulation in its per-chunk gradient steps (the
            other steps still split). The CPU backend always computes in float32.
        context_parallel: the CUDA forward's intra-card context parallelism
            (docs/context-parallel.md): None (automatic: when the shapes may leave SMs idle, a
            plan on the GPU decides whether and where to split), True (always plan for it) or
            False (never; a sequence's bits then do not depend on the call's other sequences).
        cp_segment: tokens per segment (a multiple of 64), 0 for the cost model's choice; a fixed
            value also makes a sequence's bits independent of the other sequences under CP.
        check_inputs: check mode: before anything is written, verify the inputs' values (finite,
            ``g <= 0`` as a log gate, state indices in range and distinct where written,
            ``cu_seqlens`` equal to its host copy) at the cost of one host synchronisation;
            ValueError naming the first offending element. Also on with the environment
            variable ``FLASHGDN_CHECK_INPUTS=1``.

    Any other keyword raises TypeError naming it (FLA 0.6 ignores unknown keywords silently).

    Returns:
        ``(o, final_state)`` as FLA, with FLA's dtypes: ``o`` ``[B, T, Hv, V]`` in q's dtype,
        ``final_state`` float32 (unless ``final_state_dtype``) or None; ``(o, final_state,
        checkpoints)`` when ``checkpoint_every > 0``.

    CPU tensors run on the CPU backend, CUDA tensors on the CUDA backend of their device and its
    current stream. Rejected arguments raise ValueError naming the argument.
    """
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
                      DeprecationWarning, stacklevel=2)
        state_v_first = _core._flag("transpose_state_layout", kwargs.pop("transpose_state_layout"))
    if kwargs:
        raise TypeError(
            f"chunk_gated_delta_rule() got unexpected keyword argument(s) {sorted(kwargs)}; flashgdn "
            "takes FLA 0.6's arguments (use_gate_in_kernel, A_log, dt_bias, chunk_size, head_first, "
            "transpose_state_layout as keywords), the hints chunk_indices and chunk_offsets, and its "
            "own cu_seqlens_host, state_indices, checkpoint_every, check_inputs, precision, "
            "final_state_dtype")
    if _core._flag("head_first", head_first):
        raise ValueError("head_first: head-first inputs are not supported (nor by FLA 0.6); "
                         "pass [B, T, H, ...] tensors")
    if isinstance(chunk_size, bool) or chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size: must be 16, 32 or 64 (flashgdn always uses 64), got {chunk_size!r}")
    for name, hint in (("chunk_indices", chunk_indices), ("chunk_offsets", chunk_offsets)):
        if hint is not None and not isinstance(hint, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor or None (a hint flashgdn ignores), "
                            f"got {type(hint).__name__}")
    del chunk_indices, chunk_offsets
    if cp_context is not None:
        raise NotImplementedError(
            "cp_context: context parallelism is not supported by flashgdn; pass cp_context=None "
            "(each call runs its sequences whole on one device, with cu_seqlens for varlen batches)")

    for name, t, nd, layout in (("q", q, 4, "[B, T, Hq, K]"), ("k", k, 4, "[B, T, Hq, K]"),
                                ("v", v, 4, "[B, T, Hv, V]"), ("g", g, 3, "[B, T, Hv]"),
                                ("beta", beta, 3, "[B, T, Hv]")):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != nd:
            raise ValueError(f"{name}: expected {layout}, got shape {tuple(t.shape)}")
    _check_devices(q, dict(k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens,
                           initial_state=initial_state, state_indices=state_indices))
    output_final_state = _core._flag("output_final_state", output_final_state)
    use_qk_l2norm_in_kernel = _core._flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    use_gate_in_kernel = _core._flag("use_gate_in_kernel", use_gate_in_kernel)
    use_beta_sigmoid_in_kernel = _core._flag("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel)
    allow_neg_eigval = _core._flag("allow_neg_eigval", allow_neg_eigval)
    state_v_first = _core._flag("state_v_first", state_v_first)
    check_inputs = _core._flag("check_inputs", check_inputs)
    checkpoint_every = _core._index("checkpoint_every", checkpoint_every, lo=0)
    _core._precision(precision)
    _core._context_parallel(context_parallel)
    cp_segment = _core._index("cp_segment", cp_segment, lo=0)
    _core.resolve_final_state_dtype(final_state_dtype, state_indices)  # validates it
    scale = _core._scale(scale)  # None: 1/sqrt(K), from the library (which refuses K = 0)
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1:
            raise ValueError("cu_seqlens: expected a 1-D [N + 1] int32/int64 tensor")
        if q.shape[0] != 1:
            raise ValueError(f"cu_seqlens: the batch size is expected to be 1 rather than {q.shape[0]} "
                             "when using cu_seqlens; flatten variable-length inputs first")
    if cu_seqlens_cpu is not None and cu_seqlens_host is not None:
        raise ValueError("cu_seqlens_host: pass either cu_seqlens_cpu or cu_seqlens_host, not both")
    host = _as_host_seqlens("cu_seqlens_cpu" if cu_seqlens_cpu is not None else "cu_seqlens_host",
                            cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens_host)
    if host is not None and cu_seqlens is None:
        raise ValueError("cu_seqlens_host: given without cu_seqlens")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("A_log: required when use_gate_in_kernel=True")
        A_log = A_log.float() if A_log.dtype != torch.float32 else A_log
        if dt_bias is not None and dt_bias.dtype != torch.float32:
            dt_bias = dt_bias.float()
    elif A_log is not None or dt_bias is not None:
        raise ValueError("A_log, dt_bias: given without use_gate_in_kernel=True (g must then be the log-space gate)")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval: requires use_beta_sigmoid_in_kernel=True")
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta)
        if allow_neg_eigval:
            beta = beta * 2
    q, k, v, g, beta = (_unit_last(x) for x in (q, k, v, g, beta))
    pool_written = state_indices is not None and output_final_state
    if not pool_written:  # a pool written back in place is passed as it is: the library refuses
        initial_state = _unit_last(initial_state)  # a layout it cannot write, naming it

    if state_indices is not None:
        if torch.is_grad_enabled() and any(
                isinstance(t, Tensor) and t.requires_grad
                for t in (q, k, v, g, beta, A_log, dt_bias, initial_state)):
            raise NotImplementedError(
                "state_indices: no autograd through a state pool (inference only); "
                "run under torch.no_grad() or pass initial_state per sequence")
        if initial_state is None:
            raise ValueError("state_indices: given without initial_state (the state pool)")
        if output_final_state:
            o, ckpt = torch.ops.flashgdn.chunk_gated_delta_rule_fwd_pool_(
                q, k, v, g, beta, A_log, dt_bias, cu_seqlens, host, initial_state, state_indices,
                scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, state_v_first, checkpoint_every,
                check_inputs, precision, context_parallel, cp_segment)
            return (o, None, ckpt) if checkpoint_every > 0 else (o, None)

    # Under autograd the forward also writes the chunk-start states the backward would recompute
    # (where the CUDA backward takes them: bwd_fused; docs/api.md, "saved states").
    save_states = torch.is_grad_enabled() and any(
        isinstance(t, Tensor) and t.requires_grad for t in (q, k, v, g, beta, A_log, dt_bias, initial_state))
    o, ht, ckpt, _saved = torch.ops.flashgdn.chunk_gated_delta_rule_fwd(
        q, k, v, g, beta, A_log, dt_bias, cu_seqlens, host, initial_state, state_indices,
        scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, state_v_first,
        output_final_state and state_indices is None, checkpoint_every, check_inputs, precision,
        final_state_dtype, context_parallel, cp_segment, save_states)
    final_state = ht if output_final_state and state_indices is None else None
    if checkpoint_every > 0:
        return o, final_state, ckpt
    return o, final_state
