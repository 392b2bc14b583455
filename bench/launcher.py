"""Server processes for the benchmark (ours, the echo server, a peer): started on 127.0.0.1,
optionally pinned with taskset, polled until V2 ServerReady, stopped with SIGTERM."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from service.generated.inference import grpc_service_pb2 as v2
from service.generated.inference import grpc_service_pb2_grpc

LISTENING = re.compile(r"listening grpc_port=(\d+) metrics_port=(\d+)(?: http_port=(\d+))?")
# The supervisor's "started worker (pid N)" / "started frontend-K (pid N)" (a restart repeats it).
STARTED = re.compile(r"started (worker|frontend-\d+(?:-gateway)?) \(pid (\d+)\)")
REPO_ROOT = Path(__file__).resolve().parent.parent
GO_BINARIES = REPO_ROOT / ".venv" / "bin"  # where `make openloop` and `make h2floor` put theirs


def built(program: str) -> Path:
    """`make PROGRAM` for one of the bench's Go programs (a no-op when its binary is current,
    built with the Go toolchain `make setup` installed); the binary's path."""
    done = subprocess.run(
        ["make", "--no-print-directory", program],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"make {program} failed:\n{done.stdout}{done.stderr}")
    return GO_BINARIES / program


@dataclass(frozen=True)
class Pinning:
    """CPU lists for taskset -c (None = unpinned) and why, when pinning was not possible."""

    server_cpus: str | None
    client_cpus: str | None
    note: str = ""

    def prefix(self, cpus: str | None) -> list[str]:
        return ["taskset", "-c", cpus] if cpus else []

    def describe(self) -> str:
        if self.pinned:
            return f"servers on CPUs {self.server_cpus}, load generator on CPUs {self.client_cpus}"
        return self.note or "unpinned"

    @property
    def pinned(self) -> bool:
        return self.server_cpus is not None

    @property
    def server_threads(self) -> int:
        """Intra-op threads for the server side: one per pinned CPU, 0 (all) unpinned."""
        return cpu_count(self.server_cpus) if self.server_cpus else 0


def cpu_set(cpus: str) -> set[int]:
    """The CPUs of a taskset list such as "0,2-3"."""
    found: set[int] = set()
    for part in cpus.split(","):
        low, _, high = part.partition("-")
        found.update(range(int(low), int(high or low) + 1))
    return found


def cpu_count(cpus: str) -> int:
    """CPUs in a taskset list such as "1", "0,2" or "2-5"."""
    return len(cpu_set(cpus))


def choose_pinning(server_cpus: str, client_cpus: str) -> Pinning:
    """The requested split, or unpinned with the reason when taskset or CPUs are missing."""
    if shutil.which("taskset") is None:
        return Pinning(None, None, "taskset not found: ran unpinned")
    available = len(os.sched_getaffinity(0))
    if available < 2:
        return Pinning(None, None, f"only {available} CPU: ran unpinned")
    return Pinning(server_cpus, client_cpus)


UNPINNED = Pinning(None, None)


class Service:
    """A server subprocess. Its log is drained by a thread so the pipe never fills."""

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        *,
        grpc_port: int = 0,
        metrics_port: int = 0,
        env: dict[str, str] | None = None,
        cwd: Path = REPO_ROOT,
        new_session: bool = True,
    ) -> None:
        """new_session: its own session and process group (a benchmark's server, killed with
        its whole group if it will not stop); else the caller's (a test's server)."""
        self.name = name
        self._own_session = new_session
        self.grpc_port, self.metrics_port = grpc_port, metrics_port
        self.http_port = 0  # our server's HTTP/REST port, from its log (0: none)
        self.lines: list[str] = []
        self._bound = threading.Event()
        self.process = subprocess.Popen(
            list(command),
            cwd=cwd,
            env={**os.environ, **(env or {})},
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=new_session,
        )
        if grpc_port:
            self._bound.set()
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            match = LISTENING.search(line)
            if match and not self.grpc_port:
                self.grpc_port, self.metrics_port = int(match[1]), int(match[2])
                self.http_port = int(match[3] or 0)
                self._bound.set()
        self._bound.set()  # exited: unblock the waiter

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def children(self) -> dict[str, int]:
        """The latest pid of each of our server's child processes by role, from its log;
        empty for a server that logs no such lines (a peer)."""
        return {match[1]: int(match[2]) for line in self.lines for match in STARTED.finditer(line)}

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_target(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics" if self.metrics_port else ""

    def log_tail(self, lines: int = 40) -> str:
        return "".join(self.lines[-lines:])

    def wait_ready(self, timeout_s: float, model: str = "") -> None:
        """Until V2 ServerReady (and ModelReady of model) say yes; RuntimeError if it dies."""
        give_up = time.monotonic() + timeout_s
        self._bound.wait(timeout_s)
        if not self.grpc_port:
            raise RuntimeError(f"{self.name} did not bind:\n{self.log_tail()}")
        with grpc.insecure_channel(self.target) as channel:
            stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
            while not self._ready(stub, model):
                if self.process.poll() is not None or time.monotonic() > give_up:
                    raise RuntimeError(f"{self.name} not ready:\n{self.log_tail()}")
                time.sleep(0.1)

    @staticmethod
    def _ready(stub: grpc_service_pb2_grpc.GRPCInferenceServiceStub, model: str) -> bool:
        try:
            if not stub.ServerReady(v2.ServerReadyRequest(), timeout=2).ready:
                return False
            return not model or stub.ModelReady(v2.ModelReadyRequest(name=model), timeout=2).ready
        except grpc.RpcError:
            return False

    def stop(self, timeout_s: float = 30) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                if self._own_session:
                    os.killpg(self.process.pid, signal.SIGKILL)  # it and its workers
                else:
                    self.process.kill()  # its children end with it
                self.process.wait()

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
