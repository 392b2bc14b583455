"""A lone request computed at once (Batcher.run_alone): only when the scheduling pass would
have started it at once as a batch of one, answered as that batch would be, refused as
queue() refuses; and the finiteness check of answers, exact however large the values."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

from service.errors import ShuttingDown
from service.worker.batching import batcher as batcher_module
from service.worker.batching.batcher import PROBE_EVERY, Batcher
from service.worker.batching.protocol import BatchLimits, Result
from tests.worker.test_batching import RecordingRunner, _x

Outcomes = list["Result | BaseException"]


def _run(
    body: Callable[[Batcher], Awaitable[None]],
    *,
    inline_up_to_s: float = 0.05,
    **limits: float,
) -> None:
    async def run() -> None:
        values = {"max_batch_size": 8, "max_queue_delay_s": 0.0, "max_queue_size": 100}
        batcher = Batcher(BatchLimits(**{**values, **limits}))  # type: ignore[arg-type]
        batcher.compute_short_batches_inline(inline_up_to_s)
        await batcher.start()
        try:
            await body(batcher)
        finally:
            await batcher.stop()

    asyncio.run(run())


async def _costed(batcher: Batcher, runner: RecordingRunner) -> None:
    """Two requests through the queue: the first measures the cost, the second a yield that
    brings nothing in, after which lone requests start without one."""
    for _ in range(2):
        await batcher.submit(runner, _x(3), with_weights=False)


def test_a_lone_request_is_computed_and_answered_before_run_alone_returns() -> None:
    runner = RecordingRunner()

    async def body(batcher: Batcher) -> None:
        await _costed(batcher, runner)
        outcomes: Outcomes = []
        out = np.zeros((1, 3, 2), np.float32)
        ran_on = threading.current_thread().name
        assert batcher.run_alone(
            runner, _x(3), outcomes.append, with_weights=False, tag="t", into=(out, None)
        )
        [result] = outcomes
        assert isinstance(result, Result)
        assert result.batch_size == 1
        assert result.padding == 0.0
        assert result.output is out
        assert result.batch_tags == ("t",)
        np.testing.assert_array_equal(out, _x(3) + 1)
        assert runner.batches[-1] == (1, 3, 2)
        assert threading.current_thread().name == ran_on
        stats = batcher.statistics.snapshot(runner.key)
        assert stats.inference_count == 3
        assert stats.execution_count == 3
        # Nothing left behind: the next request is lone again.
        assert batcher.run_alone(runner, _x(3), outcomes.append, with_weights=False)
        assert len(outcomes) == 2

    _run(body)


def test_run_alone_declines_what_the_pass_would_not_start_at_once() -> None:
    runner = RecordingRunner()

    async def body(batcher: Batcher) -> None:
        outcomes: Outcomes = []

        def alone(**kwargs: object) -> bool:
            return batcher.run_alone(
                runner,
                _x(3),
                outcomes.append,
                with_weights=False,
                **kwargs,  # type: ignore[arg-type]
            )

        assert not alone()  # no cost measured yet: the pass decides where it computes
        await _costed(batcher, runner)
        assert not alone(deadline=time.monotonic() - 1)  # expired: the pass answers it
        hold = threading.Event()
        slow = RecordingRunner(hold=hold)
        computing = batcher.enqueue(slow, _x(3), with_weights=False)
        assert await asyncio.to_thread(slow.entered.wait, 5)
        assert not alone()  # another batch is computing
        queued = batcher.enqueue(runner, _x(3), with_weights=False)
        assert not alone()  # and a request is queued
        hold.set()
        await asyncio.gather(computing, queued)
        assert outcomes == []  # declined ones are not answered

    _run(body)


def test_run_alone_keeps_the_probe_for_returning_load() -> None:
    runner = RecordingRunner()

    async def body(batcher: Batcher) -> None:
        await _costed(batcher, runner)
        outcomes: Outcomes = []
        taken = [
            batcher.run_alone(runner, _x(3), outcomes.append, with_weights=False)
            for _ in range(PROBE_EVERY + 1)
        ]
        # Lone requests start at once until the pass's PROBE_EVERY-th, which yields first
        # (arrivals meanwhile turn yields back on).
        declined = taken.index(False)
        assert 1 <= declined <= PROBE_EVERY
        assert not any(taken[declined:])
        assert len(outcomes) == declined
        await batcher.submit(runner, _x(3), with_weights=False)  # that probe, through the pass
        assert batcher.run_alone(runner, _x(3), outcomes.append, with_weights=False)

    _run(body)


def test_run_alone_waits_out_a_queue_delay_unless_the_request_fills_its_batch() -> None:
    runner = RecordingRunner()

    async def body(batcher: Batcher) -> None:
        outcomes: Outcomes = []
        await batcher.submit(runner, _x(3, n=2), with_weights=False)  # the cost
        assert not batcher.run_alone(runner, _x(3), outcomes.append, with_weights=False)
        full = _x(3, n=2)  # max_batch_size 2: a full batch starts at once, delay or not
        assert batcher.run_alone(runner, full, outcomes.append, with_weights=False)
        assert len(outcomes) == 1

    _run(body, max_queue_delay_s=0.5, max_batch_size=2)


def test_run_alone_declines_when_batches_never_compute_on_the_loop() -> None:
    runner = RecordingRunner()

    async def body(batcher: Batcher) -> None:
        await _costed(batcher, runner)
        assert not batcher.run_alone(runner, _x(3), lambda outcome: None, with_weights=False)

    _run(body, inline_up_to_s=0.0)


def test_run_alone_takes_and_refuses_as_queue_does() -> None:
    runner = RecordingRunner()

    async def body(batcher: Batcher) -> None:
        await _costed(batcher, runner)
        outcomes: Outcomes = []
        # Over the bytes bound, but an empty queue takes any legal request (QueueFill.refusal).
        assert batcher.run_alone(runner, _x(3, n=200), outcomes.append, with_weights=False)
        assert isinstance(outcomes[0], Result)
        assert outcomes[0].batch_size == 200
        batcher.refuse_new()
        with pytest.raises(ShuttingDown):
            batcher.run_alone(runner, _x(3), outcomes.append, with_weights=False)
        assert len(outcomes) == 1

    # 200 x 3 x 2 float32 = 4800 bytes.
    _run(body, max_queue_bytes=1024)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_answers_are_finite_exactly_when_every_value_is(dtype: type[np.floating]) -> None:
    all_finite = batcher_module._all_finite
    largest = np.finfo(dtype).max
    huge = np.full((2, 64, 8), largest, dtype)  # finite values whose sum overflows
    assert all_finite(huge)
    assert all_finite(np.zeros((1, 3, 4), dtype))
    for bad in (np.nan, np.inf, -np.inf):
        for where in ((0, 0, 0), (1, 63, 7), (1, 10, 3)):
            values = huge.copy()
            values[where] = bad
            assert not all_finite(values)


def test_a_failure_escaping_a_lone_batch_fails_the_scheduler_as_the_pass_would() -> None:
    runner = RecordingRunner()

    async def body(batcher: Batcher) -> None:
        await _costed(batcher, runner)
        runner.fail = True
        answers: Outcomes = []

        def answer_that_breaks(outcome: Result | BaseException) -> None:
            answers.append(outcome)
            raise RuntimeError("the answer's own callback failed")

        assert batcher.run_alone(runner, _x(3), answer_that_breaks, with_weights=False)
        assert len(answers) == 1  # answered once, with its batch's failure
        with pytest.raises(ShuttingDown, match="batch scheduler failed"):
            batcher.queue(runner, _x(3), answers.append, with_weights=False)

    _run(body)
