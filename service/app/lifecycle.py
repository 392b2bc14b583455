"""Run the server until SIGTERM/SIGINT, honouring a signal at any moment, start-up included."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import NoReturn

from service.app.server import AttentionServer, StartupError
from service.settings import Settings

log = logging.getLogger("service")


async def serve(settings: Settings) -> int:
    """Start, serve until signalled, drain; 0 on a clean stop, 1 when it cannot start."""
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    server = AttentionServer(settings)
    starting = asyncio.create_task(server.start(), name="start-up")

    signalled_at: list[float] = []  # loop.time() of the first signal: grace counts from it

    def on_signal() -> None:
        if signalled_at:
            # A second SIGTERM/SIGINT changes nothing: the drain under way keeps every
            # accepted request and already ends within the grace period; SIGKILL stops at once.
            left = max(0.0, settings.grace_period_s - (loop.time() - signalled_at[0]))
            log.warning("another shutdown signal: ignored, the drain ends within %.1fs", left)
            return
        signalled_at.append(loop.time())
        stop_requested.set()
        # During start-up (loading, warm-up): stop now instead of after it, and never report
        # SERVING. A step already running on its thread is left to it (the exit ends it).
        starting.cancel()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal)
    try:
        await starting
    except asyncio.CancelledError:
        if not stop_requested.is_set():
            raise
        log.info("shutdown signal received during start-up; stopping without serving")
        await server.stop(signalled_at=signalled_at[0])
        return 0
    except StartupError as err:
        log.error("cannot start: %s", err)
        await server.stop()
        return 1
    await stop_requested.wait()
    log.info("shutdown signal received; draining for up to %.1fs", settings.grace_period_s)
    await server.stop(signalled_at=signalled_at[0])
    return 0


def exit_now(code: int) -> NoReturn:
    """Exit without the interpreter's teardown: stop() has closed everything that matters,
    and the teardown (ONNX Runtime sessions, gRPC, modules; about 0.5 s measured) or a batch
    still computing on its thread would otherwise push the exit past the grace period."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
