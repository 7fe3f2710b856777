"""The fused Hopper backward (csrc/sm90/bwd_fused*, issue 36; the default path, FLASHGDN_BWD_FUSED=1 set
here against a stray 0): at precision "fast" and "default", bf16, K = V = 128, every gradient against
the float64 oracle within the suite's bounds (whole tensor and per (sequence, head) slice), for
each option the backward has; the same bits on a second run; `default`'s split T diag(beta) in
effect. GPU only."""
import os

import pytest
import torch

from gdn_testutil import (GPU_MARKS, OPTIONS, _rel, bounds_for, check, make_case, oracle_backward, option_kwargs,
                          poisoned_grads)
from flashgdn import chunk_gated_delta_rule_bwd
from flashgdn.reference import to_f64

pytestmark = GPU_MARKS
DEV = "cuda"
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias")


@pytest.fixture(autouse=True)
def fused(monkeypatch):
    monkeypatch.setenv("FLASHGDN_BWD_FUSED", "1")


LEVELS = ("fast", "default")


def backward(c, do, dht, level="fast"):
    """The low-level backward at `level` into NaN-poisoned buffers (an element not written shows)."""
    return chunk_gated_delta_rule_bwd(*c.inputs(), do, dht, precision=level, **c.lowlevel_kwargs(),
                                      **poisoned_grads(c))


def inputs_of(c, seed=7):
    B, T, Hq, Hv, K, V = c.dims
    gen = torch.Generator().manual_seed(seed)
    st = (c.N, Hv, V, K) if c.state_v_first else (c.N, Hv, K, V)
    do = torch.randn(c.v.shape, generator=gen).to(device=DEV, dtype=c.q.dtype)
    dht = torch.randn(st, generator=gen).to(DEV)
    return do, dht


def check_grads(c, gr, do, dht, ctx, level="fast"):
    """Every gradient against the oracle within the suite's bounds; dg, dA_log and ddt_bias (token
    sums that cancel, docs/reliability.md D1) within the bound or 2x the staged backward's error on
    the same inputs: `fast`'s staged backward exceeds 1.2e-2 on some seeds too (dA_log up to 4.5e-2
    on 10 seeds; dg 1.4e-2 and 1.6e-2 on 2 of 16 seeds of dense 1x1024 4/4), and the two round
    differently, not worse: the fused dg's error over the staged one's ranged 0.71-1.63, mean 1.0,
    on those 16 seeds (H200, 2026-11-28)."""
    bounds = bounds_for(c.q.dtype)
    ref = oracle_backward(c, do, dht)
    staged = None
    for name in GRADS:
        x = getattr(gr, name)
        if ref[name] is None:
            assert x is None, name
            continue
        bound = bounds[name]
        if name in ("dg", "dA_log", "ddt_bias"):
            if staged is None:
                os.environ["FLASHGDN_BWD_FUSED"] = "0"
                staged = backward(c, do, dht, level)
                os.environ["FLASHGDN_BWD_FUSED"] = "1"
            bound = max(bound, 2.0 * _rel(to_f64(getattr(staged, name)), ref[name]))
        check(name, x, ref[name], c, bound, context=f"{ctx} {level} seed={c.seed}")


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("opt", ["plain"] + OPTIONS)
def test_fused_options_varlen_gva(opt, level):
    """Varlen with an empty sequence, one-token and partial chunks; GVA (two value heads a q/k head)."""
    c = make_case(Hq=2, Hv=4, K=128, V=128, lengths=[130, 0, 64, 1, 257], device=DEV,
                  **option_kwargs(opt, 0.07))
    do, dht = inputs_of(c)
    gr = backward(c, do, dht, level)
    if c.use_gate_in_kernel and level == "default":
        # D7 (docs/reliability.md): `default` with the gate in the kernel takes the staged
        # kernels, for dA_log's and ddt_bias's sake: the same bits as FLASHGDN_BWD_FUSED=0.
        os.environ["FLASHGDN_BWD_FUSED"] = "0"
        staged = backward(c, do, dht, level)
        os.environ["FLASHGDN_BWD_FUSED"] = "1"
        for name in GRADS:
            x, y = getattr(gr, name), getattr(staged, name)
            assert (x is None and y is None) or torch.equal(x, y), name
    check_grads(c, gr, do, dht, opt, level)


