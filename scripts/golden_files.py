"""The command line every golden-file script shares: write the files it renders into their
folder, or (--check) say which differ from what it renders now."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def main(
    argv: Sequence[str] | None,
    *,
    description: str,
    default_out: Path,
    render: Callable[[], dict[str, bytes]],
    module: str,
) -> int:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help="fail when a file differs")
    parser.add_argument(
        "--out", type=Path, default=default_out, help="the folder (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    files = render()
    if args.check:
        stale = sorted(
            {name for name, data in files.items() if _read(args.out / name) != data}
            | {path.name for path in args.out.glob("*") if path.name not in files}
        )
        for name in stale:
            sys.stderr.write(f"{args.out / name} differs: run python -m {module}\n")
        return 1 if stale else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (args.out / name).write_bytes(data)
    return 0


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.exists() else None
