"""Run the supervisor until SIGTERM/SIGINT; the exit code says how it ended."""

from __future__ import annotations

from service.app.supervisor import Supervisor
from service.settings import Settings


async def serve(settings: Settings) -> int:
    """Start the processes, serve until signalled, drain; 0 on a clean stop, 1 when the
    server cannot start, a child keeps dying, or one died or was killed in the drain."""
    return await Supervisor(settings).run()
