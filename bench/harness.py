"""What the tests and the benchmarks both need to drive a real server: a free port on
loopback, and polling for a condition instead of sleeping for it."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

POLL_S = 0.02


def free_port() -> int:
    """A TCP port on 127.0.0.1 the kernel just handed out (and took back): free, and not
    reused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def loopback_server(repository: Path | str) -> list[str]:
    """The command of a server (python -m service) serving repository on 127.0.0.1, every
    port the kernel's choice; the caller appends its own flags."""
    return [
        sys.executable,
        "-m",
        "service",
        "--host",
        "127.0.0.1",
        "--grpc-port",
        "0",
        "--metrics-port",
        "0",
        "--http-port",
        "0",
        "--model-repository",
        str(repository),
    ]


def wait_for(
    condition: Callable[[], object], *, what: str = "the condition", timeout_s: float = 60.0
) -> float:
    """Poll until condition() is true; the seconds it took. TimeoutError names what."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"{what}: not reached within {timeout_s:g}s")
        time.sleep(POLL_S)
    return time.monotonic() - started