@pytest.mark.parametrize("level", LEVELS)
def test_fused_packed_tails(level):
    """Packed sequences of any lengths (64 + 100 + 0 + 1 + 300 + 67 tokens: partial last chunks in the
    tensor's middle, one of one token, an empty one): the walk reads v and dO in place, but a
    sequence's partial last chunk (its tail) from 64 rows zero past its length (bwd_fused_prep.cu),
    since the rows past it are the next sequence's, and stores that chunk's dv through the tail's
    tile (the reduce step copies its rows out; FusedLayout::tails). Every gradient against the
    oracle; the same bits as the call whose dO TMA cannot map (stride 0 over the heads: v and dO
    copied to slot layout, dv through the workspace; reverse CP off in both); and NaN in the rows
    right after each tail reaches no gradient of the sequence before (docs/api.md, "Non-finite
    values"): its dq, dk, dv, dg, dbeta rows and dh0 keep their bits."""
    lengths = [100, 64, 1, 128, 300, 67, 0, 130]
    c = make_case(Hq=2, Hv=4, K=128, V=128, lengths=lengths, device=DEV, l2norm=True)
    do, dht = inputs_of(c)
    do = do[:, :, :1].expand(do.shape)  # one head's dO for all: a stride of 0

    def run(v, d_o):
        return chunk_gated_delta_rule_bwd(c.q, c.k, v, c.g, c.beta, d_o, dht, precision=level, context_parallel=False,
                                          **c.lowlevel_kwargs(), **poisoned_grads(c))

    direct, copied = run(c.v, do.contiguous()), run(c.v, do)
    check_grads(c, direct, do, dht, "packed tails", level)
    for name in GRADS:
        x, y = getattr(direct, name), getattr(copied, name)
        assert (x is None and y is None) or torch.equal(x, y), name
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    tails = [n for n in range(len(lengths)) if lengths[n] % 64 and cu[n + 1] < cu[-1]]  # rows of a later one follow
    v_nan, do_nan = c.v.clone(), do.contiguous().clone()
    hit = set()
    for n in tails:
        v_nan[:, cu[n + 1]:cu[n + 1] + 3] = float("nan")
        do_nan[:, cu[n + 1]:cu[n + 1] + 3] = float("nan")
        hit.update(range(cu[n + 1], cu[n + 1] + 3))
    poisoned = run(v_nan, do_nan)
    checked = [n for n in tails if not hit & set(range(cu[n], cu[n + 1]))]
    assert len(checked) == 3, checked  # the 100-, 1- and 300-token sequences
    for n in checked:
        rows = slice(cu[n], cu[n + 1])
        for name in ("dq", "dk", "dv", "dg", "dbeta"):
            x, y = getattr(direct, name)[:, rows], getattr(poisoned, name)[:, rows]
            assert torch.equal(x, y), f"{name} of sequence {n}: reached by NaN in the rows after its tail"
        if direct.dh0 is not None:
            assert torch.equal(direct.dh0[n], poisoned.dh0[n]), f"dh0 of sequence {n}"


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("B,T,Hq,Hv", [(2, 300, 2, 4), (1, 1024, 4, 4), (3, 64, 1, 2)])
def test_fused_dense(B, T, Hq, Hv, level):
    c = make_case(B=B, T=T, Hq=Hq, Hv=Hv, K=128, V=128, device=DEV, l2norm=True)
    do, dht = inputs_of(c)
    check_grads(c, backward(c, do, dht, level), do, dht, f"dense {B}x{T} {Hq}/{Hv}", level)


def test_fused_default_stages_the_fp16_island():
    """`default` stages T diag(beta), dVn and R as fp16 tiles (bwd_fused_kernel.cuh, kF16Island): dv,
    which takes no chunk-start state (dv = (T diag(beta))^T dVn), then differs from `fast`'s (bf16)
    and is closer to the oracle (by the CPU emulation ~25%, bench/fused-backward.md "The fp16
    island"). With the same staging the two levels' dv would be the same bits."""
    c = make_case(B=1, T=1024, Hq=2, Hv=8, K=128, V=128, device=DEV, l2norm=True)
    do, dht = inputs_of(c)
    ref = oracle_backward(c, do, dht)["dv"]
    fast, default = (backward(c, do, dht, lv).dv for lv in ("fast", "default"))
    assert not torch.equal(fast, default)
    e_fast, e_default = _rel(to_f64(fast), ref), _rel(to_f64(default), ref)
    assert e_default < 0.97 * e_fast, (e_default, e_fast)


