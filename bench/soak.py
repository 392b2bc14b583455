"""python -m bench.soak: the soak alone (python -m bench.stress --scenarios soak ...)."""

from __future__ import annotations

import sys

from bench.stress.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["--scenarios", "soak", *sys.argv[1:]]))
