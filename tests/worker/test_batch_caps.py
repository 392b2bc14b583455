"""Measured batch caps: the decision rule, the measurement loop (on a fake clock), and how
the batcher and both APIs use and show them."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest
import tritonclient.grpc as triton
from hypothesis import given
from hypothesis import strategies as st

from service.client import AttentionClient
from service.worker.batching.batcher import Batcher
from service.worker.batching.live_caps import EXPLORE_EVERY
from service.worker.batching.policy import choose_batch
from service.worker.batching.protocol import BatchLimits
from service.worker.engine import onnx_model
from service.worker.engine.caps import (
    SECOND_PASS_AFTER_S,
    SERVER_BATCH_OVERHEAD_S,
    BatchCaps,
    batch_sizes,
    best_batch_size,
    grow,
    length_buckets,
    measure_caps,
    time_batch,
)
from service.worker.engine.repository import VersionFiles
from tests.worker.test_batching import RecordingRunner


class FakeDevice:
    """run(size, length) advances a fake clock by cost(size, length): a deterministic device."""

    def __init__(self, seconds_per_sequence) -> None:
        self.now = 0.0
        self.cost = seconds_per_sequence
        self.calls: list[tuple[int, int]] = []

    def clock(self) -> float:
        return self.now

    def run(self, size: int, length: int) -> None:
        self.calls.append((size, length))
        self.now += size * self.cost(size, length)


def cpu_like(size: int, length: int) -> float:
    """Short sequences like big batches; long ones lose per sequence as batches grow."""
    base = 1e-5 * length
    return base * (1 - 0.03 * np.log2(size)) if length <= 32 else base * (1 + 0.1 * np.log2(size))


def gpu_like(size: int, length: int) -> float:
    return 1e-4 / size


def test_buckets_and_sizes_end_at_the_limits() -> None:
    assert length_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert length_buckets(100) == [16, 32, 64, 100]
    assert length_buckets(8) == [8]
    assert batch_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert batch_sizes(12) == [1, 2, 4, 8, 12]
    assert batch_sizes(1) == [1]


def test_best_size_prefers_the_larger_of_near_ties() -> None:
    assert best_batch_size({1: 1.00, 2: 1.01, 4: 1.02, 8: 1.20}) == 4
    # Beyond timing noise (3 %), the smaller batch keeps its lead.
    assert best_batch_size({1: 1.00, 2: 1.01, 4: 1.04, 8: 1.20}) == 2
    assert best_batch_size({1: 3.0, 2: 2.0, 4: 1.0}) == 4
    assert best_batch_size({1: 1.0, 2: 1.5}) == 1


def test_cpu_like_device_gets_big_batches_short_and_small_batches_long() -> None:
    device = FakeDevice(cpu_like)
    caps = measure_caps(
        device.run, max_batch_size=32, max_seq_len=512, budget_s=1e9, clock=device.clock
    )
    assert caps.cap_for(16) == 32
    assert caps.cap_for(32) == 32
    assert caps.cap_for(128) == 1
    assert caps.cap_for(512) == 1
    # Long buckets stop growing once two sizes in a row are clearly worse (+30 %, +40 %).
    assert max(size for size, length in device.calls if length == 512) == 16


def test_gpu_like_device_fills_every_bucket() -> None:
    device = FakeDevice(gpu_like)
    caps = measure_caps(
        device.run, max_batch_size=64, max_seq_len=512, budget_s=1e9, clock=device.clock
    )
    assert caps.caps == ((512, 64),)


def test_a_spent_budget_never_caps_what_it_did_not_measure() -> None:
    """With no time to see costs rise, no bucket is capped: batching stays as without caps."""
    device = FakeDevice(cpu_like)
    caps = measure_caps(
        device.run, max_batch_size=32, max_seq_len=512, budget_s=0.0, clock=device.clock
    )
    assert {length for _, length in device.calls} == {16}  # only the first timing ran
    assert caps.caps == ((512, 32),)


def test_an_interrupted_bucket_keeps_the_shorter_bucket_cap() -> None:
    """The budget ends just after the first pass over seq 16 (cap 4): seq 32 gets one timing,
    at batch size 1, which alone proves nothing, so it and every longer bucket keep cap 4."""

    def cost(size: int, length: int) -> float:
        return 1e-3 * {1: 1.0, 2: 0.8, 4: 0.6, 8: 1.0, 16: 1.2, 32: 1.5}[size]

    first_pass = FakeDevice(cost)
    grow(first_pass.run, 16, batch_sizes(32), {}, give_up=1e9, clock=first_pass.clock)
    device = FakeDevice(cost)
    caps = measure_caps(
        device.run,
        max_batch_size=32,
        max_seq_len=512,
        budget_s=first_pass.now + 1e-9,
        clock=device.clock,
    )
    assert {(size, length) for size, length in device.calls if length > 16} == {(1, 32)}
    assert caps.caps == ((512, 4),)


def measured_cpu(size: int, length: int) -> float:
    """Seconds per sequence as one Intel Xeon core measured them at seq 16 (batches of 1 cost
    twice what batches of 32 do), scaled with length up to 32; cpu_like beyond."""
    if length > 32:
        return cpu_like(size, length)
    per_sequence_us = {1: 528, 2: 397, 4: 296, 8: 247, 16: 242, 32: 240}[size]
    return per_sequence_us * 1e-6 * length / 16


def test_a_burst_over_the_first_bucket_does_not_decide_its_cap() -> None:
    """At every start on one core, the front end starting beside the worker doubled the wall
    time of batches of 16 and 32 at seq 16 for longer than both passes over seq 16 took back
    to back: seq 16 was capped at 8, and with it every longer length. A second pass that
    stopped growing against the first pass's best (sizes 1 and 2 cost far more than it) never
    timed 16 and 32 again either."""
    clean = FakeDevice(measured_cpu)
    measure_caps(clean.run, max_batch_size=32, max_seq_len=16, budget_s=1e9, clock=clean.clock)
    burst_until = 2 * clean.now  # both passes over seq 16, back to back, fall within it
    timed_at: list[tuple[float, int]] = []

    def cost(size: int, length: int) -> float:
        timed_at.append((device.now, length))
        slowed = size >= 16 and device.now < burst_until
        return measured_cpu(size, length) * (2.0 if slowed else 1.0)

    device = FakeDevice(cost)
    caps = measure_caps(
        device.run, max_batch_size=32, max_seq_len=512, budget_s=1e9, clock=device.clock
    )
    assert caps.cap_for(16) == 32
    # The second pass over seq 16 waited SECOND_PASS_AFTER_S after its first.
    first_pass_end = next(at for at, length in timed_at if length != 16)
    second_pass_start = next(at for at, length in timed_at if length == 16 and at > first_pass_end)
    assert second_pass_start - first_pass_end >= SECOND_PASS_AFTER_S


def test_the_second_passes_of_short_buckets_come_before_the_long_buckets_end() -> None:
    """The short buckets get their second pass before the first passes of the long ones, which
    take most of the budget."""
    device = FakeDevice(measured_cpu)
    measure_caps(device.run, max_batch_size=32, max_seq_len=512, budget_s=1e9, clock=device.clock)
    first_512 = device.calls.index(next(call for call in device.calls if call[1] == 512))
    before_512 = [length for _, length in device.calls[:first_512]]
    first_pass_16 = before_512.index(32)
    assert 16 in before_512[first_pass_16:]  # seq 16's second pass ran before seq 512's first


# ms per sequence by length and batch size: one-thread ONNX Runtime, d=512 h=8, one Intel
# Xeon core (the warm-up's own timings, without the per-batch work it adds).
XEON_MS = {
    16: {1: 0.37, 2: 0.31, 4: 0.26, 8: 0.24, 16: 0.25, 32: 0.26},
    32: {1: 0.63, 2: 0.52, 4: 0.49, 8: 0.50, 16: 0.53, 32: 0.54},
    64: {1: 1.11, 2: 1.01, 4: 1.03, 8: 1.08, 16: 1.10, 32: 1.18},
    128: {1: 2.39, 2: 2.28, 4: 2.26, 8: 2.38, 16: 2.52, 32: 3.70},
    256: {1: 5.32, 2: 5.32, 4: 5.29, 8: 5.92, 16: 7.68, 32: 9.29},
    512: {1: 13.1, 2: 14.5, 4: 21.1, 8: 26.9, 16: 40.0, 32: 60.0},
}


def test_the_longest_bucket_is_measured_within_the_default_budget() -> None:
    """Interleaved with the first passes, the second passes over seq 128 and 256 (0.4-0.5 s
    each on this core) pushed seq 512's first pass past the 3 s budget, and it took seq 256's
    cap of 4 where batches of 1 cost least."""
    device = FakeDevice(lambda size, length: XEON_MS[length][size] * 1e-3)
    caps = measure_caps(
        device.run,
        max_batch_size=32,
        max_seq_len=512,
        budget_s=3.0,
        clock=device.clock,
        batch_overhead_s=SERVER_BATCH_OVERHEAD_S,
    )
    assert caps.cap_for(512) == 1
    assert caps.cap_for(16) == 32


def test_timings_by_the_cost_clock_ignore_another_process_on_the_core() -> None:
    """While something else shares the core, batches of 16 and 32 take twice their wall
    time, and the budget (wall time) runs out mid-way: timed by the computing thread's CPU
    (the cost clock), they keep their true cost, and the budget still ends the measurement."""

    class SharedCore(FakeDevice):
        def __init__(self) -> None:
            super().__init__(cpu_like)
            self.cpu = 0.0

        def cpu_clock(self) -> float:
            return self.cpu

        def run(self, size: int, length: int) -> None:
            cost = size * cpu_like(size, length)
            self.calls.append((size, length))
            self.cpu += cost
            self.now += cost * (2.0 if size >= 16 else 1.0)

    by_wall = SharedCore()
    caps = measure_caps(
        by_wall.run, max_batch_size=32, max_seq_len=16, budget_s=1e9, clock=by_wall.clock
    )
    assert caps.cap_for(16) == 8
    device = SharedCore()
    budget_s = 0.05
    caps = measure_caps(
        device.run,
        max_batch_size=32,
        max_seq_len=512,
        budget_s=budget_s,
        clock=device.clock,
        cost_clock=device.cpu_clock,
    )
    assert caps.cap_for(16) == 32
    # Ended by the budget in wall time, where the cost clock shows less time spent.
    assert budget_s <= device.now < 2 * budget_s
    assert device.cpu < budget_s


@pytest.mark.parametrize(("threads", "cost_clock"), [(1, time.thread_time), (2, None)])
def test_one_cpu_thread_times_batches_by_its_cpu_and_several_by_wall_time(
    small_export, monkeypatch: pytest.MonkeyPatch, threads: int, cost_clock
) -> None:
    """With one intra-op thread ONNX Runtime computes on the calling thread alone, so its CPU
    time is a batch's cost; with several, that thread's CPU time would miss the pool's work."""
    seen: dict = {}

    def measure(run, **kwargs) -> BatchCaps:
        seen.update(kwargs)
        run(2, 16)  # the model really runs
        return BatchCaps.uniform(kwargs["max_batch_size"], kwargs["max_seq_len"])

    monkeypatch.setattr(onnx_model, "measure_caps", measure)
    files = small_export.files
    model = onnx_model.OnnxModel(
        VersionFiles("small", 1, files.output_only, files.with_weights), [onnx_model.CPU], threads
    )
    model.measure_batch_caps(max_batch_size=4, max_seq_len=16, budget_s=1.0)
    assert seen["cost_clock"] is cost_clock


