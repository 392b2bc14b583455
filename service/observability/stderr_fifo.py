"""Where a process's standard error goes when the supervisor relays it: a FIFO per role in
the run directory (the supervisor creates and reads it; app/stderr_relay.py). A child opens
its own; a front end opens its gateway's."""

from __future__ import annotations

import os
from pathlib import Path

FIFO_PREFIX = "stderr-"


def fifo_path(run_dir: Path, role: str) -> Path:
    return run_dir / f"{FIFO_PREFIX}{role}"


def open_writer(run_dir: Path, role: str) -> int | None:
    """A blocking descriptor writing into role's FIFO; None when there is none (a process
    run on its own, or a supervisor that could not make one), or nobody reads it."""
    try:
        # Non-blocking only to fail at once where nobody reads; writes then wait as usual.
        fifo = os.open(fifo_path(run_dir, role), os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return None
    os.set_blocking(fifo, True)
    return fifo
