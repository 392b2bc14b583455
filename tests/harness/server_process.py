"""Start the real server (python -m service) on 127.0.0.1 with free ports, for tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.harness import Samples, free_port, loopback_server, metric_samples, metric_sum
from service.client import AttentionClient

LISTENING = re.compile(r"listening grpc_port=(\d+) metrics_port=(\d+)(?: http_port=(\d+))?")
REPO_ROOT = Path(__file__).resolve().parents[2]


STARTED = re.compile(r"started (worker|frontend-\d+(?:-gateway)?) \(pid (\d+)\)")


def child_pids(server: ServerProcess) -> dict[str, int]:
    """The latest pid of each child process (worker, frontend-N), from the supervisor's log."""
    return {match[1]: int(match[2]) for match in STARTED.finditer(server.log)}


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


def _status_kib(pid: int, *fields: str) -> dict[str, int]:
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in fields:
            values[name] = int(rest.split()[0])
    return values


def rss_bytes(pid: int) -> int:
    """One process's resident memory (VmRSS)."""
    return _status_kib(pid, "VmRSS")["VmRSS"] * 1024


def peak_rss_bytes(pid: int) -> int:
    """VmHWM: the most RSS since start or since reset_peak_rss."""
    return _status_kib(pid, "VmHWM")["VmHWM"] * 1024


def reset_peak_rss(pid: int) -> None:
    """Start VmHWM again from the current RSS (Linux: writing 5 to clear_refs)."""
    with open(f"/proc/{pid}/clear_refs", "w") as refs:
        refs.write("5")


def server_rss_bytes(server: ServerProcess) -> int:
    """The whole server's resident memory: every process's own pages, and the shared memory
    its front ends and worker both map counted once (the largest process's share of it)."""
    pids = [server.process.pid, *child_pids(server).values()]
    own = shared = 0
    for pid in pids:
        try:
            kib = _status_kib(pid, "RssAnon", "RssFile", "RssShmem")
        except FileNotFoundError:
            continue  # a child that has exited (and been replaced)
        own += kib.get("RssAnon", 0) + kib.get("RssFile", 0)
        shared = max(shared, kib.get("RssShmem", 0))
    return (own + shared) * 1024


class ServerProcess:
    """A server subprocess; its log is collected by a thread so the pipe never fills."""

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
        self.process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            # No NOT_SERVING pause on SIGTERM unless a test asks for one (no endpoints here).
            # No measured batch caps either: they depend on the machine's speed, and tests
            # that count batches must see --max-batch-size as the only bound.
            env={
                "ATTENTION_SHUTDOWN_NOT_SERVING_S": "0",
                "ATTENTION_BATCH_CAP_BUDGET_S": "0",
                **os.environ,
                **(env or {}),
            },
        )
        self.lines: list[str] = []
        self._bound = threading.Event()
        self.grpc_port = self.metrics_port = self.http_port = 0
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            match = LISTENING.search(line)
            if match:
                self.grpc_port, self.metrics_port = int(match[1]), int(match[2])
                self.http_port = int(match[3] or 0)
                self._bound.set()
        self._bound.set()  # exited: unblock waiters

    @property
    def log(self) -> str:
        return "".join(self.lines)

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def wait_bound(self, timeout_s: float = 60) -> None:
        if not self._bound.wait(timeout_s) or not self.grpc_port:
            raise RuntimeError(f"server did not bind:\n{self.log}")

    def wait_serving(self, timeout_s: float = 60) -> None:
        self.wait_bound(timeout_s)
        with AttentionClient(self.target) as client:
            client.wait_until_serving(timeout_s)

    def metrics(self) -> Samples:
        """Current samples: (name, sorted labels) -> value."""
        return metric_samples(f"http://127.0.0.1:{self.metrics_port}/metrics")

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of name whose labels include the given ones."""
        return metric_sum(self.metrics(), name, **labels)

    def wait_metric(
        self, name: str, at_least: float, timeout_s: float = 30, **labels: str
    ) -> float:
        """Poll /metrics until the metric reaches a value."""
        give_up = time.monotonic() + timeout_s
        while (value := self.metric(name, **labels)) < at_least:
            if time.monotonic() > give_up:
                raise TimeoutError(f"{name}{labels} stayed at {value} < {at_least}")
            time.sleep(0.01)
        return value

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

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
