"""Batch caps that follow the cost of the batches the worker really runs.

The caps measured at warm-up are a first guess: a burst of other work at start-up can make
them differ between starts on one machine. Here every computed batch reports its cost per
padded position (sequences x longest length), by length bucket (powers of two: 16, 32, ...)
and size class (powers of two); each bucket's cap moves to the size class with the lowest
cost. Per position, so that within a bucket a batch of shorter sequences does not look
cheaper than one of longer ones; and buckets stay a power of two wide even where the
warm-up caps merged neighbours with equal caps, since costs per position still differ
several-fold between length 64 and 512. Now and then a bucket tries the next size class up
and down (bounded exploration): a busy queue fills every batch to the cap, so without the
tries a cap set too low could not grow, nor one set too high come down. A batch of another
size is compared with the latest batches at the cap before it (their median cost then,
since the bucket's last pause of PAIR_WINDOW_S), never with costs from before a pause: the
host's own speed drifts (a noisy neighbour makes every batch 20-30 % dearer for a while),
and a try made before such a slowdown would look cheaper than the cap's batches during it.
A change needs the median of the last few such ratios to show a clear win (hysteresis), so
caps do not flap on noise or drift.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections import defaultdict, deque
from collections.abc import Callable

from service.catalog import BatchCaps, length_buckets

WINDOW = 9  # batches per (bucket, size) whose median cost, or median ratio, is compared
MIN_SAMPLES = 5  # before a size's cost, or its ratio to the cap's, is trusted
EXPLORE_EVERY = 32  # full batches of a bucket between two tries of one direction (up, down)
# ... while that direction has MIN_SAMPLES ratios or more and its latest is no win: each try
# of a size that costs more per sequence is lost work (on a GPU a batch of half the cap takes
# nearly a full batch's time), so a settled direction is tried rarely; a move resets it.
SETTLED_EXPLORE_EVERY = 128
# A batch of another size is compared only with the bucket's batches at the cap since its
# last pause this long (between one batch's end and the next one's start): older ones may
# have run on a host of another speed.
PAIR_WINDOW_S = 10.0
# A larger size must cost this much less per sequence to become the cap, a smaller one this
# much less to take it back: beyond timing noise (~5 % on one CPU core), and near-ties stay
# with the larger batch (its per-batch work is shared by more sequences).
GROW_WIN = 0.06
SHRINK_WIN = 0.10
UP, DOWN = 1, -1  # a try's direction


def _staggered() -> dict[int, int]:
    """Try counters that do not come due on the same batch."""
    return {UP: 0, DOWN: EXPLORE_EVERY // 2}


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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lengths = length_buckets(initial.caps[-1][0])
        self._caps = [min(initial.cap_for(length), max_batch_size) for length in self._lengths]
        self._max = max_batch_size
        self._on_change = on_change
        self._clock = clock
        # (when, cost per position) of the latest batches at each bucket's cap (by size class).
        self._costs: dict[tuple[int, int], deque[tuple[float, float]]] = defaultdict(
            lambda: deque(maxlen=WINDOW)
        )
        # Other sizes' costs, each divided by the cap's median cost when it was measured.
        self._ratios: dict[tuple[int, int], deque[float]] = defaultdict(
            lambda: deque(maxlen=WINDOW)
        )
        # Full batches at the cap since each direction's last try, per bucket (staggered).
        self._since_try = [_staggered() for _ in self._lengths]
        # When each bucket's latest batch ended, and when its batches resumed after a pause
        # of over PAIR_WINDOW_S (only batches at the cap since then are paired with).
        self._last_end: list[float | None] = [None] * len(self._lengths)
        self._resumed = [float("-inf")] * len(self._lengths)
        # What the bucket's next batch tries: UP (twice the cap, within the maximum), DOWN
        # (half the cap's size class) or nothing (0); a try is the bucket's next batch,
        # whatever size the queue gave it.
        self._trying = [0] * len(self._lengths)
        self._next_try = [UP] * len(self._lengths)  # when both are due, they alternate

    def _bucket(self, longest_seq: int) -> int:
        return min(bisect.bisect_left(self._lengths, longest_seq), len(self._lengths) - 1)

    def cap_for(self, longest_seq: int, *, exploring: bool = True) -> int:
        """The cap for a batch this long; with a try due, the try's size unless not
        exploring (a batch whose cost is not observed: it would never end the try)."""
        bucket = self._bucket(longest_seq)
        cap = self._caps[bucket]
        trying = self._trying[bucket] if exploring else 0
        if trying == UP:
            return self._up(cap)
        if trying == DOWN:
            return self._tried_size(bucket, DOWN)
        return cap

    def _up(self, cap: int) -> int:
        return min(self._max, cap * 2)

    def caps(self) -> BatchCaps:
        return BatchCaps(tuple(zip(self._lengths, self._caps, strict=True))).merged()

    def observe(self, longest_seq: int, sequences: int, cost_s: float) -> None:
        """A batch of sequences (longest longest_seq, so padded to it) cost cost_s."""
        bucket = self._bucket(longest_seq)
        size = size_class(sequences)
        cost = cost_s / (sequences * max(1, longest_seq))
        cap = self._caps[bucket]
        at_cap = size_class(cap)
        now = self._clock()
        last_end, started = self._last_end[bucket], now - cost_s
        if last_end is not None and started - last_end > PAIR_WINDOW_S:
            self._resumed[bucket] = started  # a pause: the host may have changed meanwhile
        self._last_end[bucket] = now
        if size == at_cap:
            self._costs[(bucket, size)].append((now, cost))
        else:
            current = self._recent_cost(bucket, at_cap)
            if current is not None and current > 0:
                self._ratios[(bucket, size)].append(cost / current)
        if self._trying[bucket]:
            # One batch per try: one the load could not fill (a try up with too few
            # requests queued) must not hold the bucket's cap at the try's size.
            self._trying[bucket] = 0
        elif sequences >= cap:
            since = self._since_try[bucket]
            for direction in since:
                since[direction] += 1
            due = [d for d in self._directions(bucket) if since[d] >= self._interval(bucket, d)]
            if due:
                direction = self._next_try[bucket] if self._next_try[bucket] in due else due[0]
                since[direction] = 0
                self._trying[bucket] = direction
                self._next_try[bucket] = -direction
        self._decide(bucket)

    def _directions(self, bucket: int) -> list[int]:
        """The tries that exist: a busy queue fills every batch to the cap, so without a try
        down a cap too high would never see a smaller batch."""
        cap = self._caps[bucket]
        # Up only where twice the cap is another size class (not with a maximum of 48 and a
        # cap of 32: 48 is in 32's class, and its try would never end).
        can_grow = size_class(self._up(cap)) > size_class(cap)
        return [d for d in (UP, DOWN) if (can_grow if d == UP else cap > 1)]

    def _tried_size(self, bucket: int, direction: int) -> int:
        cap = self._caps[bucket]
        return size_class(self._up(cap)) if direction == UP else size_class(cap) // 2

    def _interval(self, bucket: int, direction: int) -> int:
        """Full batches before a try this way: few while its ratios are unknown or the
        latest one is a win, many once they say the cap is better (a clear win would have
        moved the cap already)."""
        ratios = self._ratios.get((bucket, self._tried_size(bucket, direction)))
        if ratios is None or len(ratios) < MIN_SAMPLES:
            return EXPLORE_EVERY
        win = GROW_WIN if direction == UP else SHRINK_WIN
        return EXPLORE_EVERY if ratios[-1] < 1 - win else SETTLED_EXPLORE_EVERY

    def _recent_cost(self, bucket: int, size: int) -> float | None:
        """The median cost of the latest batches at the cap since the bucket's last pause,
        if enough of them (a bucket whose batches are seconds apart still pairs; one that
        was quiet for a minute starts afresh)."""
        costs = self._costs.get((bucket, size))
        if costs is None:
            return None
        resumed = self._resumed[bucket]
        recent = [cost for ended, cost in costs if ended >= resumed]
        return statistics.median(recent) if len(recent) >= MIN_SAMPLES else None

    def _median_ratio(self, bucket: int, size: int) -> float | None:
        ratios = self._ratios.get((bucket, size))
        if ratios is None or len(ratios) < MIN_SAMPLES:
            return None
        return statistics.median(ratios)

    def _decide(self, bucket: int) -> None:
        """Move the bucket's cap when another size's median ratio to it is a clear win."""
        directions = self._directions(bucket)
        larger, smaller = (
            self._median_ratio(bucket, self._tried_size(bucket, d)) if d in directions else None
            for d in (UP, DOWN)
        )
        if larger is not None and larger < 1 - GROW_WIN:
            self._set(bucket, self._up(self._caps[bucket]))
        elif smaller is not None and smaller < 1 - SHRINK_WIN:
            self._set(bucket, self._tried_size(bucket, DOWN))

    def _set(self, bucket: int, cap: int) -> None:
        if cap == self._caps[bucket]:
            return
        self._caps[bucket] = cap
        self._since_try[bucket] = _staggered()
        self._trying[bucket] = 0
        # Every ratio was to the old cap, and the new cap's costs (if any) are old: measure
        # afresh.
        for samples in (self._costs, self._ratios):
            for key in [key for key in samples if key[0] == bucket]:
                del samples[key]
        self._on_change(self.caps())
