"""Pure batching functions and the asyncio batcher, with a recording runner."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.errors import DeadlineExpired, QueueFull, ShuttingDown
from service.worker.batching.batcher import Batcher
from service.worker.batching.policy import choose_batch, merge, padding_ratio, split
from service.worker.batching.protocol import BatchFailed, BatchLimits
from service.worker.engine.caps import BatchCaps

shapes = st.lists(st.tuples(st.integers(1, 4), st.integers(1, 20)), min_size=1, max_size=12)


@given(shapes)
def test_merge_then_split_gives_back_every_request(request_shapes) -> None:
    rng = np.random.default_rng(0)
    requests = [rng.standard_normal((n, t, 3), dtype=np.float32) for n, t in request_shapes]
    embeddings, mask = merge(requests)
    assert embeddings.shape == (
        sum(n for n, _ in request_shapes),
        max(t for _, t in request_shapes),
        3,
    )
    assert int((~mask).sum()) == sum(n * t for n, t in request_shapes)  # sizes add up
    assert np.all(embeddings[mask] == 0)
    weights = rng.standard_normal((embeddings.shape[0], 2, mask.shape[1], mask.shape[1]))
    parts = split(embeddings, weights, request_shapes)
    for request, (output, part_weights) in zip(requests, parts, strict=True):
        np.testing.assert_array_equal(output, request)
        assert part_weights.shape == (request.shape[0], 2, request.shape[1], request.shape[1])


def test_split_refuses_shapes_that_do_not_cover_the_batch() -> None:
    with pytest.raises(ValueError, match="covers 2 rows, the batch has 3"):
        split(np.zeros((3, 4, 2)), None, [(2, 4)])


@settings(max_examples=200)
@given(shapes, st.integers(1, 16), st.floats(0, 1))
def test_choose_batch_respects_limits_and_keeps_the_oldest(
    request_shapes, max_sequences, max_padding
) -> None:
    counts = [min(n, max_sequences) for n, _ in request_shapes]
    lengths = [t for _, t in request_shapes]
    chosen = choose_batch(counts, lengths, max_sequences=max_sequences, max_padding=max_padding)
    assert chosen[0] == 0
    assert len(set(chosen)) == len(chosen)
    assert sum(counts[i] for i in chosen) <= max_sequences
    if len(chosen) > 1:
        chosen_counts, chosen_lengths = [counts[i] for i in chosen], [lengths[i] for i in chosen]
        total = sum(chosen_counts) * max(chosen_lengths)
        real = sum(n * t for n, t in zip(chosen_counts, chosen_lengths, strict=True))
        assert total - real <= max_padding * total + 1e-9  # padded positions, counted exactly
        assert padding_ratio(chosen_counts, chosen_lengths) <= max_padding + 1e-12


@pytest.mark.parametrize(
    ("lengths", "bound"), [((20, 18), 0.05), ((100, 90), 0.05), ((10, 4), 0.3), ((10, 7), 0.15)]
)
def test_a_batch_exactly_at_the_padding_bound_is_taken(
    lengths: tuple[int, int], bound: float
) -> None:
    """Padding exactly at the bound joins (in floating point 1 - 38/40 is above 0.05); one
    position more does not."""
    longest, shorter = lengths
    assert choose_batch([1, 1], [longest, shorter], max_sequences=2, max_padding=bound) == [0, 1]
    assert choose_batch([1, 1], [longest, shorter - 1], max_sequences=2, max_padding=bound) == [0]


def test_choose_batch_groups_similar_lengths() -> None:
    chosen = choose_batch([1, 1, 1, 1], [10, 200, 11, 9], max_sequences=8, max_padding=0.3)
    assert sorted(chosen) == [0, 2, 3]


class RecordingRunner:
    """Adds 1 to its input; records every batch it is given."""

    key = "fake/1"
    label = "fake"
    described = "model 'fake' version 1"

    def __init__(
        self,
        fail: bool = False,
        hold: threading.Event | None = None,
        batch_caps: BatchCaps | None = None,
        fail_below: float | None = None,
        key: str = "fake/1",
    ) -> None:
        self.key = key
        self.entered = threading.Event()  # set once a batch is computing
        self.batches: list[tuple[int, ...]] = []
        self.fail = fail
        self.fail_below = fail_below
        self.hold = hold
        self.batch_caps = batch_caps or BatchCaps.uniform(1024, 1024)

    def run(self, embeddings, key_padding_mask, with_weights, into=None):
        self.entered.set()
        if self.hold is not None:
            self.hold.wait(10)
        self.batches.append(embeddings.shape)
        if self.fail or (self.fail_below is not None and embeddings.min() < self.fail_below):
            raise RuntimeError("engine exploded")
        weights = np.zeros((embeddings.shape[0], 1, embeddings.shape[1], embeddings.shape[1]))
        return embeddings + 1, weights if with_weights else None


def _limits(**overrides) -> BatchLimits:
    values = {"max_batch_size": 4, "max_queue_delay_s": 0.05, "max_queue_size": 100}
    return BatchLimits(**{**values, **overrides})


def _x(seq: int, n: int = 1) -> np.ndarray:
    return np.full((n, seq, 2), float(seq), np.float32)


async def _with_batcher(limits: BatchLimits, body):
    batcher = Batcher(limits)
    await batcher.start()
    try:
        return await body(batcher)
    finally:
        await batcher.stop()


def test_full_batch_closes_without_waiting_for_the_delay() -> None:
    runner = RecordingRunner()

    async def body(batcher: Batcher):
        started = time.monotonic()
        results = await asyncio.gather(
            *(batcher.submit(runner, _x(3), with_weights=False) for _ in range(4))
        )
        return results, time.monotonic() - started

    results, elapsed = asyncio.run(_with_batcher(_limits(max_queue_delay_s=30), body))
    assert runner.batches == [(4, 3, 2)]
    assert all(r.batch_size == 4 for r in results)
    assert elapsed < 2  # at once, nowhere near the 30 s delay
    np.testing.assert_array_equal(results[0].output, _x(3) + 1)


def test_a_batch_s_leader_gets_every_tag_and_each_other_tagged_request_the_leader_s() -> None:
    runner = RecordingRunner()
    tags = [None, "a", None, "b", "c"]  # the first tagged request (a) leads the batch

    async def body(batcher: Batcher):
        return await asyncio.gather(
            *(batcher.submit(runner, _x(3), with_weights=False, tag=tag) for tag in tags)
        )

    results = asyncio.run(_with_batcher(_limits(max_batch_size=5, max_queue_delay_s=30), body))
    assert runner.batches == [(5, 3, 2)]
    assert [r.batch_tags for r in results] == [(), ("a", "b", "c"), (), ("a",), ("a",)]


def test_a_request_that_gets_no_answer_never_leads_its_batch() -> None:
    """A non-finite result gets no compute span: the first tagged request with an answer
    leads, and the one without is in no one's tags."""
    runner = RecordingRunner(fail_below=None)
    x_bad = _x(3)
    x_bad[0, 0, 0] = np.inf  # inf + 1 stays inf: this request's output is non-finite
    inputs = [(x_bad, "a"), (_x(3), "b"), (_x(3), "c")]

    async def body(batcher: Batcher):
        return await asyncio.gather(
            *(batcher.submit(runner, x, with_weights=False, tag=tag) for x, tag in inputs),
            return_exceptions=True,
        )

    results = asyncio.run(_with_batcher(_limits(max_batch_size=3, max_queue_delay_s=30), body))
    assert isinstance(results[0], Exception)
    assert [r.batch_tags for r in results[1:]] == [("b", "c"), ("b",)]


