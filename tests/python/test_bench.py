"""CPU tests of the peer benchmark harness, the repository's bench/gdnbench (not part of the
installed package), without a GPU or peers: the matrix and its split into parts, the q/k
conventions (cells, inputs, the oracle, the contenders' calls, the result columns), the compile
warm-up plan, merging the parts' results into one table, and its entry points (bench/run.py and
the warm-up's worker processes) with and without flashgdn."""
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hiding import hide_prelude

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

from gdnbench import configs as C  # noqa: E402
from gdnbench import prewarm as P  # noqa: E402
from gdnbench import report as R  # noqa: E402


def test_full_matrix_matches_the_issue():
    cells = C.full_cells(("in_kernel",))
    fwd = [c for c in cells if c.mode == "fwd"]
    assert {(c.Hq, c.Hv) for c in fwd} == set(C.FWD_HEADS) and len(C.FWD_HEADS) == 12
    assert {(c.Hq, c.Hv) for c in cells if c.mode != "fwd"} == set(C.BWD_HEADS)
    assert len(fwd) == 12 * len(C.FWD_LAYOUTS)
    assert len(cells) == len(fwd) + 2 * 5 * len(C.BWD_LAYOUTS) == 224
    mix = [lay for lay in C.FWD_LAYOUTS if lay.name.startswith("mix")][0]
    assert mix.total == 32768 and mix.lens[0] == 16384 and all(100 <= n <= 1000 for n in mix.lens[1:])


@pytest.mark.parametrize("select", [C.full_cells, C.quick_cells])
def test_every_cell_runs_in_both_q_k_conventions_by_default(select):
    """Issues 36 and 37: every mode in both conventions, a cell's conventions next to each other."""
    assert C.QK_NORMS == ("in_kernel", "prenormalized")
    both, one = select(), select(("in_kernel",))
    assert {c.qk_norm for c in one} == {"in_kernel"}
    assert len(both) == 2 * len(one) and len({c.key for c in both}) == len(both)
    assert [c.qk_norm for c in both] == ["in_kernel", "prenormalized"] * len(one)
    base = [(c.Hq, c.Hv, c.layout, c.mode) for c in both]
    assert base[0::2] == base[1::2] == [(c.Hq, c.Hv, c.layout, c.mode) for c in one]
    assert {c.mode for c in both if c.qk_norm == "prenormalized"} == {c.mode for c in one}
    pre = select(("prenormalized",))
    assert [c.key for c in pre] == [c.key for c in both if c.qk_norm == "prenormalized"]


def test_qk_norm_option_selects_the_conventions():
    from gdnbench.cli import _parse, select_cells

    assert C.parse_qk_norms(None) == C.parse_qk_norms("") == C.QK_NORMS
    assert C.parse_qk_norms("prenormalized, in_kernel") == ("in_kernel", "prenormalized")
    assert C.parse_qk_norms("prenormalized") == ("prenormalized",)
    with pytest.raises(ValueError, match="--qk-norm: expected a comma list of in_kernel, prenormalized"):
        C.parse_qk_norms("in_kernel,l2")
    with pytest.raises(ValueError):
        C.parse_qk_norms(",")
    with pytest.raises(ValueError, match="qk_norm: expected one of"):
        C.norm_in_call("both")
    assert C.norm_in_call("in_kernel") and not C.norm_in_call("prenormalized")
    cells = select_cells(_parse(["--quick"]))
    assert len(cells) == 14 and {c.qk_norm for c in cells} == set(C.QK_NORMS)
    cells = select_cells(_parse(["--full", "--qk-norm", "prenormalized", "--modes", "bwd", "--configs", "2/8"]))
    assert len(cells) == len(C.BWD_LAYOUTS) and {(c.qk_norm, c.mode) for c in cells} == {("prenormalized", "bwd")}
    # Parts keep whole head configurations, so both conventions of a cell land in the same part.
    for i in (1, 2):
        part = select_cells(_parse(["--full", "--part", f"{i}/2"]))
        keys = {(c.Hq, c.Hv, c.layout, c.mode) for c in part}
        assert {(k, n) for k in keys for n in C.QK_NORMS} == {((c.Hq, c.Hv, c.layout, c.mode), c.qk_norm) for c in part}
    with pytest.raises(SystemExit, match="--qk-norm: expected"):
        select_cells(_parse(["--full", "--qk-norm", "pre"]))


def test_estimate_counts_each_conventions_cells_and_shares_the_warm_up():
    one, both = C.quick_cells(("in_kernel",)), C.quick_cells()
    assert C._warmup_tasks(one) == C._warmup_tasks(both)  # the conventions compile the same kernels
    extra = C.S_STOPPED_PER_CELL * (len(both) - len(one))  # the warm-up is longer than the timing here
    assert math.isclose(C.estimate_s(both), C.estimate_s(one) + extra)
    assert C.estimate_s(C.full_cells()) > C.estimate_s(C.full_cells(("prenormalized",)))


def test_parts_cover_the_matrix_once_with_whole_head_configurations():
    cells = C.full_cells()
    for n in (1, 2, 3, 7):
        parts = [C.part_of(cells, i, n) for i in range(1, n + 1)]
        keys = [c.key for p in parts for c in p]
        assert sorted(keys) == sorted(c.key for c in cells)
        owners = {}
        for i, p in enumerate(parts):
            for c in p:
                assert owners.setdefault((c.Hq, c.Hv), i) == i


def test_estimate_overlaps_the_warm_up_with_the_timing():
    one = [c for c in C.full_cells(("in_kernel",)) if (c.Hq, c.Hv) == (4, 4)]  # forward only: 3 peers' forward tasks
    longest = C.PREWARM_TASK_S[("flashqla", False)]  # one task is longer than the three spread over 16
    expect = C.S_START + max(longest + C.S_STOPPED_PER_CELL * len(one) + C.S_TAIL, C.S_PER_CELL["fwd"] * len(one))
    assert math.isclose(C.estimate_s(one, workers=16), expect)
    assert C.estimate_s(C.full_cells(), workers=1) > C.estimate_s(C.full_cells(), workers=16)