def test_caps_never_grow_with_length() -> None:
    """A noisy device that seems to favour big batches only at seq 128 gets no such cap."""

    def bumpy(size: int, length: int) -> float:
        if length == 128:
            return 1e-3 / size
        return 1e-3 * (1 + 0.5 * np.log2(size))

    device = FakeDevice(bumpy)
    caps = measure_caps(
        device.run, max_batch_size=32, max_seq_len=512, budget_s=1e9, clock=device.clock
    )
    assert caps.caps == ((512, 1),)


def test_timing_takes_the_best_of_repeated_runs() -> None:
    noisy = iter([5.0, 1.0, 1.0, 1.0] + [1.0] * 100)
    device = FakeDevice(lambda size, length: next(noisy) * 1e-3)
    assert time_batch(device.run, 1, 16, device.clock) == pytest.approx(1e-3)


@given(st.lists(st.integers(1, 64), min_size=1, max_size=8), st.integers(1, 2048))
def test_cap_for_covers_every_length(sizes: list[int], longest: int) -> None:
    lengths = [16 * 2**i for i in range(len(sizes))]
    caps = BatchCaps(tuple(zip(lengths, sizes, strict=True))).merged()
    pairs = zip(lengths, sizes, strict=True)
    expected = next((size for length, size in pairs if longest <= length), sizes[-1])
    assert caps.cap_for(longest) == expected


