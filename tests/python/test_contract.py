"""The call contract through the Python layer (docs/api.md, "Contract"): writes go into the
caller's memory or the call is refused; calls with no tokens are validated like any other;
overlapping arguments are refused and interleaved disjoint ones accepted; cu_seqlens edge cases;
arguments never truncated; check mode. CPU backend; the GPU part at the end runs on a device.
"""
import pytest
import torch

import flashgdn
from flashgdn import _C, chunk_gated_delta_rule, chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd
from gdn_testutil import make_case, nan_like

NAN = float("nan")


def _small(**kw):
    args = dict(lengths=[30, 40], Hq=1, Hv=2, K=16, V=16, dtype=torch.float32, seed=5)
    args.update(kw)
    return make_case(**args)


# ---- item 1: in place means in place ----------------------------------------------------------


def test_transposed_pool_is_refused_not_copied():
    """A pool stored [P, Hv, V, K] seen through a transposed view: refused, naming initial_state
    and the state_v_first hint; never copied (the final states would land in the copy)."""
    c = _small(initial_state=False)
    pool_vk = torch.randn(4, 2, 16, 16)
    pool0 = pool_vk.clone()
    idx = torch.tensor([3, 1], dtype=torch.int32)
    with torch.no_grad(), pytest.raises(ValueError, match="initial_state") as e:
        chunk_gated_delta_rule(*c.inputs(), initial_state=pool_vk.transpose(-1, -2), state_indices=idx,
                               output_final_state=True, cu_seqlens=c.cu_seqlens)
    assert "state_v_first=True" in str(e.value)
    assert torch.equal(pool_vk, pool0)
    # The hint works: the same memory with state_v_first is written in place, and equals the
    # K-major run.
    pool_kv = pool0.transpose(-1, -2).contiguous()
    with torch.no_grad():
        o1, _ = chunk_gated_delta_rule(*c.inputs(), initial_state=pool_vk, state_indices=idx,
                                       output_final_state=True, cu_seqlens=c.cu_seqlens, state_v_first=True)
        o2, _ = chunk_gated_delta_rule(*c.inputs(), initial_state=pool_kv, state_indices=idx,
                                       output_final_state=True, cu_seqlens=c.cu_seqlens)
    assert torch.equal(o1, o2)
    assert torch.equal(pool_vk.transpose(-1, -2), pool_kv)
    assert not torch.equal(pool_vk, pool0)
    # Read only (no output_final_state): copying the transposed view is harmless and allowed.
    with torch.no_grad():
        chunk_gated_delta_rule(*c.inputs(), initial_state=pool_vk.transpose(-1, -2), state_indices=idx,
                               cu_seqlens=c.cu_seqlens)


@pytest.mark.parametrize("name", ["o", "final_state", "checkpoints"])
def test_lowlevel_forward_outputs_never_copied(name):
    c = _small()
    N, Hv, K, V = 2, 2, 16, 16
    bufs = dict(o=torch.full((1, 70, 16, 2), NAN).transpose(-1, -2),  # [1, 70, Hv, V], strided last
                final_state=torch.full((N, Hv, V, K), NAN).transpose(-1, -2),
                checkpoints=torch.full((1, Hv, V, K), NAN).transpose(-1, -2))
    with pytest.raises(ValueError, match=f"'{name}'.*contiguous last dimension"):
        chunk_gated_delta_rule_fwd(*c.inputs(), output_final_state=True, checkpoint_every=64,
                                   cu_seqlens=c.cu_seqlens, initial_state=c.initial_state, **{name: bufs[name]})
    assert torch.isnan(bufs[name]).all()


def test_lowlevel_gradients_never_copied():
    c = _small()
    dq = torch.full((1, 70, 1, 32), NAN)[..., ::2]
    with pytest.raises(ValueError, match="'dq'.*contiguous last dimension"):
        chunk_gated_delta_rule_bwd(*c.inputs(), torch.randn(1, 70, 2, 16), cu_seqlens=c.cu_seqlens, dq=dq)
    assert torch.isnan(dq).all()


