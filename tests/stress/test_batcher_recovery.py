"""What the batcher does after load goes away: memory handed back once a backlog has
drained, and a request that reaches its deadline in the queue counted as a deadline drop
whichever clock fires first."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from service.memory.budget import TRIM_AFTER_BATCH_BYTES
from service.worker.batching import batcher as batcher_module
from service.worker.batching.batcher import Batcher
from service.worker.batching.protocol import BatchLimits
from tests.worker.test_batcher_bounds import _depth, _sample, _until
from tests.worker.test_batching import RecordingRunner, _x


def _dropped(reason: str) -> float:
    return _sample("attention_requests_dropped_total", model="fake", reason=reason)


def test_memory_is_handed_back_once_a_backlog_drains(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: after a 3x overload the queue drained but RSS stayed ~1.1 GiB up (freed
    request buffers kept by malloc). Small traffic never pays for a trim."""
    trims: list[str] = []
    monkeypatch.setattr(
        batcher_module, "release_free_memory", lambda: trims.append(threading.current_thread().name)
    )
    hold = threading.Event()
    runner = RecordingRunner(hold=hold)
    request = _x(64, n=1)  # 512 bytes: many are needed to reach the threshold
    backlog = TRIM_AFTER_BATCH_BYTES // request.nbytes + 1

    async def body() -> tuple[int, int]:
        batcher = Batcher(
            BatchLimits(max_batch_size=4096, max_queue_delay_s=0.0, max_queue_size=backlog + 10)
        )
        await batcher.start()
        try:
            hold.set()
            await batcher.submit(runner, request, with_weights=False)  # small: no trim
            # A trim would have been started when that batch ended: wait for it, not a while.
            await _until(lambda: not batcher._tasks)
            small = len(trims)
            hold.clear()  # the next batch computes until released: the queue fills behind it
            runner.entered.clear()
            first = asyncio.create_task(batcher.submit(runner, request, with_weights=False))
            await _until(runner.entered.is_set)
            calls = [batcher.submit(runner, request, with_weights=False) for _ in range(backlog)]
            queued = asyncio.gather(*calls)
            await _until(lambda: _depth() == backlog)  # all queued behind the held batch
            hold.set()
            await first
            await queued
            await _until(lambda: bool(trims))
            return small, len(trims)
        finally:
            await batcher.stop()

    small, after_backlog = asyncio.run(body())
    assert small == 0
    assert after_backlog == 1
    assert trims[0].startswith("batch-compute")  # off the event loop


def test_a_drop_at_the_deadline_counts_as_deadline_whichever_clock_fires_first() -> None:
    """gRPC cancels a handler at its deadline, sometimes a moment before the batcher's own
    timer: that drop is a deadline drop, as the request counter says. Before: 40% of the
    calls that expired in the queue were counted as cancelled."""
    runner = RecordingRunner()

    async def body() -> None:
        batcher = Batcher(BatchLimits(max_batch_size=64, max_queue_delay_s=30, max_queue_size=10))
        await batcher.start()
        try:
            deadline = time.monotonic() + 0.01
            early = asyncio.create_task(
                batcher.submit(runner, _x(2), with_weights=False, deadline=deadline)
            )
            plain = asyncio.create_task(batcher.submit(runner, _x(2), with_weights=False))
            await asyncio.sleep(0)  # both queued
            early.cancel()  # as gRPC does at the deadline, before the batcher's timer fires
            plain.cancel()  # a caller that left: cancelled
            await asyncio.gather(early, plain, return_exceptions=True)
        finally:
            # The drops woke the scheduler just before stop() cancels it. Before: on Python
            # 3.11 asyncio.wait_for swallowed that cancellation and stop() never returned.
            async with asyncio.timeout(30):
                await batcher.stop()

    before = _dropped("deadline"), _dropped("cancelled")
    asyncio.run(body())
    assert (_dropped("deadline") - before[0], _dropped("cancelled") - before[1]) == (1, 1)
    assert runner.batches == []


def test_a_call_cancelled_at_its_deadline_counts_as_deadline_when_the_scheduler_sees_it_first() -> (
    None
):
    """The scheduler can reach a queue before a cancelled call's done-callback runs (it was
    woken in the same loop turn); that drop follows the same rule. Before: always counted as
    cancelled there, while the request counter said DEADLINE_EXCEEDED."""
    runner = RecordingRunner()

    async def body() -> None:
        batcher = Batcher(BatchLimits(max_batch_size=64, max_queue_delay_s=0.0, max_queue_size=10))
        await batcher.start()
        try:
            deadline = time.monotonic() + 0.01
            call = asyncio.create_task(
                batcher.submit(runner, _x(2), with_weights=False, deadline=deadline)
            )
            await asyncio.sleep(0)  # queued; the scheduler is woken, not yet run
            call.cancel()  # its done-callback runs after the scheduler's turn
            await asyncio.gather(call, return_exceptions=True)
        finally:
            async with asyncio.timeout(30):
                await batcher.stop()

    before = _dropped("deadline"), _dropped("cancelled")
    asyncio.run(body())
    assert (_dropped("deadline") - before[0], _dropped("cancelled") - before[1]) == (1, 0)
    assert runner.batches == []