def test_prewarm_plan_groups_by_peer_heads_and_gradients():
    cells = [c for c in C.full_cells() if (c.Hq, c.Hv) in ((2, 8), (4, 4))]

    def refuses(name, cell):
        return "no backward" if name == "flashinfer" and cell.mode != "fwd" else None

    tasks = P.plan(cells, ["flashgdn", "flashinfer", "fla", "flashqla"], refuses)
    keys = [(t["contender"], t["Hq"], t["Hv"], t["grad"]) for t in tasks]
    assert len(keys) == len(set(keys))
    assert "flashgdn" not in {t["contender"] for t in tasks}  # nothing to compile
    assert ("flashinfer", 2, 8, True) not in keys  # refused up front
    assert set(keys) == {(n, 2, 8, False) for n in ("flashqla", "fla", "flashinfer")} | \
        {(n, 4, 4, False) for n in ("flashqla", "fla", "flashinfer")} | {("flashqla", 2, 8, True), ("fla", 2, 8, True)}
    # The slowest compiler first, its gradient tasks before its forward ones; the other peers'
    # gradient tasks last (skipped once that peer's backward is refused).
    assert keys[:3] == [("flashqla", 2, 8, True), ("flashqla", 2, 8, False), ("flashqla", 4, 4, False)]
    assert keys[-1] == ("fla", 2, 8, True)
    lay_of = P.known_layouts()
    for t in tasks:
        sizes = [lay_of[n].total for n in t["layouts"]]
        assert sizes == sorted(sizes)  # compile on the small layouts first
        want = {c.layout.name for c in cells if (c.Hq, c.Hv) == (t["Hq"], t["Hv"]) and (c.mode != "fwd") == t["grad"]}
        assert set(t["layouts"]) == want
        assert t["qk_norms"] == list(C.QK_NORMS)  # one task calls each layout in both conventions
    pre = P.plan([c for c in cells if c.qk_norm == "prenormalized"], ["fla", "flashqla"], refuses)
    assert [(t["contender"], t["Hq"], t["Hv"], t["grad"]) for t in pre] == [k for k in keys if k[0] != "flashinfer"]
    assert all(t["qk_norms"] == ["prenormalized"] for t in pre)


def test_prewarm_task_is_complete_with_every_layout_in_every_convention(tmp_path, monkeypatch):
    t = dict(contender="fla", Hq=2, Hv=8, grad=False, layouts=["1x2048", "1x4096"], qk_norms=list(C.QK_NORMS))
    ok = [dict(layout=n, qk_norm=q, status="ok") for n in t["layouts"] for q in C.QK_NORMS]
    assert P.completed(dict(t, calls=ok)) and not P.completed(dict(t, calls=ok[:2]))
    old = {k: v for k, v in t.items() if k != "qk_norms"}  # a task of a run before the conventions
    assert P.task_norms(old) == ["in_kernel"] and P.completed(dict(old, calls=ok[0::2]))
    monkeypatch.setenv(P.MARKER_ENV, str(tmp_path))
    assert P.marker_path(t, "v1") != P.marker_path(dict(t, qk_norms=["in_kernel"]), "v1")


def test_warmed_keeps_only_tasks_without_their_own_error():
    s = {"tasks": [dict(contender="fla", Hq=2, Hv=8, grad=False, calls=[{"layout": "1x2048", "status": "ok"}]),
                   dict(contender="flashqla", Hq=2, Hv=8, grad=False, calls=[], error="timed out after 60 s")]}
    assert P.warmed(s) == {("fla", 2, 8, False)}


def _row(contender, ms, status="ok", config="2/8", layout="1x8192", mode="fwd", qk_norm=None):
    """A result row; without qk_norm, as a run before the column wrote it."""
    r = dict(config=config, Hq=2, Hv=8, layout=layout, kind="seq", nseq=1, T_total=8192, mode=mode,
             contender=contender, status=status, reason="" if status == "ok" else "time budget",
             ms=ms, floor_ms=0.01, mem_mib=1.0, first_call_s=0.1, method="graph")
    if qk_norm is not None:
        r["qk_norm"] = qk_norm
    return r


def _part(tmp_path, name, commit, rows, tasks=(), accuracy=None):
    d = tmp_path / name
    d.mkdir()
    hdr = dict(gpu="H100", date="2026-11-23", flashgdn_commit=commit, selection="full", argv="--full",
               copy_GBps=3000.0, bf16_TFLOPs=760.0, contenders={"flashgdn": "0.1.0", "fla": "0.6.0"},
               prewarm=dict(workers=16, wall_s=10.0, tasks=list(tasks)))
    acc = {"flashgdn": {"status": "ok"}} if accuracy is None else accuracy  # default: the old format
    (d / "results.json").write_text(json.dumps({"header": hdr, "accuracy": acc, "rows": rows}))
    return str(d)


def test_merge_prefers_measured_cells_and_names_every_commit(tmp_path):
    task = dict(contender="fla", Hq=2, Hv=8, grad=False, s=12.0, calls=[{"layout": "1x8192", "status": "ok"}])
    a = _part(tmp_path, "a", "aaa", [_row("flashgdn", 2.0), _row("fla", float("nan"), status="skipped")], [task])
    b = _part(tmp_path, "b", "bbb", [_row("flashgdn", 3.0), _row("fla", 0.5)])
    hdr, rows, acc = R.merge([a, b])
    by = {r["contender"]: r for r in rows}
    assert by["flashgdn"]["ms"] == 2.0  # first part's measurement is kept
    assert by["fla"]["status"] == "ok" and by["fla"]["ms"] == 0.5  # a skipped cell is filled in
    assert hdr["flashgdn_commit"] == "aaa, bbb"
    assert len(hdr["prewarm"]["tasks"]) == 1
    md = R.markdown(hdr, rows, acc)
    assert "Compile-cache warm-up" in md and "| fla | 2/8 | no | 12.0 | 1 |  |" in md
    R.add_speedups(rows)
    assert math.isclose(by["fla"]["speedup_of_flashgdn"], 0.25)


