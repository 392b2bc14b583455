"""One start for the drain in every process: the moment the supervisor took the shutdown
signal. A child handles its SIGTERM only when its event loop next turns, which can be a
good part of a second late (a front end decoding a 32 MiB request), and a gateway hears of
it from its front end; timing the grace period from there would let the worker, on time,
give up on requests that a front end still means to answer, and push the exit past the
grace period.

The file holds the wall-clock time (time.time()): the one clock the Go gateway can read
too. A drain is short, so a clock step during one is the only way to be misled, and a time
that is not plausibly this drain's is ignored."""

from __future__ import annotations

import os
import time
from pathlib import Path

FILE = "shutdown-signal"  # in the run directory
# uvloop's loop.time() is whole milliseconds, up to one behind time.monotonic().
CLOCK_SLACK_S = 0.005
PLAUSIBLE_S = 86400.0  # older than this, the file says nothing of this run


def record(run_dir: Path) -> OSError | None:
    """Now, written before the children are signalled; the error when it cannot be (each
    process then times the drain from its own handling of the signal)."""
    partial = run_dir / (FILE + ".partial")
    try:
        partial.write_text(repr(time.time()))
        os.replace(partial, run_dir / FILE)
    except OSError as err:
        return err
    return None


def started(run_dir: Path, handled_at: float) -> float:
    """When this process's drain began, on time.monotonic()'s clock: the supervisor's signal,
    else handled_at (this process's own handling of SIGTERM) where there is none to read or
    the time read is not plausibly this run's signal (the run directory is this run's, and a
    run is drained once). One heard later than the grace period gets no time of its own."""
    try:
        signalled_wall = float((run_dir / FILE).read_text())
    except (OSError, ValueError):
        return handled_at
    signalled_at = time.monotonic() - (time.time() - signalled_wall)
    if handled_at - PLAUSIBLE_S <= signalled_at <= handled_at + CLOCK_SLACK_S:
        return min(signalled_at, handled_at)
    return handled_at


def path(run_dir: Path) -> Path:
    return run_dir / FILE
