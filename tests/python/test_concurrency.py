"""Concurrency, CUDA graphs and leaks (issue 38, point 4).

CPU (runs everywhere, about 10 s on 2 cores, 2,000 + 11,000 library calls):
  * several Python threads call forward and backward at once (the binding releases the GIL, so the
    calls overlap in the library, each with its own CPU worker threads), on different problems
    (varlen and dense, fp32/bf16/fp16, l2norm, gate in the kernel, V-major states, checkpoints, a
    state pool, the autograd op, rejected calls): every result is bitwise the serial call's, and a
    rejected call's message is its own;
  * 10,000 small calls (forward, backward, the autograd op, rejected calls) with the process's
    C heap in use (glibc's mallinfo2; else the resident memory, /proc/self/statm) and Python's
    live object count bounded after a warm-up.
GPU (marked gpu, skipped without CUDA; same patterns as test_gpu.py):
  * threads each on its own torch.cuda.Stream, calling at once: bitwise the serial calls';
  * a CUDA graph of a forward with the final state (cu_seqlens' host copy passed) replayed 200 times
    with q/k/v, the gates, beta and the initial state refilled between replays: each replay
    bitwise the eager call on the same values;
  * 10,000 small calls with torch.cuda.memory_allocated(), the driver's free memory and the
    process's resident memory bounded.

Bitwise means byte for byte (NaN patterns included): ``_same`` compares the raw bytes.
"""
import ctypes
import gc
import os
import random
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import flashgdn
from flashgdn import chunk_gated_delta_rule, chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd
from gdn_testutil import make_case

# ---- helpers ------------------------------------------------------------------------------------


def _bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a, b) -> bool:
    """Same bits: tensors byte for byte (shape and dtype too), None with None, strings equal,
    lists and tuples element by element."""
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b)))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                and torch.equal(_bytes(a).cpu(), _bytes(b).cpu()))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return a == b


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                     "usmblks", "fsmblks", "uordblks", "fordblks",
                                                     "keepcost")]


def _mallinfo2():
    try:
        fn = ctypes.CDLL(None).mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _mallinfo2()


def _heap_bytes() -> int:
    """Bytes of the C heap in use now (glibc: mallinfo2's uordblks + hblkhd, what malloc handed
    out and has not taken back, torch's CPU tensors and the library's buffers included). A leak
    raises it whatever the process freed before: the resident size does not grow while malloc
    reuses pages that earlier tests freed (the self-check below failed on RSS in the full suite).
    Where mallinfo2 is missing, the resident size."""
    if _MALLINFO2 is None:
        return _rss_bytes()
    info = _MALLINFO2()
    return int(info.uordblks) + int(info.hblkhd)


