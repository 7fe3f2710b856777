"""The engines' prefill calls (flashgdn.engines), called exactly as vLLM and SGLang call their
FLA copies: keywords, V-major state pools (bf16 as vLLM's default), pool indices with padding,
output buffers, return tuples. Every value against the float64 oracle; the pool rows a call must
not touch compared bitwise."""
import inspect
import math

import pytest
import torch

from flashgdn.engines import CHUNK, sglang_chunk_gated_delta_rule, vllm_chunk_gated_delta_rule
from flashgdn.reference import reference_forward, to_f64
from gdn_testutil import check, make_case

import numpy as np

LENGTHS = [70, 1, 0, 129, 64]


def _inputs(lengths=LENGTHS, Hq=2, Hv=4, K=32, V=64, dtype=torch.bfloat16, device="cpu", seed=0):
    """q, k, v, g, beta packed along T (B = 1), cu_seqlens int32 on the device (as the engines'
    query_start_loc), and the case for the oracle. l2norm'd outside (vLLM's fused_post_conv_prep
    normalises q and k; SGLang passes raw ones with use_qk_l2norm_in_kernel=True)."""
    c = make_case(lengths=lengths, Hq=Hq, Hv=Hv, K=K, V=V, dtype=dtype, device=device, seed=seed,
                  initial_state=False, state_v_first=True, g_dtype=torch.float32, beta_dtype=dtype)
    return c


