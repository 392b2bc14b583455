"""Start the real server (python -m service) on 127.0.0.1 with free ports, for tests: the
bench's Service (bench/launcher.py) with the tests' defaults, waits and /metrics helpers."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.harness import (
    Samples,
    free_port,
    loopback_server,
    metric_samples,
    metric_sum,
    poll_until,
    status_kib,
)
from bench.launcher import REPO_ROOT as REPO_ROOT  # the tests' cwd for what they run
from bench.launcher import Service
from bench.stress.common import rss_mib
from service.client import AttentionClient


def child_pids(server: ServerProcess) -> dict[str, int]:
    """The latest pid of each child process (worker, frontend-N), from the supervisor's log."""
    return server.children


def behind_gateway(server: ServerProcess) -> bool:
    """Whether the native gRPC gateway serves this server's gRPC port (its start is logged)."""
    return any(name.endswith("-gateway") for name in child_pids(server))


def gateway_mode(server: ServerProcess) -> str:
    """The --grpc-gateway mode server runs in, as the grpc_gateway fixture names it."""
    return "on" if behind_gateway(server) else "off"


@contextmanager
def in_mode(server: ServerProcess, mode: str) -> Iterator[ServerProcess]:
    """server where it runs in that gateway mode already, else one started as it was (the same
    repository, flags and environment) in that mode: for the one gRPC test of a module whose
    other tests need a server in one mode only."""
    if gateway_mode(server) == mode:
        yield server
        return
    env = {**server.env, "ATTENTION_GRPC_GATEWAY": mode}
    with ServerProcess(server.repository, *server.flags, env=env, http=server.http) as other:
        yield other


def worker_pid(server: ServerProcess) -> int:
    return child_pids(server)["worker"]


def rss_bytes(pid: int) -> int:
    """One process's resident memory (VmRSS)."""
    return status_kib(pid, "VmRSS")["VmRSS"] * 1024


def peak_rss_bytes(pid: int) -> int:
    """VmHWM: the most RSS since start or since reset_peak_rss."""
    return status_kib(pid, "VmHWM")["VmHWM"] * 1024


def reset_peak_rss(pid: int) -> None:
    """Start VmHWM again from the current RSS (Linux: writing 5 to clear_refs)."""
    with open(f"/proc/{pid}/clear_refs", "w") as refs:
        refs.write("5")


def server_rss_bytes(server: ServerProcess) -> int:
    """The whole server's resident memory: every process's own pages, and the shared memory
    its front ends and worker both map counted once (the largest process's share of it)."""
    return round(rss_mib(server.pid) * (1 << 20))


def settled_bytes(read: Callable[[], int], quiet_s: float = 1.5, timeout_s: float = 10) -> int:
    """A memory figure once it has stopped moving (within 1 MiB for quiet_s): what an idle
    server holds after its idle trims (IDLE_TRIM_AFTER_S) have run. The lowest reading if it
    never settles by timeout_s."""
    lowest = first = read()
    since = time.monotonic()
    give_up = since + timeout_s
    while (now := time.monotonic()) < give_up:
        value = read()
        lowest = min(lowest, value)
        if abs(value - first) > 1 << 20:
            first, since = value, now
        elif now - since >= quiet_s:
            return value
        time.sleep(0.1)
    return lowest


class ServerProcess(Service):
    """Our server as a test starts it (the bench's Service, in the test's own session and
    process group); entered, it is serving."""

    def __init__(
        self,
        model_repository: Path,
        *flags: str,
        env: dict[str, str] | None = None,
        http: bool = False,
    ):
        self.repository, self.flags, self.env, self.http = model_repository, flags, env or {}, http
        # --http-port 0 means no HTTP/REST endpoint, so a test that wants one is given a port
        # the kernel just handed out (and took back): free, and not reused at once.
        http_port = free_port() if http else 0
        command = [*loopback_server(model_repository), "--http-port", str(http_port), *flags]
        # No NOT_SERVING pause on SIGTERM unless a test asks for one (no endpoints here). No
        # measured batch caps either: they depend on the machine's speed, and tests that count
        # batches must see --max-batch-size as the only bound.
        defaults = {"ATTENTION_SHUTDOWN_NOT_SERVING_S": "0", "ATTENTION_BATCH_CAP_BUDGET_S": "0"}
        environment = {**defaults, **os.environ, **self.env}
        super().__init__("server", command, env=environment, new_session=False)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    @property
    def http_url(self) -> str:
        return self.http_target

    def wait_bound(self, timeout_s: float = 60) -> None:
        if not self._bound.wait(timeout_s) or not self.grpc_port:
            raise RuntimeError(f"server did not bind:\n{self.log}")

    def wait_serving(self, timeout_s: float = 60) -> None:
        self.wait_bound(timeout_s)
        with AttentionClient(self.target) as client:
            client.wait_until_serving(timeout_s)

    def metrics(self) -> Samples:
        """Current samples: (name, sorted labels) -> value."""
        return metric_samples(self.metrics_url)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of name whose labels include the given ones."""
        return metric_sum(self.metrics(), name, **labels)

    def wait_metric(
        self, name: str, at_least: float, timeout_s: float = 30, **labels: str
    ) -> float:
        """Poll /metrics until the metric reaches a value."""
        return poll_until(
            lambda: self.metric(name, **labels),
            lambda value: value >= at_least,
            what=f"{name}{labels} at {at_least}",
            timeout_s=timeout_s,
            poll_s=0.01,
        )

    def terminate(self, timeout_s: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout_s)

    def __enter__(self) -> ServerProcess:
        try:
            self.wait_serving()
        except BaseException:
            self.kill()
            raise
        return self

    def kill(self) -> None:
        self.stop(30)
