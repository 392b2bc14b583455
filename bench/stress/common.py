"""What the reliability scenarios share: a (pinned) server process, its resident memory and
metrics, health checks, percentiles, and the figures table and JSON they end with."""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.cputime import family_cpu_s
from bench.harness import Samples, loopback_server, metric_samples, metric_sum, status_kib
from bench.launcher import Pinning, Service, cpu_set
from bench.stats import percentile

MIB = 1 << 20
RESULTS = Path(__file__).resolve().parent.parent / "results"
# A failing scenario's figures still print; these say which checks it failed.
Figures = dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class ServerSpec:
    """Which server a scenario starts: repository, flags, environment, CPUs."""

    repository: Path
    flags: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    pinning: Pinning = field(default_factory=lambda: Pinning(None, None))
    # Tests start faster without the warm-up's batch-size measurement (machine-dependent).
    measure_caps: bool = True

    def command(self) -> list[str]:
        threads = self.pinning.server_threads
        return [
            *self.pinning.prefix(self.pinning.server_cpus),
            *loopback_server(self.repository),
            *(["--intra-op-threads", str(threads)] if threads else []),
            *([] if self.measure_caps else ["--batch-cap-budget-s", "0"]),
            *self.flags,
        ]

    def start(self, name: str = "server", timeout_s: float = 120) -> Service:
        service = Service(name, self.command(), env=dict(self.env))
        try:
            service.wait_ready(timeout_s)
        except BaseException:
            service.stop()
            raise
        return service


def pin_self(pinning: Pinning) -> None:
    """Run this process (the load generator) on the client CPUs, as bench/ does."""
    if pinning.client_cpus:
        os.sched_setaffinity(0, cpu_set(pinning.client_cpus))


def _status_kib(pid: int) -> dict[str, int]:
    return status_kib(pid, "RssAnon", "RssFile", "RssShmem")


def rss_mib(pid: int) -> float:
    """Resident memory of a server, from /proc (MiB): the process and every live descendant
    (supervisor, front ends, worker), each one's own pages, and the shared memory they all
    map counted once (the largest process's share of it)."""
    own = shared = 0
    found = False
    for member in family_cpu_s(pid):
        try:
            kib = _status_kib(member)
        except FileNotFoundError:
            continue  # exited meanwhile
        found = found or member == pid
        own += kib.get("RssAnon", 0) + kib.get("RssFile", 0)
        shared = max(shared, kib.get("RssShmem", 0))
    if not found:
        raise RuntimeError(f"no process {pid}")
    return (own + shared) / 1024


def rss_by_process(pid: int, roles: Mapping[str, int]) -> dict[str, float]:
    """Each live member's own resident memory (MiB, anonymous + file; shared memory apart),
    named by its role where roles (role -> pid, from the server's log) knows it: which process
    a figure's growth is in."""
    names = {member: role for role, member in roles.items()}
    found = {}
    for member in family_cpu_s(pid):
        try:
            kib = _status_kib(member)
        except FileNotFoundError:
            continue
        name = "supervisor" if member == pid else names.get(member, f"pid {member}")
        found[name] = round((kib.get("RssAnon", 0) + kib.get("RssFile", 0)) / 1024, 1)
    return found


class RssSampler:
    """Samples a process's RSS on a thread every period_s; peak and the last sample."""

    def __init__(self, pid: int, period_s: float = 0.1) -> None:
        self.pid, self.period_s = pid, period_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.monotonic(), rss_mib(self.pid)))
            except (OSError, RuntimeError):
                return  # the process is gone
            self._stop.wait(self.period_s)

    @property
    def peak_mib(self) -> float:
        return max((mib for _, mib in self.samples), default=math.nan)

    @property
    def growth_mib(self) -> float:
        """The peak over the first sample (taken as the sampler is entered)."""
        return self.peak_mib - self.samples[0][1] if self.samples else math.nan

    def __enter__(self) -> RssSampler:
        self.samples.append((time.monotonic(), rss_mib(self.pid)))  # before what it watches
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def metrics(url: str) -> Samples:
    return metric_samples(url, timeout_s=10)


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of name whose labels include the given ones."""
    return metric_sum(metrics(url), name, **labels)


async def health_status(stub: health_pb2_grpc.HealthStub, timeout_s: float = 5) -> str:
    """SERVING / NOT_SERVING, or the status code name when the check itself fails."""
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
    except grpc.aio.AioRpcError as err:
        return err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def ms(values_s: Sequence[float], p: float) -> float:
    """The p-th percentile of durations in seconds, in milliseconds (nan when none)."""
    return percentile(sorted(values_s), p) * 1000


def slope_per(xs: Sequence[float], ys: Sequence[float], per: float) -> float:
    """Least-squares slope of ys over xs, times per (nan with fewer than two points)."""
    if len(xs) < 2:
        return math.nan
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        return math.nan
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread * per


def run_async(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def format_figures(title: str, figures: Figures) -> str:
    """Two columns, one figure a line; nested dicts flattened as a.b."""
    rows: list[tuple[str, str]] = []

    def add(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and not all(isinstance(v, int | float) for v in value.values()):
            for key, inner in value.items():
                add(f"{prefix}.{key}" if prefix else str(key), inner)
        elif isinstance(value, float):
            rows.append((prefix, f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"))
        else:
            rows.append((prefix, str(value)))

    add("", figures)
    width = max((len(name) for name, _ in rows), default=0)
    return "\n".join([title, *(f"  {name:<{width}}  {value}" for name, value in rows)])


def write_json(name: str, figures: Figures, out_dir: Path = RESULTS) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(figures, indent=2, default=str) + "\n")
    return path
