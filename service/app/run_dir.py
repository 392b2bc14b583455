"""The supervisor's run directory (the worker's socket, the metrics files of every process),
and the sweep of those left behind by a supervisor that was SIGKILLed: its children exit
with it (PDEATHSIG), but nobody is left to remove the directory."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)
PREFIX = "attention-serving-"
OWNER_FILE = "supervisor.pid"


def create() -> Path:
    """A fresh run directory, marked with this process's pid, after sweeping dead ones."""
    sweep(Path(tempfile.gettempdir()))
    run_dir = Path(tempfile.mkdtemp(prefix=PREFIX))
    (run_dir / OWNER_FILE).write_text(f"{os.getpid()} {_pid_namespace()}")
    return run_dir


def sweep(parent: Path) -> list[Path]:
    """Remove this user's run directories whose supervisor is gone; the ones removed. Only
    those of supervisors in this pid namespace: a pid from another (a container sharing
    this temporary directory) says nothing here."""
    removed = []
    namespace = _pid_namespace()
    for candidate in parent.glob(PREFIX + "*"):
        try:
            if candidate.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        marked = owner(candidate)
        if marked is None:
            continue  # not ours, or being created right now
        pid, owner_namespace = marked
        if owner_namespace != namespace or _alive(pid):
            continue
        shutil.rmtree(candidate, ignore_errors=True)
        removed.append(candidate)
    if removed:
        log.info("removed %d run directories of supervisors that died", len(removed))
    return removed


def owner(run_dir: Path) -> tuple[int, str] | None:
    """The pid and pid namespace of the supervisor that made run_dir; None when unreadable."""
    try:
        pid, namespace = (run_dir / OWNER_FILE).read_text().split()
        return int(pid), namespace
    except (OSError, ValueError):
        return None


def of_supervisor(pid: int, parent: Path | None = None) -> Path | None:
    """The run directory of the supervisor with this pid in this pid namespace, if any."""
    namespace = _pid_namespace()
    for candidate in (parent or Path(tempfile.gettempdir())).glob(PREFIX + "*"):
        if owner(candidate) == (pid, namespace):
            return candidate
    return None


def _pid_namespace() -> str:
    """This process's pid namespace ("" where /proc does not say)."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process holds that pid now
    return True