def test_saved_states_scratch_needs_saved_states():
    """saved_states_scratch (the saved states' memory as the backward's scratch) only with
    saved_states, and a bool (TypeError otherwise, as every flag): refused naming it, nothing written."""
    c = _small()
    dq = torch.full((1, 70, 1, 16), NAN)
    with pytest.raises(ValueError, match="'saved_states_scratch'.*0 without saved_states"):
        chunk_gated_delta_rule_bwd(*c.inputs(), torch.randn(1, 70, 2, 16), cu_seqlens=c.cu_seqlens, dq=dq,
                                   saved_states_scratch=True)
    with pytest.raises(TypeError, match="saved_states_scratch"):
        chunk_gated_delta_rule_bwd(*c.inputs(), torch.randn(1, 70, 2, 16), cu_seqlens=c.cu_seqlens, dq=dq,
                                   saved_states_scratch=2)
    assert torch.isnan(dq).all()


# ---- item 2: outputs that overlap themselves ---------------------------------------------------


def test_expanded_output_refused():
    c = _small()
    o = torch.full((1, 1, 2, 16), NAN).expand(1, 70, 2, 16)  # stride 0 along T
    with pytest.raises(ValueError, match="'o'.*no two elements"):
        chunk_gated_delta_rule_fwd(*c.inputs(), cu_seqlens=c.cu_seqlens, o=o)
    assert torch.isnan(o).all()


# ---- item 3: calls with no tokens --------------------------------------------------------------


def _empty(B=2, Hq=1, Hv=2, K=16, V=16, dtype=torch.float32):
    q = torch.zeros(B, 0, Hq, K, dtype=dtype)
    return q, q.clone(), torch.zeros(B, 0, Hv, V, dtype=dtype), torch.zeros(B, 0, Hv), torch.zeros(B, 0, Hv)


def test_no_tokens_validated():
    q, k, v, g, beta = _empty()
    with pytest.raises(ValueError, match="K=48"):
        chunk_gated_delta_rule(torch.zeros(2, 0, 1, 48), torch.zeros(2, 0, 1, 48), v, g, beta)
    with pytest.raises(ValueError, match="'k'.*dtype"):
        chunk_gated_delta_rule(q, k.bfloat16(), v, g, beta)
    with pytest.raises(ValueError, match="'scale'"):
        chunk_gated_delta_rule(q, k, v, g, beta, scale=NAN)
    with pytest.raises(ValueError, match="'cu_seqlens'.*non-decreasing"):
        chunk_gated_delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=torch.tensor([0, 1, 0]))
    # Preallocated outputs of a rejected call stay as they were.
    ht = torch.full((2, 2, 16, 15), NAN)
    with pytest.raises(ValueError, match="'final_state'"):
        chunk_gated_delta_rule_fwd(q, k, v, g, beta, output_final_state=True, final_state=ht)
    assert torch.isnan(ht).all()
    dh0 = torch.full((3, 2, 16, 16), NAN)
    with pytest.raises(ValueError, match="'dh0'"):
        chunk_gated_delta_rule_bwd(q, k, v, g, beta, v.clone(), initial_state=torch.zeros(2, 2, 16, 16), dh0=dh0)
    assert torch.isnan(dh0).all()


def test_no_tokens_results():
    """Every final state is the initial one (a pool is unchanged), dh0 is dht, dA_log and
    ddt_bias are zero, through the library (no Python shortcut)."""
    q, k, v, g, beta = _empty(B=1)
    cu = torch.tensor([0, 0, 0])
    pool = torch.randn(4, 2, 16, 16)
    pool0 = pool.clone()
    with torch.no_grad():
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=pool, state_indices=torch.tensor([2, -1]),
                                       output_final_state=True, cu_seqlens=cu)
    assert ht is None and o.shape == v.shape and torch.equal(pool, pool0)
    A_log, dt_bias = torch.zeros(2), torch.zeros(2)
    dht = torch.randn(2, 2, 16, 16)
    gr = chunk_gated_delta_rule_bwd(q, k, v, g, beta, v.clone(), dht, initial_state=pool[:2].clone(), cu_seqlens=cu,
                                    use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                    dA_log=torch.full((2,), NAN), ddt_bias=torch.full((2,), NAN))
    assert torch.equal(gr.dh0, dht)
    assert torch.equal(gr.dA_log, torch.zeros(2)) and torch.equal(gr.ddt_bias, torch.zeros(2))


def test_empty_batch():
    q, k, v, g, beta = _empty(B=0)
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    assert o.shape == (0, 0, 2, 16) and ht.shape == (0, 2, 16, 16)


# ---- item 4: overlapping arguments -------------------------------------------------------------


