"""Where the batcher computes and writes: short CPU batches on the event loop's thread, long
ones (by their predicted time) on a compute thread; answers written into the caller's
arrays; a computing request cannot be withdrawn."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from service.catalog import BatchCaps
from service.worker.batching.batcher import Batcher
from service.worker.batching.protocol import BatchLimits, Result
from service.worker.engine.cuda import CPU
from service.worker.engine.onnx_model import OnnxModel
from service.worker.engine.repository import VersionFiles
from tests.worker.test_batching import RecordingRunner, _x


class ThreadRecordingRunner(RecordingRunner):
    """Takes about seconds_per_sequence per sequence and records which thread ran it."""

    def __init__(self, seconds_per_sequence: float = 0.002, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seconds_per_sequence = seconds_per_sequence
        self.threads: list[str] = []

    def run(self, embeddings, key_padding_mask, with_weights):
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


class OneByOneWriter:
    """A client's region as the batcher sees it (AnswerWriter): takes a part whole."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []

    def write(self, part: np.ndarray) -> None:
        self.parts.append(part.copy())


def _batch_of_three(runner: RecordingRunner, *, with_weights: bool = False):
    """Requests of lengths 10 (two sequences), 12 and 9, queued together and run as one batch:
    their results, the arrays the first writes into, and the third's writer."""
    out = np.zeros((2, 10, 2), np.float32)
    writer = OneByOneWriter()
    inputs = [_x(10, n=2) + np.arange(2, dtype=np.float32)[:, None, None], _x(12), _x(9)]

    async def body(batcher: Batcher) -> list[Result]:
        futures = [
            batcher.enqueue(runner, inputs[0], with_weights=with_weights, into=(out, None)),
            batcher.enqueue(runner, inputs[1], with_weights=with_weights),
            batcher.enqueue(runner, inputs[2], with_weights=with_weights, into=(writer, None)),
        ]
        return await asyncio.wait_for(asyncio.gather(*futures), 10)

    async def run() -> list[Result]:
        limits = BatchLimits(
            max_batch_size=8, max_queue_delay_s=0.05, max_queue_size=100, max_padding_ratio=0.5
        )
        batcher = Batcher(limits)
        await batcher.start()
        try:
            return await body(batcher)
        finally:
            await batcher.stop()

    return asyncio.run(run()), inputs, out, writer


def test_a_batch_larger_than_its_run_size_runs_in_pieces_by_length() -> None:
    runner = RecordingRunner(run_sizes=BatchCaps(((8, 4), (1024, 2))))  # 2 at length 12
    results, inputs, out, writer = _batch_of_three(runner)
    # Runs of at most 2 sequences, shortest first, a request never split: 9 alone (the 10s
    # would make 3), the two 10s, then 12. Each pads nothing.
    assert runner.batches == [(1, 9, 2), (2, 10, 2), (1, 12, 2)]
    assert [r.batch_size for r in results] == [4, 4, 4]  # still one batch to the scheduler
    assert [r.padding for r in results] == [0.0, 0.0, 0.0]
    assert len({r.batch_id for r in results}) == 1
    for result, embeddings in zip(results, inputs, strict=True):
        np.testing.assert_array_equal(result.output, embeddings + 1)
    assert results[0].output is out  # written straight into the caller's array
    np.testing.assert_array_equal(out, inputs[0] + 1)
    [part] = writer.parts  # a client's region takes its part whole, once
    np.testing.assert_array_equal(part, inputs[2] + 1)

    one_by_one = RecordingRunner(run_sizes=BatchCaps.uniform(1, 1024))
    results, inputs, _, _ = _batch_of_three(one_by_one)
    # A request of two sequences is not split: it runs as itself.
    assert one_by_one.batches == [(1, 9, 2), (2, 10, 2), (1, 12, 2)]
    for result, embeddings in zip(results, inputs, strict=True):
        np.testing.assert_array_equal(result.output, embeddings + 1)

    pieces = RecordingRunner(run_sizes=BatchCaps.uniform(3, 1024))
    results, inputs, _, _ = _batch_of_three(pieces)
    assert pieces.batches == [(3, 10, 2), (1, 12, 2)]  # 9 padded to 10 beside the two 10s
    padding = 1 / (3 * 10 + 12)  # one padded position of the 42 run
    assert [r.padding for r in results] == pytest.approx([padding] * 3)
    for result, embeddings in zip(results, inputs, strict=True):
        np.testing.assert_array_equal(result.output, embeddings + 1)


def test_a_batch_within_its_run_size_and_one_with_weights_run_whole() -> None:
    within = RecordingRunner(run_sizes=BatchCaps.uniform(4, 1024))
    results, inputs, _, _ = _batch_of_three(within)
    assert within.batches == [(4, 12, 2)]
    assert results[0].padding > 0
    for result, embeddings in zip(results, inputs, strict=True):
        np.testing.assert_array_equal(result.output, embeddings + 1)

    weights = RecordingRunner(run_sizes=BatchCaps.uniform(1, 1024))  # measured without weights
    results, _, _, _ = _batch_of_three(weights, with_weights=True)
    assert weights.batches == [(4, 12, 2)]
    assert all(r.attention_weights is not None for r in results)


def test_pieces_of_the_real_graph_equal_each_request_run_alone(small_export) -> None:
    """The d=64 export on ONNX Runtime: a batch run in pieces answers each request as it
    would be answered alone, and as the same batch run whole (padding masked out)."""
    files = VersionFiles(
        "small", 1, small_export.files.output_only, small_export.files.with_weights
    )
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal((n, seq, 64), dtype=np.float32) for n, seq in PIECES_SHAPES]

    def batch(run_sizes: BatchCaps) -> tuple[list[Result], list[tuple[int, ...]]]:
        model = OnnxModel(files, [CPU], 1)
        model.run_sizes = run_sizes
        shapes: list[tuple[int, ...]] = []
        original = model.run

        def recording(embeddings, mask, with_weights):
            shapes.append(embeddings.shape[:2])
            return original(embeddings, mask, with_weights)

        model.run = recording  # type: ignore[method-assign]

        async def run() -> list[Result]:
            batcher = Batcher(
                BatchLimits(
                    max_batch_size=16,
                    max_queue_delay_s=0.05,
                    max_queue_size=100,
                    max_padding_ratio=1.0,
                )
            )
            await batcher.start()
            try:
                futures = [batcher.enqueue(model, x, with_weights=False) for x in inputs]
                return await asyncio.wait_for(asyncio.gather(*futures), 20)
            finally:
                await batcher.stop()

        return asyncio.run(run()), shapes

    in_pieces, pieces_run = batch(BatchCaps.uniform(2, 64))
    whole, whole_run = batch(BatchCaps.uniform(16, 64))
    assert whole_run == [(6, 40)]
    assert pieces_run == [(1, 8), (2, 20), (1, 33), (2, 40)]  # by length, at most 2 a run
    alone_model = OnnxModel(files, [CPU], 1)
    for x, piece, merged in zip(inputs, in_pieces, whole, strict=True):
        alone, _ = alone_model.run(x, np.zeros(x.shape[:2], dtype=bool), False)
        np.testing.assert_allclose(piece.output, alone, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(merged.output, alone, rtol=1e-5, atol=1e-6)
        assert piece.batch_size == merged.batch_size == 6
    assert in_pieces[0].padding < whole[0].padding


PIECES_SHAPES = [(2, 20), (1, 8), (2, 40), (1, 33)]