def test_fused_dense_head_first():
    """v and dO stored head-first ([B, H, T, D] memory seen as [B, T, H, D]): the kernel's tile maps
    of the user's tensors in the other dimension order."""
    c = make_case(B=2, T=200, Hq=2, Hv=4, K=128, V=128, device=DEV)
    c.v = c.v.transpose(1, 2).contiguous().transpose(1, 2)
    do, dht = inputs_of(c)
    do = do.transpose(1, 2).contiguous().transpose(1, 2)
    check_grads(c, backward(c, do, dht), do, dht, "head-first v, dO")


def test_fused_state_pool_and_no_dht(monkeypatch):
    """Initial states from a bf16 pool through state_indices (a negative index: its dh0 zero), no
    dht: the gradients against the oracle, dh0 against the staged backward's (same call)."""
    c = make_case(Hq=2, Hv=4, K=128, V=128, lengths=[200, 70, 5], device=DEV, initial_state=False)
    pool = (0.5 * torch.randn(6, 4, 128, 128, device=DEV)).to(torch.bfloat16)
    idx = torch.tensor([4, -1, 1], device=DEV, dtype=torch.int32)
    do, _ = inputs_of(c)
    kw = dict(c.lowlevel_kwargs(), initial_state=pool, state_indices=idx)
    gr = chunk_gated_delta_rule_bwd(*c.inputs(), do, None, precision="fast", **kw)
    monkeypatch.setenv("FLASHGDN_BWD_FUSED", "0")
    staged = chunk_gated_delta_rule_bwd(*c.inputs(), do, None, precision="fast", **kw)
    assert gr.dh0.shape == staged.dh0.shape and bool((gr.dh0[1] == 0).all())
    bounds = bounds_for(c.q.dtype)
    for name in ("dq", "dk", "dv", "dg", "dbeta", "dh0"):
        check(name, getattr(gr, name), to_f64(getattr(staged, name)), c, bounds[name],
              context="pool, against the staged backward")


@pytest.mark.parametrize("level", LEVELS)
def test_fused_same_bits(level):
    c = make_case(Hq=2, Hv=4, K=128, V=128, lengths=[300, 77], device=DEV, l2norm=True, gate_in_kernel=True)
    do, dht = inputs_of(c)
    a, b = backward(c, do, dht, level), backward(c, do, dht, level)
    for name in GRADS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None and y is None) or torch.equal(x, y), name


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("layout", ["varlen", "dense", "many_chains"])
def test_fused_reverse_cp(layout, level):
    """The fused walk split into segments (cp_segment=1024: 16 chunks; bwd_fused.cu 3a-3c): the
    transfers A_s, B_s, the scan and the segment walks, against the oracle and against the same call
    unsplit (context_parallel=False), with the same bits on a second split call; automatic CP too.
    Varlen: a 3000-token sequence in three segments (the last one partial; phase 1 walks it from
    dht and the transfers of the middle one), an empty one, one of 1100 tokens in two (no transfer:
    the last walked in phase 1 seeds the first), short ones unsplit; one q/k head, two value heads (GVA). Dense: one
    4096-token sequence (four segments), no gates' decay on one head (the exact transfer matters
    most there). Many chains: 48 (one 2560-token sequence, 12/48 heads), three segments of 16
    chunks, as the automatic plan takes them on 96 to 164 SMs (tests/cpp/test_bwd_dh_plan.cpp; not
    the same bits: the states pass's own split follows cp_segment too)."""
    if layout == "many_chains":
        c = make_case(B=1, T=2560, Hq=12, Hv=48, K=128, V=128, device=DEV, l2norm=True)
        c.g[:, :, 0] = 0.0
    elif layout == "varlen":
        # the gate in the kernel at `fast` only: `default` takes the staged kernels with it (D7)
        c = make_case(Hq=1, Hv=2, K=128, V=128, lengths=[3000, 130, 0, 1100], device=DEV, l2norm=True,
                      gate_in_kernel=level == "fast")
    else:
        c = make_case(B=1, T=4096, Hq=2, Hv=4, K=128, V=128, device=DEV, l2norm=True)
        c.g[:, :, 0] = 0.0
    do, dht = inputs_of(c)

    def run(**cp):
        return chunk_gated_delta_rule_bwd(*c.inputs(), do, dht, precision=level, **c.lowlevel_kwargs(),
                                          **poisoned_grads(c), **cp)

    off = run(context_parallel=False)
    on = run(context_parallel=True, cp_segment=1024)
    again = run(context_parallel=True, cp_segment=1024)
    auto = run(context_parallel=None)
    check_grads(c, on, do, dht, f"{layout} split", level)
    check_grads(c, auto, do, dht, f"{layout} automatic", level)
    ref = oracle_backward(c, do, dht)
    for name in GRADS:
        a, b, r = getattr(off, name), getattr(on, name), getattr(again, name)
        if a is None:
            continue
        assert torch.equal(b, r), f"{name}: two split calls differ"
        # The seeds (an fp32 scan of transfers walked with bf16 mirrors of dS, as the unsplit walk
        # is) round differently from the unsplit carry, not worse: the split call's error against
        # the oracle within 1.25x the unsplit call's. dg: a token's dg sums terms that cancel
        # (docs/reliability.md D1) and takes the chunk-start states, which the states pass splits
        # with cp_segment too, at `fast` in bf16: over 12 seeds of each case (two that failed this
        # test, 10 more; H200, 2026-11-29, D8) dg's split / unsplit was 0.63-1.71 (dense) and 0.79-2.02 (many chains)
        # at `fast`, 0.92-1.04 at `default` (`high` states); the five other gradients 0.94-1.04.
        # So dg's split error is held to 2x the unsplit one's where it exceeds the suite's dg
        # bound (check_grads holds it to that bound). Not for dA_log and ddt_bias, per-head sums
        # of dg over tokens (varlen: 1.3e-3 unsplit, 5.3e-3 split; H200, 2026-11-28); check_grads
        # holds dg, dA_log and ddt_bias to their bounds.
        e_off, e_on = _rel(to_f64(a), ref[name]), _rel(to_f64(b), ref[name])
        print(f"[cp] {name:8s} unsplit {e_off:.3e} split {e_on:.3e}")
        if name not in ("dA_log", "ddt_bias"):
            allowed = max(2.0 * e_off, bounds_for(c.q.dtype)["dg"]) if name == "dg" else 1.25 * e_off
            assert e_on <= allowed, f"{name}: split {e_on:.3e} against unsplit {e_off:.3e}"


