"""What the tests and the benchmarks both need to drive a real server: a free port on
loopback (or one that never answers), the server's command line, polling for a condition
instead of sleeping for it, and its /metrics read as samples."""

from __future__ import annotations

import socket
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from prometheus_client.parser import text_string_to_metric_families

POLL_S = 0.02
T = TypeVar("T")

# (sample name, its labels sorted) -> value
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port() -> int:
    """A TCP port on 127.0.0.1 the kernel just handed out (and took back): free, and not
    reused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def silent_listener(backlog: int = 64) -> Iterator[int]:
    """A port on 127.0.0.1 that takes connections (into the kernel's backlog) and never
    answers: a peer that hangs."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(backlog)
        yield int(listener.getsockname()[1])


def loopback_server(repository: Path | str) -> list[str]:
    """The command of a server (python -m service) serving repository on 127.0.0.1, every
    port the kernel's choice; the caller appends its own flags."""
    return [
        sys.executable,
        "-m",
        "service",
        "--host",
        "127.0.0.1",
        "--grpc-port",
        "0",
        "--metrics-port",
        "0",
        "--http-port",
        "0",
        "--model-repository",
        str(repository),
    ]


def wait_for(
    condition: Callable[[], object],
    *,
    what: str | Callable[[], str] = "the condition",
    timeout_s: float = 60.0,
    poll_s: float = POLL_S,
) -> float:
    """Poll until condition() is true; the seconds it took. TimeoutError names what (a callable:
    what it says when the time is up, such as the state reached)."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            said = what() if callable(what) else what
            raise TimeoutError(f"{said}: not reached within {timeout_s:g}s")
        time.sleep(poll_s)
    return time.monotonic() - started


def poll_until(
    read: Callable[[], T],
    accept: Callable[[T], object],
    *,
    what: str | Callable[[T], str],
    timeout_s: float = 60.0,
    poll_s: float = POLL_S,
) -> T:
    """read() until accept() takes what it returns; that value. TimeoutError names what, with
    the last value read (a callable what: its words for that value)."""
    last: list[T] = []

    def accepted() -> bool:
        last[:] = [read()]
        return bool(accept(last[0]))

    def said() -> str:
        return what(last[0]) if callable(what) else f"{what} (last read: {last[0]!r})"

    wait_for(accepted, what=said, timeout_s=timeout_s, poll_s=poll_s)
    return last[0]


def metrics_text(url: str, timeout_s: float = 30.0) -> str:
    """The exposition /metrics at url serves now. The timeout is generous: a scrape waits for
    a core while the worker computes large batches."""
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return reply.read().decode()


def parse_samples(text: str) -> Samples:
    """Every sample of a Prometheus text exposition."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric_samples(url: str, timeout_s: float = 30.0) -> Samples:
    """Every sample /metrics at url exposes now."""
    return parse_samples(metrics_text(url, timeout_s))


def status_kib(pid: int, *fields: str) -> dict[str, int]:
    """Fields of /proc/<pid>/status that are counted in KiB (VmRSS, RssAnon, VmHWM, ...)."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in fields:
            values[name] = int(rest.split()[0])
    return values


def metric_sum(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of name whose labels include the given ones."""
    return sum(
        value
        for (sample, sample_labels), value in samples.items()
        if sample == name and set(labels.items()) <= set(sample_labels)
    )
