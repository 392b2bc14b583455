"""PNG plots of a results file: python -m bench.plots bench/results/latest.json --out docs."""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and in CI
import matplotlib.pyplot as plt

from bench.report import HEAD_TO_HEAD, ONE_CALLER, by_h2load

Row = dict[str, Any]


def load_rows(document: dict[str, Any]) -> list[Row]:
    """Rows measured with the load generator that completed requests, but the side-by-side
    rounds (repeats of the peers' points), the floors' one-caller points and h2load's rows
    (another client, in its own group and in the unpinned one)."""
    return [
        r
        for r in document["rows"]
        if "p99_ms" in r
        and r.get("requests")
        and r["group"] != HEAD_TO_HEAD
        and not by_h2load(r)
        and not r["name"].endswith(ONE_CALLER)
    ]


def series(rows: list[Row]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """seq -> configuration label -> [(seq/s, p99 ms)] sorted by throughput."""
    found: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        # The headline's server runs are batching on at c=64: one line with c=1 and c=16.
        name = "batching on" if row["name"] == "server" else row["name"]
        label = f"{row['target']}: {name} ({row['api']})"
        if row["group"] == "open":
            label = f"{row['target']}: open loop ({row['api']})"
        found[row["seq"]][label].append((row["sequences_per_s"], row["p99_ms"]))
    return {seq: {k: sorted(v) for k, v in by.items()} for seq, by in found.items()}


def _seq_order(item: tuple[str, object]) -> tuple[bool, int]:
    """Fixed lengths first, shortest first; distributions after."""
    seq = item[0]
    return (not seq.isdigit(), int(seq) if seq.isdigit() else 0)


def throughput_vs_p99(document: dict[str, Any], path: Path) -> Path | None:
    by_seq = series(load_rows(document))
    if not by_seq:
        return None  # a run of groups without the load generator's rows (h2load alone)
    fig, axes = plt.subplots(1, len(by_seq), figsize=(6.5 * len(by_seq), 5), squeeze=False)
    for ax, (seq, configs) in zip(axes[0], sorted(by_seq.items(), key=_seq_order), strict=True):
        for label, points in sorted(configs.items()):
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", label=label)
        ax.set(title=f"seq {seq}", xlabel="sequences/s", ylabel="p99 latency (ms)", yscale="log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(_caption(document))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def batch_sizes(document: dict[str, Any], path: Path) -> Path | None:
    """Share of batches per batch-size bucket, for each server run with /metrics."""
    runs = [
        r
        for r in load_rows(document)
        if (r.get("server_metrics") or {}).get("batches") and r["load"] == "c=64"
    ]
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.8 / len(runs)
    for index, row in enumerate(runs):
        buckets = row["server_metrics"]["batch_size_buckets"]
        total = sum(buckets.values()) or 1.0
        labels = [f"<={float(le):g}" if le != "+Inf" else ">max" for le in buckets]
        xs = [i + index * width for i in range(len(labels))]
        ax.bar(
            xs,
            [n / total for n in buckets.values()],
            width=width,
            label=f"{row['name']} ({row['api']}, seq {row['seq']})",
        )
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels)
    ax.set(xlabel="batch size (sequences)", ylabel="share of batches")
    ax.legend(fontsize=7)
    fig.suptitle(_caption(document))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _caption(document: dict[str, Any]) -> str:
    machine = document.get("machine", {})
    return (
        f"{machine.get('cpus', '?')} CPUs, {machine.get('date', '')}, {document.get('pinning', '')}"
    )


def render(document: dict[str, Any], out: Path) -> list[Path]:
    """The plots the document has rows for."""
    out.mkdir(parents=True, exist_ok=True)
    drawn = [
        throughput_vs_p99(document, out / "bench-throughput-p99.png"),
        batch_sizes(document, out / "bench-batch-sizes.png"),
    ]
    return [path for path in drawn if path is not None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.plots", description=__doc__)
    parser.add_argument("results", type=Path, help="JSON written by python -m bench")
    parser.add_argument("--out", type=Path, default=Path("docs"), help="folder for the PNGs")
    args = parser.parse_args(argv)
    for path in render(json.loads(args.results.read_text()), args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
