"""Batch size caps by sequence length, measured on the real graph at warm-up.

On a CPU, a batch of 32 long sequences costs more per sequence than running them one by one
(attention is memory-bound there); on a GPU large batches win. Instead of guessing, time the
graph at a few batch sizes per length bucket and cap each bucket at its best throughput: a
measured version of Triton's preferred batch sizes. --max-batch-size stays the upper bound.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

from service.catalog import BatchCaps, length_buckets

# Per-sequence costs within this fraction of the best count as a tie, won by the larger
# batch. The best timing of one size differs by about 3 % between starts on one core (timed
# by the thread's CPU; by wall time about 5 %, so there a choice between sizes within 5 % of
# each other may follow noise, at little cost); the server's own work per batch is counted
# below, not here. At 8 %, batches of 8 and 16 won ties at seq 128 that cost the server
# 5-10 % of its throughput against caps of 2 or 4 on an Intel Xeon core.
TIE_TOLERANCE = 0.03
# What the worker adds to every batch beyond the graph's run (its loop, merging, splitting,
# writing answers): a batch of one at seq 16 costs the worker about 670 us of CPU where the
# graph alone takes 370, and batches of 32 add about 50 us a request, so about 0.25 ms a
# batch. Left out, batch 1 won near-ties at seq 128 and the server ran 162 seq/s where
# batches of 2 had given 237.
SERVER_BATCH_OVERHEAD_S = 0.00025
# A short bucket's second pass runs once this long (wall time) has passed since its first,
# between longer buckets' first passes: a burst that slowed the first is likely over by
# then. The short buckets take milliseconds, so two passes back to back met the same burst.
# (Where no longer bucket is left to fill the time, the second pass follows sooner.)
SECOND_PASS_AFTER_S = 0.25
# Growing the batch stops after two sizes in a row cost this much more than the best: far
# beyond timing noise, and on every device measured, costs only rise from there.
CLEARLY_WORSE = 0.25
# Each timing is the best of repeated runs: at least MIN_REPEATS runs and MIN_TIMED_S of
# runs for short batches (noise is large there); two runs for batches of LONG_RUN_S or more.
MIN_REPEATS = 3
MIN_TIMED_S = 0.01
LONG_RUN_S = 0.05
MAX_REPEATS = 20


def batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... up to and including max_batch_size."""
    sizes = []
    size = 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    return [*sizes, max_batch_size]


def best_batch_size(seconds_per_sequence: dict[int, float]) -> int:
    """The batch size with the lowest cost per sequence; near-ties go to the larger size."""
    best = min(seconds_per_sequence.values())
    return max(
        size for size, cost in seconds_per_sequence.items() if cost <= best * (1 + TIE_TOLERANCE)
    )


Clock = Callable[[], float]


def time_batch(
    run: Callable[[int, int], None],
    size: int,
    length: int,
    clock: Clock = time.perf_counter,
    batch_overhead_s: float = 0.0,
) -> float:
    """Seconds per sequence of one batch of `size` sequences of `length`: the best of
    repeated runs (the first run of a shape also allocates, and short runs are noisy), plus
    batch_overhead_s per batch for the work the server adds to every batch."""
    timings: list[float] = []
    while len(timings) < MAX_REPEATS:
        started = clock()
        run(size, length)
        timings.append(clock() - started)
        if len(timings) >= 2 and min(timings) >= LONG_RUN_S:
            break
        if len(timings) >= MIN_REPEATS and sum(timings) >= MIN_TIMED_S:
            break
    return (min(timings) + batch_overhead_s) / size


def grow(
    run: Callable[[int, int], None],
    length: int,
    sizes: Sequence[int],
    costs: dict[int, float],
    give_up: float,
    clock: Clock = time.perf_counter,
    batch_overhead_s: float = 0.0,
    cost_clock: Clock | None = None,
) -> bool:
    """One pass over a bucket: time each size in turn, each keeping its best timing of every
    pass in costs, until every size is measured or two sizes in a row cost clearly more than
    the best of this pass. (Against the best of every pass, a second pass stopped after sizes
    1 and 2 of short sequences, which cost twice batch 32's, and never timed again the large
    sizes that a burst had slowed in the first.) False when the budget (give_up, by clock)
    ended first; the bucket's first timing always runs. Timings are by cost_clock (default:
    clock)."""
    worse_in_a_row = 0
    best = float("inf")
    for size in sizes:
        if worse_in_a_row >= 2:
            break
        if costs and clock() >= give_up:
            return False
        timed = time_batch(run, size, length, cost_clock or clock, batch_overhead_s)
        costs[size] = min(costs.get(size, timed), timed)
        best = min(best, timed)
        worse_in_a_row = worse_in_a_row + 1 if timed > best * (1 + CLEARLY_WORSE) else 0
    return True


