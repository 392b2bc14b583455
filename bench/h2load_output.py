"""h2load's output read back: the summary it prints at the end of a run, and its per-request
--log-file (start, HTTP status, microseconds until the end of the response), from which
percentiles come (h2load prints none)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.stats import latency_summary_ms

PREFIX_BYTES = 5  # the gRPC message prefix: compressed flag, 4-byte length


@dataclass(frozen=True)
class Summary:
    """What h2load prints at the end of a run."""

    total: int
    started: int
    done: int
    succeeded: int
    failed: int
    errored: int
    timeout: int
    status: dict[str, int]  # "2xx" .. "5xx"
    data_bytes: int  # DATA frame payload received (answers with their gRPC prefixes)
    finished_s: float
    requests_per_s: float
    request_ms: dict[str, float]  # "time for request": min, max, mean, sd

    def problems(self, requests: int = 0) -> list[str]:
        """What h2load itself saw go wrong (empty: nothing); requests: how many a run with
        -n was to make (0 for a run with -D)."""
        found = []
        if self.failed or self.errored or self.timeout:
            found.append(
                f"h2load: {self.failed} failed, {self.errored} errored, {self.timeout} timed out"
            )
        if requests and self.done != requests:
            found.append(f"h2load: {self.done} of {requests} requests done")
        other = sum(n for kind, n in self.status.items() if kind != "2xx")
        # With -D, a request whose headers came during the warm-up has no status counted.
        short_of_2xx = bool(requests) and self.status.get("2xx", 0) < self.done
        if other or short_of_2xx:
            found.append(
                f"h2load: {self.status.get('2xx', 0)} of {self.done} answers 2xx, {other} other"
            )
        return found


_REQUESTS = re.compile(
    r"^requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
    r"(\d+) errored, (\d+) timeout",
    re.M,
)
_STATUS = re.compile(r"^status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", re.M)
_DATA = re.compile(r"^traffic: .*\((\d+)\) data\s*$", re.M)
_FINISHED = re.compile(r"^finished in ([\d.]+)(us|ms|s), ([\d.]+) req/s", re.M)
_REQUEST_TIME = re.compile(r"^time for request:\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", re.M)
_SECONDS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_DURATION = re.compile(r"^([\d.]+)(us|ms|s)$")


def seconds(text: str) -> float:
    """h2load's "656us", "4.26ms", "3.00s" in seconds."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"not an h2load duration: {text!r}")
    return float(match[1]) * _SECONDS[match[2]]


def parse_output(text: str) -> Summary:
    """The summary h2load prints; ValueError naming the line it could not find."""

    def need(pattern: re.Pattern[str], what: str) -> re.Match[str]:
        match = pattern.search(text)
        if match is None:
            raise ValueError(f"h2load printed no {what} line:\n{text[-800:]}")
        return match

    keys = ("total", "started", "done", "succeeded", "failed", "errored", "timeout")
    counts = dict(zip(keys, map(int, need(_REQUESTS, "requests").groups()), strict=True))
    kinds = ("2xx", "3xx", "4xx", "5xx")
    status = dict(zip(kinds, map(int, need(_STATUS, "status codes").groups()), strict=True))
    finished = need(_FINISHED, "finished")
    times = need(_REQUEST_TIME, "time for request").groups()
    return Summary(
        **counts,
        status=status,
        data_bytes=int(need(_DATA, "traffic").group(1)),
        finished_s=float(finished[1]) * _SECONDS[finished[2]],
        requests_per_s=float(finished[3]),
        request_ms={
            key: seconds(value) * 1000
            for key, value in zip(("min", "max", "mean", "sd"), times, strict=True)
        },
    )


@dataclass(frozen=True)
class Logged:
    """One line of h2load's --log-file: start (us since the epoch), HTTP status (-1 for a
    failed stream), microseconds until the end of the response."""

    start_us: int
    status: int
    duration_us: int


def parse_log(text: str) -> list[Logged]:
    found = []
    for line in text.splitlines():
        if line.strip():
            start, status, duration = line.split("\t")[:3]
            found.append(Logged(int(start), int(status), int(duration)))
    return found


def log_figures(entries: Sequence[Logged]) -> dict[str, Any]:
    """Throughput over the span the answered requests cover, and their latencies (ms)."""
    ok = [e for e in entries if 200 <= e.status < 300]
    if not ok:
        return {"window_s": 0.0, "requests": 0, "requests_per_s": 0.0, **latency_summary_ms([])}
    first = min(e.start_us for e in ok)
    last = max(e.start_us + e.duration_us for e in ok)
    span_s = max(last - first, 1) / 1e6
    return {
        "window_s": span_s,
        "requests": len(ok),
        "requests_per_s": len(ok) / span_s,
        **latency_summary_ms([e.duration_us / 1e6 for e in ok]),
    }


def answers_short(summary: Summary, answer_bytes: int) -> int:
    """How many of the done requests got no answer message, judged by the DATA bytes
    received against answers of the checked size (a gRPC error sends none)."""
    each = answer_bytes + PREFIX_BYTES
    missing = summary.done * each - summary.data_bytes
    return max(0, round(missing / each))