def test_caps_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="ascending"):
        BatchCaps(((64, 1), (16, 4)))
    with pytest.raises(ValueError, match=">= 1"):
        BatchCaps(((16, 0),))


def test_choose_batch_obeys_the_cap_of_the_batch_longest_length() -> None:
    caps = BatchCaps(((16, 4), (512, 1)))
    # Short requests fill to 4; a long one never joins them (it would make the cap 1).
    chosen = choose_batch(
        [1] * 6, [8, 8, 100, 8, 8, 8], max_sequences=32, max_padding=1.0, cap_for=caps.cap_for
    )
    assert chosen == [0, 1, 3, 4]
    # The oldest always runs, alone when its length allows no company.
    assert choose_batch(
        [1, 1], [100, 100], max_sequences=32, max_padding=1.0, cap_for=caps.cap_for
    ) == [0]
    # A request larger than the cap still runs whole.
    assert choose_batch(
        [8, 1], [100, 100], max_sequences=32, max_padding=1.0, cap_for=caps.cap_for
    ) == [0]


def test_batcher_splits_long_sequences_into_capped_batches() -> None:
    runner = RecordingRunner(batch_caps=BatchCaps(((16, 4), (512, 1))))

    async def body() -> None:
        batcher = Batcher(BatchLimits(max_batch_size=32, max_queue_delay_s=30, max_queue_size=100))
        await batcher.start()
        try:
            short = [
                batcher.submit(runner, np.ones((1, 8, 2), np.float32), with_weights=False)
                for _ in range(4)
            ]
            long = [
                batcher.submit(runner, np.ones((1, 100, 2), np.float32), with_weights=False)
                for _ in range(3)
            ]
            # Full (capped) batches close without waiting out the 30 s delay.
            results = await asyncio.wait_for(asyncio.gather(*short, *long), timeout=20)
        finally:
            await batcher.stop()
        assert [r.batch_size for r in results] == [4, 4, 4, 4, 1, 1, 1]

    asyncio.run(body())
    assert sorted(runner.batches) == [(1, 100, 2)] * 3 + [(4, 8, 2)]


