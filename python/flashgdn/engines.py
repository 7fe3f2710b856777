"""The serving engines' own GDN prefill calls, taken as written, run on flashgdn.

* ``vllm_chunk_gated_delta_rule``: the signature of vLLM's copy of FLA's
  ``chunk_gated_delta_rule`` (``vllm/third_party/flash_linear_attention/ops/chunk.py``, formerly
  ``vllm/model_executor/layers/fla/ops/chunk.py``), which vLLM's Qwen3-Next / Qwen3.5 GDN layer
  (``vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py``) calls with keywords.
* ``sglang_chunk_gated_delta_rule``: the signature of SGLang's copy
  (``python/sglang/kernels/ops/attention/fla/chunk.py``: ``q, k, v, g, beta, scale,
  initial_state, initial_state_indices, cu_seqlens, head_first, use_qk_l2norm_in_kernel,
  inplace_update``), which SGLang's Triton GDN kernel
  (``python/sglang/srt/layers/attention/linear/kernels/gdn_triton.py``) calls with keywords and
  whose three return values ``(o, _, h)`` it unpacks.

Both engines keep their recurrent state in a pool of V-major rows ``[P, Hv, V, K]`` (vLLM: bf16
by default; SGLang: float32 or bf16). vLLM gathers the rows of a batch before the call and
scatters the final states back after it; with ``state_indices=`` this entry point reads and
writes the pool rows in place instead (docs/engines.md shows the lines to change). SGLang's copy
already takes the pool and its indices, and so does this one.

Both are forward-only, like the engines' copies (refused under autograd with an input that
requires grad), are not traced by torch.compile (they call the library directly, as the engines'
copies are excluded from compilation), and run on flashgdn's CPU backend for CPU tensors and its
CUDA backend for CUDA tensors. Validation is flashgdn's: a rejected call raises ValueError naming the argument and
writes nothing (no pool row, no output buffer).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import _core

__all__ = ["vllm_chunk_gated_delta_rule", "sglang_chunk_gated_delta_rule", "CHUNK"]

CHUNK = 64  # the engines' FLA chunk size: SGLang's h holds the state at every 64th token


def _check_inference(fn: str, tensors) -> None:
    if torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors):
        raise NotImplementedError(
            f"{fn}: forward only, as the engine's own kernel (run under torch.no_grad() or "
            "torch.inference_mode(); flashgdn.chunk_gated_delta_rule is differentiable)")


def _need_tensor(name: str, t, ndim: int, layout: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {layout}, got shape {tuple(t.shape)}")


def _optional_tensor(name: str, t) -> None:
    if t is not None and not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")


def _host_indices(name: str, idx: Tensor) -> List[int]:
    """The index values on the host (one device read for a CUDA tensor)."""
    if idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected dtype int32 or int64, got {idx.dtype}")
    return [int(i) for i in idx.to(device="cpu", dtype=torch.int64).tolist()]


def _check_cu_values(cu: List[int], T: int) -> None:
    """cu_seqlens values as the library checks them (the checks the workspace query leaves out)."""
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing values from 0 to T={T}, got {cu}")


def _check_pool_rows(name: str, rows: List[int], P: int, written: bool) -> None:
    """Pool indices as the library checks host ones: below the pool size, the non-negative ones
    distinct where the pool is written (negative: no state)."""
    for n, r in enumerate(rows):
        if r >= P:
            raise ValueError(f"{name}: expected indices below the pool size P={P}, got {name}[{n}]={r}")
    if written:
        seen = {}
        for n, r in enumerate(rows):
            if r >= 0 and r in seen:
                raise ValueError(f"{name}: expected distinct non-negative indices (the pool rows are "
                                 f"written), got {r} at positions {seen[r]} and {n}")
            seen.setdefault(r, n)


def _host_cu(cu_seqlens: Optional[Tensor], cu_seqlens_cpu) -> Optional[Tensor]:
    if cu_seqlens_cpu is None:
        return None
    if isinstance(cu_seqlens_cpu, Tensor):
        if cu_seqlens_cpu.device.type != "cpu":
            raise ValueError(f"cu_seqlens_cpu: expected a CPU tensor, got a tensor on {cu_seqlens_cpu.device}")
        return cu_seqlens_cpu.to(torch.int64)
    return torch.tensor(list(cu_seqlens_cpu), dtype=torch.int64)


# ---- vLLM -------------------------------------------------------------------------------------


def vllm_chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    chunk_indices: Optional[Tensor] = None,
    chunk_offsets: Optional[Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
    core_attn_out: Optional[Tensor] = None,
    *,
    state_indices: Optional[Tensor] = None,
    has_initial_state: Optional[Tensor] = None,
    cu_seqlens_cpu: Optional[Union[Tensor, Sequence[int]]] = None,
    precision: str = "default",
    check_inputs: bool = False,
) -> Tuple[Tensor, Optional[Tensor]]:
    """vLLM's ``chunk_gated_delta_rule`` (its FLA copy), forward only, on flashgdn.

    Positional order and meaning as vLLM's: ``q, k [1, T, Hq, K]``, ``v [1, T, Hv, V]``,
    ``g, beta [1, T, Hv]`` (any of float32, bfloat16, float16), ``initial_state [N, Hv, V, K]``
    (V-major, as vLLM's state), ``cu_seqlens [N + 1]``. ``chunk_indices`` and ``chunk_offsets``
    (vLLM's precomputed chunk tables) are accepted and ignored. ``core_attn_out``: an output
    buffer of q's dtype, contiguous, with at least ``v.numel()`` elements (vLLM's
    ``[num_tokens, Hv, V]`` with padding tokens): ``o`` is written into its first ``v.numel()``
    elements, as vLLM's copy does, and the returned ``o`` is that view.

    Returns ``(o, final_state)``: ``final_state [N, Hv, V, K]`` float32 (as vLLM's copy; vLLM
    rounds it to its pool dtype when it scatters it) or None without ``output_final_state``.

    Keyword-only, flashgdn's: ``state_indices [N]`` int32/int64 makes ``initial_state`` the pool
    ``[P, Hv, V, K]`` itself (any state dtype: vLLM's bf16 pool), no gather and no scatter:
    sequence ``n`` starts from row ``state_indices[n]`` and, with ``output_final_state``, its final
    state is written back into that row in the pool's dtype; a negative index (vLLM's
    ``PAD_SLOT_ID = -1`` for padding) starts from zero and writes nothing; the non-negative
    indices must be distinct when the pool is written. Then ``final_state`` is returned as None.
    ``has_initial_state [N]`` bool (vLLM's metadata, with ``state_indices`` only): a sequence
    whose entry is False starts from zero (its pool row is zeroed first, after every argument
    has been checked: vLLM's ``initial_state[~has_initial_state] = 0``; this reads the mask on
    the host, one synchronisation on CUDA, as vLLM's boolean indexing does).
    ``cu_seqlens_cpu``: host copy of ``cu_seqlens`` (no device read of it). ``precision``,
    ``check_inputs``: as ``flashgdn.chunk_gated_delta_rule``.
    """
    fn = "vllm_chunk_gated_delta_rule"
    for name, t, nd, layout in (("q", q, 4, "[B, T, Hq, K]"), ("k", k, 4, "[B, T, Hq, K]"),
                                ("v", v, 4, "[B, T, Hv, V]"), ("g", g, 3, "[B, T, Hv]"),
                                ("beta", beta, 3, "[B, T, Hv]")):
        _need_tensor(name, t, nd, layout)
    for name, t in (("initial_state", initial_state), ("cu_seqlens", cu_seqlens),
                    ("chunk_indices", chunk_indices), ("chunk_offsets", chunk_offsets),
                    ("core_attn_out", core_attn_out), ("state_indices", state_indices),
                    ("has_initial_state", has_initial_state)):
        _optional_tensor(name, t)
    del chunk_indices, chunk_offsets  # hints for FLA's kernels; flashgdn needs neither
    output_final_state = _core._flag("output_final_state", output_final_state)
    _check_inference(fn, (q, k, v, g, beta, initial_state))
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"cu_seqlens: the batch size is expected to be 1 rather than {q.shape[0]} "
                         "when using cu_seqlens")
    host = _host_cu(cu_seqlens, cu_seqlens_cpu)
    if host is not None and cu_seqlens is None:
        raise ValueError("cu_seqlens_cpu: given without cu_seqlens")

    o = None
    if core_attn_out is not None:
        need = v.numel()
        if core_attn_out.dtype != q.dtype or core_attn_out.device != q.device:
            raise ValueError(f"core_attn_out: expected a {q.dtype} tensor on {q.device} (q's), got "
                             f"{core_attn_out.dtype} on {core_attn_out.device}")
        if not core_attn_out.is_contiguous():
            raise ValueError("core_attn_out: expected a contiguous buffer (o fills its first "
                             "v.numel() elements)")
        if core_attn_out.numel() < need:
            raise ValueError(f"core_attn_out: expected at least v.numel()={need} elements, got "
                             f"{core_attn_out.numel()} (shape {tuple(core_attn_out.shape)})")
        o = core_attn_out.view(-1)[:need].view(v.shape)

    if has_initial_state is not None and state_indices is None:
        raise ValueError("has_initial_state: only with state_indices (the pool); without it pass "
                         "the per-sequence initial states, zeroed where there is none")
    if state_indices is not None and initial_state is None:
        raise ValueError("state_indices: given without initial_state (the state pool)")
    hook = None
    if has_initial_state is not None and not output_final_state:
        raise ValueError("has_initial_state: only with output_final_state=True (the fresh pool rows "
                         "are zeroed, then written with the final states)")
    if state_indices is not None and has_initial_state is not None:
        N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else q.shape[0]
        if has_initial_state.dtype != torch.bool or tuple(has_initial_state.shape) != (N,):
            raise ValueError(f"has_initial_state: expected a bool tensor of shape [N] = [{N}], got "
                             f"{has_initial_state.dtype} of shape {tuple(has_initial_state.shape)}")
        if has_initial_state.device != q.device:
            raise ValueError(f"has_initial_state: expected a tensor on {q.device} (the device of q), "
                             f"got a tensor on {has_initial_state.device}")
        pool = initial_state

        def hook():
            # Every argument has passed the library's checks but the values; check the values a
            # rejected call would be refused for, then zero the fresh rows.
            rows = _host_indices("state_indices", state_indices)
            _check_pool_rows("state_indices", rows, pool.shape[0], output_final_state)
            if cu_seqlens is not None:
                _check_cu_values(_host_indices("cu_seqlens", host if host is not None else cu_seqlens),
                                 q.shape[1])
            fresh = has_initial_state.to("cpu").tolist()
            zero = [r for r, has in zip(rows, fresh) if not has and r >= 0]
            if zero:
                pool.index_fill_(0, torch.tensor(zero, dtype=torch.int64, device=pool.device), 0)

    o_out, ht, _ = _core.chunk_gated_delta_rule_fwd(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
        cu_seqlens, cu_seqlens_host=host, state_indices=state_indices, state_v_first=True, o=o,
        check_inputs=check_inputs, precision=precision, before_launch=hook)
    return o_out, ht


# ---- SGLang -----------------------------------------------------------------------------------


def _sglang_h_layout(B: int, T: int, lengths: Optional[List[int]]):
    """SGLang's h: ``[B, NT, Hv, V, K]``, row ``boh_n + c`` the state of sequence ``n`` after
    ``c * 64`` of its tokens (c = 0 .. ceil(L_n / 64) - 1). Returns (NT, [(h row, source)]) with
    source ('init', n) or ('ckpt', checkpoint row); h rows are flattened over B."""
    rows = []
    if lengths is None:  # dense: B sequences of T tokens, one h row block per batch row
        nt = -(-T // CHUNK)
        per = T // CHUNK
        for b in range(B):
            for c in range(nt):
                rows.append((b * nt + c, ("init", b) if c == 0 else ("ckpt", b * per + c - 1)))
        return nt, rows
    nt_total, ck = 0, 0
    for n, L in enumerate(lengths):
        nt = -(-L // CHUNK)
        for c in range(nt):
            rows.append((nt_total + c, ("init", n) if c == 0 else ("ckpt", ck + c - 1)))
        nt_total += nt
        ck += L // CHUNK
    return nt_total, rows


def sglang_chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    initial_state_indices: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    head_first: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    inplace_update: bool = True,
    *,
    return_h: bool = True,
    cu_seqlens_cpu: Optional[Union[Tensor, Sequence[int]]] = None,
    precision: str = "default",
    check_inputs: bool = False,
) -> Tuple[Tensor, None, Optional[Tensor]]:
    """SGLang's ``chunk_gated_delta_rule`` (its FLA copy), forward only, on flashgdn.

    Positional order, defaults and meaning as SGLang's (its copy's twelve parameters, the last
    ``inplace_update``; older copies end at ``use_qk_l2norm_in_kernel``): ``initial_state`` is
    the state pool ``[P, Hv, V, K]`` (V-major, float32, bfloat16 or float16) and
    ``initial_state_indices [N]`` (int32/int64) its row per sequence; with ``inplace_update``
    (the default, as SGLang's) each sequence's final state is written back into its row, in
    place, in the pool's dtype, and the non-negative indices must be distinct;
    ``inplace_update=False`` (SGLang's multi-item scoring) only reads the pool. A
    negative index starts from zero and writes nothing (SGLang zeroes a fresh slot when it
    allocates it, so a fresh sequence passes its zeroed row). Without ``initial_state_indices``,
    ``initial_state`` holds one row per sequence (``[N, Hv, V, K]``, row ``n`` for sequence
    ``n``). ``head_first`` must be False (SGLang refuses True too).

    Returns ``(o, None, h)`` as SGLang's: ``o [B, T, Hv, V]`` in q's dtype, and ``h
    [B, NT, Hv, V, K]`` in q's dtype, the state at the start of every 64-token chunk: row
    ``boh_n + c`` of the flattened ``[NT]`` axis (``boh_n = sum_{m < n} ceil(L_m / 64)``; dense
    batches: ``h[b, c]``) is sequence ``n``'s state after ``c * 64`` of its tokens, ``c = 0`` its
    initial state. flashgdn computes it from its checkpoints (every 64 tokens) and the initial
    states; ``return_h=False`` (flashgdn's keyword) skips that work and returns None there.
    ``cu_seqlens_cpu``: host copy of ``cu_seqlens``. ``precision``, ``check_inputs``: as
    ``flashgdn.chunk_gated_delta_rule``.
    """
    fn = "sglang_chunk_gated_delta_rule"
    for name, t, nd, layout in (("q", q, 4, "[B, T, Hq, K]"), ("k", k, 4, "[B, T, Hq, K]"),
                                ("v", v, 4, "[B, T, Hv, V]"), ("g", g, 3, "[B, T, Hv]"),
                                ("beta", beta, 3, "[B, T, Hv]")):
        _need_tensor(name, t, nd, layout)
    for name, t in (("initial_state", initial_state), ("initial_state_indices", initial_state_indices),
                    ("cu_seqlens", cu_seqlens)):
        _optional_tensor(name, t)
    if _core._flag("head_first", head_first):
        raise ValueError("head_first: head-first inputs are not supported; pass [B, T, H, ...] tensors")
    inplace_update = _core._flag("inplace_update", inplace_update)
    return_h = _core._flag("return_h", return_h)
    _check_inference(fn, (q, k, v, g, beta, initial_state))
    B, T = q.shape[0], q.shape[1]
    Hv, V, K = v.shape[2], v.shape[3], k.shape[3]
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(f"cu_seqlens: the batch size is expected to be 1 rather than {B} "
                             "when using cu_seqlens")
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens: expected a 1-D [N + 1] tensor, got shape {tuple(cu_seqlens.shape)}")
    host = _host_cu(cu_seqlens, cu_seqlens_cpu)
    if host is not None and cu_seqlens is None:
        raise ValueError("cu_seqlens_cpu: given without cu_seqlens")
    N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
    if initial_state_indices is not None and initial_state is None:
        raise ValueError("initial_state_indices: given without initial_state (the state pool)")
    indices = initial_state_indices
    if initial_state is not None and indices is None:
        indices = torch.arange(max(N, 0), dtype=torch.int64, device=q.device)

    lengths = None
    if return_h and cu_seqlens is not None:
        cu = _host_indices("cu_seqlens", host if host is not None else cu_seqlens)
        _check_cu_values(cu, T)
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        if host is None:
            host = torch.tensor(cu, dtype=torch.int64)  # read once: the library reuses it

    init_rows = None
    if return_h and initial_state is not None:
        # h's first row per sequence is its initial state: read it before the pool is written.
        # Validate what the gather touches first (the library validates the rest before it writes).
        if initial_state.dim() != 4 or tuple(initial_state.shape[1:]) != (Hv, V, K):
            raise ValueError(f"initial_state: expected a pool [P, Hv, V, K] = [P, {Hv}, {V}, {K}], "
                             f"got shape {tuple(initial_state.shape)}")
        if indices.dim() != 1 or indices.shape[0] != N:
            raise ValueError(f"initial_state_indices: expected shape [N] = [{N}], got {tuple(indices.shape)}")
        rows = _host_indices("initial_state_indices", indices)
        _check_pool_rows("initial_state_indices", rows, initial_state.shape[0], inplace_update)
        sel = torch.tensor([max(r, 0) for r in rows], dtype=torch.int64, device=initial_state.device)
        init_rows = initial_state.index_select(0, sel).to(q.dtype)
        for n, r in enumerate(rows):
            if r < 0:
                init_rows[n].zero_()

    o, _, ckpt = _core.chunk_gated_delta_rule_fwd(
        q, k, v, g, beta, scale, initial_state, inplace_update and initial_state is not None,
        use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_host=host,
        state_indices=indices if initial_state is not None else None, state_v_first=True,
        checkpoint_every=CHUNK if return_h else 0, check_inputs=check_inputs, precision=precision)
    if not return_h:
        return o, None, None

    nt, layout = _sglang_h_layout(B, T, lengths)
    h_rows = B * nt if lengths is None else nt
    h = torch.zeros((h_rows, Hv, V, K), dtype=q.dtype, device=q.device)
    if layout:
        n_init = init_rows.shape[0] if init_rows is not None else 0
        src = ckpt.to(q.dtype)
        if init_rows is not None:
            src = torch.cat([init_rows, src], 0)
        dst_idx, src_idx = [], []
        for dst, (kind, i) in layout:
            if kind == "init":
                if init_rows is None:
                    continue  # no initial state: the zero row stays
                dst_idx.append(dst)
                src_idx.append(i)
            else:
                dst_idx.append(dst)
                src_idx.append(n_init + i)
        if dst_idx:
            d = torch.tensor(dst_idx, dtype=torch.int64, device=q.device)
            s = torch.tensor(src_idx, dtype=torch.int64, device=q.device)
            h.index_copy_(0, d, src.index_select(0, s))
    h = h.view(B, nt, Hv, V, K) if lengths is None else h.view(1, nt, Hv, V, K)
    return o, None, h