@pytest.mark.xfail(strict=True, reason="known defect D8 (docs/reliability.md): the fused `fast` dg with the gate "
                   "in the kernel, 1.81e-2 against max(1.2e-2, 2x the staged 7.76e-3) on this seed (H200, 2026-11-29)")
def test_fused_fast_gate_dg_d8():
    """D8's reproducer: test_fused_reverse_cp's varlen case (gate in the kernel, `fast`) on the seed that
    failed it, unsplit: dg beyond its bound and beyond twice the staged backward's error (D1's
    cancellation, with the fused kernel's bf16 rounding). Strict: a fix turns it into a pass."""
    c = make_case(Hq=1, Hv=2, K=128, V=128, lengths=[3000, 130, 0, 1100], device=DEV, l2norm=True,
                  gate_in_kernel=True, seed=14594057535952057461)
    do, dht = inputs_of(c)
    gr = chunk_gated_delta_rule_bwd(*c.inputs(), do, dht, precision="fast", **c.lowlevel_kwargs(),
                                    **poisoned_grads(c), context_parallel=False)
    check_grads(c, gr, do, dht, "D8 varlen unsplit", "fast")


def test_fused_reverse_cp_certificate_reads_the_keys():
    """The certificate that skips a segment's A_s (fused_bwd::transfer_negligible) bounds
    |I - beta k k^T| by the keys the walk multiplies, not by the gates alone. Keys normalised before
    the call (no in-kernel norm), three segments of 1024 tokens (the last is walked from dht and
    needs no transfer; the middle one's A_1 is the one tested). In the middle segment, gates that
    decay by e^-20 (certified by the gates alone) and 40 tokens of one key with beta |k|^2 = 3, whose
    transfer grows that key's direction by 2^40: A_1 is ~2e3 there, not negligible. dO is zero past
    the first segment and the last barely moves the carry (beta 0.01, no decay), so the first
    segment's gradients and dh0 come from A_1 (~dht) alone: dropping A_1 would change them wholly;
    with the keys read they match the unsplit call."""
    c = make_case(B=1, T=3072, Hq=1, Hv=2, K=128, V=128, device=DEV, l2norm=False)
    c.g[:, :1024] = -0.01
    c.g[:, 1024:2048] = -20.0 / 1024
    c.g[:, 2048:] = 0.0
    c.beta[:, 2048:] = 0.01
    k0 = torch.nn.functional.normalize(torch.randn(128, device=DEV), dim=0)
    c.k[:, 1500:1540] = (3.0 ** 0.5 * k0).to(c.k.dtype)
    c.beta[:, 1500:1540] = 1.0
    do, dht = inputs_of(c)
    do[:, 1024:] = 0

    def run(**cp):
        return chunk_gated_delta_rule_bwd(*c.inputs(), do, dht, precision="fast", **c.lowlevel_kwargs(), **cp)

    off, on = run(context_parallel=False), run(context_parallel=True, cp_segment=1024)
    for name, a, b in (("dh0", off.dh0, on.dh0), ("dq", off.dq[:, :1024], on.dq[:, :1024]),
                       ("dk", off.dk[:, :1024], on.dk[:, :1024]), ("dv", off.dv[:, :1024], on.dv[:, :1024])):
        a, b = a.double(), b.double()
        rel = ((a - b).norm() / a.norm()).item()
        assert torch.isfinite(a).all() and rel < 0.1, f"{name}: split against unsplit {rel:.2e}"



