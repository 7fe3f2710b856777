"""``python -m flashgdn.bench``, the package's small self-timing command: its argument checks,
a CPU run with the oracle check, numpy imported only for --check, and a GPU run where there is
one."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import flashgdn
from flashgdn import bench
from hiding import hide_prelude

TINY = ["--T", "70", "--heads", "1/2", "--dim", "32", "--warmup", "1", "--reps", "2"]


@pytest.mark.parametrize("args,message", [
    (["--T", "0"], "--T: expected an integer >= 1, got 0"),
    (["--batch", "-2"], "--batch: expected an integer >= 1, got -2"),
    (["--reps", "0"], "--reps: expected an integer >= 1, got 0"),
    (["--warmup", "-1"], "--warmup: expected an integer >= 0, got -1"),
    (["--heads", "16x64"], "--heads: expected HQ/HV, two positive integers such as 16/64, got '16x64'"),
    (["--heads", "0/4"], "--heads: expected HQ/HV, two positive integers such as 16/64, got '0/4'"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
])
def test_arguments_are_checked(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(args)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_shape_the_library_refuses_names_the_argument():
    with pytest.raises(SystemExit) as e:
        bench.run(bench.parse_args(TINY + ["--device", "cpu", "--heads", "3/4"]))
    assert "the call failed: ValueError" in str(e.value.code) and "Hv that is a positive multiple of Hq=3" in \
        str(e.value.code)


@pytest.mark.skipif(torch.cuda.is_available() and flashgdn.has_cuda(), reason="a CUDA device is here")
def test_device_cuda_without_one_says_why():
    with pytest.raises(SystemExit) as e:
        bench.run(bench.parse_args(TINY + ["--device", "cuda"]))
    assert str(e.value.code).startswith("flashgdn.bench: --device cuda: ")


@pytest.mark.parametrize("extra", [[], ["--varlen", "--batch", "3", "--dtype", "fp32"]])
def test_cpu_run_times_and_checks(extra):
    res = bench.run(bench.parse_args(TINY + ["--device", "cpu", "--backward", "--check"] + extra))
    assert res["device"] == "cpu"
    for what in ("forward", "forward+backward"):
        med, lo = res[what]
        assert 0 < lo <= med
    err = res["errors"]
    assert set(err) == {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"}
    bound = 1e-5 if "fp32" in extra else 2e-2
    assert all(e < bound for e in err.values()), err


def _module(args, hide_numpy=False):
    """``python -m flashgdn.bench ARGS`` in a subprocess, numpy hidden if asked (as if it were
    not installed); the last line of its stdout says whether numpy got imported."""
    script = (hide_prelude("numpy") if hide_numpy else "import sys\n") + textwrap.dedent(f"""
        import runpy
        sys.argv = ["flashgdn.bench"] + {args!r}
        try:
            runpy.run_module("flashgdn.bench", run_name="__main__")
        finally:
            print("numpy imported:", "numpy" in sys.modules)
    """)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(__file__))


def test_module_runs_without_numpy_unless_asked_for_the_oracle():
    r = _module(TINY + ["--device", "cpu"], hide_numpy=True)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout.splitlines()
    assert out[0].startswith(f"flashgdn {flashgdn.__version__} on cpu: 1 x 70 tokens (dense), Hq/Hv 1/2")
    assert out[1].startswith("forward ") and out[1].endswith(")") and " ms " in out[1]
    assert out[-1] == "numpy imported: False"
    r = _module(TINY + ["--device", "cpu", "--check"], hide_numpy=True)
    assert r.returncode == 1 and "flashgdn.bench: --check: flashgdn.reference (the float64 oracle) needs numpy" \
        in r.stderr, r.stdout + r.stderr
    assert "forward" not in r.stdout  # it fails before timing anything


def test_module_prints_the_oracle_errors():
    r = _module(TINY + ["--device", "cpu", "--check"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-2].startswith("vs float64 oracle: o ")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)")
@pytest.mark.skipif(not flashgdn.has_cuda(), reason="flashgdn was built without the CUDA backend")
def test_gpu_run_times_and_checks():
    res = bench.run(bench.parse_args(["--T", "1000", "--heads", "2/8", "--backward", "--check", "--varlen",
                                      "--batch", "2", "--reps", "5"]))
    assert res["device"] == torch.cuda.get_device_name()
    assert 0 < res["forward"][1] <= res["forward"][0] and 0 < res["forward+backward"][1]
    assert all(e < 2e-2 for e in res["errors"].values()), res["errors"]
