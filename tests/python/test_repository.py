"""The repository a newcomer clones stays small and readable (issue 35).

- bench/results keeps only the runs that back what README.md and docs/ claim: the files git
  tracks there stay under 4 MB, and none of them is a script or a patch (those are records that
  live in git history; a script a documented procedure needs lives in bench/ or scripts/);
- bench/NOTES.md is a page of where each kernel stands, not a log: under 300 lines.

Standard library only: no torch, no built package, no GPU.
"""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = "bench/results"
NOTES = os.path.join(ROOT, "bench", "NOTES.md")

RESULTS_MAX_BYTES = 4_000_000
NOTES_MAX_LINES = 300
RECORD_SUFFIXES = (".py", ".sh", ".patch", ".diff")


def tracked(path):
    """Files git tracks under `path` (relative to ROOT); skips outside a git checkout."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed: the tracked files cannot be listed")
    if not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip(f"{ROOT} is not a git checkout (an sdist or a copy): no tracked files to list")
    out = subprocess.run(["git", "-C", ROOT, "ls-files", "-z", "--", path],
                         capture_output=True, check=False)
    if out.returncode != 0:
        pytest.skip(f"git ls-files failed here: {out.stderr.decode(errors='replace').strip()}")
    return [f for f in out.stdout.decode().split("\0") if f]


def test_bench_results_tracked_size_under_limit():
    files = tracked(RESULTS)
    sizes = {f: os.lstat(os.path.join(ROOT, f)).st_size
             for f in files if os.path.lexists(os.path.join(ROOT, f))}
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert total < RESULTS_MAX_BYTES, (
        f"{RESULTS} tracks {total} bytes in {len(files)} files (limit {RESULTS_MAX_BYTES}); keep "
        f"the runs that back today's claims, drop raw files and plots, and name the commit that "
        f"holds the rest in {RESULTS}/README.md. Largest: {largest}")


def test_no_scripts_or_patches_under_bench_results():
    records = [f for f in tracked(RESULTS) if f.endswith(RECORD_SUFFIXES)]
    assert not records, (
        f"scripts and patches under {RESULTS} (records belong in git history; a script a "
        f"documented procedure needs goes to bench/ or scripts/): {records}")


def test_notes_is_a_short_page():
    with open(NOTES, encoding="utf-8") as f:
        lines = sum(1 for _ in f)
    assert lines < NOTES_MAX_LINES, (
        f"bench/NOTES.md has {lines} lines (limit {NOTES_MAX_LINES}): it says where each kernel "
        f"stands; a step's full record goes in its commit, its outcome in one line")