def test_standing_names_the_best_peer_and_the_ratio():
    rows = [_row("flashgdn", 2.0), _row("flashqla", 0.5), _row("flashinfer", 0.4),
            _row("fla", float("nan"), status="refused"),
            _row("flashgdn", 1.0, layout="1x2048"), _row("flashqla", 2.0, layout="1x2048")]
    text = R.standing(rows)
    assert "| 2/8 | 0.20 I | 2.00 Q | 0.63 |" in text  # geomean of 0.2 and 2.0
    assert "2 cells: geometric mean 0.632, worst 0.200, best 2.000; flashgdn faster than the best peer in 1 of them." in text


def _both_conventions():
    """One cell in both conventions: flashgdn leads in_kernel (2.0 / 1.0) and trails prenormalized."""
    return [_row("flashgdn", 1.0, qk_norm="in_kernel"), _row("flashqla", 2.0, qk_norm="in_kernel"),
            _row("flashgdn", 1.6, qk_norm="prenormalized"), _row("flashqla", 1.2, qk_norm="prenormalized")]


def test_results_carry_the_q_k_convention_in_every_file(tmp_path):
    import csv

    rows = _both_conventions()
    acc = {"in_kernel": {"flashgdn": {"status": "ok", "o": 1e-3}},
           "prenormalized": {"flashgdn": {"status": "ok", "o": 2e-3}}}
    R.write_all(tmp_path, dict(gpu="H100", date="2026-11-28", qk_norms="in_kernel, prenormalized"), rows, acc)
    with open(tmp_path / "results.csv") as f:
        got = list(csv.DictReader(f))
    assert R.CSV_FIELDS.index("qk_norm") == R.CSV_FIELDS.index("mode") + 1
    assert [(r["contender"], r["qk_norm"], r["ms"]) for r in got] == [
        ("flashgdn", "in_kernel", "1.000000"), ("flashqla", "in_kernel", "2.000000"),
        ("flashgdn", "prenormalized", "1.600000"), ("flashqla", "prenormalized", "1.200000")]
    assert got[1]["speedup_of_flashgdn"] == "2.000000" and got[3]["speedup_of_flashgdn"] == "0.750000"
    j = json.loads((tmp_path / "results.json").read_text())
    assert [r["qk_norm"] for r in j["rows"]] == ["in_kernel"] * 2 + ["prenormalized"] * 2
    assert j["accuracy"]["prenormalized"]["flashgdn"]["o"] == 2e-3
    md = (tmp_path / "results.md").read_text()
    assert "| qk_norms | in_kernel, prenormalized |" in md
    assert "| flashgdn | in_kernel | ok | 1.0e-03 |" in md and "| flashgdn | prenormalized | ok | 2.0e-03 |" in md
    fwd_in = "## Forward (inference: no saved state), q, k normalised in the call (in_kernel): ms per call"
    fwd_pre = "## Forward (inference: no saved state), q, k normalised before the call (prenormalized): ms per call"
    assert md.index(fwd_in) < md.index(fwd_pre)
    table_pre = md[md.index(fwd_pre):].split("\n\n")[1]
    assert "| 2/8 | 1x8192 | 1.600 | 1.200 | flashqla 1.200 | 0.75 |" in table_pre
    assert "| fwd | prenormalized | 2/8 | 1x8192 | 1 | 1 |" in md  # memory and first-call table
    st = (tmp_path / "standing.md").read_text()
    st_in, st_pre = st.split("## Forward (inference: no saved state), q, k normalised before the call")
    assert "| 2/8 | 2.00 Q | 2.00 |" in st_in and "| 2/8 | 0.75 Q | 0.75 |" in st_pre
    text = R.summary_text({}, rows, acc)
    assert "check flashgdn   prenormalized" in text
    assert any(ln.startswith("fwd    prenormalized 2/8    1x8192") and ln.split()[-2] == "0.75"
               for ln in text.splitlines())


def test_merge_reads_a_folder_from_before_the_column_as_in_kernel(tmp_path):
    """An old part (no qk_norm in its rows, its accuracy check keyed by contender) merges with a
    new one: its rows are in_kernel, and a new prenormalized row of the same cell is kept beside them."""
    old = _part(tmp_path, "old", "aaa", [_row("flashgdn", 1.0), _row("flashqla", 2.0)])
    new = _part(tmp_path, "new", "bbb", [_row("flashgdn", 1.6, qk_norm="prenormalized"),
                                         _row("flashqla", 1.2, qk_norm="prenormalized"),
                                         _row("flashgdn", 9.0, qk_norm="in_kernel")],
                accuracy={"prenormalized": {"flashgdn": {"status": "ok", "o": 2e-3}}})
    hdr, rows, acc = R.merge([old, new])
    assert [(r["contender"], r["qk_norm"], r["ms"]) for r in rows] == [
        ("flashgdn", "in_kernel", 1.0), ("flashqla", "in_kernel", 2.0),  # the first part wins
        ("flashgdn", "prenormalized", 1.6), ("flashqla", "prenormalized", 1.2)]
    assert acc == {"in_kernel": {"flashgdn": {"status": "ok"}},
                   "prenormalized": {"flashgdn": {"status": "ok", "o": 2e-3}}}
    assert hdr["qk_norms"] == "in_kernel, prenormalized"
    out = tmp_path / "merged"
    R.write_all(out, hdr, rows, acc)
    assert "in_kernel" in (out / "results.csv").read_text().splitlines()[1]
    # The old folder alone: every file says in_kernel.
    hdr, rows, acc = R.merge([old])
    assert {r["qk_norm"] for r in rows} == {"in_kernel"} and set(acc) == {"in_kernel"}
    R.write_all(tmp_path / "old-only", hdr, rows, acc)
    assert "prenormalized" not in (tmp_path / "old-only" / "results.md").read_text().split("## Accuracy")[1]


