"""The server's Prometheus histograms, scraped before and after a run and subtracted, so the
load generator reports batch sizes, queue/compute time and padding for any API (V2 included,
whose responses carry no timing)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bench.harness import metrics_text, parse_samples
from bench.stats import bucket_counts, histogram_delta, histogram_mean

HISTOGRAMS = {
    "batch_size": "attention_batch_size_sequences",
    "queue_s": "attention_queue_duration_seconds",
    "compute_s": "attention_compute_duration_seconds",
    "padding_ratio": "attention_batch_padding_ratio",
}


@dataclass
class HistogramSnapshot:
    buckets: dict[str, float] = field(default_factory=dict)
    sum: float = 0.0
    count: float = 0.0


Snapshot = dict[str, HistogramSnapshot]


def parse(text: str) -> Snapshot:
    """The histograms in HISTOGRAMS, summed over their label sets (models)."""
    wanted = {name: key for key, name in HISTOGRAMS.items()}
    snapshot: Snapshot = {key: HistogramSnapshot() for key in HISTOGRAMS}
    for (name, labels), value in parse_samples(text).items():
        family, _, part = name.rpartition("_")
        key = wanted.get(family)
        if key is None:
            continue
        histogram = snapshot[key]
        if part == "bucket":
            le = dict(labels)["le"]
            histogram.buckets[le] = histogram.buckets.get(le, 0.0) + value
        elif part == "sum":
            histogram.sum += value
        elif part == "count":
            histogram.count += value
    return snapshot


def scrape(url: str, timeout_s: float = 5.0) -> Snapshot | None:
    """None when the URL does not answer (a peer server without these metrics)."""
    try:
        return parse(metrics_text(url, timeout_s))
    except OSError:
        return None


def _mean_delta(before: Snapshot, after: Snapshot, key: str) -> float:
    total = after[key].sum - before[key].sum
    return histogram_mean(total, after[key].count - before[key].count)


def summarize(before: Snapshot, after: Snapshot) -> dict[str, Any]:
    """What happened on the server between two scrapes: batches, their sizes, mean queue
    (per request) and compute (per batch) time, padding."""
    sizes = before["batch_size"], after["batch_size"]
    return {
        "batches": sizes[1].count - sizes[0].count,
        "mean_batch_size": _mean_delta(before, after, "batch_size"),
        "batch_size_buckets": bucket_counts(histogram_delta(sizes[0].buckets, sizes[1].buckets)),
        "mean_queue_ms": _mean_delta(before, after, "queue_s") * 1000,
        "mean_compute_ms_per_batch": _mean_delta(before, after, "compute_s") * 1000,
        "mean_padding_ratio": _mean_delta(before, after, "padding_ratio"),
    }