def test_input_inside_output_refused():
    c = _small()
    o = torch.full((1, 70, 2, 16), NAN)
    q = o[:, :, :1, :]  # q a view of part of o (head 0 of each token)
    q.copy_(c.q)
    with pytest.raises(ValueError, match="'o'.*'q'"):
        chunk_gated_delta_rule_fwd(q, c.k, c.v, c.g, c.beta, cu_seqlens=c.cu_seqlens, o=o)
    assert torch.equal(q, c.q) and torch.isnan(o[:, :, 1]).all()


def test_gradients_sharing_memory():
    c = _small()
    do = torch.randn(1, 70, 2, 16)
    buf = torch.full((1, 70, 1, 16), NAN)
    with pytest.raises(ValueError, match="'dq'.*'dk'"):
        chunk_gated_delta_rule_bwd(*c.inputs(), do, cu_seqlens=c.cu_seqlens, dq=buf, dk=buf)
    assert torch.isnan(buf).all()
    # Disjoint halves of one buffer: accepted, and the same numbers as separate buffers.
    ref = chunk_gated_delta_rule_bwd(*c.inputs(), do, cu_seqlens=c.cu_seqlens)
    both = torch.full((1, 70, 1, 32), NAN)
    gr = chunk_gated_delta_rule_bwd(*c.inputs(), do, cu_seqlens=c.cu_seqlens, dq=both[..., :16], dk=both[..., 16:])
    assert torch.equal(both[..., :16], ref.dq) and torch.equal(both[..., 16:], ref.dk)
    assert gr.dq.data_ptr() == both.data_ptr()


def test_checkpoints_over_initial_state_refused():
    c = make_case(B=1, T=130, Hq=1, Hv=2, K=16, V=16, dtype=torch.float32, seed=1)
    buf = torch.randn(2, 2, 16, 16)
    before = buf.clone()
    with pytest.raises(ValueError, match="'checkpoints'.*'initial_state'"):
        chunk_gated_delta_rule_fwd(*c.inputs(), initial_state=buf[:1], checkpoint_every=64, checkpoints=buf)
    assert torch.equal(buf, before)


def test_fused_projection_inputs_accepted():
    """q, k, v slices of one projection (inputs may overlap each other) and o interleaved with
    nothing: the reference layout of a real model."""
    c = _small(Hv=1)
    proj = torch.cat([c.q, c.k, c.v], dim=-1)
    o1, _ = chunk_gated_delta_rule(proj[..., :16], proj[..., 16:32], proj[..., 32:], c.g, c.beta,
                                   cu_seqlens=c.cu_seqlens)
    o2, _ = chunk_gated_delta_rule(c.q, c.k, c.v, c.g, c.beta, cu_seqlens=c.cu_seqlens)
    assert torch.equal(o1, o2)


# ---- item 6: cu_seqlens ------------------------------------------------------------------------


def test_empty_cu_seqlens_refused():
    c = _small()
    with pytest.raises(ValueError, match="'cu_seqlens'.*at least 2 entries"):
        chunk_gated_delta_rule(*c.inputs(), cu_seqlens=torch.zeros(0, dtype=torch.int32))


@pytest.mark.parametrize("name", ["cu_seqlens", "initial_state", "state_indices", "g"])
def test_meta_argument_refused(name):
    c = _small()
    kw = dict(cu_seqlens=c.cu_seqlens, initial_state=c.initial_state)
    args = list(c.inputs())
    if name == "g":
        args[3] = args[3].to("meta")
    elif name == "state_indices":
        kw["state_indices"] = torch.tensor([0, 1], device="meta")
    else:
        kw[name] = kw[name].to("meta")
    with torch.no_grad(), pytest.raises(ValueError, match=f"{name}: expected a tensor on cpu.*meta"):
        chunk_gated_delta_rule(*args, **kw)


def test_all_meta_is_shape_inference():
    """Every tensor on meta: torch's fake implementation (shapes only) is the intended answer."""
    c = _small()
    o, ht = chunk_gated_delta_rule(*(x.to("meta") for x in c.inputs()), output_final_state=True,
                                   cu_seqlens=c.cu_seqlens.to("meta"))
    assert o.device.type == "meta" and ht.shape == (2, 2, 16, 16)


