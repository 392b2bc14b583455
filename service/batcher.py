"""Dynamic batcher: one queue per (model version, wants-weights), one scheduler, bounded compute.

A batch closes when its queue holds max_batch_size sequences or its oldest request has
waited max_queue_delay; while every compute slot is busy, queues keep filling, so load
turns into larger batches instead of longer queues of small ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from service import metrics
from service.batch_types import BatchFailed, BatchLimits, Result, Runner
from service.batching import choose_batch, merge, padding_ratio, split
from service.errors import DeadlineExpired, QueueFull, ShuttingDown
from service.statistics import InferenceStatistics

log = logging.getLogger(__name__)
GRAPHS = {False: "output", True: "output+attention_weights"}


@dataclass(eq=False)
class _Pending:
    embeddings: np.ndarray  # [n, seq, d]
    future: asyncio.Future[Result]
    enqueued_at: float
    deadline: float | None


@dataclass(eq=False)
class _Queue:
    runner: Runner
    with_weights: bool
    items: deque[_Pending] = field(default_factory=deque)

    def sequences(self) -> int:
        return sum(item.embeddings.shape[0] for item in self.items)


@dataclass(frozen=True)
class _Computed:
    parts: list[tuple[np.ndarray, np.ndarray | None]]
    compute_s: float
    padding: float


def _compute(runner: Runner, arrays: Sequence[np.ndarray], with_weights: bool) -> _Computed:
    """Runs on the executor thread: merge, ONNX Runtime, split."""
    started = time.monotonic()
    embeddings, mask = merge(arrays)
    output, weights = runner.run(embeddings, mask, with_weights)
    shapes = [(a.shape[0], a.shape[1]) for a in arrays]
    # Contiguous here, on the compute thread: the padded slices would otherwise be copied
    # while encoding, on the event loop that every other call waits for.
    parts = [
        (np.ascontiguousarray(out), None if w is None else np.ascontiguousarray(w))
        for out, w in split(output, weights, shapes)
    ]
    padding = padding_ratio([s[0] for s in shapes], [s[1] for s in shapes])
    return _Computed(parts, time.monotonic() - started, padding)


class Batcher:
    """Use start(), then submit() from request handlers; drain() then stop() on shutdown."""

    def __init__(self, limits: BatchLimits, statistics: InferenceStatistics | None = None) -> None:
        self._limits = limits
        self.statistics = statistics or InferenceStatistics()
        self._queues: dict[tuple[str, bool], _Queue] = {}
        self._pending = 0
        self._running = 0
        self._accepting = False
        self._flushing = False  # close batches at once instead of waiting for them to fill
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._slots = asyncio.Semaphore(limits.max_inflight_batches)
        self._tasks: set[asyncio.Task[None]] = set()
        self._scheduler: asyncio.Task[None] | None = None
        self._executor = ThreadPoolExecutor(
            max_workers=limits.max_inflight_batches, thread_name_prefix="batch-compute"
        )

    async def start(self) -> None:
        self._scheduler = asyncio.create_task(self._schedule(), name="batch-scheduler")
        self._accepting = True

    async def submit(
        self,
        runner: Runner,
        embeddings: np.ndarray,
        *,
        with_weights: bool,
        deadline: float | None = None,
    ) -> Result:
        """Queue [n, seq, d] embeddings and wait for their share of a batch.

        deadline is on the time.monotonic() clock; past it the request is never computed.
        """
        if not self._accepting:
            raise ShuttingDown(
                "server is not accepting requests (starting up or shutting down); retry"
            )
        if self._pending >= self._limits.max_queue_size:
            raise QueueFull(
                f"queue full: {self._pending} requests waiting (max_queue_size="
                f"{self._limits.max_queue_size}); retry with backoff"
            )
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        future.add_done_callback(self._on_done)
        queue = self._queues.get((runner.key, with_weights))
        if queue is None:
            queue = self._queues[(runner.key, with_weights)] = _Queue(runner, with_weights)
        queue.items.append(_Pending(embeddings, future, time.monotonic(), deadline))
        self._set_pending(self._pending + 1)
        self._wakeup.set()
        return await future

    async def drain(self) -> None:
        """Compute every queued request without waiting for batches to fill; return when idle.
        Requests still arriving (accepted by gRPC before shutdown) are served too."""
        self._flushing = True
        self._wakeup.set()
        await self._idle.wait()

    async def stop(self) -> None:
        """Stop the scheduler; anything still queued fails with UNAVAILABLE."""
        self._accepting = False
        if self._scheduler is not None:
            self._scheduler.cancel()
            await asyncio.gather(self._scheduler, return_exceptions=True)
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for queue in self._queues.values():
            while queue.items:
                item = queue.items.popleft()
                if not item.future.done():
                    item.future.set_exception(ShuttingDown("server stopped before computing it"))
        self._set_pending(0)
        self._executor.shutdown(wait=True)

    # -- scheduling -------------------------------------------------------------------------

    def _on_done(self, future: asyncio.Future[Result]) -> None:
        if future.cancelled():
            self._wakeup.set()  # let the scheduler drop it from its queue now

    def _set_pending(self, value: int) -> None:
        self._pending = value
        metrics.QUEUE_DEPTH.set(value)
        if value == 0 and self._running == 0:
            self._idle.set()
        else:
            self._idle.clear()

    async def _schedule(self) -> None:
        while True:
            await self._slots.acquire()
            try:
                queue, batch = await self._next_batch()
            except BaseException:
                self._slots.release()
                raise
            task = asyncio.create_task(self._run(queue, batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _next_batch(self) -> tuple[_Queue, list[_Pending]]:
        while True:
            self._wakeup.clear()
            now = time.monotonic()
            self._drop_dead(now)
            queue, wait_s = self._ready_queue(now)
            if queue is not None:
                return queue, self._take(queue)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout=wait_s)

    def _drop_dead(self, now: float) -> None:
        """Remove cancelled and expired requests before they cost any compute."""

        def dead(item: _Pending) -> bool:
            return item.future.cancelled() or (item.deadline is not None and item.deadline <= now)

        removed = 0
        for queue in self._queues.values():
            if not any(dead(item) for item in queue.items):
                continue  # the common case: no new deque on every wake-up
            alive: deque[_Pending] = deque()
            for item in queue.items:
                expired = item.deadline is not None and item.deadline <= now
                if item.future.cancelled():
                    # gRPC cancels the handler when the client's deadline passes.
                    reason = "deadline" if expired else "cancelled"
                    metrics.DROPPED.labels(queue.runner.label, reason).inc()
                elif expired:
                    metrics.DROPPED.labels(queue.runner.label, "deadline").inc()
                    self.statistics.record_failure(queue.runner.key, now - item.enqueued_at)
                    item.future.set_exception(
                        DeadlineExpired(
                            f"deadline passed after {now - item.enqueued_at:.3f}s in the queue, "
                            "before compute; allow more time or lower the load"
                        )
                    )
                else:
                    alive.append(item)
                    continue
                removed += 1
            queue.items = alive
        if removed:
            self._set_pending(self._pending - removed)

    def _ready_queue(self, now: float) -> tuple[_Queue | None, float | None]:
        """The ready queue with the oldest head, else how long until one becomes ready."""
        ready: _Queue | None = None
        wait_s: float | None = None
        for queue in self._queues.values():
            if not queue.items:
                continue
            head = queue.items[0]
            due = head.enqueued_at + self._limits.max_queue_delay_s
            is_ready = (
                self._flushing
                or due <= now
                or queue.sequences() >= self._cap(queue, head.embeddings.shape[1])
            )
            if is_ready:
                if ready is None or head.enqueued_at < ready.items[0].enqueued_at:
                    ready = queue
            else:
                # Wake for the batch's due time, or sooner to drop a request whose
                # deadline passes while it waits.
                deadlines = [item.deadline for item in queue.items if item.deadline is not None]
                wake = min([due, *deadlines]) - now
                wait_s = wake if wait_s is None else min(wait_s, wake)
        return ready, wait_s

    def _cap(self, queue: _Queue, longest_seq: int) -> int:
        """Most sequences worth batching at this length: the measured cap, within the limit."""
        return min(self._limits.max_batch_size, queue.runner.batch_caps.cap_for(longest_seq))

    def _take(self, queue: _Queue) -> list[_Pending]:
        items = list(queue.items)
        chosen = choose_batch(
            [item.embeddings.shape[0] for item in items],
            [item.embeddings.shape[1] for item in items],
            max_sequences=self._limits.max_batch_size,
            max_padding=self._limits.max_padding_ratio,
            cap_for=queue.runner.batch_caps.cap_for,
        )
        picked = set(chosen)
        queue.items = deque(item for i, item in enumerate(items) if i not in picked)
        # Counted as running before it leaves the queue: drain() never sees a false idle.
        self._running += 1
        self._set_pending(self._pending - len(chosen))
        return [items[i] for i in chosen]

    async def _run(self, queue: _Queue, batch: list[_Pending]) -> None:
        started = time.monotonic()
        label = queue.runner.label
        loop = asyncio.get_running_loop()
        try:
            computed = await loop.run_in_executor(
                self._executor,
                _compute,
                queue.runner,
                [item.embeddings for item in batch],
                queue.with_weights,
            )
        except Exception as err:
            log.exception("batch of %d requests on %s failed", len(batch), queue.runner.key)
            self.statistics.record_failure(queue.runner.key, time.monotonic() - started, len(batch))
            for item in batch:
                if not item.future.done():
                    failure = BatchFailed(f"batch on {queue.runner.key} failed")
                    failure.__cause__ = err
                    item.future.set_exception(failure)
        else:
            sequences = sum(item.embeddings.shape[0] for item in batch)
            metrics.BATCHES.labels(label, GRAPHS[queue.with_weights]).inc()
            metrics.BATCH_SIZE.labels(label).observe(sequences)
            metrics.PADDING_RATIO.labels(label).observe(computed.padding)
            metrics.COMPUTE_DURATION.labels(label).observe(computed.compute_s)
            self.statistics.record_batch(
                queue.runner.key,
                sequences,
                [started - item.enqueued_at for item in batch],
                computed.compute_s,
            )
            for item, (output, weights) in zip(batch, computed.parts, strict=True):
                queue_s = started - item.enqueued_at
                metrics.queue_duration(label).observe(queue_s)
                if not item.future.done():
                    item.future.set_result(
                        Result(output, weights, queue_s, computed.compute_s, sequences)
                    )
        finally:
            self._running -= 1
            self._slots.release()
            self._set_pending(self._pending)
            self._wakeup.set()
