"""The fused reverse kernel's stage plan (fused_schedule.py): free of the hazards its barriers
must rule out, and computing exactly chunk_form_fused's backward (itself checked against the
float64 recurrence in test_chunk_form_fused.py), with every 16-bit staging at the same point."""
import re
from dataclasses import replace

import numpy as np
import pytest

import fused_schedule as fs
from chunk_form_fused import F16_ISLAND, STAGED, backward, island, round_bf16, round_fp16_tile

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _bf16(name, x):
    """Round to bf16 where chunk_form_fused.STAGED names a staging (every name the table uses is one)."""
    assert name in STAGED, name
    return round_bf16(x)


def _inputs(T, K, V, gates, seed):
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    q, k = unit(rng.standard_normal((T, K))), unit(rng.standard_normal((T, K)))
    v, do = rng.standard_normal((T, V)), rng.standard_normal((T, V))
    g = {"zero": np.zeros(T), "realistic": -rng.uniform(0, 0.3, T), "strong": -rng.uniform(2, 8, T)}[gates]
    beta = rng.uniform(0, 2, T)
    beta[::7] = 0.0
    s0, dht = 0.1 * rng.standard_normal((K, V)), 0.1 * rng.standard_normal((K, V))
    return q, k, v, g, beta, 0.5, s0, do, dht


def _worst(a, b):
    return max(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-300) for x, y in zip(a, b))


def test_the_table_has_no_hazards():
    assert fs.hazards(fs.SCHEDULE) == []


def test_the_fp16_island_moves_no_op_and_keeps_what_the_split_kept():
    """`default` runs the same table with Tb, dVn and R staged as fp16 tiles (chunk_form_fused.island;
    the kernel's kF16Island): the table computes the chunk form under that policy exactly, and with
    those three the only roundings, dv and dk keep ~2^-11 against bf16's ~2^-8 (the `fast` staging):
    most of what the earlier hi + lo split of Tb and dVn kept, without its second load of q."""
    args = _inputs(150, 128, 128, "realistic", seed=3)
    want = backward(*args)
    only_island = lambda name, x: island()(name, x) if name in F16_ISLAND else x  # noqa: E731
    only_bf16 = lambda name, x: _bf16(name, x) if name in F16_ISLAND else x  # noqa: E731
    got = fs.run(*args, rnd=only_island)
    assert _worst(got, backward(*args, rnd=only_island)) <= 1e-12
    single = fs.run(*args, rnd=only_bf16)
    for name, x, y, z in zip(NAMES, got, want, single):
        if name in ("dv", "dk"):
            err_island = np.linalg.norm(x - y) / np.linalg.norm(y)
            assert 4 * err_island < np.linalg.norm(z - y) / np.linalg.norm(y), name


def test_the_fp16_tile_keeps_small_gradients():
    """The island's tile scale: a tile far below fp16's normal range (gradients of a loss averaged
    over many tokens: 1e-9) keeps fp16's relative precision, where plain fp16 would lose it; a tile
    beyond fp16's largest value too; zeros stay zeros."""
    rng = np.random.default_rng(0)
    for x in (1e-9 * rng.standard_normal((64, 128)), 1e30 * rng.standard_normal((8, 8))):
        assert np.linalg.norm(round_fp16_tile(x) - x) / np.linalg.norm(x) < 2 ** -11
    x = 1e-9 * rng.standard_normal((64, 128))
    assert np.linalg.norm(x.astype(np.float16).astype(np.float64) - x) / np.linalg.norm(x) > 0.5
    assert np.array_equal(round_fp16_tile(np.zeros((4, 4))), np.zeros((4, 4)))


def test_every_product_once():
    found = sorted(int(n) for op in fs.SCHEDULE for n in re.findall(r"P(\d+):", op.name))
    assert found == list(range(1, 20))


@pytest.mark.parametrize("rnd", [fs.exact, _bf16, island()], ids=["exact", "bf16-staged", "fp16-island"])
@pytest.mark.parametrize("T, K, V, gates", [(1, 128, 128, "realistic"), (64, 128, 128, "zero"),
                                            (65, 128, 128, "strong"), (150, 128, 128, "realistic"),
                                            (97, 64, 32, "realistic")])
def test_matches_the_chunk_form(T, K, V, gates, rnd):
    args = _inputs(T, K, V, gates, seed=T + K)
    got = fs.run(*args, rnd=rnd)
    want = backward(*args, rnd=rnd)
    for name, x, y in zip(NAMES, got, want):
        assert x.shape == y.shape, name
        assert np.linalg.norm(x - y) <= 1e-12 * np.linalg.norm(y) + 1e-300, name


def _moved(name_start, stage):
    return [replace(op, stage=stage) if op.name.startswith(name_start) else op for op in fs.SCHEDULE]