def test_prewarm_markers_skip_tasks_done_on_these_caches(tmp_path, monkeypatch):
    tasks = [dict(contender="fla", Hq=2, Hv=8, grad=False, layouts=["1x2048", "1x4096"]),
             dict(contender="fla", Hq=2, Hv=8, grad=True, layouts=["1x8192", "2x4096"]),
             dict(contender="flashqla", Hq=2, Hv=8, grad=False, layouts=["1x2048"])]
    ran = []

    def fake_run(spec, timeout_s):
        ran.append(spec["contender"] + str(spec["grad"]))
        if spec["contender"] == "flashqla":  # one call failed: no marker
            return dict(spec, s=1.0, calls=[{"layout": "1x2048", "status": "failed: RuntimeError: x"}])
        if spec["grad"]:  # refused on its first call: the refusal is the same for every layout
            return dict(spec, s=1.0, calls=[{"layout": "1x8192", "status": "refused: RuntimeError: no"}])
        return dict(spec, s=1.0, calls=[{"layout": n, "status": "ok"} for n in spec["layouts"]])

    monkeypatch.setattr(P, "_run_one", fake_run)
    monkeypatch.delenv(P.MARKER_ENV, raising=False)
    P.prewarm(tasks, 2, 60, say=lambda m: None, versions={"fla": "v1"})
    assert not list(tmp_path.iterdir())  # markers are opt-in
    monkeypatch.setenv(P.MARKER_ENV, str(tmp_path / "marks"))
    ran.clear()
    P.prewarm(tasks, 2, 60, say=lambda m: None, versions={"fla": "v1"})
    assert sorted(ran) == ["flaFalse", "flaTrue", "flashqlaFalse"]
    assert len(list((tmp_path / "marks").iterdir())) == 2
    ran.clear()
    s = P.prewarm(tasks, 2, 60, say=lambda m: None, versions={"fla": "v1"})
    assert ran == ["flashqlaFalse"]  # only the task without a marker runs again
    assert {("fla", 2, 8, False), ("fla", 2, 8, True)} <= P.warmed(s)
    ran.clear()
    P.prewarm(tasks, 2, 60, say=lambda m: None, versions={"fla": "v2"})  # another version: no marker
    assert sorted(ran) == ["flaFalse", "flaTrue", "flashqlaFalse"]


def test_prewarm_plan_puts_the_check_first():
    cells = [c for c in C.full_cells() if (c.Hq, c.Hv) in ((2, 8), (4, 4))]

    def refuses(name, cell):
        return "no backward" if name == "flashinfer" and cell.mode != "fwd" else None

    tasks = P.plan(cells, ["flashinfer", "fla", "flashqla"], refuses, check=(2, 8, True))
    keys = [(t["contender"], t["Hq"], t["Hv"], t["grad"]) for t in tasks]
    # With gradients where the peer has them; FlashInfer (no backward) checks its forward.
    assert keys[:3] == [("flashqla", 2, 8, True), ("fla", 2, 8, True), ("flashinfer", 2, 8, False)]
    for t in tasks:
        first = t["layouts"][0] == C.CHECK_LAYOUT.name
        assert first == (tuple(keys[tasks.index(t)]) in keys[:3])
        assert t["layouts"].count(C.CHECK_LAYOUT.name) == first


def _fake_runs(monkeypatch, outcome):
    """_run_one replaced: each task waits for its own event, then returns outcome(spec)."""
    import threading

    gates, started = {}, []

    def fake_run(spec, timeout_s):
        key = (spec["contender"], spec["Hq"], spec["Hv"], spec["grad"])
        started.append(key)
        gates.setdefault(key, threading.Event()).wait(10)
        return outcome(spec)

    monkeypatch.setattr(P, "_run_one", fake_run)
    monkeypatch.delenv(P.MARKER_ENV, raising=False)
    return gates, started


def test_warmup_reports_each_task_as_it_ends(monkeypatch):
    import threading

    gates, _ = _fake_runs(monkeypatch, lambda spec: dict(spec, s=1.0, calls=[{"layout": "1x2048", "status": "ok"}]))
    tasks = [dict(contender="flashqla", Hq=2, Hv=8, grad=False, layouts=["1x2048"]),
             dict(contender="fla", Hq=2, Hv=8, grad=False, layouts=["1x2048"])]
    for t in tasks:
        gates[(t["contender"], 2, 8, False)] = threading.Event()
    w = P.Warmup(tasks, 2, 60, say=lambda m: None)
    assert not w.ready("flashqla", 2, 8, False) and not w.ready("fla", 2, 8, False)
    assert w.ready("flashinfer", 2, 8, False)  # no task: nothing to wait for
    assert w.pending() == 2
    gates[("fla", 2, 8, False)].set()
    assert w.wait(10)
    assert w.ready("fla", 2, 8, False) and not w.ready("flashqla", 2, 8, False) and w.pending() == 1
    assert not w.wait(0.05)  # times out: the other task is still running
    gates[("flashqla", 2, 8, False)].set()
    w.join()
    assert w.pending() == 0 and not w.wait(0.05)
    assert P.warmed(w.summary()) == {("flashqla", 2, 8, False), ("fla", 2, 8, False)}


