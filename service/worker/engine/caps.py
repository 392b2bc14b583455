"""Batch size caps by sequence length, measured on the real graph at warm-up.

On a CPU, a batch of 32 long sequences costs more per sequence than running them one by one
(attention is memory-bound there); on a GPU large batches win. Instead of guessing, time the
graph at a few batch sizes per length bucket and cap each bucket at its best throughput: a
measured version of Triton's preferred batch sizes. --max-batch-size stays the upper bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from service.catalog import BatchCaps, length_buckets

# Per-sequence costs within this fraction of the best count as a tie, won by the larger
# batch: the same compute per sequence, and the server's per-batch work (scheduling, thread
# hand-off, futures), which this timing leaves out, is shared by more sequences. Repeated
# measurements of one size on one core differ by ~5 %.
TIE_TOLERANCE = 0.08
# What the server adds to every batch beyond the graph's run (scheduling, the hand-off to
# and from the compute thread, splitting results, resolving futures): ~0.5 ms on one CPU
# core. Left out, batch 1 won near-ties at seq 128 and the server ran 162 seq/s where
# batches of 2 had given 237.
SERVER_BATCH_OVERHEAD_S = 0.0005
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


@dataclass(frozen=True)
class BucketTiming:
    """Seconds per sequence by batch size at one length, and whether the sizes left out are
    known to be worse (the measurement saw costs rise) or merely unmeasured (budget spent)."""

    costs: dict[int, float]
    conclusive: bool


def measure_bucket(
    run: Callable[[int, int], None],
    length: int,
    sizes: Sequence[int],
    give_up: float,
    clock: Clock = time.perf_counter,
    batch_overhead_s: float = 0.0,
) -> BucketTiming:
    """Grow the batch size until every size is measured, two sizes in a row cost clearly
    more than the best, or the budget ends; twice, each size keeping its best timing.

    One pass is not enough: a burst of other work on the core (another process, the kernel
    reclaiming a finished process's memory) that slows two sizes in a row stops the growth
    at batch 1. That happened at start-up right after a previous server exited: every
    length was capped at 1 and the server's throughput halved. The second pass rarely meets
    the same burst, and it grows again from the best timings of both.
    """
    costs: dict[int, float] = {}
    for first_pass in (True, False):
        worse_in_a_row = 0
        for size in sizes:
            if worse_in_a_row >= 2:
                break
            if costs and clock() >= give_up:
                # Only a first pass cut short leaves sizes unjudged.
                return BucketTiming(costs, conclusive=not first_pass)
            timed = time_batch(run, size, length, clock, batch_overhead_s)
            costs[size] = min(costs.get(size, timed), timed)
            clearly_worse = costs[size] > min(costs.values()) * (1 + CLEARLY_WORSE)
            worse_in_a_row = worse_in_a_row + 1 if clearly_worse else 0
    return BucketTiming(costs, conclusive=True)


def measure_caps(
    run: Callable[[int, int], None],
    *,
    max_batch_size: int,
    max_seq_len: int,
    budget_s: float,
    clock: Clock = time.perf_counter,
    batch_overhead_s: float = 0.0,
) -> BatchCaps:
    """Time run(batch_size, seq_len) per length bucket; cap each bucket at its best size.

    Caps never grow with length: a longer sequence costs at least as much per position, so
    a batch that did not pay off for shorter ones does not for longer ones either. What the
    budget leaves unknown is never guessed smaller: a bucket whose measurement stopped early
    keeps the cap of the shorter bucket before it (max_batch_size for the first), and
    buckets left unmeasured do the same.
    """
    give_up = clock() + budget_s
    sizes = batch_sizes(max_batch_size)
    caps: list[tuple[int, int]] = []
    for length in length_buckets(max_seq_len):
        shorter = caps[-1][1] if caps else max_batch_size
        if caps and clock() >= give_up:
            caps.append((length, shorter))
            continue
        timing = measure_bucket(run, length, sizes, give_up, clock, batch_overhead_s)
        best = best_batch_size(timing.costs) if timing.conclusive else shorter
        caps.append((length, min(best, shorter)))
    return BatchCaps(tuple(caps)).merged()
