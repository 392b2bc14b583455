"""Batch caps that follow live costs: they grow when larger batches are cheaper per sequence,
shrink when smaller ones clearly are, stay put on noise and on the host's drift, and explore
only now and then."""

from __future__ import annotations

import random
from collections.abc import Callable

from service.catalog import BatchCaps
from service.worker.batching.live_caps import EXPLORE_EVERY, SETTLED_EXPLORE_EVERY, LiveCaps

MAX = 32


def _run(
    caps: LiveCaps,
    cost_per_seq: Callable[[int], float],
    batches: int,
    *,
    noise: float = 0.0,
    seq: int = 100,
    seed: int = 0,
) -> list[int]:
    """Batches as a busy queue forms them (always full to the cap in force); the sizes run."""
    rng = random.Random(seed)
    sizes = []
    for _ in range(batches):
        size = caps.cap_for(seq)
        sizes.append(size)
        jitter = 1 + rng.uniform(-noise, noise)
        caps.observe(seq, size, size * cost_per_seq(size) * jitter)
    return sizes


def test_a_cap_measured_too_low_grows_to_the_cheapest_size() -> None:
    # Per-sequence cost falls with batch size up to 8, then rises (memory-bound).
    costs = {1: 1.0, 2: 0.7, 4: 0.55, 8: 0.5, 16: 0.6, 32: 0.8}
    changes: list[BatchCaps] = []
    caps = LiveCaps(BatchCaps(((128, 1), (512, 1))), MAX, on_change=changes.append)
    _run(caps, costs.__getitem__, 800)
    assert caps.caps().cap_for(100) == 8
    assert caps.caps().cap_for(500) == 1  # a bucket that saw no batches keeps its first guess
    assert changes
    assert changes[-1] == caps.caps()


def test_a_cap_too_high_comes_down() -> None:
    costs = {1: 1.0, 2: 0.6, 4: 0.5, 8: 0.7, 16: 0.9, 32: 1.2}
    caps = LiveCaps(BatchCaps(((512, 32),)), MAX)
    sizes = _run(caps, costs.__getitem__, 50)
    # A busy queue fills the cap, so smaller sizes are seen only when the queue is short:
    # feed some, as light load does.
    for size in (16, 8, 4) * 6:
        caps.observe(100, size, size * costs[size])
    _run(caps, costs.__getitem__, 600)
    assert caps.caps().cap_for(100) in (4, 8), sizes[-5:]


def test_noise_alone_does_not_move_a_cap() -> None:
    changes: list[BatchCaps] = []
    caps = LiveCaps(BatchCaps(((512, 8),)), MAX, on_change=changes.append)
    _run(caps, lambda size: 0.5, 2000, noise=0.04)  # flat cost, +-4 % jitter
    assert len(changes) <= 1  # a tie may go to the larger size once, then stays
    assert caps.cap_for(100) in (8, 16)


def test_exploration_is_bounded() -> None:
    caps = LiveCaps(BatchCaps(((512, 4),)), MAX)
    costs = {1: 1.0, 2: 0.8, 4: 0.5, 8: 0.9, 16: 1.0, 32: 1.1}
    sizes = _run(caps, costs.__getitem__, 1000)
    assert caps.caps().cap_for(100) == 4
    ups = sum(1 for size in sizes if size > 4)
    downs = sum(1 for size in sizes if size < 4)
    assert ups > 0  # both ways, by turns
    assert downs > 0
    assert ups <= 1000 // EXPLORE_EVERY + 1
    assert downs <= 1000 // EXPLORE_EVERY + 1


def test_the_cap_never_exceeds_max_batch_size() -> None:
    caps = LiveCaps(BatchCaps(((512, 64),)), 16)
    assert caps.cap_for(10) == 16
    _run(caps, lambda size: 1.0 / size, 500)
    assert caps.cap_for(10) <= 16


def test_costs_are_compared_per_padded_position() -> None:
    # Mixed lengths in one bucket: batches of 8 happen to hold shorter sequences than those
    # of 4. Per position they cost the same, so 8 is no win (per sequence it looks one).
    changes: list[BatchCaps] = []
    caps = LiveCaps(BatchCaps(((512, 4),)), MAX, on_change=changes.append)
    for _ in range(400):
        size = caps.cap_for(250)
        longest = 250 if size == 4 else 130
        caps.observe(longest, size, size * longest * 1e-6)
    assert caps.cap_for(250) == 4
    assert not changes


def test_buckets_stay_a_power_of_two_wide_where_first_caps_were_merged() -> None:
    costs = {1: 1.0, 2: 0.8, 4: 0.6, 8: 0.4, 16: 0.6, 32: 0.8}
    caps = LiveCaps(BatchCaps(((512, 4),)), MAX)
    _run(caps, costs.__getitem__, 800, seq=100)
    assert caps.cap_for(100) == 8
    assert [caps.cap_for(length) for length in (64, 129, 500)] == [4, 4, 4]
    assert caps.caps() == BatchCaps(((64, 4), (128, 8), (512, 4)))


def test_a_host_that_slows_down_does_not_make_a_worse_size_look_cheaper() -> None:
    # A batch of 16 costs 15 % more per sequence than one of 8 all along; the host then
    # gets 25 % slower (a noisy neighbour) and later recovers. A try of 16 taken before the
    # slowdown must not be compared with batches of 8 taken during it.
    changes: list[BatchCaps] = []
    caps = LiveCaps(BatchCaps(((512, 8),)), MAX, on_change=changes.append)
    costs = {4: 1.1, 8: 1.0, 16: 1.15, 32: 1.4}
    rng = random.Random(1)
    for batch in range(3000):
        slowdown = 1.25 if 600 <= batch < 1500 else 1.0
        size = caps.cap_for(100)
        jitter = 1 + rng.uniform(-0.03, 0.03)
        caps.observe(100, size, size * costs[size] * slowdown * jitter)
    assert not changes
    assert caps.caps().cap_for(100) == 8