def test_host_copy_must_match():
    c = _small()
    with pytest.raises(ValueError, match="'cu_seqlens_host'.*equal to cu_seqlens"):
        chunk_gated_delta_rule(*c.inputs(), cu_seqlens=c.cu_seqlens, cu_seqlens_cpu=[0, 40, 70])
    # An invalid cu_seqlens does not hide behind a valid host copy.
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_gated_delta_rule(*c.inputs(), cu_seqlens=torch.tensor([0, 80, 70]), cu_seqlens_cpu=[0, 30, 70])
    o1, _ = chunk_gated_delta_rule(*c.inputs(), cu_seqlens=c.cu_seqlens, cu_seqlens_cpu=[0, 30, 70])
    o2, _ = chunk_gated_delta_rule(*c.inputs(), cu_seqlens=c.cu_seqlens)
    assert torch.equal(o1, o2)


# ---- item 7: the workspace queries read no tensor memory ---------------------------------------


def test_workspace_query_reads_no_values():
    """The size query on descriptors whose data pointers are unmapped addresses: reading any
    value (cu_seqlens, state_indices) would crash the process. A call reads a device cu_seqlens
    once, in validation, on the call's stream (the query never does): with the Python layer's
    query-then-call, one read per call (see test_gpu_one_read_per_call)."""
    addr = [0x10000]

    def fake(t):
        d = list(flashgdn._core._desc("x", t))
        d[0] = addr[0]
        addr[0] += 0x10000
        return tuple(d)

    c = _small()
    kw = dict(q=fake(c.q), k=fake(c.k), v=fake(c.v), g=fake(c.g), beta=fake(c.beta),
              cu_seqlens=fake(c.cu_seqlens), initial_state=fake(torch.zeros(4, 2, 16, 16)),
              state_indices=fake(torch.zeros(2, dtype=torch.int64)), output_final_state=True,
              o=fake(torch.zeros(1, 70, 2, 16)), checkpoint_every=64,
              checkpoints=fake(torch.zeros(1, 2, 16, 16)), check_inputs=True)
    assert _C.forward_workspace_size(**kw) == 0


# ---- item 8: valid calls that were refused -----------------------------------------------------


def test_zero_checkpoint_rows():
    c = _small(lengths=[10, 20])  # T = 30 < 64: zero rows, an empty tensor
    o, ht, ck = chunk_gated_delta_rule(*c.inputs(), cu_seqlens=c.cu_seqlens, checkpoint_every=64,
                                       output_final_state=True)
    assert ck.shape == (0, 2, 16, 16)
    o, _, ck = chunk_gated_delta_rule_fwd(*c.inputs(), cu_seqlens=c.cu_seqlens, checkpoint_every=64,
                                          checkpoints=torch.empty(0, 2, 16, 16))
    assert ck.shape[0] == 0


def test_huge_read_only_pool():
    """A pool of 2^52 rows that are one state (stride 0): no table over the rows."""
    c = _small(initial_state=False)
    state = torch.randn(1, 2, 16, 16)
    pool = state.expand(2**52, 2, 16, 16)
    with torch.no_grad():
        o1, _ = chunk_gated_delta_rule(*c.inputs(), initial_state=pool, state_indices=torch.tensor([2**52 - 1, 7]),
                                       cu_seqlens=c.cu_seqlens)
        o2, _ = chunk_gated_delta_rule(*c.inputs(), initial_state=state.expand(2, 2, 16, 16), cu_seqlens=c.cu_seqlens)
    assert torch.equal(o1, o2)
    # Written back, the same pool would have every row in one place: refused.
    with torch.no_grad(), pytest.raises(ValueError, match="'initial_state'.*no two elements"):
        chunk_gated_delta_rule(*c.inputs(), initial_state=state.expand(4, 2, 16, 16), state_indices=torch.tensor([0, 1]),
                               cu_seqlens=c.cu_seqlens, output_final_state=True)


# ---- item 9: clear errors, nothing truncated ---------------------------------------------------


def test_zero_head_dim_is_a_value_error():
    q = torch.zeros(1, 4, 1, 0)
    v = torch.zeros(1, 4, 1, 16)
    g = torch.zeros(1, 4, 1)
    with pytest.raises(ValueError, match="'q'.*K=0"):
        chunk_gated_delta_rule(q, q, v, g, g)