@pytest.mark.parametrize("name_start, stage, expect", [
    ("K copied to t22", 5, "D writes ['t22'] that R uses"),  # R reads R from t22 in stage 5
    ("dS mirror", 7, "C writes ['dsm'] that D uses"),     # D reads the mirror in P9
    ("P11:", 11, "reads S0 in stage 11"),                 # S0 is the next chunk's by then
    ("P15:", 15, "reads ar in stage 15"),
    ("P5:", 5, "writes out in stage 5"),                  # the dK store still reads out
])
def test_the_checker_catches_a_moved_op(name_start, stage, expect):
    problems = fs.hazards(_moved(name_start, stage))
    assert any(expect in p for p in problems), problems


def test_a_hazard_free_but_misordered_table_computes_something_else():
    """P18 one stage early reads dVg where dOg will be: no barrier rule breaks (C alone touches
    t23 in stage 12), but the gradients differ; the comparison with the chunk form catches it."""
    moved = _moved("P18:", 12)
    assert fs.hazards(moved) == []
    args = _inputs(130, 128, 128, "realistic", seed=3)
    assert _worst(fs.run(*args, schedule=moved), backward(*args)) > 1e-3


def test_an_undeclared_access_is_refused():
    sched = [replace(op, reads=tuple(r for r in op.reads if r != "dsm")) if op.name.startswith("P9:") else op
             for op in fs.SCHEDULE]
    with pytest.raises(AssertionError, match="without declaring it"):
        fs.run(*_inputs(70, 64, 64, "zero", seed=1), schedule=sched)


def test_the_plan_shows_this_table():
    import os
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "..", "bench", "fused-backward.md")) as f:
        assert fs.markdown() in f.read(), "bench/fused-backward.md's stage table differs from fused_schedule.py"


# ---- the waits (bwd_fused_kernel.cuh, stage_wait) ---------------------------------------------

def test_the_waits_order_every_shared_access():
    """Over three chunks, every pair of accesses by two roles to one shared tile, one of them a
    write, is ordered by program order, the waits and the chunk fence; no wait can pass early."""
    assert fs.unordered() == []


def test_every_wait_is_needed():
    """Each of the table's waits left out leaves some pair of accesses unordered: the checker
    sees what each wait is for, and the table has none to spare."""
    table = fs.waits()
    assert sum(len(w) for w in table.values()) > 0
    for key, ws in table.items():
        for y in ws:
            trial = {k: dict(v) for k, v in table.items()}
            del trial[key][y]
            assert fs.unordered(table=trial), f"{key[0]} needs no wait on {y} before stage {key[1]}"


def test_the_waits_follow_a_moved_op():
    """P19 (D, stage 15, reads t12 and t22) moved to stage 13: D now reads dAs before R stages it
    in stage 14, which the derived waits cannot order (R's write comes after in the chunk) and the
    checker reports; the hazard check sees no clash, since no role touches t12 in stage 13."""
    moved = _moved("P19:", 13)
    assert fs.hazards(moved) == []
    assert fs.unordered(moved, fs.waits()) != []


def test_the_kernel_waits_on_this_table():
    """bwd_fused_kernel.cuh's stage_wait table is fused_schedule.waits_table_cpp()'s text."""
    import os
    import re
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "..", "csrc", "sm90", "bwd_fused_kernel.cuh")) as f:
        src = f.read()
    rows = re.findall(r"^\s*\{\{.*\}\},\s*// stage \d+$", src, flags=re.M)
    assert "\n".join(r.strip() for r in rows) == "\n".join(r.strip() for r in fs.waits_table_cpp().splitlines()), \
        "the kernel's stage_wait table differs from `python tests/python/fused_schedule.py --waits`"


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("gates", ["realistic", "strong"])
def test_any_interleaving_computes_the_table(gates):
    """The roles, the producer and the store warp run at random relative speeds under the waits:
    every gradient the same bits as run()'s stage-by-stage execution."""
    args = _inputs(200, 32, 32, gates, seed=5)
    ref = fs.run(*args)
    for seed in range(12):
        assert _same(fs.run_concurrent(*args, seed=seed), ref), f"interleaving seed {seed}"


def test_each_wait_left_out_shows_in_some_interleaving():
    """Without any one of the waits, some interleaving (of the first 16 seeds) computes other
    values, reads a tile of another shape or one not yet written, or cannot proceed: the
    simulation sees every wait."""
    args = _inputs(200, 32, 32, "realistic", seed=3)
    ref = fs.run(*args)
    table = fs.waits()
    for key, ws in table.items():
        for y in ws:
            trial = {k: dict(v) for k, v in table.items()}
            del trial[key][y]
            caught = False
            for seed in range(16):
                try:
                    caught = not _same(fs.run_concurrent(*args, table=trial, seed=seed), ref)
                except (AssertionError, ValueError, KeyError):  # a deadlock, a tile of another shape, one not yet written
                    caught = True
                if caught:
                    break
            assert caught, f"{key[0]} before stage {key[1]} without its wait on {y}: every interleaving agreed"
