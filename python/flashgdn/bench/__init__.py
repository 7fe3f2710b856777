"""flashgdn.bench: flashgdn against its peers (FlashQLA, FlashInfer, FLA) on the GPU.

    python -m flashgdn.bench --quick                 # 7 cells, ~7 min from cold compile caches (H100)
    python -m flashgdn.bench --full --part 1/2       # the whole matrix in two parts, each < 10 min from cold
    python -m flashgdn.bench report --merge DIR...   # merge parts, redo the table and the plots

Without a built flashgdn (its ``_C`` missing) the package import fails; run the same code by
path instead: ``python python/flashgdn/bench ...`` (flashgdn's cells then say "not installed").
See bench/README.md for what is measured and how.
"""
__all__ = ["main"]


def main(argv=None):
    from .cli import main as _main

    return _main(argv)
