"""The peer benchmark: ``python bench/run.py [--quick | --full [--part i/n]] ...``.

Runs the package gdnbench next to this file (this folder is the script's sys.path[0]); an
installed flashgdn is timed, and without one its cells say "not installed". bench/README.md
lists every command and option.
"""
import sys

from gdnbench.cli import main

if __name__ == "__main__":
    sys.exit(main())