def _pool(P, Hv, V, K, dtype, seed=1, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return (0.5 * torch.randn(P, Hv, V, K, generator=gen)).to(dtype).to(device)


def _oracle(c, pool, idx, checkpoint_every=0, l2norm=False):
    """The oracle on the pool rows idx (negative: zero) with V-major states."""
    return reference_forward(*c.inputs(), initial_state=pool, state_indices=idx, state_v_first=True,
                             cu_seqlens=c.cu_seqlens, use_qk_l2norm_in_kernel=l2norm,
                             checkpoint_every=checkpoint_every)


# ---- vLLM --------------------------------------------------------------------------------------


def _vllm_metadata(c, P):
    """What vLLM's GDN metadata holds for a prefill batch: the state slot per sequence (one
    padding entry, PAD_SLOT_ID = -1, at the end), which sequences continue from a cached state,
    and FLA's chunk tables (chunk_indices [num_chunks, 2], chunk_offsets [N + 1])."""
    N = len(c.lengths)
    idx = torch.tensor([5, 0, 3, 1, -1][:N], dtype=torch.int32)
    has = torch.tensor([True, False, True, True, False][:N])
    nt = [math.ceil(L / CHUNK) for L in c.lengths]
    chunk_indices = torch.tensor([[n, i] for n, m in enumerate(nt) for i in range(m)], dtype=torch.int32)
    chunk_offsets = torch.tensor([0] + list(np.cumsum(nt)), dtype=torch.int32)
    return idx, has, chunk_indices, chunk_offsets


def test_vllm_as_written_gather_scatter():
    """vLLM's lines unchanged but the import: gather the pool rows, zero the fresh ones, call with
    vLLM's keywords, scatter the float32 final states back in the pool's dtype."""
    c = _inputs()
    P, Hv, V, K = 7, 4, 64, 32
    ssm_state = _pool(P, Hv, V, K, torch.bfloat16)
    idx, has, chunk_indices, chunk_offsets = _vllm_metadata(c, P)
    idx, has = idx[:4], has[:4]  # the gather path has no padding entry (vLLM would read row -1)
    c4 = _inputs(lengths=LENGTHS[:4])
    pool0 = ssm_state.clone()
    with torch.inference_mode():
        initial_state = ssm_state[idx.long()].contiguous()
        initial_state[~has, ...] = 0
        core_attn_out_non_spec, last_recurrent_state = vllm_chunk_gated_delta_rule(
            q=c4.q, k=c4.k, v=c4.v, g=c4.g, beta=c4.beta, initial_state=initial_state, output_final_state=True,
            cu_seqlens=c4.cu_seqlens, chunk_indices=chunk_indices[:4], chunk_offsets=chunk_offsets[:5],
            use_qk_l2norm_in_kernel=False)
        ssm_state[idx.long()] = last_recurrent_state.to(ssm_state.dtype)
    assert core_attn_out_non_spec.shape == c4.v.shape and core_attn_out_non_spec.dtype == c4.q.dtype
    assert last_recurrent_state.shape == (4, Hv, V, K) and last_recurrent_state.dtype == torch.float32
    eff = torch.where(has, idx, torch.full_like(idx, -1))
    ref = _oracle(c4, pool0, eff)
    check("o", core_attn_out_non_spec, ref["o"], c4, 6e-3)
    check("final_state", last_recurrent_state, ref["final_state"], c4, 6e-3)


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32], ids=["bf16_pool", "fp32_pool"])
def test_vllm_pool_in_place(pool_dtype):
    """The pool itself with state_indices (padding -1, fresh sequences by has_initial_state) and
    the output buffer core_attn_out [num_tokens, Hv, V] with padding tokens: the same bits as the
    gather/scatter path, the rows and buffer elements nobody owns untouched."""
    c = _inputs()
    P, Hv, V, K = 8, 4, 64, 32
    N, T = len(c.lengths), c.q.shape[1]
    ssm_state = _pool(P, Hv, V, K, pool_dtype)
    idx, has, chunk_indices, chunk_offsets = _vllm_metadata(c, P)
    pool0 = ssm_state.clone()
    num_tokens = T + 5  # CUDA-graph padding of the token axis
    core_attn_out = torch.full((num_tokens, Hv, V), float("nan"), dtype=c.q.dtype)
    with torch.inference_mode():
        o, final = vllm_chunk_gated_delta_rule(
            q=c.q, k=c.k, v=c.v, g=c.g, beta=c.beta, initial_state=ssm_state, output_final_state=True,
            cu_seqlens=c.cu_seqlens, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
            use_qk_l2norm_in_kernel=False, core_attn_out=core_attn_out,
            state_indices=idx, has_initial_state=has)
    assert final is None
    assert o.data_ptr() == core_attn_out.data_ptr() and o.shape == c.v.shape
    assert torch.equal(o.reshape(T, Hv, V), core_attn_out[:T])
    assert torch.isnan(core_attn_out[T:].float()).all()
    eff = torch.where(has, idx, torch.full_like(idx, -1))
    ref = _oracle(c, pool0, eff)
    check("o", o, ref["o"], c, 6e-3)
    rows = idx.tolist()
    for n, r in enumerate(rows):
        if r >= 0:
            check("final_state", ssm_state[r:r + 1], ref["final_state"][n:n + 1], c,
                  6e-3 if pool_dtype == torch.float32 else 8e-3, sliced=False, context=f"row {r}")
    untouched = [r for r in range(P) if r not in rows]
    assert torch.equal(ssm_state[untouched], pool0[untouched])  # row P-1 too: -1 is padding

    # the gather/scatter path gives the same bits (one rounding of the final state either way)
    live = [n for n, r in enumerate(rows) if r >= 0]
    assert live == list(range(len(live)))  # the padding entry is last
    T_live = sum(c.lengths[n] for n in live)
    gathered = pool0[idx[live].long()].clone()
    gathered[~has[live]] = 0
    with torch.inference_mode():
        o2, ht2 = vllm_chunk_gated_delta_rule(
            *(x[:, :T_live] for x in c.inputs()), None, gathered, True, c.cu_seqlens[:len(live) + 1])
    assert torch.equal(o.reshape(T, Hv, V)[:T_live], o2.reshape(T_live, Hv, V))
    assert torch.equal(ssm_state[idx[live].long()], ht2.to(pool_dtype))


