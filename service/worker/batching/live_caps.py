"""Batch caps that follow the cost of the batches the worker really runs.

The caps measured at warm-up are a first guess: a burst of other work at start-up can make
them differ between starts on one machine. Here every computed batch reports its cost per
padded position (sequences x longest length), by length bucket (powers of two: 16, 32, ...)
and size class (powers of two); each bucket's cap moves to the size class with the lowest
cost. Per position, so that within a bucket a batch of shorter sequences does not look
cheaper than one of longer ones; and buckets stay a power of two wide even where the
warm-up caps merged neighbours with equal caps, since costs per position still differ
several-fold between length 64 and 512. Now and then a bucket tries the next size up (bounded
exploration), so a cap set too low at start can grow. Costs are medians of the last few
batches (robust to a stray slow one), and a change needs a clear win (hysteresis), so caps
do not flap on noise.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict, deque
from collections.abc import Callable

from service.catalog import BatchCaps, length_buckets

WINDOW = 9  # batches per (bucket, size) whose median cost is compared
MIN_SAMPLES = 5  # before a size's cost is trusted
EXPLORE_EVERY = 32  # batches of a bucket at its cap between two tries of the next size up
# A larger size must cost this much less per sequence to become the cap, a smaller one this
# much less to take it back: beyond timing noise (~5 % on one CPU core), and near-ties stay
# with the larger batch (its per-batch work is shared by more sequences).
GROW_WIN = 0.06
SHRINK_WIN = 0.10


def size_class(sequences: int) -> int:
    """The power of two at or below sequences."""
    return 1 << (max(1, sequences).bit_length() - 1)


class LiveCaps:
    """cap_for() as BatchCaps has it; observe() after every batch; on_change gets new caps."""

    def __init__(
        self,
        initial: BatchCaps,
        max_batch_size: int,
        on_change: Callable[[BatchCaps], None] = lambda caps: None,
    ) -> None:
        self._lengths = length_buckets(initial.caps[-1][0])
        self._caps = [min(initial.cap_for(length), max_batch_size) for length in self._lengths]
        self._max = max_batch_size
        self._on_change = on_change
        self._costs: dict[tuple[int, int], deque[float]] = defaultdict(lambda: deque(maxlen=WINDOW))
        self._since_try = [0] * len(self._lengths)
        self._trying = [False] * len(self._lengths)

    def _bucket(self, longest_seq: int) -> int:
        return min(bisect.bisect_left(self._lengths, longest_seq), len(self._lengths) - 1)

    def cap_for(self, longest_seq: int) -> int:
        bucket = self._bucket(longest_seq)
        cap = self._caps[bucket]
        if self._trying[bucket]:
            return min(self._max, cap * 2)
        return cap

    def caps(self) -> BatchCaps:
        return BatchCaps(tuple(zip(self._lengths, self._caps, strict=True))).merged()

    def observe(self, longest_seq: int, sequences: int, cost_s: float) -> None:
        """A batch of sequences (longest longest_seq, so padded to it) cost cost_s."""
        bucket = self._bucket(longest_seq)
        size = size_class(sequences)
        self._costs[(bucket, size)].append(cost_s / (sequences * max(1, longest_seq)))
        cap = self._caps[bucket]
        if self._trying[bucket] and size > cap:
            self._trying[bucket] = False  # one batch of the larger size per try
        elif size >= cap:
            self._since_try[bucket] += 1
            if self._since_try[bucket] >= EXPLORE_EVERY and cap < self._max:
                self._since_try[bucket] = 0
                self._trying[bucket] = True
        self._decide(bucket)

    def _median(self, bucket: int, size: int) -> float | None:
        costs = self._costs.get((bucket, size))
        if costs is None or len(costs) < MIN_SAMPLES:
            return None
        return statistics.median(costs)

    def _decide(self, bucket: int) -> None:
        cap = self._caps[bucket]
        current = self._median(bucket, size_class(cap))
        if current is None:
            return
        larger = self._median(bucket, size_class(cap) * 2) if cap < self._max else None
        smaller = self._median(bucket, size_class(cap) // 2) if cap > 1 else None
        if larger is not None and larger < current * (1 - GROW_WIN):
            self._set(bucket, min(self._max, size_class(cap) * 2))
        elif smaller is not None and smaller < current * (1 - SHRINK_WIN):
            self._set(bucket, size_class(cap) // 2)

    def _set(self, bucket: int, cap: int) -> None:
        if cap == self._caps[bucket]:
            return
        self._caps[bucket] = cap
        self._since_try[bucket] = 0
        self._on_change(self.caps())
