"""A DataPlane that computes in the test's own process: the servicers over a real Batcher,
for tests that need a Runner of their own (a failing engine) behind the real servicers."""

from __future__ import annotations

from typing import Any

import numpy as np

from service.catalog import ModelRegistry
from service.dataplane import IndexEntry, Result, VersionStats
from service.errors import NotSupported
from service.worker.batching.batcher import Batcher


class LocalPlane:
    def __init__(self, registry: ModelRegistry[Any], batcher: Batcher) -> None:
        self._registry = registry
        self._batcher = batcher

    @property
    def models(self) -> ModelRegistry[Any]:
        return self._registry

    async def infer(
        self,
        model: Any,
        embeddings: np.ndarray,
        *,
        with_weights: bool,
        deadline: float | None,
        tag: object = None,
        targets: object = None,
    ) -> Result:
        if targets:
            raise NotSupported("no client shared memory in this test")
        return await self._batcher.submit(
            model, embeddings, with_weights=with_weights, deadline=deadline, tag=tag
        )

    async def statistics(self, keys: list[str]) -> dict[str, VersionStats]:
        return {key: self._batcher.statistics.snapshot(key) for key in keys}

    async def index(self, *, ready_only: bool) -> list[IndexEntry]:
        raise NotSupported("no model repository in this test")

    async def load(self, name: str, peer: str = "") -> None:
        raise NotSupported("no model repository in this test")

    async def unload(self, name: str, peer: str = "") -> None:
        raise NotSupported("no model repository in this test")

    async def shm_register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        raise NotSupported("no client shared memory in this test")

    async def shm_unregister(self, name: str) -> None:
        raise NotSupported("no client shared memory in this test")

    async def shm_status(self, name: str) -> list[tuple[str, str, int, int]]:
        raise NotSupported("no client shared memory in this test")