def test_vllm_rejections_write_nothing():
    c = _inputs()
    P, Hv, V, K = 8, 4, 64, 32
    T = c.q.shape[1]
    idx, has, chunk_indices, chunk_offsets = _vllm_metadata(c, P)
    kw = dict(q=c.q, k=c.k, v=c.v, g=c.g, beta=c.beta, output_final_state=True, cu_seqlens=c.cu_seqlens,
              chunk_indices=chunk_indices, chunk_offsets=chunk_offsets, use_qk_l2norm_in_kernel=False)
    bad = [
        ("has_initial_state", dict(has_initial_state=has.int())),
        ("has_initial_state", dict(has_initial_state=has[:3])),
        ("state_indices", dict(state_indices=torch.tensor([5, 0, 3, 9, -1], dtype=torch.int32))),
        ("state_indices", dict(state_indices=torch.tensor([5, 0, 5, 1, -1], dtype=torch.int32))),
        ("core_attn_out", dict(core_attn_out=torch.zeros(T - 1, Hv, V, dtype=c.q.dtype))),
        ("core_attn_out", dict(core_attn_out=torch.zeros(T, Hv, V, dtype=torch.float32))),
        ("core_attn_out", dict(core_attn_out=torch.zeros(Hv, T, V, dtype=c.q.dtype).transpose(0, 1))),
        ("'v'", dict(v=c.v[..., :3, :])),  # the library's own check, after the Python ones
        ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 70, 71, 71, 200, T + 1], dtype=torch.int32))),
    ]
    for name, override in bad:
        pool = _pool(P, Hv, V, K, torch.bfloat16)
        pool0 = pool.clone()
        out = torch.full((T + 3, Hv, V), float("nan"), dtype=c.q.dtype)
        args = dict(kw, initial_state=pool, state_indices=idx, has_initial_state=has, core_attn_out=out)
        args.update(override)
        with torch.inference_mode(), pytest.raises(ValueError) as e:
            vllm_chunk_gated_delta_rule(**args)
        assert name in str(e.value), (name, str(e.value))
        assert torch.equal(pool, pool0), f"{name}: the pool was written by a rejected call"
        assert torch.isnan(out.float()).all(), f"{name}: the output buffer was written"
    with pytest.raises(ValueError, match="has_initial_state"):
        vllm_chunk_gated_delta_rule(**dict(kw, initial_state=_pool(P, Hv, V, K, torch.bfloat16)[:5],
                                           has_initial_state=has))
    q = c.q.clone().requires_grad_()
    with pytest.raises(NotImplementedError, match="forward only"):
        vllm_chunk_gated_delta_rule(**dict(kw, q=q))


# ---- SGLang ------------------------------------------------------------------------------------


def _expected_h(c, pool, idx, ref):
    """SGLang's h from the oracle: [1, NT, Hv, V, K], the state at the start of every 64-token
    chunk of every sequence (c = 0: the initial state)."""
    rows, ck = [], 0
    pool64 = to_f64(pool)
    for n, L in enumerate(c.lengths):
        for j in range(math.ceil(L / CHUNK)):
            if j == 0:
                r = int(idx[n])
                rows.append(pool64[r] if r >= 0 else np.zeros(pool64.shape[1:]))
            else:
                rows.append(ref["checkpoints"][ck + j - 1])
        ck += L // CHUNK
    return np.stack(rows)[None]


# SGLang's chunk_gated_delta_rule (python/sglang/kernels/ops/attention/fla/chunk.py, the version
# whose caller passes inplace_update): its parameters in order, with their defaults, all
# positional-or-keyword, no **kwargs. Earlier copies end at use_qk_l2norm_in_kernel.
SGLANG_PARAMS = [("q", None), ("k", None), ("v", None), ("g", None), ("beta", None), ("scale", None),
                 ("initial_state", None), ("initial_state_indices", None), ("cu_seqlens", None),
                 ("head_first", False), ("use_qk_l2norm_in_kernel", False), ("inplace_update", True)]


