"""Where the batcher computes and writes: short CPU batches on the event loop's thread, long
ones (by their predicted time) on a compute thread; answers written into the caller's
arrays; a computing request cannot be withdrawn."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np

from service.worker.batching.batcher import Batcher
from service.worker.batching.protocol import BatchLimits, Result
from tests.worker.test_batching import RecordingRunner, _x


class ThreadRecordingRunner(RecordingRunner):
    """Takes about seconds_per_sequence per sequence and records which thread ran it."""

    def __init__(self, seconds_per_sequence: float = 0.002, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seconds_per_sequence = seconds_per_sequence
        self.threads: list[str] = []

    def run(self, embeddings, key_padding_mask, with_weights, into=None):
        self.threads.append(threading.current_thread().name)
        time.sleep(self.seconds_per_sequence * embeddings.shape[0])
        return super().run(embeddings, key_padding_mask, with_weights)


def _limits() -> BatchLimits:
    return BatchLimits(max_batch_size=8, max_queue_delay_s=0.0, max_queue_size=100)


def _run(body, *, inline_up_to_s: float = 0.05):
    async def run():
        batcher = Batcher(_limits())
        batcher.compute_short_batches_inline(inline_up_to_s)
        await batcher.start()
        try:
            return await body(batcher)
        finally:
            await batcher.stop()

    return asyncio.run(run())


def test_short_batches_compute_on_the_loop_and_long_ones_on_a_thread() -> None:
    runner = ThreadRecordingRunner()

    async def body(batcher: Batcher) -> None:
        loop_thread = threading.current_thread().name
        await batcher.submit(runner, _x(16), with_weights=False)  # no cost known: a thread
        await batcher.submit(runner, _x(16), with_weights=False)  # ~2 ms predicted: the loop
        # 32x longer: predicted with the square of it (2 ms x 1024), far past 50 ms.
        await batcher.submit(runner, _x(512), with_weights=False)
        await batcher.submit(runner, _x(16, n=4), with_weights=False)  # 4 x 2 ms: the loop
        assert runner.threads[0] != loop_thread
        assert runner.threads[1] == loop_thread
        assert runner.threads[2] != loop_thread
        assert runner.threads[3] == loop_thread

    _run(body)


def test_no_batch_computes_on_the_loop_when_inline_compute_is_off() -> None:
    runner = ThreadRecordingRunner()

    async def body(batcher: Batcher) -> None:
        for _ in range(3):
            await batcher.submit(runner, _x(16), with_weights=False)
        assert threading.current_thread().name not in runner.threads

    _run(body, inline_up_to_s=0.0)


def test_answers_go_into_the_callers_arrays_and_computing_ones_cannot_be_withdrawn() -> None:
    hold = threading.Event()
    runner = ThreadRecordingRunner(hold=hold)

    async def body(batcher: Batcher) -> None:
        answers: dict[str, list[object]] = {"computing": [], "queued": []}
        computed = asyncio.Event()

        def on_computed(outcome: object) -> None:
            answers["computing"].append(outcome)
            computed.set()

        first_out = np.zeros((1, 3, 2), np.float32)
        computing = batcher.queue(
            runner,
            _x(3),
            on_computed,
            with_weights=False,
            into=(first_out, None),
        )
        assert await asyncio.to_thread(runner.entered.wait, 5)  # its batch is computing
        queued = batcher.queue(runner, _x(5), answers["queued"].append, with_weights=False)
        assert batcher.withdraw(computing) is False  # its batch still writes into first_out
        assert batcher.withdraw(queued) is True
        assert [type(answer) for answer in answers["queued"]] == [asyncio.CancelledError]
        hold.set()
        await asyncio.wait_for(computed.wait(), 5)
        [result] = answers["computing"]
        assert isinstance(result, Result)
        assert result.output is first_out
        np.testing.assert_array_equal(first_out, _x(3) + 1)
        assert batcher.withdraw(computing) is False  # answered: nothing to drop
        assert len(answers["queued"]) == 1  # each answered once


def test_a_cancelled_future_withdraws_its_queued_request() -> None:
    hold = threading.Event()
    runner = ThreadRecordingRunner(hold=hold)

    async def body(batcher: Batcher) -> None:
        computing = batcher.enqueue(runner, _x(3), with_weights=False)
        assert await asyncio.to_thread(runner.entered.wait, 5)
        queued = batcher.enqueue(runner, _x(5), with_weights=False)
        queued.cancel()
        computing.cancel()  # too late to drop: its batch still computes and is counted
        hold.set()
        await asyncio.gather(computing, queued, return_exceptions=True)
        await batcher.drain()
        assert runner.batches == [(1, 3, 2)]

    _run(body)