@pytest.mark.parametrize("value, error, match", [
    (64.9, TypeError, "checkpoint_every: expected an int, got float 64.9"),
    (2**64, ValueError, r"checkpoint_every: expected an int in \[0, 2\*\*63\), got 18446744073709551616"),
    (True, TypeError, "checkpoint_every: expected an int, got a bool"),
    ("64", TypeError, "checkpoint_every: expected an int"),
    (-64, ValueError, "checkpoint_every"),
])
def test_checkpoint_every_never_truncated(value, error, match):
    c = _small()
    with pytest.raises(error, match=match):
        chunk_gated_delta_rule(*c.inputs(), cu_seqlens=c.cu_seqlens, checkpoint_every=value)
    with pytest.raises(error, match=match):
        chunk_gated_delta_rule_fwd(*c.inputs(), cu_seqlens=c.cu_seqlens, checkpoint_every=value)


@pytest.mark.parametrize("name", ["output_final_state", "use_qk_l2norm_in_kernel", "state_v_first", "check_inputs"])
@pytest.mark.parametrize("value", [0.5, 2, "yes", None])
def test_flags_never_truncated(name, value):
    c = _small()
    with pytest.raises(TypeError, match=f"{name}: expected a bool"):
        chunk_gated_delta_rule(*c.inputs(), cu_seqlens=c.cu_seqlens, **{name: value})


def test_scale_must_be_a_number():
    c = _small()
    with pytest.raises(TypeError, match="scale: expected a float or None"):
        chunk_gated_delta_rule(*c.inputs(), cu_seqlens=c.cu_seqlens, scale="0.25")


def test_device_messages_distinguish():
    c = _small()
    o = torch.empty(1, 70, 2, 16, device="meta")
    with pytest.raises(ValueError, match="o: expected a tensor on cpu or cuda, got a tensor on meta"):
        chunk_gated_delta_rule_fwd(*c.inputs(), cu_seqlens=c.cu_seqlens, o=o)
    # Through the binding, a cpu tensor with device id 1 is not "cpu".
    kw = {n: flashgdn._core._desc(n, t) for n, t in zip(("q", "k", "v", "g", "beta"), c.inputs())}
    kw["cu_seqlens"] = flashgdn._core._desc("cu_seqlens", c.cu_seqlens)
    out = torch.empty(1, 70, 2, 16)
    d = list(flashgdn._core._desc("o", out))
    d[5] = 1
    with pytest.raises(ValueError, match="'o'.*cpu:1"):
        _C.forward(**kw, o=tuple(d))


# ---- item 10: check mode -----------------------------------------------------------------------


def test_check_mode_public_and_lowlevel(monkeypatch):
    c = _small()
    q = c.q.clone()
    q[0, 33, 0, 5] = NAN
    args = (q, c.k, c.v, c.g, c.beta)
    o, _ = chunk_gated_delta_rule(*args, cu_seqlens=c.cu_seqlens)  # off: runs
    with pytest.raises(ValueError, match=r"'q'.*finite.*nan at q\[0, 33, 0, 5\]"):
        chunk_gated_delta_rule(*args, cu_seqlens=c.cu_seqlens, check_inputs=True)
    o = torch.full((1, 70, 2, 16), NAN)
    with pytest.raises(ValueError, match="'q'"):
        chunk_gated_delta_rule_fwd(*args, cu_seqlens=c.cu_seqlens, o=o, check_inputs=True)
    assert torch.isnan(o).all()
    g = c.g.clone()
    g[0, 3, 1] = 0.5
    with pytest.raises(ValueError, match=r"'g'.*<= 0.*g\[0, 3, 1\]"):
        chunk_gated_delta_rule_bwd(c.q, c.k, c.v, g, c.beta, torch.randn(1, 70, 2, 16), cu_seqlens=c.cu_seqlens,
                                   check_inputs=True)
    monkeypatch.setenv("FLASHGDN_CHECK_INPUTS", "1")
    with pytest.raises(ValueError, match="'q'"):
        chunk_gated_delta_rule(*args, cu_seqlens=c.cu_seqlens)


def test_check_mode_in_autograd():
    """check_inputs reaches the backward: a NaN in the incoming gradient is named there."""
    c = _small()
    q = c.q.clone().requires_grad_()
    o, _ = chunk_gated_delta_rule(q, c.k, c.v, c.g, c.beta, cu_seqlens=c.cu_seqlens, check_inputs=True)
    do = torch.randn_like(o)
    do[0, 2, 1, 3] = float("inf")
    with pytest.raises(ValueError, match=r"'d_o'.*inf at d_o\[0, 2, 1, 3\]"):
        o.backward(do)


