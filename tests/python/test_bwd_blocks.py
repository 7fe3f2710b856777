"""The CUDA backward walked in blocks of chunk slots (csrc/cuda/chunk_bwd.cu, bwd_dh_plan.h's
block_plan): the per-chunk workspace holds one block, and the reverse pass carries dS from block
to block in fp32, so blocks change no bit. Calls this small take one block; the test hook
FLASHGDN_BWD_BLOCK_SLOTS forces blocks of a few slots. Every gradient must equal the one-block
call's bit for bit, match the float64 oracle, and the forced blocks must take less memory.
The staged kernels' plan: FLASHGDN_BWD_FUSED=0 for every test here (the fused kernel, which takes
bf16 K = V = 128 at `fast` and `default`, walks whole sequences and has no blocks)."""
import os

import pytest
import torch

import flashgdn
from flashgdn import chunk_gated_delta_rule_bwd
from gdn_testutil import bounds_for, check, make_case, oracle_backward

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)"),
    pytest.mark.skipif(not flashgdn.has_cuda(), reason="flashgdn was built without the CUDA backend"),
]

DEV = "cuda"
ENV = "FLASHGDN_BWD_BLOCK_SLOTS"


@pytest.fixture(autouse=True)
def staged(monkeypatch):
    monkeypatch.setenv("FLASHGDN_BWD_FUSED", "0")

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias")


def _bwd(c, do, dht, block_slots, **kw):
    """The backward with blocks of block_slots chunk slots (0: the library's own plan), and the
    peak memory torch's allocator saw during it beyond what was allocated before."""
    old = os.environ.get(ENV)
    os.environ[ENV] = str(block_slots)
    try:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        gr = chunk_gated_delta_rule_bwd(*c.inputs(), do, dht, **c.lowlevel_kwargs(), **kw)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    finally:
        if old is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = old
    return gr, peak


def _same_bits(c, kw, slots_list, ctx, oracle=True):
    gen = torch.Generator().manual_seed(7)
    st = (c.N, c.dims[3], c.dims[5], c.dims[4]) if c.state_v_first else (c.N, c.dims[3], c.dims[4], c.dims[5])
    do = torch.randn(c.v.shape, generator=gen).to(device=DEV, dtype=c.q.dtype)
    dht = torch.randn(st, generator=gen).to(DEV)
    one, peak_one = _bwd(c, do, dht, 0, **kw)
    for name in NAMES:
        x = getattr(one, name)
        assert x is None or torch.isfinite(x.float()).all(), f"{name} not finite ({ctx})"
    if oracle:
        rb = oracle_backward(c, do, dht)
        b = bounds_for(c.q.dtype)
        for name in NAMES:
            if rb[name] is not None:
                check(name, getattr(one, name), rb[name], c, b[name], context=f"{ctx} seed={c.seed}")
    for slots in slots_list:
        got, peak = _bwd(c, do, dht, slots, **kw)
        for name in NAMES:
            a, b = getattr(one, name), getattr(got, name)
            assert (a is None) == (b is None), name
            assert a is None or torch.equal(a, b), f"{name}: blocks of {slots} slots change the bits ({ctx})"
        if slots <= 2:
            assert peak < peak_one, f"blocks of {slots} slots take {peak} bytes, one block {peak_one} ({ctx})"


# A varlen pack of every kind of length: empty first, between and last; one token; one chunk and
# one token either side; a long one that crosses many blocks.
PACK = [0, 300, 777, 0, 1, 64, 65, 63, 1500, 0]


@pytest.mark.parametrize("precision", ["default", "fast", "high"])
@pytest.mark.parametrize("D", [64, 128])
def test_blocks_same_bits_varlen(precision, D):
    c = make_case(lengths=PACK, Hq=2, Hv=8, K=D, V=D, device=DEV, l2norm=True, gate_in_kernel=True)
    _same_bits(c, dict(precision=precision, context_parallel=False), [1, 2, 3, 7], f"{precision} D={D}",
               oracle=precision != "fast")


@pytest.mark.parametrize("opt", ["dense", "fp16", "v_first_no_h0", "pool", "cp_auto"])
def test_blocks_same_bits_options(opt):
    kw = dict(context_parallel=False)
    if opt == "dense":
        c = make_case(B=3, T=300, Hq=4, Hv=16, K=128, V=128, device=DEV)
    elif opt == "fp16":
        c = make_case(lengths=PACK, Hq=2, Hv=4, K=128, V=128, dtype=torch.float16, device=DEV)
    elif opt == "v_first_no_h0":
        c = make_case(lengths=PACK, Hq=1, Hv=2, K=128, V=128, device=DEV, state_v_first=True, initial_state=False)
    elif opt == "pool":
        c = make_case(lengths=[200, 0, 129], Hq=2, Hv=4, K=128, V=128, device=DEV)
        c.initial_state = torch.randn(5, 4, 128, 128, device=DEV)  # a pool; one sequence without a row
        c.state_indices = torch.tensor([3, -1, 0], device=DEV, dtype=torch.int32)
    else:  # automatic CP where the reverse pass stays unsplit: 7 x 32 chains fill the SMs
        c = make_case(lengths=[900, 33, 640, 0, 1, 64, 400], Hq=8, Hv=32, K=128, V=128, device=DEV)
        kw = dict(context_parallel=None)
    _same_bits(c, kw, [1, 2, 5], opt, oracle=opt not in ("pool",))


def test_blocks_ignored_where_the_reverse_pass_splits():
    """A reverse pass split into segments does not block (its warm-ups reach past a block): the
    hook changes nothing there, bits and memory alike."""
    c = make_case(lengths=[3000], Hq=1, Hv=2, K=128, V=128, device=DEV)
    kw = dict(context_parallel=True, cp_segment=1024)
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(c.v.shape, generator=gen).to(device=DEV, dtype=c.q.dtype)
    dht = torch.randn(c.initial_state.shape, generator=gen).to(DEV)
    one, peak_one = _bwd(c, do, dht, 0, **kw)
    got, peak = _bwd(c, do, dht, 1, **kw)
    for name in NAMES:
        a, b = getattr(one, name), getattr(got, name)
        assert a is None or torch.equal(a, b), name
    assert peak == peak_one