def test_warmup_skips_gradient_tasks_after_a_refused_backward(monkeypatch):
    def outcome(spec):
        if spec["grad"]:
            return dict(spec, s=1.0, calls=[{"layout": "3seq", "status": "refused: RuntimeError: no backward"}])
        return dict(spec, s=1.0, calls=[{"layout": "1x2048", "status": "ok"}])

    gates, started = _fake_runs(monkeypatch, outcome)
    import threading
    for hv in (8, 16):
        gates[("fla", 2, hv, True)] = threading.Event()
    gates[("fla", 2, 8, True)].set()
    tasks = [dict(contender="fla", Hq=2, Hv=8, grad=True, layouts=["3seq"]),
             dict(contender="fla", Hq=2, Hv=16, grad=True, layouts=["1x8192"])]
    w = P.Warmup(tasks, 1, 60, say=lambda m: None)  # one process: the second starts after the first
    w.join()
    assert started == [("fla", 2, 8, True)]
    s = w.summary()["tasks"]
    assert s[1]["skipped"].startswith("backward refused on an earlier task")
    assert w.ready("fla", 2, 16, True)


def test_drain_runs_ready_items_in_order_and_waits_for_the_rest():
    from gdnbench.cli import drain

    ready = {"a", "b"}
    ran, skipped, waits = [], [], []

    def wait():
        waits.append(len(ran))
        ready.add("c")  # the warm-up moved on

    drain(["a", "c", "b"], lambda x: x in ready, ran.append, skipped.append, lambda: False, wait)
    assert ran == ["a", "b", "c"] and waits == [2] and not skipped
    ran.clear()
    clock = iter([False, True, True])
    drain(["a", "b", "c"], lambda x: True, ran.append, skipped.append, lambda: next(clock), wait)
    assert ran == ["a"] and skipped == ["b", "c"]


def _proc_state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _children(pid):
    import os

    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                if d.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d))
        except (OSError, ValueError, IndexError):
            pass
    return out


def test_quiet_stops_the_warm_up_processes_and_continues_them(monkeypatch):
    import subprocess
    import sys
    import time

    if not sys.platform.startswith("linux"):
        import pytest
        pytest.skip("reads /proc")
    monkeypatch.setattr(P, "DRAIN_S", 0.0)
    # A worker and a child of it (as a compiler would be): both in the worker's process group.
    p = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                          "subprocess.run([sys.executable, '-c', 'import time; time.sleep(30)'])"],
                         start_new_session=True)
    try:
        time.sleep(0.5)
        child = _children(p.pid)[0]
        with P._LIVE_CV:
            P._LIVE.add(p)
        w = P.Warmup([], 1, 60, say=lambda m: None)
        with w.quiet() as n:
            assert n == 1
            time.sleep(0.2)
            assert _proc_state(p.pid) == "T" and _proc_state(child) == "T"
            assert P._PAUSED[0]
        time.sleep(0.2)
        assert _proc_state(p.pid) != "T" and _proc_state(child) != "T"
        assert not P._PAUSED[0]
    finally:
        with P._LIVE_CV:
            P._LIVE.discard(p)
        P._signal_group(p, 9)
        p.wait()


# ---- the harness's entry points, with and without flashgdn -------------------------------------

def _run_script(*args):
    return subprocess.run([sys.executable, str(BENCH_DIR / "run.py"), *args], capture_output=True, text=True,
                          cwd=str(BENCH_DIR.parent), timeout=300)


def test_run_script_lists_and_validates_without_a_gpu():
    r = _run_script("--full", "--list", "--part", "1/2")
    assert r.returncode == 0, r.stdout + r.stderr
    n = len(C.part_of(C.full_cells(), 1, 2))
    assert r.stdout.strip().splitlines()[-1].startswith(f"{n} cells, ")
    r = _run_script("--full", "--part", "3/2")
    assert r.returncode != 0 and "--part: expected i/n with 1 <= i <= n, got 3/2" in r.stderr


def test_run_script_lists_the_cells_with_their_q_k_convention():
    r = _run_script("--quick", "--list")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    cells = C.quick_cells()
    assert lines[:-1] == [f"{c.mode:7s} {c.heads:6s} {c.qk_norm:13s} {c.layout.name}"
                          for c in sorted(cells, key=lambda c: ((c.Hq, c.Hv) != (16, 64), c.mode != "fwd"))]
    assert lines[-1].startswith(f"{len(cells)} cells, 2 head configurations, q/k in_kernel and prenormalized, "
                                f"estimated {C.estimate_s(cells) / 60:.1f} min")
    r = _run_script("--full", "--list", "--qk-norm", "prenormalized", "--modes", "fwdbwd")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 + 5 * len(C.BWD_LAYOUTS) and all(" prenormalized " in ln for ln in lines[:-1])
    assert "q/k prenormalized, estimated" in lines[-1]
    r = _run_script("--quick", "--list", "--qk-norm", "none")
    assert r.returncode != 0 and "--qk-norm: expected a comma list of in_kernel, prenormalized, got 'none'" in r.stderr


# ---- the q/k conventions: inputs, the oracle, the contenders' calls ------------------------------

def _inputs(qk_norm, requires_grad=True):
    from gdnbench import inputs

    return inputs.make_inputs(2, 4, C.Layout("varlen", (5, 9)), seed=3, device="cpu", requires_grad=requires_grad,
                              with_grads_out=True, qk_norm=qk_norm)


