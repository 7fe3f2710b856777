"""Entry point: ``python -m flashgdn.bench`` or, without a built flashgdn, ``python python/flashgdn/bench``."""
import sys

if __package__ in (None, ""):
    # Run by path: load this folder as the package "flashgdn_bench" without importing flashgdn
    # itself (whose __init__ needs the compiled _C).
    import importlib.util
    import os

    _here = os.path.dirname(os.path.abspath(__file__))
    _spec = importlib.util.spec_from_file_location(
        "flashgdn_bench", os.path.join(_here, "__init__.py"), submodule_search_locations=[_here])
    _pkg = importlib.util.module_from_spec(_spec)
    sys.modules["flashgdn_bench"] = _pkg
    _spec.loader.exec_module(_pkg)
    from flashgdn_bench.cli import main
else:
    from .cli import main

if __name__ == "__main__":
    sys.exit(main())
