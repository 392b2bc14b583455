"""Pure arithmetic of the benchmark: percentiles, length distributions, Poisson arrivals,
the stack ceiling, Prometheus histogram differences. No I/O, so each piece is tested alone."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

PERCENTILES = (50.0, 90.0, 99.0, 99.9)


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of already sorted values (nan when empty).

    Nearest rank, not interpolation: p99.9 of 500 samples is the slowest one, never a value
    that no request saw."""
    if not sorted_values:
        return math.nan
    rank = math.ceil(p / 100.0 * len(sorted_values))
    return float(sorted_values[min(max(rank, 1), len(sorted_values)) - 1])


def latency_summary_ms(latencies_s: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99/p99.9 and mean, in milliseconds."""
    ordered = sorted(latencies_s)
    summary = {f"p{p:g}_ms": percentile(ordered, p) * 1000 for p in PERCENTILES}
    summary["mean_ms"] = (sum(ordered) / len(ordered) * 1000) if ordered else math.nan
    return summary


@dataclass(frozen=True)
class Lengths:
    """Sequence lengths: fixed ("128") or drawn uniformly from low..high ("uniform:16:256")."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> Lengths:
        parts = text.strip().split(":")
        try:
            if len(parts) == 1:
                low = high = int(parts[0])
            elif len(parts) == 3 and parts[0] == "uniform":
                low, high = int(parts[1]), int(parts[2])
            else:
                raise ValueError
        except ValueError:
            raise ValueError(
                f"sequence length {text!r}: expected N or uniform:LOW:HIGH (e.g. uniform:16:256)"
            ) from None
        if not 1 <= low <= high:
            raise ValueError(f"sequence length {text!r}: need 1 <= LOW <= HIGH")
        return cls(low, high)

    @property
    def fixed(self) -> bool:
        return self.low == self.high

    def values(self) -> range:
        return range(self.low, self.high + 1)

    def draw(self, rng: np.random.Generator, count: int) -> np.ndarray:
        return rng.integers(self.low, self.high + 1, size=count)

    def __str__(self) -> str:
        return str(self.low) if self.fixed else f"uniform:{self.low}:{self.high}"


def poisson_arrivals(rate_per_s: float, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times (seconds from 0, ascending, < duration_s) of a Poisson process."""
    if rate_per_s <= 0 or duration_s <= 0:
        return np.empty(0)
    # Draw a little more than the expected count, then top up in the rare short case.
    expected = rate_per_s * duration_s
    gaps = rng.exponential(1.0 / rate_per_s, size=int(expected + 6 * math.sqrt(expected) + 16))
    times = np.cumsum(gaps)
    while times[-1] < duration_s:
        more = np.cumsum(rng.exponential(1.0 / rate_per_s, size=len(gaps))) + times[-1]
        times = np.concatenate([times, more])
    return times[times < duration_s]


def stack_ceiling(echo_per_s: float, in_process_per_s: float) -> float:
    """Most a server can do when each request pays the protocol floor and the compute in
    series on the same core: 1 / (1/echo + 1/in_process)."""
    if echo_per_s <= 0 or in_process_per_s <= 0:
        return 0.0
    return 1.0 / (1.0 / echo_per_s + 1.0 / in_process_per_s)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if not numerator or not denominator or math.isnan(numerator) or math.isnan(denominator):
        return None
    return numerator / denominator


Histogram = dict[str, float]  # "le" bound (as Prometheus prints it) -> cumulative count


def histogram_delta(before: Mapping[str, float], after: Mapping[str, float]) -> Histogram:
    """Cumulative bucket counts of a Prometheus histogram between two scrapes."""
    return {le: after[le] - before.get(le, 0.0) for le in after}


def bucket_counts(cumulative: Mapping[str, float]) -> dict[str, float]:
    """Per-bucket (not cumulative) counts, in ascending order of the bound."""
    ordered = sorted(cumulative.items(), key=lambda item: float(item[0]))
    counts: dict[str, float] = {}
    previous = 0.0
    for le, total in ordered:
        counts[le] = total - previous
        previous = total
    return counts


def histogram_mean(sum_delta: float, count_delta: float) -> float:
    return sum_delta / count_delta if count_delta > 0 else math.nan