def test_a_maximum_that_is_not_a_power_of_two_is_not_tried_within_the_caps_size_class() -> None:
    # With --max-batch-size 48 and a cap of 32, twice the cap is 48: the same size class as 32,
    # so a try of it could never be told apart from the cap's own batches. It is not made.
    changes: list[BatchCaps] = []
    caps = LiveCaps(BatchCaps(((512, 32),)), 48, on_change=changes.append)
    costs = {16: 1.08, 32: 1.0, 48: 1.4}
    sizes = _run(caps, costs.__getitem__, 5000, noise=0.03)
    assert 48 not in sizes
    assert not changes
    assert caps.caps().cap_for(100) == 32


def test_a_smaller_batch_is_not_compared_with_batches_at_the_cap_long_before_it() -> None:
    # A busy minute on a slow host at the cap (8), then a quiet one; later, light load on a
    # host back to normal speed sends batches of 4, which cost 8 % more per sequence than 8
    # on the same host. Against the slow batches of a minute before they would look 14 %
    # cheaper and take the cap down.
    now = [0.0]
    changes: list[BatchCaps] = []
    caps = LiveCaps(BatchCaps(((512, 8),)), MAX, on_change=changes.append, clock=lambda: now[0])
    for _ in range(200):
        now[0] += 0.05
        if caps.cap_for(100) == 8:
            caps.observe(100, 8, 8 * 1.25)
    now[0] += 60
    for _ in range(100):
        now[0] += 0.5
        caps.observe(100, 4, 4 * 1.08)
    assert not changes
    assert caps.caps().cap_for(100) == 8


def test_batches_whose_cost_is_not_observed_do_not_take_a_try() -> None:
    caps = LiveCaps(BatchCaps(((512, 8),)), MAX)
    tries = set()
    for _ in range(4 * EXPLORE_EVERY):
        tries.add(caps.cap_for(100))
        assert caps.cap_for(100, exploring=False) == 8  # a batch with attention weights
        caps.observe(100, caps.cap_for(100), caps.cap_for(100) * 1.0)
    assert tries == {4, 8, 16}


def test_a_settled_cap_tries_other_sizes_rarely() -> None:
    # As on a GPU: a batch takes about the same time whatever its size, so a try of half the
    # cap is half a batch of work lost. Once the tries have shown the cap is better, they
    # space out.
    caps = LiveCaps(BatchCaps(((512, 32),)), MAX)
    sizes = _run(caps, lambda size: 1.0 / size, 10_000, noise=0.03)
    assert caps.caps().cap_for(100) == 32
    early = sum(1 for size in sizes[:1000] if size != 32)
    late = sum(1 for size in sizes[1000:] if size != 32)
    assert early >= 5  # enough tries to know
    assert late <= 9000 // 64  # at most one batch in 64 once settled (1.5 %)
    assert SETTLED_EXPLORE_EVERY >= 64


def test_a_bucket_whose_batches_are_seconds_apart_still_compares_and_moves() -> None:
    # Long sequences on a slow CPU, or buckets taking turns under mixed lengths: 2.5 s
    # between two batches of the bucket. A batch of 4 costs 20 % less per sequence than 8.
    now = [0.0]
    caps = LiveCaps(BatchCaps(((512, 8),)), MAX, clock=lambda: now[0])
    costs = {2: 0.9, 4: 0.8, 8: 1.0, 16: 1.1}
    for _ in range(1000):
        now[0] += 2.5
        size = caps.cap_for(100)
        caps.observe(100, size, size * costs[size])
    assert caps.caps().cap_for(100) == 4


def test_a_settled_cap_still_follows_a_change_of_costs() -> None:
    # Settled at 8 (tries rare), then batches of 16 become 20 % cheaper per sequence than 8
    # (another load, another host): a try that shows the win brings the tries back.
    costs = {4: 1.1, 8: 1.0, 16: 1.15, 32: 1.4}
    caps = LiveCaps(BatchCaps(((512, 8),)), MAX)
    _run(caps, costs.__getitem__, 3000, noise=0.03)
    assert caps.caps().cap_for(100) == 8
    costs[16] = 0.8
    sizes = _run(caps, costs.__getitem__, 400, noise=0.03, seed=1)
    assert caps.caps().cap_for(100) == 16, sizes.count(16)


def test_slow_batches_run_back_to_back_still_compare_across_a_long_try() -> None:
    # Each batch takes its cost in time, back to back: 5 s for a batch of 8, 10 s for a try
    # of 16. The try's own run is no pause between the cap's batches.
    now = [0.0]
    caps = LiveCaps(BatchCaps(((512, 8),)), MAX, clock=lambda: now[0])
    per_sequence = {2: 0.75, 4: 0.5, 8: 0.625, 16: 0.7}  # seconds; 4 is 20 % cheaper than 8
    for _ in range(1500):
        size = caps.cap_for(100)
        cost = size * per_sequence[size]
        now[0] += cost
        caps.observe(100, size, cost)
    assert caps.caps().cap_for(100) == 4


def test_a_try_the_queue_cannot_fill_ends_with_the_next_batch() -> None:
    # One caller at a time: every batch holds one sequence. A try up (2) cannot be filled and
    # must not keep the cap at 2 (a queue delay would then wait for a second request).
    caps = LiveCaps(BatchCaps(((512, 1),)), MAX)
    offered = []
    for _ in range(640):
        offered.append(caps.cap_for(100))
        caps.observe(100, 1, 1.0)
    assert offered.count(1) >= 640 - 640 // EXPLORE_EVERY - 1