# ---- the states saved by the forward (fgdn_fwd_args.saved_states) --------------------------------


def _bits(x):
    """x's bits (torch.equal on them: NaNs, as the spare row's uninitialised memory may hold, equal)."""
    return x.view(torch.int16)


def _saved_states_case(layout):
    """A packed call with empty, one-token and aligned sequences, a dense one with a partial chunk,
    or (cp) a packed one whose long sequences the reverse walk splits into 16-chunk segments."""
    if layout == "varlen":
        return make_case(Hq=2, Hv=4, K=128, V=128, lengths=[130, 0, 64, 1, 257], device=DEV, l2norm=True)
    if layout == "cp":
        return make_case(Hq=1, Hv=2, K=128, V=128, lengths=[3000, 130, 0, 1100], device=DEV, l2norm=True)
    return make_case(B=2, T=300, Hq=2, Hv=4, K=128, V=128, device=DEV)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("layout", ["varlen", "dense"])
def test_saved_states_same_bits(layout, level):
    """The forward writes the chunk-start states (saved_states) and the backward reads them instead
    of its states pass: every gradient the same bits as the backward that recomputes them (both
    take the forward's `fast` kernel at both levels), and o within the
    oracle's bounds. Overwriting the saved states changes the gradients: the backward reads them."""
    from flashgdn import _core
    from gdn_testutil import oracle_forward
    c = _saved_states_case(layout)
    do, dht = inputs_of(c)
    kw = c.lowlevel_kwargs()
    rows = _core.saved_states_rows(c.q, c.k, c.v, c.cu_seqlens, level, c.use_gate_in_kernel)
    B, T = c.v.shape[:2]
    slots = (T + 63) // 64 + c.N if c.cu_seqlens is not None else B * ((T + 63) // 64)
    assert rows == slots + 1  # the chunk slots (csrc/cuda/chunk_index.cuh) and one spare row
    saved = torch.full((rows, 4, 128, 128), float("nan"), device=DEV, dtype=torch.bfloat16)
    o, ht, _ = _core.chunk_gated_delta_rule_fwd(*c.inputs(), output_final_state=True, precision=level,
                                                 saved_states=saved, **kw)
    ref = oracle_forward(c)
    bounds = bounds_for(c.q.dtype)
    check("o", o, ref["o"], c, bounds["o"], context=f"saved states {layout} {level}")
    check("final_state", ht, ref["final_state"], c, bounds["final_state"], context=f"saved states {layout} {level}")
    with_saved = chunk_gated_delta_rule_bwd(*c.inputs(), do, dht, precision=level, saved_states=saved, **kw)
    recomputed = chunk_gated_delta_rule_bwd(*c.inputs(), do, dht, precision=level, **kw)
    for name in GRADS:
        x, y = getattr(with_saved, name), getattr(recomputed, name)
        assert (x is None and y is None) or torch.equal(x, y), f"{name}: saved states change the bits ({layout} {level})"
    saved.zero_()
    zeroed = chunk_gated_delta_rule_bwd(*c.inputs(), do, dht, precision=level, saved_states=saved, **kw)
    assert not torch.equal(zeroed.dq, recomputed.dq), "the backward did not read saved_states"