def measure_caps(
    run: Callable[[int, int], None],
    *,
    max_batch_size: int,
    max_seq_len: int,
    budget_s: float,
    clock: Clock = time.perf_counter,
    batch_overhead_s: float = 0.0,
    cost_clock: Clock | None = None,
) -> BatchCaps:
    """Time run(batch_size, seq_len) per length bucket; cap each bucket at its best size.

    The budget is counted by clock (wall time), each timing by cost_clock: the computing
    thread's CPU time where ONNX Runtime runs on that thread alone, so that processes sharing
    the core do not count. By wall time, the front end and gateway starting beside the worker
    on one core doubled the cost of batches of 16 and 32 at seq 16 at every start: seq 16 was
    capped at 8, and with it every longer length.

    Two passes over every bucket, the second where the budget allows, each size keeping its
    best timing of both: a burst that still counts (the kernel reclaiming memory, or anything
    on a clock of wall time) and slows two sizes in a row stops a bucket's growth. A short
    bucket's second pass comes SECOND_PASS_AFTER_S after its first, between the first passes
    of longer buckets, so the short ones get theirs even when the first passes of the long
    ones take most of the budget; the long buckets' second passes come after every first
    pass, so they never push the longest bucket's first past the budget.

    Caps never grow with length: a longer sequence costs at least as much per position, so
    a batch that did not pay off for shorter ones does not for longer ones either. What the
    budget leaves unknown is never guessed smaller: a bucket whose first pass stopped early
    keeps the cap of the shorter bucket before it (max_batch_size for the first), and
    buckets left unmeasured do the same.
    """
    if max_batch_size == 1:
        return BatchCaps.uniform(1, max_seq_len)  # nothing to choose
    give_up = clock() + budget_s
    sizes = batch_sizes(max_batch_size)
    lengths = length_buckets(max_seq_len)
    costs: dict[int, dict[int, float]] = {length: {} for length in lengths}
    judged: list[int] = []  # buckets whose first pass ended (their costs decide the cap)
    # Buckets awaiting their second pass, with when their first pass ended.
    second: deque[tuple[float, int]] = deque()

    def one_pass(length: int) -> bool:
        return grow(run, length, sizes, costs[length], give_up, clock, batch_overhead_s, cost_clock)

    # Buckets whose first pass took SECOND_PASS_AFTER_S or more: a burst shorter than that
    # cannot have slowed all of it, and their second pass, as long, waits until every
    # bucket's first (interleaved, it pushed the longest bucket's first past the budget).
    long_passes: list[int] = []
    for length in lengths:
        if judged and clock() >= give_up:
            break
        started = clock()
        if not one_pass(length):
            break
        judged.append(length)
        ended = clock()
        if ended - started < SECOND_PASS_AFTER_S:
            second.append((ended, length))
        else:
            long_passes.append(length)
        while second and clock() - second[0][0] >= SECOND_PASS_AFTER_S and clock() < give_up:
            one_pass(second.popleft()[1])
    for length in [length for _, length in second] + long_passes:
        if clock() >= give_up:
            break
        one_pass(length)
    return _decide(costs, judged, max_batch_size)


def _decide(
    costs: dict[int, dict[int, float]], judged: list[int], max_batch_size: int
) -> BatchCaps:
    """Each judged bucket's best size, never above a shorter bucket's cap; the others keep the
    shorter bucket's cap (max_batch_size for the first)."""
    caps: list[tuple[int, int]] = []
    for length, bucket_costs in costs.items():
        shorter = caps[-1][1] if caps else max_batch_size
        best = best_batch_size(bucket_costs) if length in judged else shorter
        caps.append((length, min(best, shorter)))
    return BatchCaps(tuple(caps)).merged()