def test_partial_batch_closes_after_the_delay() -> None:
    runner = RecordingRunner()

    async def body(batcher: Batcher):
        return await asyncio.gather(
            *(batcher.submit(runner, _x(t), with_weights=False) for t in (3, 5))
        )

    results = asyncio.run(_with_batcher(_limits(), body))
    assert runner.batches == [(2, 5, 2)]
    assert results[0].output.shape == (1, 3, 2)
    assert results[0].queue_s >= 0.04


def test_weights_and_no_weights_never_share_a_batch() -> None:
    runner = RecordingRunner()

    async def body(batcher: Batcher):
        return await asyncio.gather(
            batcher.submit(runner, _x(3), with_weights=True),
            batcher.submit(runner, _x(3), with_weights=False),
        )

    with_weights, without = asyncio.run(_with_batcher(_limits(), body))
    assert len(runner.batches) == 2
    assert with_weights.attention_weights is not None
    assert without.attention_weights is None


def test_failed_batch_fails_its_requests_and_nothing_else() -> None:
    """A batch fails as a whole; the next batch of the same queue (same runner, same graph)
    is computed as usual."""
    runner = RecordingRunner(fail_below=0.0)

    async def body(batcher: Batcher):
        poisoned = await asyncio.gather(
            batcher.submit(runner, -_x(2), with_weights=False),
            batcher.submit(runner, _x(2), with_weights=False),
            return_exceptions=True,
        )
        after = await batcher.submit(runner, _x(2), with_weights=False)
        return poisoned, after

    (first, second), after = asyncio.run(_with_batcher(_limits(max_batch_size=2), body))
    assert runner.batches == [(2, 2, 2), (1, 2, 2)]  # the two shared a batch, in one queue
    assert isinstance(first, BatchFailed)
    assert isinstance(second, BatchFailed)
    assert isinstance(first.__cause__, RuntimeError)
    np.testing.assert_array_equal(after.output, _x(2) + 1)