def test_prenormalized_inputs_are_the_raw_ones_normalised_and_the_leaves():
    import torch

    raw, pre = _inputs("in_kernel"), _inputs("prenormalized")
    assert raw["qk_norm"] == "in_kernel" and pre["qk_norm"] == "prenormalized"
    for name in ("v", "g", "beta", "h0", "do", "dht"):  # the same draw otherwise
        assert torch.equal(raw[name], pre[name]), name
    for name in ("q", "k"):
        x, y = raw[name].detach(), pre[name]
        assert y.dtype == torch.bfloat16 and y.shape == x.shape and y.is_leaf and y.requires_grad
        norms = torch.linalg.vector_norm(y.double(), dim=-1)
        assert torch.allclose(norms, torch.ones_like(norms), atol=1e-2)
        assert not torch.allclose(torch.linalg.vector_norm(x.double(), dim=-1), torch.ones_like(norms), atol=0.5)
        assert torch.equal(y.detach(), torch.nn.functional.normalize(x.float(), dim=-1).bfloat16())
    with pytest.raises(ValueError, match="qk_norm"):
        _inputs("l2")


def _hide_flashgdn(monkeypatch, which):
    if which == "torch":
        monkeypatch.setitem(sys.modules, "flashgdn", None)  # `from flashgdn import reference` fails
        return
    try:
        import flashgdn.reference  # noqa: F401
    except ImportError as e:
        pytest.skip(f"flashgdn.reference does not import here: {e}")


@pytest.mark.parametrize("which", ["torch", "flashgdn.reference"])
def test_oracle_normalises_only_in_kernel_inputs(monkeypatch, which):
    """The oracle gets each convention's inputs: raw q, k with its own norm (in_kernel), the
    normalised tensors without a norm (prenormalized), gradients w.r.t. the tensors given."""
    import torch

    from gdnbench import oracle

    _hide_flashgdn(monkeypatch, which)
    names = ("q", "k", "v", "g", "beta", "h0")
    got = {}
    for qk in C.QK_NORMS:
        x = _inputs(qk)
        ref = oracle.oracle(x, True)
        assert ref["oracle"].startswith(which if which == "torch" else "flashgdn.reference"), ref["oracle"]
        leaves = {n: x[n].detach().double().requires_grad_(True) for n in names}
        o, ht = oracle._torch_recurrence(*leaves.values(), x["scale"], x["cu_host"], normalize=qk == "in_kernel")
        loss = (o * x["do"].double()).sum() + (ht * x["dht"].double()).sum()
        grads = torch.autograd.grad(loss, list(leaves.values()))
        assert oracle.rel_l2(ref["o"], o) < 1e-7 and oracle.rel_l2(ref["ht"], ht) < 1e-7
        for n, gr in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads):
            assert oracle.rel_l2(ref[n], gr) < 1e-7, (qk, n)
        got[qk] = (x, ref)
    (raw, r_in), (pre, r_pre) = got["in_kernel"], got["prenormalized"]
    # Same recurrence on (nearly) the same normalised q, k: bf16 rounding of the normalised tensors apart.
    assert oracle.rel_l2(r_pre["o"], r_in["o"]) < 1e-2 and oracle.rel_l2(r_pre["ht"], r_in["ht"]) < 1e-2
    for n, d in (("q", "dq"), ("k", "dk")):
        # The chain rule through the norm, u = x / |x|: dx = (du - u <u, du>) / |x|. The prenormalized
        # gradient keeps its radial part (no norm in its graph); projected, it gives the in_kernel one.
        u, du = pre[n].detach().double(), torch.as_tensor(r_pre[d]).double()
        radial = u * (u * du).sum(-1, keepdim=True)
        nx = torch.linalg.vector_norm(raw[n].detach().double(), dim=-1, keepdim=True)
        assert oracle.rel_l2((du - radial) / nx, r_in[d]) < 1e-2
        assert torch.linalg.vector_norm(radial) > 0.05 * torch.linalg.vector_norm(du)