def test_both_apis_show_the_measured_caps(server) -> None:
    with AttentionClient(server.target) as client:
        info = client.get_model("mha")
    caps = [(cap.max_sequence_length, cap.max_batch_size) for cap in info.versions[0].batch_caps]
    assert caps, "GetModel lists the caps"
    assert caps[-1][0] == info.max_sequence_length  # the last cap covers every legal length
    assert all(1 <= size <= info.max_batch_size for _, size in caps)
    assert [length for length, _ in caps] == sorted({length for length, _ in caps})
    assert "mha/1 batch caps (measured)" in server.log

    v2 = triton.InferenceServerClient(server.target)
    try:
        config = v2.get_model_config("mha", as_json=True)["config"]
    finally:
        v2.close()
    shown = config["parameters"]["batch_caps"]["string_value"]
    assert shown == ",".join(f"{length}:{size}" for length, size in caps)
    preferred = config["dynamic_batching"]["preferred_batch_size"]
    assert sorted(preferred) == sorted({size for _, size in caps})


def test_a_burst_that_slows_one_pass_does_not_decide_the_cap() -> None:
    """Every run of sizes 2..32 is 60 % slower during the first pass (something else held the
    core): with one pass, growth stopped after sizes 2 and 4 and seq 16 was capped at 1, and
    with it every longer length."""
    state = {"second_pass": False, "seen_larger": False}

    def cost(size: int, length: int) -> float:
        if size == 1 and state["seen_larger"]:
            state["second_pass"] = True
        state["seen_larger"] |= size > 1
        slowed = size > 1 and not state["second_pass"]
        return 1e-3 * (1 - 0.03 * np.log2(size)) * (1.6 if slowed else 1.0)

    device = FakeDevice(cost)
    caps = measure_caps(
        device.run, max_batch_size=32, max_seq_len=16, budget_s=1e9, clock=device.clock
    )
    assert caps.cap_for(16) == 32


