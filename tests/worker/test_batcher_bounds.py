"""The batcher's bounds and isolation: dead requests free their place at once, bytes are
bounded, models do not wait for each other, a dead scheduler is loud, non-finite results
never come back OK."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from prometheus_client import REGISTRY

from service.errors import DeadlineExpired, NonFiniteOutput, QueueFull
from service.worker.batching.batcher import Batcher, SchedulerFailed
from service.worker.batching.protocol import BatchLimits
from service.worker.engine.caps import BatchCaps
from tests.worker.test_batching import RecordingRunner, _x


def _limits(**overrides) -> BatchLimits:
    values = {"max_batch_size": 4, "max_queue_delay_s": 0.0, "max_queue_size": 100}
    return BatchLimits(**{**values, **overrides})


async def _until(condition, timeout_s: float = 5.0) -> None:
    give_up = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < give_up, "condition not met in time"
        await asyncio.sleep(0.001)


def _sample(name: str, **labels: str) -> float:
    """A metric's current value, as /metrics would show it (0 before its first sample)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _depth() -> float:
    return _sample("attention_queue_depth_requests")


def test_cancelled_and_expired_requests_free_the_queue_while_compute_is_busy() -> None:
    """Before: they held max_queue_size until a compute slot freed, so live requests got
    RESOURCE_EXHAUSTED behind them."""
    hold = threading.Event()
    runner = RecordingRunner(hold=hold)

    async def body(batcher: Batcher):
        busy = asyncio.create_task(batcher.submit(runner, _x(1, n=4), with_weights=False))
        await _until(runner.entered.is_set)  # computing, held
        cancelled = asyncio.create_task(batcher.submit(runner, _x(2), with_weights=False))
        expiring = asyncio.create_task(
            batcher.submit(runner, _x(2), with_weights=False, deadline=time.monotonic() + 0.05)
        )
        await _until(lambda: _depth() == 2)
        with pytest.raises(QueueFull):
            await batcher.submit(runner, _x(2), with_weights=False)
        cancelled.cancel()
        with pytest.raises(DeadlineExpired):
            await asyncio.wait_for(expiring, 2)  # while the batch is still held
        assert _depth() == 0  # freed while the slot is still busy:
        assert not hold.is_set()
        live = asyncio.create_task(batcher.submit(runner, _x(3), with_weights=False))
        await _until(lambda: _depth() == 1)  # accepted, not RESOURCE_EXHAUSTED
        hold.set()
        return await busy, await live

    stats_before = _sample("attention_requests_dropped_total", model="fake", reason="deadline")
    batcher_limits = _limits(max_queue_size=2, max_batch_size=4)

    async def run():
        batcher = Batcher(batcher_limits)
        await batcher.start()
        try:
            result = await body(batcher)
            return result, batcher.statistics.snapshot("fake/1")
        finally:
            await batcher.stop()

    (busy, live), stats = asyncio.run(run())
    assert (busy.batch_size, live.batch_size) == (4, 1)
    assert runner.batches == [(4, 1, 2), (1, 3, 2)]  # the dead two were never computed
    # One story: each drop is in the dropped counter and in the statistics' failures.
    assert (
        _sample("attention_requests_dropped_total", model="fake", reason="deadline")
        == stats_before + 1
    )
    assert stats.fail.count == 2


