"""gdnbench: flashgdn against its peers (FlashQLA, FlashInfer, FLA) on the GPU.

    python bench/run.py --quick                 # 7 cells, ~7 min from cold compile caches (H100)
    python bench/run.py --full --part 1/2       # the whole matrix in two parts, each < 10 min from cold
    python bench/run.py report --merge DIR...   # merge parts, redo the table and the plots

The harness lives in the repository, not in the flashgdn wheel. It imports flashgdn only for
flashgdn's cells and the float64 oracle: without an installed flashgdn those cells say "not
installed" and the oracle is a float64 torch recurrence. ``python -m gdnbench`` with bench/ on
the path is the same command. See bench/README.md for what is measured and how.
"""
__all__ = ["main"]


def main(argv=None):
    from .cli import main as _main

    return _main(argv)
