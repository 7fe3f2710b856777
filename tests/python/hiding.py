"""For tests that run a script in a subprocess as if some packages were not installed."""
import textwrap


def hide_prelude(*packages: str) -> str:
    """Python source to put first in such a script: sys.path's finder, made blind to the
    top-level ``packages`` (and everything under them)."""
    return textwrap.dedent(f"""
        import importlib.machinery, sys
        class _Hide:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {tuple(packages)!r}:
                    return None
                return importlib.machinery.PathFinder.find_spec(name, path, target)
            def invalidate_caches(self):
                importlib.machinery.PathFinder.invalidate_caches()
        sys.meta_path[:] = [_Hide() if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
    """)