def test_queued_bytes_are_bounded_and_an_empty_queue_takes_any_request() -> None:
    hold = threading.Event()
    runner = RecordingRunner(hold=hold)
    request = _x(8, n=4)  # 256 bytes
    limits = _limits(max_queue_bytes=2 * request.nbytes, max_batch_size=4)

    async def body(batcher: Batcher):
        busy = asyncio.create_task(batcher.submit(runner, request, with_weights=False))
        await _until(runner.entered.is_set)  # computing, held
        queued = [
            asyncio.create_task(batcher.submit(runner, request, with_weights=False))
            for _ in range(2)
        ]
        await _until(lambda: _depth() == 2)
        with pytest.raises(QueueFull, match=f"max_queue_bytes={2 * request.nbytes}"):
            await batcher.submit(runner, _x(1), with_weights=False)
        assert _sample("attention_queue_bytes") == 2 * request.nbytes
        hold.set()
        await asyncio.gather(busy, *queued)
        huge = _x(8, n=4 * 3)  # more than the whole bound, into an empty queue
        return await batcher.submit(runner, huge, with_weights=False)

    async def run():
        batcher = Batcher(limits)
        await batcher.start()
        try:
            return await body(batcher)
        finally:
            await batcher.stop()

    assert asyncio.run(run()).output.shape == (12, 8, 2)


def test_a_small_model_does_not_wait_for_another_models_batch() -> None:
    """Before: one compute slot for every model, so the small one waited for the large."""
    hold = threading.Event()
    large = RecordingRunner(hold=hold, key="large/1")
    small = RecordingRunner(key="small/1")

    async def body(limits: BatchLimits) -> float:
        batcher = Batcher(limits)
        await batcher.start()
        try:
            busy = asyncio.create_task(batcher.submit(large, _x(4), with_weights=False))
            await _until(large.entered.is_set)
            started = time.monotonic()
            try:
                await asyncio.wait_for(batcher.submit(small, _x(2), with_weights=False), 2)
            finally:
                hold.set()
                await busy
            return time.monotonic() - started
        finally:
            hold.clear()
            large.entered.clear()
            await batcher.stop()

    assert asyncio.run(body(_limits())) < 1
    # The global cap still holds: with one slot in all, the small model waits.
    with pytest.raises(TimeoutError):
        asyncio.run(body(_limits(max_inflight_batches=1)))


def test_a_failed_scheduler_fails_requests_and_says_so() -> None:
    """Before: an exception in the scheduling task left every request waiting forever."""

    class BrokenCaps(BatchCaps):
        def cap_for(self, length: int) -> int:
            raise RuntimeError("scheduler bug")

    runner = RecordingRunner(batch_caps=BrokenCaps.uniform(4, 4))
    runner.batch_caps.__class__ = BrokenCaps
    failures: list[BaseException] = []

    async def body():
        batcher = Batcher(_limits(max_queue_delay_s=30), on_failure=failures.append)
        await batcher.start()
        try:
            with pytest.raises(SchedulerFailed):
                await asyncio.wait_for(batcher.submit(runner, _x(2), with_weights=False), 5)
            with pytest.raises(SchedulerFailed):
                await batcher.submit(runner, _x(2), with_weights=False)
        finally:
            await batcher.stop()

    asyncio.run(body())
    assert [str(error) for error in failures] == ["scheduler bug"]


def test_a_non_finite_result_fails_its_request_alone() -> None:
    runner = RecordingRunner()
    huge = np.full((1, 2, 2), np.finfo(np.float32).max, np.float32)  # + 1 stays finite
    overflow = np.full((1, 2, 2), np.inf, np.float32)  # stands in for an overflow in ORT

    async def body(batcher: Batcher):
        return await asyncio.gather(
            batcher.submit(runner, overflow, with_weights=False),
            batcher.submit(runner, huge, with_weights=False),
            return_exceptions=True,
        )

    async def run():
        batcher = Batcher(_limits(max_queue_delay_s=0.05))
        await batcher.start()
        try:
            return await body(batcher), batcher.statistics.snapshot("fake/1")
        finally:
            await batcher.stop()

    before = _sample("attention_nonfinite_outputs_total", model="fake")
    (bad, good), stats = asyncio.run(run())
    assert runner.batches == [(2, 2, 2)]
    assert isinstance(bad, NonFiniteOutput)
    assert np.isfinite(good.output).all()
    assert _sample("attention_nonfinite_outputs_total", model="fake") == before + 1
    assert (stats.fail.count, stats.success.count) == (1, 1)