def test_the_servers_per_batch_work_breaks_near_ties_towards_larger_batches() -> None:
    """Compute alone makes batch 1 the cheapest per sequence (by 12 %, beyond a tie); with the
    server's fixed work per batch counted, 2 sequences share it and batch 2 wins."""

    def cost(size: int, length: int) -> float:
        return 1e-3 * {1: 1.0, 2: 1.12, 4: 1.5, 8: 1.9, 16: 2.4, 32: 3.0}[size]

    alone = FakeDevice(cost)
    caps = measure_caps(
        alone.run, max_batch_size=32, max_seq_len=128, budget_s=1e9, clock=alone.clock
    )
    assert caps.cap_for(128) == 1
    device = FakeDevice(cost)
    caps = measure_caps(
        device.run,
        max_batch_size=32,
        max_seq_len=128,
        budget_s=1e9,
        clock=device.clock,
        batch_overhead_s=SERVER_BATCH_OVERHEAD_S,
    )
    assert caps.cap_for(128) == 2


def test_batches_with_weights_keep_the_cap_while_live_caps_try_another_size() -> None:
    # Live caps try twice the cap after EXPLORE_EVERY full output-only batches (and half of
    # it halfway, a round that then has no full batch); only output-only batches report a
    # cost, so a batch with attention weights must not take the try.
    runner = RecordingRunner(batch_caps=BatchCaps(((512, 4),)))
    limits = BatchLimits(max_batch_size=32, max_queue_delay_s=0.05, max_queue_size=100)

    async def body() -> None:
        batcher = Batcher(dataclasses.replace(limits, live_caps=True))
        await batcher.start()
        try:
            for _ in range(EXPLORE_EVERY + 1):  # batches of 4, closed at the cap
                await asyncio.wait_for(
                    asyncio.gather(
                        *(
                            batcher.submit(
                                runner, np.ones((1, 8, 2), np.float32), with_weights=False
                            )
                            for _ in range(4)
                        )
                    ),
                    timeout=20,
                )
            runner.batches.clear()
            await asyncio.wait_for(
                asyncio.gather(
                    *(
                        batcher.submit(runner, np.ones((1, 8, 2), np.float32), with_weights=True)
                        for _ in range(8)
                    )
                ),
                timeout=20,
            )
        finally:
            await batcher.stop()

    asyncio.run(body())
    assert runner.batches == [(4, 8, 2), (4, 8, 2)]