def test_queue_full_rejects_and_expired_requests_are_dropped() -> None:
    hold = threading.Event()
    runner = RecordingRunner(hold=hold)

    async def body(batcher: Batcher):
        busy = asyncio.create_task(batcher.submit(runner, _x(1, n=4), with_weights=False))
        await asyncio.sleep(0)  # let it be queued; it then blocks the only compute slot
        expiring = asyncio.create_task(
            batcher.submit(runner, _x(2), with_weights=False, deadline=time.monotonic())
        )
        waiting = asyncio.create_task(batcher.submit(runner, _x(2), with_weights=False))
        await asyncio.sleep(0)
        with pytest.raises(QueueFull, match="max_queue_size=2"):
            await batcher.submit(runner, _x(2), with_weights=False)
        hold.set()  # its deadline has passed while the only slot was busy
        with pytest.raises(DeadlineExpired, match="before compute"):
            await expiring
        return await busy, await waiting

    busy, waiting = asyncio.run(_with_batcher(_limits(max_queue_size=2), body))
    assert busy.batch_size == 4
    assert waiting.batch_size == 1
    assert runner.batches == [(4, 1, 2), (1, 2, 2)]


def test_drain_flushes_queued_requests_and_stop_refuses_new_ones() -> None:
    runner = RecordingRunner()

    async def body():
        batcher = Batcher(_limits(max_queue_delay_s=60))
        with pytest.raises(ShuttingDown):
            await batcher.submit(runner, _x(2), with_weights=False)
        await batcher.start()
        queued = asyncio.create_task(batcher.submit(runner, _x(2), with_weights=False))
        await asyncio.sleep(0)
        await asyncio.wait_for(batcher.drain(), timeout=10)
        result = await queued
        await batcher.stop()
        with pytest.raises(ShuttingDown):
            await batcher.submit(runner, _x(2), with_weights=False)
        return result

    assert asyncio.run(body()).batch_size == 1


def test_a_deadline_passing_while_the_batch_fills_is_dropped_at_once() -> None:
    """No slot is busy and the batch is far from full: the scheduler still wakes for it."""
    runner = RecordingRunner()

    async def body(batcher: Batcher):
        started = time.monotonic()
        with pytest.raises(DeadlineExpired):
            await batcher.submit(runner, _x(2), with_weights=False, deadline=started + 0.05)
        return time.monotonic() - started

    waited = asyncio.run(_with_batcher(_limits(max_queue_delay_s=30), body))
    assert waited < 1  # dropped when its 50 ms deadline passes, not at the 30 s delay
    assert runner.batches == []


def test_choose_batch_first_come_when_length_grouping_is_off() -> None:
    lengths = [16, 200, 17, 190, 18]
    grouped = choose_batch([1] * 5, lengths, max_sequences=3, max_padding=1.0)
    first_come = choose_batch(
        [1] * 5, lengths, max_sequences=3, max_padding=1.0, group_by_length=False
    )
    assert grouped == [0, 2, 4]
    assert first_come == [0, 1, 2]
