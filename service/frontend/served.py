"""Per-model health entries (service name = model name) that follow the served set."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from grpc_health.v1 import health, health_pb2

from service.catalog import ModelRegistry, ServedModel

log = logging.getLogger(__name__)


class ServedSet:
    """Keeps the per-model health entries equal to what the worker serves, and warns about a
    version whose largest call exceeds the message limits this front end started with."""

    def __init__(self, health_servicer: health.aio.HealthServicer) -> None:
        self._health = health_servicer
        self._shown: set[str] = set()
        self._warned: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._health_order = asyncio.Lock()  # FIFO: updates land in the order of the changes
        self._needs: Callable[[ServedModel], tuple[int, int]] | None = None
        self._limits = (0, 0)

    def check_limits(
        self, needs: Callable[[ServedModel], tuple[int, int]], limits: tuple[int, int]
    ) -> None:
        """From now on, warn about a newly served version whose largest legal call (receive,
        send bytes) exceeds the gRPC message limits the server was started with."""
        self._needs, self._limits = needs, limits

    def sync(self, registry: ModelRegistry[ServedModel], *, ready: bool) -> None:
        """Call on the event loop after every change of the served set or of readiness."""
        self._warn_too_large(registry.all())
        names = set(registry.names())
        statuses = {
            name: health_pb2.HealthCheckResponse.SERVING
            if ready and name in names
            else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in names | self._shown
        }
        self._shown = names
        task = asyncio.ensure_future(self._set_health(statuses))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _warn_too_large(self, models: list[ServedModel]) -> None:
        if self._needs is None:
            return
        for model in models:
            if model.key in self._warned:
                continue
            needs = self._needs(model)
            if needs[0] > self._limits[0] or needs[1] > self._limits[1]:
                self._warned.add(model.key)
                log.warning(
                    "%s takes calls of up to %d bytes (answers %d) but the gRPC limits were set "
                    "at start to %d (%d) from the models served then: larger calls get "
                    "RESOURCE_EXHAUSTED until a restart",
                    model.key,
                    *needs,
                    *self._limits,
                )

    async def _set_health(self, statuses: dict[str, int]) -> None:
        # set() can wait (a Watch call holds its entry while it writes): without the lock, an
        # older update could finish after a newer one and leave a stale status.
        async with self._health_order:
            for name, status in statuses.items():
                await self._health.set(name, status)  # type: ignore[arg-type]