def test_sglang_signature():
    """SGLang's positional order and defaults; flashgdn's own arguments keyword-only after them."""
    params = list(inspect.signature(sglang_chunk_gated_delta_rule).parameters.values())
    head = params[:len(SGLANG_PARAMS)]
    assert [p.name for p in head] == [n for n, _ in SGLANG_PARAMS]
    assert all(p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD for p in head)
    for p, (name, default) in zip(head[5:], SGLANG_PARAMS[5:]):
        assert p.default is default, (name, p.default)
    assert all(p.default is inspect.Parameter.empty for p in head[:5])
    rest = params[len(SGLANG_PARAMS):]
    assert rest and all(p.kind == inspect.Parameter.KEYWORD_ONLY for p in rest), [p.name for p in rest]


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32_pool", "bf16_pool"])
@pytest.mark.parametrize("inplace_update", [True, False], ids=["inplace", "multi_item_scoring"])
def test_sglang_extend_as_written(pool_dtype, inplace_update):
    """gdn_triton.py's TritonGDNKernel.extend() on a GPU build, line for line: its keywords, the
    indices and inplace_update passed through dicts it splats, no scale, three return values
    (o, _, h). With inplace_update (the default) the final states go into the pool rows in place;
    inplace_update=False (its multi-item scoring) leaves the pool as it was."""
    c = _inputs(lengths=[130, 1, 0, 64, 200])
    P, Hv, V, K = 9, 4, 64, 32
    ssm_states = _pool(P, Hv, V, K, pool_dtype)
    cache_indices = torch.tensor([6, 2, 8, 0, 4], dtype=torch.int32)
    query_start_loc = c.cu_seqlens
    q, k, v, g, beta = c.inputs()
    pool0 = ssm_states.clone()
    chunk_gated_delta_rule = sglang_chunk_gated_delta_rule  # the one line a user changes
    with torch.inference_mode():
        recurrent_state = ssm_states
        recurrent_state_indices_args = {"initial_state_indices": cache_indices}
        inplace_update_args = {"inplace_update": inplace_update}
        o, _, h = chunk_gated_delta_rule(
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            initial_state=recurrent_state,
            cu_seqlens=query_start_loc,
            head_first=False,
            use_qk_l2norm_in_kernel=True,
            **recurrent_state_indices_args,
            **inplace_update_args,
        )
    assert _ is None
    ref = _oracle(c, pool0, cache_indices, checkpoint_every=CHUNK, l2norm=True)
    check("o", o, ref["o"], c, 6e-3)
    if inplace_update:
        bound = 6e-3 if pool_dtype == torch.float32 else 8e-3
        for n, r in enumerate(cache_indices.tolist()):
            check("final_state", ssm_states[r:r + 1], ref["final_state"][n:n + 1], c, bound, sliced=False,
                  context=f"slot {r}")
        untouched = [r for r in range(P) if r not in cache_indices.tolist()]
        assert torch.equal(ssm_states[untouched], pool0[untouched])
    else:
        assert torch.equal(ssm_states, pool0)
    nt = sum(math.ceil(L / CHUNK) for L in c.lengths)
    assert h.shape == (1, nt, Hv, V, K) and h.dtype == c.q.dtype
    exp_h = _expected_h(c, pool0, cache_indices, ref)
    check("h", h, exp_h, c, 8e-3, sliced=False)
    # chunk 0 of each sequence is its initial state, rounded once to h's dtype
    assert torch.equal(h[0, 0], pool0[6].to(c.q.dtype))