def _rss_bytes() -> int:
    """The process's resident set size now (Linux: /proc/self/statm, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fwd_bwd(c, device, checkpoint_every=0, pool_dtype=None, do_seed=7):
    """Low-level forward (final state, optional checkpoints) then backward; every output. With
    pool_dtype the initial states are a pool in that dtype, read and written in place through
    state_indices (a fresh copy per call, so repeated calls see the same pool)."""
    kw = c.lowlevel_kwargs()
    out = []
    if pool_dtype is not None:
        pool = torch.cat([c.initial_state, c.initial_state.flip(0)]).to(pool_dtype)  # 2N rows
        rows = torch.arange(2 * c.N - 1, -1, -2, dtype=torch.int32, device=device)[: c.N].flip(0).contiguous()
        kw.update(initial_state=pool, state_indices=rows)
    o, ht, ck = chunk_gated_delta_rule_fwd(*c.inputs(), output_final_state=True,
                                           checkpoint_every=checkpoint_every, **kw)
    out += [o, ht, ck]
    if pool_dtype is not None:
        out.append(pool.clone())  # the final states, written into the pool's rows
        # the backward reads the initial states from a pool as the forward found it
        kw["initial_state"] = torch.cat([c.initial_state, c.initial_state.flip(0)]).to(pool_dtype)
    gen = torch.Generator().manual_seed(do_seed)
    do = torch.randn(o.shape, generator=gen).to(device=device, dtype=o.dtype)
    dht = torch.randn(c.initial_state.shape, generator=gen).to(device) if pool_dtype is None else None
    gr = chunk_gated_delta_rule_bwd(*c.inputs(), do, dht, **kw)
    return out + list(gr)


def _autograd(c, device, do_seed=8):
    """The FLA call (flashgdn.chunk_gated_delta_rule) with torch.autograd.grad: o, the final state
    and the gradient of every differentiable input."""
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
             if getattr(c, n) is not None]
    leaves = {n: getattr(c, n).detach().clone().requires_grad_() for n in names}
    kw = {key: val for key, val in c.kwargs().items()
          if key not in ("initial_state", "A_log", "dt_bias", "state_indices")}
    o, ht = chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                                   initial_state=leaves.get("initial_state"), A_log=leaves.get("A_log"),
                                   dt_bias=leaves.get("dt_bias"), output_final_state=True,
                                   cu_seqlens_cpu=c.cu_seqlens_host, **kw)
    gen = torch.Generator().manual_seed(do_seed)
    do = torch.randn(o.shape, generator=gen).to(device=device, dtype=o.dtype)
    dht = torch.randn(ht.shape, generator=gen).to(device)
    grads = torch.autograd.grad((o, ht), list(leaves.values()), (do, dht))
    return [o.detach(), ht.detach()] + list(grads)


def _rejected(c, what):
    """A call that the library refuses; returns the exception's type and message."""
    kw = c.lowlevel_kwargs()
    q, k, v, g, beta = c.inputs()
    try:
        if what == "beta_shape":
            chunk_gated_delta_rule_fwd(q, k, v, g, beta[..., :1], **kw)
        elif what == "g_dtype":
            chunk_gated_delta_rule_fwd(q, k, v, g.to(torch.int32), beta, **kw)
        elif what == "nan_check_mode":  # a value check: reads the values (check mode)
            bad = v.clone()
            bad.view(-1)[5] = float("nan")
            chunk_gated_delta_rule_bwd(q, k, bad, g, beta, torch.ones_like(v), **kw, check_inputs=True)
        elif what == "k_heads":
            chunk_gated_delta_rule_fwd(q, k[:, :, :1].contiguous(), v, g, beta, **kw)
        else:
            raise AssertionError(what)
    except (ValueError, RuntimeError, TypeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return "accepted"


# ---- CPU: threads ------------------------------------------------------------------------------

PACK = [70, 0, 1, 64, 130, 65]


def _cpu_jobs():
    """(name, thunk) pairs: each thunk makes one call sequence on fixed inputs and returns its
    results. Inputs are built once and shared by every thread (read concurrently)."""
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    c1 = make_case(lengths=PACK, Hq=2, Hv=4, K=64, V=64, dtype=bf16, seed=1)
    c2 = make_case(B=3, T=100, Hq=1, Hv=2, K=128, V=128, dtype=f32, l2norm=True, gate_in_kernel=True, seed=2)
    c3 = make_case(lengths=[33, 128, 7], Hq=2, Hv=2, K=64, V=128, dtype=f16, state_v_first=True, scale=0.2,
                   g_dtype=bf16, beta_dtype=bf16, seed=3)
    c4 = make_case(lengths=[90, 1, 64], Hq=1, Hv=2, K=64, V=64, dtype=bf16, seed=4)
    c5 = make_case(lengths=[50, 0, 80], Hq=1, Hv=2, K=64, V=64, dtype=f32, l2norm=True, gate_in_kernel=True,
                   cu_dtype=torch.int64, seed=5)
    c6 = make_case(B=2, T=65, Hq=2, Hv=4, K=32, V=64, dtype=bf16, initial_state=False, seed=6)
    return [
        ("varlen_bf16_checkpoints", lambda: _fwd_bwd(c1, "cpu", checkpoint_every=64)),
        ("dense_fp32_gate_l2norm", lambda: _fwd_bwd(c2, "cpu")),
        ("varlen_fp16_vfirst_scale", lambda: _fwd_bwd(c3, "cpu", checkpoint_every=64)),
        ("varlen_pool_bf16", lambda: _fwd_bwd(c4, "cpu", pool_dtype=bf16)),
        ("autograd_varlen_gate", lambda: _autograd(c5, "cpu")),
        ("autograd_dense_no_h0", lambda: _autograd(c6, "cpu")),
        ("rejected_beta_shape", lambda: _rejected(c1, "beta_shape")),
        ("rejected_g_dtype", lambda: _rejected(c2, "g_dtype")),
        ("rejected_nan_check_mode", lambda: _rejected(c3, "nan_check_mode")),
        ("rejected_k_heads", lambda: _rejected(c6, "k_heads")),
    ]


@pytest.fixture
def cpu_workers(monkeypatch):
    """Three CPU workers a call (more than this machine may have cores): each concurrent call
    starts its own, so the library's pool runs with concurrent callers oversubscribed. Set before
    any thread starts (the library reads the variable on every call)."""
    monkeypatch.setenv("FLASHGDN_NUM_THREADS", "3")


def test_bit_comparison_sees_one_flipped_bit():
    """The comparison the tests below rest on can fail: one bit of one output, a different problem,
    a different message."""
    jobs = dict(_cpu_jobs())
    a = jobs["varlen_bf16_checkpoints"]()
    b = jobs["varlen_bf16_checkpoints"]()
    assert _same(a, b)
    flipped = [x.clone() if isinstance(x, torch.Tensor) else x for x in b]
    flipped[4].view(-1).view(torch.uint8)[3] ^= 1  # dk
    assert not _same(a, flipped)
    assert not _same(a, jobs["dense_fp32_gate_l2norm"]())
    assert "beta" in jobs["rejected_beta_shape"]()
    assert not _same(jobs["rejected_beta_shape"](), jobs["rejected_g_dtype"]())


def test_cpu_threads_same_bits_as_serial(cpu_workers):
    """Six threads run every job four times, in a shuffled order, all released at once; each
    result equals the job's serial result bit for bit."""
    jobs = _cpu_jobs()
    serial = {name: fn() for name, fn in jobs}
    named = {"rejected_beta_shape": "'beta'", "rejected_g_dtype": "'g ", "rejected_nan_check_mode": "nan at v[",
             "rejected_k_heads": "'k'"}
    for name, part in named.items():  # each refused, naming its own argument
        assert serial[name].startswith("ValueError") and part in serial[name], (name, serial[name])
    tasks = [(name, fn) for name, fn in jobs for _ in range(4)]
    random.Random(38).shuffle(tasks)
    n_threads = 6
    start = threading.Barrier(n_threads)

    def worker(i):
        start.wait()
        return [(name, fn()) for name, fn in tasks[i::n_threads]]

    with ThreadPoolExecutor(n_threads) as ex:
        results = [r for part in ex.map(worker, range(n_threads)) for r in part]
    assert len(results) == len(tasks)
    bad = [name for name, res in results if not _same(res, serial[name])]
    assert not bad, f"results differ from the serial call's under concurrency: {sorted(set(bad))}"


# ---- CPU: leaks --------------------------------------------------------------------------------

# Calls the leak test makes after its warm-up (one call = one forward or backward entry, a rejected
# call included), and the growth of resident memory it tolerates.
LEAK_CALLS = 10_000
WARMUP_CALLS = 1_000
WINDOWS = 10
RSS_BOUND = 4 << 20  # 4 MiB


def _small_cpu_calls():
    """A cycle of small CPU calls of every kind: (number of library entries, thunk)."""
    c = make_case(lengths=[5, 0, 11, 64], Hq=1, Hv=2, K=64, V=64, dtype=torch.float32, seed=21)
    d = make_case(B=2, T=9, Hq=1, Hv=1, K=32, V=32, dtype=torch.bfloat16, l2norm=True, gate_in_kernel=True,
                  seed=22)
    kw, dkw = c.lowlevel_kwargs(), d.lowlevel_kwargs()
    o, ht, _ = chunk_gated_delta_rule_fwd(*c.inputs(), output_final_state=True, **kw)
    return [
        (1, lambda: chunk_gated_delta_rule_fwd(*c.inputs(), output_final_state=True, checkpoint_every=64, **kw)),
        (1, lambda: chunk_gated_delta_rule_bwd(*c.inputs(), o, ht, **kw)),
        (1, lambda: chunk_gated_delta_rule_fwd(*d.inputs(), output_final_state=True, **dkw)),
        (2, lambda: _autograd(d, "cpu")),
        (1, lambda: _rejected(c, "beta_shape")),
        (1, lambda: _rejected(d, "nan_check_mode")),
    ]


def _run_calls(cycle, n_calls, state):
    done = 0
    while done < n_calls:
        entries, fn = cycle[state[0] % len(cycle)]
        state[0] += 1
        fn()
        done += entries
    return done


def _measure(cycle, calls_per_window, windows, state):
    """Heap bytes in use (_heap_bytes) and live Python objects at the end of each window of calls."""
    rss, objs = [], []
    for _ in range(windows):
        _run_calls(cycle, calls_per_window, state)
        gc.collect()
        rss.append(_heap_bytes())
        objs.append(len(gc.get_objects()))
    return rss, objs


def _leak_verdict(warm_rss, rss, bound):
    """Growth that a leak cannot hide and allocator noise cannot fake: the least heap in use of
    the last three windows over the largest of the warm-up's. A steady leak of L bytes a call
    raises every later window by at least L times the calls since the warm-up; the allocator's
    ups and downs (arenas, trimming) are absorbed by the max on one side and the min on the other."""
    growth = min(rss[-3:]) - max(warm_rss)
    return growth, growth < bound


class _FakeCudaTensor(torch.Tensor):
    """A CPU tensor that says it lives on a CUDA device: drives the host-copy table of
    cu_seqlens (flashgdn._core.resolve_host_seqlens) without a GPU."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def test_seqlens_table_from_many_threads(monkeypatch):
    """Regression: calls without the host copy of cu_seqlens, from 10 threads, more distinct
    tensors than the table keeps (64): every call gets its own tensor's copy, none fails (the
    table was updated without a lock: one thread evicted another's entry, KeyError)."""
    from flashgdn import _core
    import contextlib
    import sys

    class SlowTable(OrderedDict):  # widens the window between an entry's store and its move
        def move_to_end(self, key, last=True):
            time.sleep(1e-4)
            super().move_to_end(key, last)

    monkeypatch.setattr(_core.torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(_core.torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(_core, "_SEQLENS_SEEN", SlowTable())
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    T = 10
    q = torch.zeros(1).as_subclass(_FakeCudaTensor)
    errors = []

    def worker(w):
        cus = [torch.tensor([0, (w + i) % T, T]).as_subclass(_FakeCudaTensor) for i in range(7)]
        try:
            for _ in range(40):
                for cu in cus:
                    host = _core.resolve_host_seqlens(q, cu, None, T)
                    assert host.tolist() == cu.as_subclass(torch.Tensor).tolist()
        except Exception as e:  # noqa: BLE001 (any failure of a thread is the test's)
            errors.append(repr(e))

    try:
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]


def test_seqlens_table_inference_tensors(monkeypatch):
    """Regression: a device cu_seqlens made under torch.inference_mode (as serving engines make
    them) has no version counter; the host-copy table keys it without one instead of raising, and
    a capture after one eager call with it finds the copy."""
    from flashgdn import _core
    import contextlib

    capturing = [False]
    monkeypatch.setattr(_core.torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(_core.torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    with torch.inference_mode():
        q = torch.zeros(1).as_subclass(_FakeCudaTensor)
        cu = torch.tensor([0, 3, 10]).as_subclass(_FakeCudaTensor)
        assert _core.resolve_host_seqlens(q, cu, None, 10).tolist() == [0, 3, 10]
        capturing[0] = True
        assert _core.resolve_host_seqlens(q, cu, None, 10).tolist() == [0, 3, 10]
        other = torch.tensor([0, 3, 10]).as_subclass(_FakeCudaTensor)
        with pytest.raises(ValueError, match="cu_seqlens: a call captured in a CUDA graph"):
            _core.resolve_host_seqlens(q, other, None, 10)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc/self/statm (Linux)")
def test_rss_probe_sees_a_deliberate_leak():
    """The measurement can fail: a forward whose outputs are kept (as a leak would keep them; about
    140 KiB a call) over 200 calls is reported as growth beyond the bound."""
    cycle = _small_cpu_calls()
    state = [0]
    warm, _ = _measure(cycle, 50, 3, state)
    kept = []

    def leaky():
        kept.append(cycle[0][1]())

    rss, _ = _measure([(1, leaky)], 40, 5, state)
    per_call = sum(x.numel() * x.element_size() for x in kept[0] if x is not None)
    growth, ok = _leak_verdict(warm, rss, RSS_BOUND)
    print(f"\nprobe: kept {per_call >> 10} KiB a call, measured growth {growth / 2**20:.2f} MiB")
    assert per_call > 100 << 10
    assert not ok, (f"keeping {per_call >> 10} KiB a call over {len(kept)} calls was measured as "
                    f"{growth / 2**20:.2f} MiB")
    del kept


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc/self/statm (Linux)")
def test_cpu_no_leak_over_10000_calls():
    """10,000 small calls after 1,000 of warm-up: the heap in use (_heap_bytes) grows by less than
    4 MiB (the least of the last three windows over the most of the warm-up's: see _leak_verdict) and the
    live Python objects by less than 500. 4 MiB catches a leak of about 500 bytes a call or
    more (any leaked output, workspace or state of these calls is 4 KiB or more) and is
    several times the noise measured (well under 1 MiB); the object bound catches a reference
    kept per call (10,000 calls would add 10,000 objects or more)."""
    cycle = _small_cpu_calls()
    state = [0]
    t0 = time.perf_counter()
    warm_rss, warm_objs = _measure(cycle, WARMUP_CALLS // 4, 4, state)
    rss, objs = _measure(cycle, LEAK_CALLS // WINDOWS, WINDOWS, state)
    elapsed = time.perf_counter() - t0
    growth, ok = _leak_verdict(warm_rss, rss, RSS_BOUND)
    mib = [round(x / 2**20, 2) for x in warm_rss + rss]
    print(f"\n{LEAK_CALLS + WARMUP_CALLS} CPU calls in {elapsed:.1f} s; resident MiB per window {mib}; "
          f"growth {growth / 2**20:.3f} MiB; live objects {warm_objs[-1]} -> {objs[-1]}")
    assert ok, f"the heap in use grew by {growth / 2**20:.2f} MiB over {LEAK_CALLS} calls: {mib}"
    assert objs[-1] - warm_objs[-1] < 500, f"live Python objects grew: {warm_objs} -> {objs}"


# ---- GPU ---------------------------------------------------------------------------------------
# Not run on a machine without CUDA. Each test takes a few seconds on an H100.

DEV = "cuda"


def gpu(fn):
    """The marks of tests/python/test_gpu.py's pytestmark, on one test."""
    fn = pytest.mark.skipif(not flashgdn.has_cuda(), reason="flashgdn was built without the CUDA backend")(fn)
    fn = pytest.mark.skipif(not torch.cuda.is_available(),
                            reason="no CUDA device (torch.cuda.is_available() is False)")(fn)
    return pytest.mark.gpu(fn)


def _gpu_jobs():
    """(name, thunk) pairs on different problems (shapes, dtypes, options), fixed seeds."""
    bf16, f16 = torch.bfloat16, torch.float16
    c1 = make_case(lengths=[700, 0, 1, 64, 300, 65], Hq=4, Hv=16, K=128, V=128, dtype=bf16, device=DEV,
                   l2norm=True, gate_in_kernel=True, seed=31)
    c2 = make_case(B=3, T=257, Hq=2, Hv=8, K=128, V=128, dtype=bf16, device=DEV, seed=32)
    c3 = make_case(lengths=[129, 513, 64], Hq=2, Hv=4, K=64, V=64, dtype=f16, device=DEV, state_v_first=True,
                   seed=33)
    c4 = make_case(lengths=[1000, 37], Hq=2, Hv=8, K=128, V=128, dtype=bf16, device=DEV, seed=34)
    return [
        ("varlen_gate_l2norm", lambda: _fwd_bwd(c1, DEV)),
        ("dense", lambda: _fwd_bwd(c2, DEV)),
        ("varlen_fp16_vfirst_checkpoints", lambda: _fwd_bwd(c3, DEV, checkpoint_every=64)),
        ("varlen_pool_bf16", lambda: _fwd_bwd(c4, DEV, pool_dtype=bf16)),
        ("autograd_varlen_gate", lambda: _autograd(c1, DEV)),
    ]


@gpu
def test_gpu_threads_and_streams_same_bits_as_serial():
    """One thread per job, each on its own torch.cuda.Stream, runs its job five times, all
    released at once; every result equals the job's serial result on the default stream, bit for
    bit."""
    jobs = _gpu_jobs()
    serial = [fn() for _, fn in jobs]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in jobs]
    start = threading.Barrier(len(jobs))

    def worker(i):
        start.wait()
        with torch.cuda.stream(streams[i]):
            out = [jobs[i][1]() for _ in range(5)]
        streams[i].synchronize()
        return out

    with ThreadPoolExecutor(len(jobs)) as ex:
        results = list(ex.map(worker, range(len(jobs))))
    torch.cuda.synchronize()
    for (name, _), ref, runs in zip(jobs, serial, results):
        for r, res in enumerate(runs):
            assert _same(res, ref), f"{name}, run {r} on a side stream beside other threads: differs from serial"


GRAPH_REPLAYS = 200


@gpu
@pytest.mark.parametrize("mode", ["varlen", "dense_gate_in_kernel"])
def test_cuda_graph_replays_with_new_values(mode):
    """A CUDA graph of the FLA call with the final state (cu_seqlens' host copy passed), replayed
    200 times with new values of q, k, v, g, beta and the initial state (and A_log, dt_bias with
    the gate in the kernel) copied into the captured tensors before each replay: every replay's
    output and final state equal, bit for bit, an eager call on the same values; and consecutive
    replays differ (the new values are read)."""
    if mode == "varlen":
        shape = dict(lengths=[300, 0, 1, 129, 64, 77], Hq=2, Hv=8, K=128, V=128, device=DEV)
    else:
        shape = dict(B=2, T=200, Hq=2, Hv=8, K=128, V=128, device=DEV, l2norm=True, gate_in_kernel=True)
    c = make_case(**shape, seed=40)
    names = ["q", "k", "v", "g", "beta", "initial_state"] + (["A_log", "dt_bias"] if c.use_gate_in_kernel else [])
    static = {n: getattr(c, n).clone() for n in names}
    opts = dict(scale=c.scale, use_qk_l2norm_in_kernel=c.use_qk_l2norm_in_kernel,
                use_gate_in_kernel=c.use_gate_in_kernel, cu_seqlens=c.cu_seqlens,
                cu_seqlens_cpu=c.cu_seqlens_host, output_final_state=True)

    def call(t):
        return chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["initial_state"],
                                      A_log=t.get("A_log"), dt_bias=t.get("dt_bias"), **opts)

    torch.cuda.synchronize()
    with torch.no_grad():
        torch.cuda.set_sync_debug_mode("error")
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                call(static)  # warm-up
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = call(static)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        previous = None
        for i in range(GRAPH_REPLAYS):
            n = make_case(**shape, seed=1000 + i)
            for name in names:
                static[name].copy_(getattr(n, name))
            graph.replay()
            eager = call({name: getattr(n, name) for name in names})
            assert _same(out[0], eager[0]), f"replay {i}: o differs from the eager call"
            assert _same(out[1], eager[1]), f"replay {i}: the final state differs from the eager call"
            if previous is not None:
                assert not _same(out[0], previous), f"replay {i}: o unchanged with new inputs"
            previous = out[0].clone()


# The bounds of the GPU leak test: a leaked output of these calls is 128 KiB or more on the device
# (so 10,000 calls would leak over 1 GiB), so the tensors' bound can be tight; the driver's free
# memory and the resident host memory move with caches (the allocator's, the driver's), hence
# their looser bounds, still far under any leak of a call's outputs or workspace.
GPU_ALLOCATED_BOUND = 1 << 20  # 1 MiB
GPU_DRIVER_BOUND = 64 << 20  # 64 MiB
GPU_RSS_BOUND = 32 << 20  # 32 MiB


@gpu
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc/self/statm (Linux)")
def test_gpu_no_leak_over_10000_calls():
    """10,000 small CUDA calls (forward with and without the host copy of cu_seqlens, backward,
    the autograd op, rejected calls) after 1,000 of warm-up: torch.cuda.memory_allocated() grows
    by less than 1 MiB, the device memory in use by the driver's count (total - free, with
    torch's cache emptied) by less than 64 MiB, resident host memory by less than 32 MiB (each the
    least of the last three windows over the most of the warm-up's), live Python objects by less
    than 500."""
    c = make_case(lengths=[64, 1, 63], Hq=2, Hv=4, K=128, V=128, device=DEV, seed=51)
    d = make_case(B=2, T=64, Hq=1, Hv=4, K=128, V=128, device=DEV, l2norm=True, gate_in_kernel=True, seed=52)
    kw, dkw = c.lowlevel_kwargs(), d.lowlevel_kwargs()
    no_host = dict(kw, cu_seqlens_host=None)  # the library's wrapper reads cu_seqlens back (and caches it)
    o, ht, _ = chunk_gated_delta_rule_fwd(*c.inputs(), output_final_state=True, **kw)
    cycle = [
        (1, lambda: chunk_gated_delta_rule_fwd(*c.inputs(), output_final_state=True, **kw)),
        (1, lambda: chunk_gated_delta_rule_fwd(*c.inputs(), output_final_state=True, checkpoint_every=64,
                                               **no_host)),
        (1, lambda: chunk_gated_delta_rule_bwd(*c.inputs(), o, ht, **kw)),
        (1, lambda: chunk_gated_delta_rule_fwd(*d.inputs(), output_final_state=True, **dkw)),
        (2, lambda: _autograd(d, DEV)),
        (1, lambda: _rejected(c, "beta_shape")),
    ]
    state = [0]

    def measure(calls, windows):
        alloc, used, rss, objs = [], [], [], []
        for _ in range(windows):
            _run_calls(cycle, calls, state)
            torch.cuda.synchronize()
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            alloc.append(torch.cuda.memory_allocated())
            used.append(total - free)
            rss.append(_rss_bytes())
            objs.append(len(gc.get_objects()))
        return alloc, used, rss, objs

    t0 = time.perf_counter()
    warm = measure(WARMUP_CALLS // 4, 4)
    after = measure(LEAK_CALLS // WINDOWS, WINDOWS)
    elapsed = time.perf_counter() - t0
    mib = lambda xs: [round(x / 2**20, 2) for x in xs]  # noqa: E731
    print(f"\n{LEAK_CALLS + WARMUP_CALLS} CUDA calls in {elapsed:.1f} s; MiB per window: "
          f"allocated {mib(warm[0] + after[0])}, driver used {mib(warm[1] + after[1])}, "
          f"resident {mib(warm[2] + after[2])}; live objects {warm[3][-1]} -> {after[3][-1]}")
    for label, i, bound in (("torch.cuda.memory_allocated()", 0, GPU_ALLOCATED_BOUND),
                            ("device memory in use (driver)", 1, GPU_DRIVER_BOUND),
                            ("resident host memory", 2, GPU_RSS_BOUND)):
        growth, ok = _leak_verdict(warm[i], after[i], bound)
        assert ok, f"{label} grew by {growth / 2**20:.2f} MiB over {LEAK_CALLS} calls (bound {bound >> 20} MiB)"
    assert after[3][-1] - warm[3][-1] < 500, f"live Python objects grew: {warm[3]} -> {after[3]}"