@pytest.mark.parametrize("layout", ["varlen", "dense", "cp"])
def test_saved_states_scratch(layout, monkeypatch):
    """saved_states_scratch: the backward may overwrite the saved states once read. Without it
    they are left bitwise as the forward wrote them; with it the gradients are the same bits, the
    states are overwritten (their memory holds the dk, dq tiles), and the workspace is smaller by
    S Hv 128 128 2 bytes (the out tiles' buffer gone). cp: the walk in segments (transfer walks,
    the seeding walk, the segment walks), each chunk's state read before its tiles land on it."""
    from flashgdn import _C, _core
    c = _saved_states_case(layout)
    do, dht = inputs_of(c)
    kw = c.lowlevel_kwargs()
    if layout == "cp":
        kw.update(context_parallel=True, cp_segment=1024)
    Hv = c.v.shape[2]
    rows = _core.saved_states_rows(c.q, c.k, c.v, c.cu_seqlens, "default", c.use_gate_in_kernel)
    real = _C.backward_workspace_size
    asked = []

    def spy(**a):  # the workspace each backward asks for
        asked.append(real(**a))
        return asked[-1]
    monkeypatch.setattr(_C, "backward_workspace_size", spy)
    saved = torch.empty((rows, Hv, 128, 128), device=DEV, dtype=torch.bfloat16)
    _core.chunk_gated_delta_rule_fwd(*c.inputs(), output_final_state=True, saved_states=saved, **kw)
    written = saved.clone()
    kept = chunk_gated_delta_rule_bwd(*c.inputs(), do, dht, saved_states=saved, **kw)
    assert torch.equal(_bits(saved), _bits(written)), "saved_states changed without saved_states_scratch"
    sizes = []
    for scratch in (False, True):
        got = chunk_gated_delta_rule_bwd(*c.inputs(), do, dht, saved_states=saved,
                                         saved_states_scratch=scratch, **kw)
        sizes.append(asked[-1])
        for name in GRADS:
            x, y = getattr(got, name), getattr(kept, name)
            assert (x is None and y is None) or torch.equal(x, y), f"{name}: scratch={scratch} changes the bits"
    assert not torch.equal(_bits(saved), _bits(written)), "saved_states_scratch: the states' memory was not used"
    slots = rows - 1
    assert sizes[0] - sizes[1] >= slots * Hv * 128 * 128 * 2, f"workspace {sizes[0]} -> {sizes[1]} bytes"


def test_saved_states_scratch_is_an_output():
    """As the backward's scratch the saved states are written: refused where they overlap an input
    (here q), which read-only saved states may."""
    from flashgdn import _core
    c = _saved_states_case("varlen")
    do, dht = inputs_of(c)
    kw = c.lowlevel_kwargs()
    rows = _core.saved_states_rows(c.q, c.k, c.v, c.cu_seqlens, "default", c.use_gate_in_kernel)
    saved = torch.empty((rows, 4, 128, 128), device=DEV, dtype=torch.bfloat16)
    _core.chunk_gated_delta_rule_fwd(*c.inputs(), output_final_state=True, saved_states=saved, **kw)
    q_in_saved = saved.view(-1)[-c.q.numel():].view(c.q.shape)  # q's values in the states' last rows
    q_in_saved.copy_(c.q)
    inputs = (q_in_saved,) + c.inputs()[1:]
    chunk_gated_delta_rule_bwd(*inputs, do, dht, saved_states=saved, **kw)  # read-only: accepted
    with pytest.raises(ValueError, match="saved_states"):
        chunk_gated_delta_rule_bwd(*inputs, do, dht, saved_states=saved, saved_states_scratch=True, **kw)


