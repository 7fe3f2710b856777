"""``python -m gdnbench`` (with bench/ on the path): the same as ``python bench/run.py``."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