def test_accuracy_check_matches_the_contender_and_the_oracle_per_convention(monkeypatch):
    """flashgdn's CPU path through the harness's accuracy check: small errors where the oracle got
    the same convention's inputs, and a wrong oracle convention shows."""
    import torch

    try:
        from gdnbench.contenders import FlashGDN
        c = FlashGDN()
        c.load()
        import flashgdn.reference  # noqa: F401
    except Exception as e:
        pytest.skip(f"flashgdn (with its reference) does not import here: {e}")
    from gdnbench import oracle
    from gdnbench.cli import accuracy_check

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    for qk, other in (("in_kernel", "prenormalized"), ("prenormalized", "in_kernel")):
        x = _inputs(qk)
        r = accuracy_check(torch, c, x, oracle.oracle(x, True), True)
        errs = [r[k] for k in ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")]
        assert r["grad_status"] == "ok" and max(errs) < 1e-2, r
        for n in ("q", "k", "v", "g", "beta", "h0"):
            x[n].grad = None
        wrong = accuracy_check(torch, c, x, oracle.oracle(dict(x, qk_norm=other), True), True)
        assert max(wrong["dq"], wrong["dk"]) > 5e-2, (qk, wrong)


class _Recorder:
    """Stands in for a contender's module: records the keyword arguments of its call."""

    def __init__(self):
        self.kw = []

    def chunk_gated_delta_rule(self, *args, **kw):
        self.kw.append(kw)
        return None, None


@pytest.mark.parametrize("qk_norm,in_call", [("in_kernel", True), ("prenormalized", False)])
def test_every_contender_normalises_only_in_the_in_kernel_convention(qk_norm, in_call):
    from gdnbench import contenders

    x = _inputs(qk_norm, requires_grad=False)
    for name, cls in contenders.ALL.items():
        c, rec = cls(), _Recorder()
        c.mod, c.fn = rec, rec.chunk_gated_delta_rule
        y = c.convert(x)
        c.call(y)
        assert rec.kw[-1]["use_qk_l2norm_in_kernel"] is in_call, name
        assert y["q"].data_ptr() == x["q"].data_ptr() or name == "flashinfer"
    fi = contenders.FlashInfer().convert(x)  # packed [B*T, H, K]: the same (normalised or raw) values
    assert fi["qk_norm"] == qk_norm and fi["q"].equal(x["q"].reshape(-1, *x["q"].shape[2:]))


def test_fla_dispatch_script_validates_its_arguments_before_any_gpu_work():
    script = str(BENCH_DIR / "fla_dispatch.py")
    r = subprocess.run([sys.executable, script, "--layouts", "nosuch"], capture_output=True, text=True)
    assert r.returncode == 2 and "--layouts: 'nosuch' matches no layout of the matrix" in r.stderr
    r = subprocess.run([sys.executable, script, "--configs", "16-64"], capture_output=True, text=True)
    assert r.returncode == 2 and "--configs: expected a comma list of Hq/Hv" in r.stderr
    r = subprocess.run([sys.executable, script, "--configs", "3/8"], capture_output=True, text=True)
    assert r.returncode == 2 and "Hv must be a positive multiple of Hq" in r.stderr


def test_prewarm_workers_run_the_script():
    """A warm-up task runs as its own process (bench/run.py prewarm-task) and reports back, here
    the error of an unknown contender."""
    assert P.RUN_SCRIPT == BENCH_DIR / "run.py" and P.RUN_SCRIPT.is_file()
    r = P._run_one(dict(contender="nosuch", Hq=2, Hv=8, grad=False, layouts=[]), 240)
    assert r["calls"] == [] and r["error"] == "KeyError: 'nosuch'", r


def test_default_results_folder_is_bench_results():
    out = R.default_out_dir({"gpu": "NVIDIA H100 80GB HBM3", "date": "2026-11-23 10:00 UTC"})
    assert out == BENCH_DIR / "results" / "h100-80gb-hbm3-2026-11-23"


def test_without_flashgdn_its_cells_say_not_installed_and_the_oracle_is_torch():
    """flashgdn hidden: its contender is unavailable, the oracle falls back to the float64 torch
    recurrence; with flashgdn, its C++ oracle and that recurrence agree."""
    script = hide_prelude("flashgdn") + textwrap.dedent(f"""
        sys.path.insert(0, {str(BENCH_DIR)!r})
        from gdnbench import configs as C, contenders, inputs, oracle
        try:
            contenders.FlashGDN().load()
        except contenders.Unavailable as e:
            print("unavailable:", e)
        x = inputs.make_inputs(1, 2, C.Layout("varlen", (5, 9)), device="cpu", requires_grad=True,
                               with_grads_out=True)
        ref = oracle.oracle(x, True)
        assert sorted(k for k, v in ref.items() if v is not None) == sorted(
            ["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0", "oracle"]), ref.keys()
        print(ref["oracle"])
        assert "flashgdn" not in sys.modules
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("unavailable: ModuleNotFoundError") and "flashgdn" in lines[0]
    assert lines[1].startswith("torch float64 recurrence (flashgdn.reference unavailable")

    try:
        import flashgdn.reference  # noqa: F401
    except ImportError as e:
        pytest.skip(f"flashgdn.reference does not import here: {e}")
    from gdnbench import inputs, oracle

    x = inputs.make_inputs(1, 2, C.Layout("varlen", (5, 9)), device="cpu", requires_grad=True, with_grads_out=True)
    ref = oracle.oracle(x, True)
    assert ref["oracle"] == "flashgdn.reference (C++ float64)"
    leaves = {n: x[n].detach().double() for n in ("q", "k", "v", "g", "beta", "h0")}
    o, ht = oracle._torch_recurrence(*leaves.values(), x["scale"], x["cu_host"])
    assert oracle.rel_l2(o, ref["o"]) < 1e-7 and oracle.rel_l2(ht, ref["ht"]) < 1e-7  # bench/README.md: 1e-8


def _flashgdn_stub():
    """The benchmark's flashgdn contender over a stub module: the keyword arguments of its last
    call land in `seen`."""
    from gdnbench.contenders import FlashGDN
    seen = {}

    class Stub:
        @staticmethod
        def chunk_gated_delta_rule(*args, **kwargs):
            seen.update(kwargs)

    f = FlashGDN()
    f.mod = Stub()
    x = dict(q=None, k=None, v=None, g=None, beta=None, scale=0.1, h0=None, cu=None, cu_host=None, qk_norm="in_kernel")
    return f, x, seen


def test_flashgdn_precision_reaches_its_calls():
    """--flashgdn-precision sets the level of flashgdn's calls (the forward's, and through autograd
    the backward's): the contender passes it on; the option takes only the library's levels."""
    f, x, seen = _flashgdn_stub()
    f.call(x)
    assert seen["precision"] == "default"
    f.precision = "fast"
    f.call(x)
    assert seen["precision"] == "fast"
    r = _run_script("--quick", "--list", "--flashgdn-precision", "fast")
    assert r.returncode == 0, r.stdout + r.stderr
    r = _run_script("--quick", "--list", "--flashgdn-precision", "low")
    assert r.returncode != 0 and "--flashgdn-precision" in r.stderr and "invalid choice" in r.stderr


def test_flashgdn_cp_reaches_its_calls():
    """--flashgdn-cp and --flashgdn-cp-segment set the context parallelism of flashgdn's calls (for
    automatic against off or a fixed segment on the same rows); the header records them; the options
    take only what the library accepts."""
    from gdnbench import cli
    f, x, seen = _flashgdn_stub()
    f.call(x)
    assert seen["context_parallel"] is None and seen["cp_segment"] == 0
    for argv, want in ((["--flashgdn-cp", "off"], (False, 0, "off")),
                       (["--flashgdn-cp", "on", "--flashgdn-cp-segment", "1024"], (True, 1024, "on, segment 1024 tokens")),
                       ([], (None, 0, "auto"))):
        a = cli._parse(["--quick"] + argv)
        cli.configure_flashgdn(f, a)
        f.call(x)
        assert (seen["context_parallel"], seen["cp_segment"]) == want[:2], argv
        assert f"| flashgdn_cp | {want[2]} |" in R.markdown({"gpu": "G", "date": "D", "flashgdn_cp": cli.flashgdn_cp(a)}, [], {})
    for argv, msg in ((["--flashgdn-cp", "off", "--flashgdn-cp-segment", "1024"], "needs --flashgdn-cp on or auto"),
                      (["--flashgdn-cp-segment", "100"], "multiple of 64"),
                      (["--flashgdn-cp", "sometimes"], "invalid choice")):
        r = _run_script("--quick", "--list", *argv)
        assert r.returncode != 0 and "--flashgdn-cp" in r.stderr and msg in r.stderr, r.stderr


def test_header_says_which_backward_and_level_flashgdn_ran(monkeypatch):
    """The results' header names flashgdn's level and its backward: the fused kernel unless
    FLASHGDN_BWD_FUSED reads as 0 (std::atoi, as the library reads it), else the staged one; the
    markdown lists both."""
    from gdnbench import cli
    for value, fused in (("1", True), (" 1", True), ("1x", True), ("0", False), ("", False), ("yes", False),
                         ("10", True), (" 0", False)):
        monkeypatch.setenv("FLASHGDN_BWD_FUSED", value)
        assert cli.flashgdn_backward().startswith("fused") == fused, value
    monkeypatch.delenv("FLASHGDN_BWD_FUSED")
    assert cli.flashgdn_backward().startswith("fused")
    hdr = {"gpu": "G", "date": "D", "flashgdn_precision": "fast", "flashgdn_backward": "staged"}
    md = R.markdown(hdr, [], {})
    assert "| flashgdn_precision | fast |" in md and "| flashgdn_backward | staged |" in md


def test_degenerate_keys_script_runs_on_the_cpu_backend():
    """bench/degenerate_keys.py (the GPU levels on repeated keys, beta 0.99) runs end to end on the
    CPU backend: a row per (keys, level), six finite errors each, at the fp32 backend's floor."""
    r = subprocess.run([sys.executable, str(BENCH_DIR / "degenerate_keys.py"), "--device", "cpu", "--T", "96",
                        "--heads", "1/2", "--keys", "identical,alternating"],
                       capture_output=True, text=True, cwd=str(BENCH_DIR.parent), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [ln.split("|")[1:-1] for ln in r.stdout.splitlines() if ln.startswith("| identical") or ln.startswith("| alternating")]
    assert len(rows) == 6
    for row in rows:
        errs = [float(x) for x in row[2:]]
        assert len(errs) == 6 and all(math.isfinite(e) and e < 5e-3 for e in errs), row


def test_fused_precision_dalog_table():
    """bench/fused_precision.py --dalog (docs/reliability.md D7's emulation) prints a row per policy
    with finite, nonzero errors of dA_log's per-head sums (each policy rounds something)."""
    r = subprocess.run([sys.executable, str(BENCH_DIR / "fused_precision.py"), "--dalog", "--T", "70", "--heads", "2",
                        "--K", "16", "--seeds", "1"], capture_output=True, text=True, cwd=str(BENCH_DIR.parent),
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [ln.split("|")[1:-1] for ln in r.stdout.splitlines() if ln.startswith("| fused") or ln.startswith("| +")]
    assert len(rows) == 8
    da = [float(row[2].split()[0]) for row in rows]
    assert all(math.isfinite(x) and 0 < x < 0.1 for x in da), rows


def test_fused_precision_states_table():
    """bench/fused_precision.py --states: a row per state-recurrence policy; `high` (every operand
    split, taken as exact) gives the states' own bf16 storage as the only rounding, so each
    gradient's error there is at most `fast`'s (every operand rounded) on the same inputs; dv and
    dh0 do not read the states' products and are equal in every row."""
    r = subprocess.run([sys.executable, str(BENCH_DIR / "fused_precision.py"), "--states", "--T", "200", "--heads", "2",
                        "--K", "16", "--seeds", "1"], capture_output=True, text=True, cwd=str(BENCH_DIR.parent),
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {ln.split("|")[1].strip(): [float(x) for x in ln.split("|")[2:-1]]
            for ln in r.stdout.splitlines() if ln.startswith("| `") or ln.startswith("| S") or ln.startswith("| Y")
            or ln.startswith("| Vd")}
    assert len(rows) == 7, r.stdout
    high, fast = rows["`high` (every operand split)"], rows["`fast` (every operand bf16)"]
    assert all(math.isfinite(e) and 0 < e < 0.1 for row in rows.values() for e in row), rows
    assert high[3] < fast[3] and high[0] < fast[0], (high, fast)  # dg, dq
    assert all(row[2] == high[2] and row[5] == high[5] for row in rows.values()), rows


def test_grad_precision_parses_variants_and_layouts():
    """bench/grad_precision.py: a variant is a level with optional VAR=VAL pairs the library reads
    at each call; a layout is 'check' or NxT; anything else is refused naming the option."""
    sys.path.insert(0, str(BENCH_DIR))
    import grad_precision as gp
    from gdnbench import configs as C
    assert gp.parse_variant("default") == ("default", {})
    assert gp.parse_variant("fast:FLASHGDN_BWD_FUSED=1;X=y") == ("fast", {"FLASHGDN_BWD_FUSED": "1", "X": "y"})
    for bad in ("medium", "fast:FLASHGDN_BWD_FUSED"):
        with pytest.raises(SystemExit, match="--variants"):
            gp.parse_variant(bad)
    assert gp.parse_layout("check") == C.CHECK_LAYOUT
    assert gp.parse_layout("1x2048") == C.seq(2048)
    assert gp.parse_layout("4x512") == C.varlen(4, 512)
    with pytest.raises(SystemExit, match="--layouts"):
        gp.parse_layout("2048")
