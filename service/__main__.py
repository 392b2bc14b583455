"""python -m service: run the server until SIGTERM/SIGINT, then drain and exit 0."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable

from service.app.lifecycle import exit_now, serve
from service.memory.malloc import keep_freed_memory
from service.settings import describe, load_settings

log = logging.getLogger("service")


def main(argv: list[str] | None = None) -> int:
    settings = load_settings(argv)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    log.info("settings: %s", describe(settings))
    if settings.malloc_reuse == "on":
        log.info("malloc keeps freed memory for reuse: %s", keep_freed_memory())
    loop_factory = event_loop_factory(settings.event_loop)
    log.info("event loop: %s", "uvloop" if loop_factory else "asyncio")
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        # Exit from inside: the runner's own exit would first join the default executor,
        # i.e. wait out a model load or batch-cap measurement a start-up signal cut short.
        exit_now(runner.run(serve(settings)))


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


if __name__ == "__main__":
    sys.exit(main())