def test_sglang_inplace_update_false_and_options():
    """inplace_update=False reads the pool only; a negative index starts from zero; no
    initial_state_indices means one row per sequence; return_h=False skips h; a dense batch has
    h [B, NT, ...]."""
    c = _inputs(lengths=[100, 64, 3])
    P, Hv, V, K = 5, 4, 64, 32
    pool = _pool(P, Hv, V, K, torch.float32)
    pool0 = pool.clone()
    idx = torch.tensor([3, -1, 0], dtype=torch.int64)
    with torch.inference_mode():
        o, none, h = sglang_chunk_gated_delta_rule(c.q, c.k, c.v, c.g, c.beta, None, pool, idx, c.cu_seqlens,
                                                    False, True, False)
    assert none is None and torch.equal(pool, pool0)
    ref = _oracle(c, pool0, idx, checkpoint_every=CHUNK, l2norm=True)
    check("o", o, ref["o"], c, 6e-3)
    check("h", h, _expected_h(c, pool0, idx, ref), c, 8e-3, sliced=False)
    assert torch.all(h[0, 2] == 0)  # sequence 1 (index -1): its first chunk starts from zero
    with torch.inference_mode():
        o2, _, h2 = sglang_chunk_gated_delta_rule(c.q, c.k, c.v, c.g, c.beta, None, pool, idx, c.cu_seqlens,
                                                   use_qk_l2norm_in_kernel=True, inplace_update=True,
                                                   return_h=False)
    assert h2 is None and torch.equal(o, o2)
    assert torch.equal(pool[[1, 2, 4]], pool0[[1, 2, 4]]) and not torch.equal(pool[3], pool0[3])

    # one row per sequence, no indices: row n is sequence n's
    per_seq = _pool(3, Hv, V, K, torch.float32, seed=4)
    per0 = per_seq.clone()
    with torch.inference_mode():
        o3, _, _ = sglang_chunk_gated_delta_rule(q=c.q, k=c.k, v=c.v, g=c.g, beta=c.beta, initial_state=per_seq,
                                                 cu_seqlens=c.cu_seqlens, use_qk_l2norm_in_kernel=True)
    ref3 = _oracle(c, per0, torch.arange(3), l2norm=True)
    check("o", o3, ref3["o"], c, 6e-3, context="no indices")
    check("final_state", per_seq, ref3["final_state"], c, 6e-3, context="no indices")

    # dense batch: B rows of T tokens
    d = make_case(B=2, T=150, Hq=2, Hv=4, K=32, V=64, initial_state=False, l2norm=True, seed=3)
    dpool = _pool(4, Hv, V, K, torch.float32, seed=6)
    dpool0 = dpool.clone()
    didx = torch.tensor([2, 0], dtype=torch.int32)
    with torch.inference_mode():
        od, _, hd = sglang_chunk_gated_delta_rule(q=d.q, k=d.k, v=d.v, g=d.g, beta=d.beta, initial_state=dpool,
                                                  initial_state_indices=didx, use_qk_l2norm_in_kernel=True)
    refd = reference_forward(*d.inputs(), initial_state=dpool0, state_indices=didx, state_v_first=True,
                             use_qk_l2norm_in_kernel=True, checkpoint_every=CHUNK)
    check("o", od, refd["o"], d, 6e-3, context="dense")
    assert hd.shape == (2, 3, Hv, V, K)
    exp = np.stack([to_f64(dpool0[2]), refd["checkpoints"][0], refd["checkpoints"][1],
                    to_f64(dpool0[0]), refd["checkpoints"][2], refd["checkpoints"][3]]).reshape(2, 3, Hv, V, K)
    check("h", hd, exp, d, 8e-3, sliced=False, context="dense")


def test_sglang_rejections_write_nothing():
    c = _inputs(lengths=[100, 64, 3])
    P, Hv, V, K = 5, 4, 64, 32
    kw = dict(q=c.q, k=c.k, v=c.v, g=c.g, beta=c.beta, cu_seqlens=c.cu_seqlens, use_qk_l2norm_in_kernel=True)
    for name, override in [
        ("initial_state_indices", dict(initial_state_indices=torch.tensor([3, 3, 0], dtype=torch.int32))),
        ("initial_state_indices", dict(initial_state_indices=torch.tensor([3, 7, 0], dtype=torch.int32))),
        ("initial_state_indices", dict(initial_state_indices=torch.tensor([3, 1], dtype=torch.int32))),
        ("initial_state", dict(initial_state=_pool(P, Hv, K + 1, V, torch.float32))),
        ("head_first", dict(head_first=True)),
        ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 100, 90, 167], dtype=torch.int32))),
    ]:
        pool = _pool(P, Hv, V, K, torch.float32)
        args = dict(kw, initial_state=pool, initial_state_indices=torch.tensor([3, 1, 0], dtype=torch.int32))
        args.update(override)
        pool0 = args["initial_state"].clone()
        with torch.inference_mode(), pytest.raises(ValueError) as e:
            sglang_chunk_gated_delta_rule(**args)
        assert name in str(e.value), (name, str(e.value))
        assert torch.equal(args["initial_state"], pool0), f"{name}: the pool was written"
    with pytest.raises(ValueError, match="initial_state_indices"):
        sglang_chunk_gated_delta_rule(**kw, initial_state_indices=torch.tensor([0, 1, 2]))
    q = c.q.clone().requires_grad_()
    with pytest.raises(NotImplementedError, match="forward only"):
        sglang_chunk_gated_delta_rule(**dict(kw, q=q))


