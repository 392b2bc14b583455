"""Per model-version inference statistics, in the shape V2's ModelStatistics reports them."""

from __future__ import annotations

import copy
import threading
import time
from collections import defaultdict

from service.dataplane import Duration, VersionStats

__all__ = ["Duration", "InferenceStatistics", "VersionStats"]


class InferenceStatistics:
    """Written by the batcher, read by the V2 ModelStatistics call; keyed by runner key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats: dict[str, VersionStats] = defaultdict(VersionStats)

    def record_batch(
        self,
        key: str,
        sequences: int,
        queue_s: list[float],
        compute_s: float,
        succeeded_sequences: int,
    ) -> None:
        """A batch of sequences computed; queue_s: the wait of each request answered OK, whose
        sequences (succeeded_sequences) alone are inferences, as Triton counts them."""
        with self._lock:
            stats = self._stats[key]
            stats.inference_count += succeeded_sequences
            stats.execution_count += 1
            stats.last_inference_ms = int(time.time() * 1000)
            stats.compute_infer.add(compute_s * len(queue_s), len(queue_s))
            stats.batches[sequences].add(compute_s)
            for waited in queue_s:
                stats.queue.add(waited)
                stats.success.add(waited + compute_s)

    def record_failure(self, key: str, seconds: float, requests: int = 1) -> None:
        with self._lock:
            self._stats[key].fail.add(seconds * requests, requests)

    def snapshot(self, key: str) -> VersionStats:
        """A copy that later updates do not change."""
        with self._lock:
            return copy.deepcopy(self._stats[key])