# ---- on a GPU --------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not (torch.cuda.is_available() and flashgdn.has_cuda()),
                         reason="no CUDA device or flashgdn built without the CUDA backend")


def _gpu_case(**kw):
    args = dict(lengths=[100, 0, 70, 130], Hq=2, Hv=4, K=64, V=64, dtype=torch.bfloat16, device="cuda", seed=3)
    args.update(kw)
    return make_case(**args)


@gpu
def test_gpu_one_read_per_call():
    """Device-to-host copies during a call, counted by the CUDA profiler (CUPTI sees the
    library's own cudaMemcpyAsync): one without a host copy of cu_seqlens, none with it."""
    from torch.profiler import ProfilerActivity, profile
    c = _gpu_case()
    chunk_gated_delta_rule(*c.inputs(), cu_seqlens=c.cu_seqlens)  # warm-up
    torch.cuda.synchronize()

    def d2h(**kw):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            chunk_gated_delta_rule(*c.inputs(), cu_seqlens=c.cu_seqlens, **kw)
            torch.cuda.synchronize()
        if not any("chunk" in e.name or "kernel" in e.name.lower() for e in prof.events()):
            pytest.skip("the CUDA profiler recorded no kernels here (no CUPTI)")
        return sum(1 for e in prof.events() if "DtoH" in e.name)

    assert d2h() == 1
    assert d2h(cu_seqlens_cpu=c.cu_seqlens_host) == 0


@gpu
def test_gpu_cu_seqlens_written_on_the_callers_stream():
    """cu_seqlens written by a kernel on a non-blocking stream right before the call, behind a
    long sleep: the call (which reads it back on that stream) sees the new values, and the
    Python layer's workspace query (no read at all) cannot see the stale ones."""
    c = _gpu_case()
    ref, _ = chunk_gated_delta_rule(*c.inputs(), cu_seqlens=c.cu_seqlens)
    torch.cuda.synchronize()
    cu = torch.tensor([0, 300, 300, 300, 300], dtype=torch.int32, device="cuda")  # valid, stale
    s = torch.cuda.Stream()  # torch's streams do not synchronise with the legacy default stream
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: a read on any other stream would come first
        torch.add(c.cu_seqlens, 0, out=cu)  # a kernel on s
        o, _ = chunk_gated_delta_rule(*c.inputs(), cu_seqlens=cu)
    s.synchronize()
    assert torch.equal(o, ref)


@gpu
def test_gpu_no_tokens_and_check_mode():
    q = torch.zeros(2, 0, 2, 64, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros(2, 0, 4, 64, dtype=torch.bfloat16, device="cuda")
    g = torch.zeros(2, 0, 4, device="cuda")
    h0 = torch.randn(2, 4, 64, 64, device="cuda")
    o, ht = chunk_gated_delta_rule(q, q, v, g, g, initial_state=h0, output_final_state=True)
    assert torch.equal(ht, h0)
    dht = torch.randn_like(h0)
    gr = chunk_gated_delta_rule_bwd(q, q, v, g, g, v.clone(), dht, initial_state=h0)
    assert torch.equal(gr.dh0, dht)
    c = _gpu_case()
    qn = c.q.clone()
    qn[0, 150, 1, 7] = NAN
    with pytest.raises(ValueError, match=r"nan at q\[0, 150, 1, 7\]"):
        chunk_gated_delta_rule(qn, c.k, c.v, c.g, c.beta, cu_seqlens=c.cu_seqlens, check_inputs=True)
    with pytest.raises(ValueError, match="'cu_seqlens'.*host copy"):
        chunk_gated_delta_rule(*c.inputs(), cu_seqlens=c.cu_seqlens, cu_seqlens_cpu=[0, 100, 100, 171, 300],
                               check_inputs=True)
    pool = torch.randn(6, 4, 64, 64, device="cuda")
    with torch.no_grad(), pytest.raises(ValueError, match="'state_indices'.*twice"):
        chunk_gated_delta_rule(*c.inputs(), cu_seqlens=c.cu_seqlens, initial_state=pool,
                               state_indices=torch.tensor([1, 2, 1, 3], device="cuda"), output_final_state=True,
                               check_inputs=True)