# ---- CUDA (skipped without a GPU) ---------------------------------------------------------------


def _need_gpu():
    import flashgdn

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the engines' calls on the CUDA backend cannot run here")
    if not flashgdn.has_cuda():
        pytest.skip("this build has no CUDA backend")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("flashgdn's CUDA backend needs a Hopper GPU (compute capability 9.0)")


@pytest.mark.gpu
def test_engines_cuda_pools():
    """vLLM's bf16 V-major pool in place and SGLang's extend on the GPU, K = V = 128, against the
    oracle; the host copy of cu_seqlens keeps vLLM's call free of device reads."""
    _need_gpu()
    c = make_case(lengths=[300, 1, 0, 129, 64], Hq=2, Hv=4, K=128, V=128, dtype=torch.bfloat16, device="cuda",
                  initial_state=False, state_v_first=True, beta_dtype=torch.bfloat16, seed=11)
    P, Hv, V, K = 8, 4, 128, 128
    pool = _pool(P, Hv, V, K, torch.bfloat16, device="cuda")
    pool0 = pool.clone()
    idx = torch.tensor([5, 0, 3, 1, -1], dtype=torch.int32, device="cuda")
    has = torch.tensor([True, False, True, True, False], device="cuda")
    T = c.q.shape[1]
    out = torch.empty((T + 8, Hv, V), dtype=torch.bfloat16, device="cuda")
    with torch.inference_mode():
        o, _ = vllm_chunk_gated_delta_rule(q=c.q, k=c.k, v=c.v, g=c.g, beta=c.beta, initial_state=pool,
                                           output_final_state=True, cu_seqlens=c.cu_seqlens,
                                           use_qk_l2norm_in_kernel=False, core_attn_out=out, state_indices=idx,
                                           has_initial_state=has, cu_seqlens_cpu=c.cu_seqlens_host)
    eff = torch.where(has, idx, torch.full_like(idx, -1)).cpu()
    ref = _oracle(c, pool0.cpu(), eff)
    check("o", o, ref["o"], c, 6e-3, context="vllm cuda")
    for n, r in enumerate(idx.tolist()):
        if r >= 0:
            check("final_state", pool[r:r + 1], ref["final_state"][n:n + 1], c, 8e-3, sliced=False)
    pool = _pool(P, Hv, V, K, torch.float32, device="cuda")
    pool0 = pool.clone()
    sidx = torch.tensor([6, 2, 7, 0, 4], dtype=torch.int32, device="cuda")
    with torch.inference_mode():
        o, _, h = sglang_chunk_gated_delta_rule(q=c.q, k=c.k, v=c.v, g=c.g, beta=c.beta, initial_state=pool,
                                                cu_seqlens=c.cu_seqlens, head_first=False,
                                                use_qk_l2norm_in_kernel=True, initial_state_indices=sidx,
                                                inplace_update=True)
    ref = _oracle(c, pool0.cpu(), sidx.cpu(), checkpoint_every=CHUNK, l2norm=True)
    check("o", o, ref["o"], c, 6e-3, context="sglang cuda")
    check("h", h, _expected_h(c, pool0.cpu(), sidx.cpu(), ref), c, 8e-3, sliced=False)