def test_autograd_backward_twice(monkeypatch):
    """A backward that keeps the graph (retain_graph) only reads the forward's saved states; the one
    that releases it takes them as its scratch: the same bits both times."""
    from flashgdn import _core, chunk_gated_delta_rule
    real = _core.chunk_gated_delta_rule_bwd
    calls = []

    def spy(*a, **kw):  # how each backward takes the saved states
        calls.append((kw.get("saved_states") is not None, kw.get("saved_states_scratch", False)))
        return real(*a, **kw)
    monkeypatch.setattr(_core, "chunk_gated_delta_rule_bwd", spy)
    c = make_case(Hq=2, Hv=4, K=128, V=128, lengths=[200, 77], device=DEV, l2norm=True)
    do, dht = inputs_of(c)
    leaves = [x.clone().requires_grad_() for x in (c.q, c.k, c.v, c.g, c.beta)]
    o, ht = chunk_gated_delta_rule(*leaves, output_final_state=True, cu_seqlens_cpu=c.cu_seqlens_host,
                                   **c.kwargs())
    loss = (o.float() * do.float()).sum() + (ht * dht).sum()
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    second = torch.autograd.grad(loss, leaves)
    assert calls == [(True, False), (True, True)], f"saved states taken as {calls}"
    for name, x, y in zip(("dq", "dk", "dv", "dg", "dbeta"), first, second):
        assert torch.equal(x, y), f"{name}: the second backward differs from the first"


@pytest.mark.parametrize("level", LEVELS)
def test_autograd_saves_states(level):
    """Under autograd the forward saves the states where the backward takes them: the gradients of
    a loss the same bits as the low-level backward's (which recomputes them)."""
    from gdn_testutil import loss_and_grads
    from flashgdn import chunk_gated_delta_rule
    c = make_case(Hq=2, Hv=4, K=128, V=128, lengths=[200, 77], device=DEV, l2norm=True)
    do, dht = inputs_of(c)
    leaves = [x.clone().requires_grad_() for x in (c.q, c.k, c.v, c.g, c.beta)]

    def loss(q, k, v, g, beta):
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, precision=level,
                                       cu_seqlens_cpu=c.cu_seqlens_host, **c.kwargs())
        return (o.float() * do.float()).sum() + (ht * dht).sum()

    got = loss_and_grads(loss, leaves)[1:]
    want = chunk_gated_delta_rule_bwd(*c.inputs(), do, dht, precision=level, **c.lowlevel_kwargs())
    for name, x in zip(("dq", "dk", "dv", "dg", "dbeta"), got):
        assert torch.equal(x, getattr(want, name)), f"{name}: autograd's saved states change the bits ({level})"


def test_saved_states_refused_where_the_backward_recomputes():
    """fp16 inputs (the staged backward) take no saved states: the library refuses them, naming
    the argument; the shapes-only rule says 0 rows there."""
    from flashgdn import _core
    c = make_case(Hq=2, Hv=4, K=128, V=128, lengths=[130, 64], device=DEV, dtype=torch.float16)
    assert _core.saved_states_rows(c.q, c.k, c.v, c.cu_seqlens, "default") == 0
    saved = torch.zeros((6, 4, 128, 128), device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="saved_states"):
        _core.chunk_gated_delta_rule_fwd(*c.inputs(), saved_states=saved, **c.lowlevel_kwargs())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("level", ["fast", "default", "high"])
@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_saved_states_rows_mirror_the_library(D, gate, level, dtype, monkeypatch):
    """_core.saved_states_rows (from the shapes, for the fake op) equals the library's
    fgdn_saved_states_rows on the same call, dense and packed, with and without the switch."""
    from flashgdn import _C, _core
    for fused in (None, "0"):
        if fused is None:
            monkeypatch.delenv("FLASHGDN_BWD_FUSED", raising=False)
        else:
            monkeypatch.setenv("FLASHGDN_BWD_FUSED", fused)
        for lengths in ([130, 0, 64, 1], None):
            c = (make_case(Hq=2, Hv=4, K=D, V=D, lengths=lengths, device=DEV, dtype=dtype, gate_in_kernel=gate)
                 if lengths else make_case(B=2, T=300, Hq=2, Hv=4, K=D, V=D, device=DEV, dtype=dtype,
                                           gate_in_kernel=gate))
            kw = _core._inputs(*c.inputs(), c.scale, c.initial_state, False, c.cu_seqlens, c.cu_seqlens_host,
                               gate, c.A_log, c.dt_bias, None, False, False)
            o = torch.empty(c.v.shape, dtype=c.q.dtype, device=DEV)
            kw.update(output_final_state=False, checkpoint_every=0, precision=_core._precision(level),
                      context_parallel=0, cp_segment=0, o=_core._desc("o", o))
            with torch.cuda.device(c.q.device):
                want = _C.saved_states_rows(**kw)
            got = _core.saved_states_rows(c.q, c.k, c.v, c.cu_seqlens, level, gate)
            assert got == want, (D, gate, level, dtype, fused, lengths)
