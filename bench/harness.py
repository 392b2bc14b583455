"""What the tests and the benchmarks both need to drive a real server: a free port on
loopback, and polling for a condition instead of sleeping for it."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

POLL_S = 0.02


def free_port() -> int:
    """A TCP port on 127.0.0.1 the kernel just handed out (and took back): free, and not
    reused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


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
