"""Where the worker listens for front ends: one Unix socket in the supervisor's run folder."""

from __future__ import annotations

from pathlib import Path

SOCKET_NAME = "worker.sock"


def socket_path(run_dir: Path) -> Path:
    return run_dir / SOCKET_NAME
