"""The asyncio event loop each process runs on."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


def event_loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's factory when chosen (or auto and installed); None = asyncio's own loop."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise SystemExit("--event-loop uvloop, but uvloop is not installed") from None
        return None
    return uvloop.new_event_loop
