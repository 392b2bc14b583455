"""The Go load generator in bench/openloop/ (built by `make openloop`), run from Python.

It posts one prebuilt gRPC request over cleartext HTTP/2: in an open loop (Poisson arrivals,
each call sent at its time whatever the answers) or a closed loop (callers that wait for their
answers), with an optional V2 ServerReady probe at a fixed period. A compiled client costs the
load generator's core little, so its lag behind schedule stays small where a Python open loop
fell behind (then the load generator, not the server, decided the outcome); the lag is
measured and reported either way."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.launcher import GO_BINARIES, UNPINNED, Pinning, built

BINARY = GO_BINARIES / "openloop"
OK = "OK"


def build() -> Path:
    """`make openloop` (a no-op when the binary is current); the binary's path."""
    return built("openloop")


@dataclass(frozen=True)
class Call:
    """One call: when it was due (s from the start), how late it started and how long its
    answer took (s), the answer's status name and message, and its bytes."""

    at_s: float
    lag_s: float
    latency_s: float
    code: str
    message: str
    bytes: int


@dataclass(frozen=True)
class Run:
    calls: list[Call]
    probes: list[Call]  # a probe's code is "NOT_READY" when it answered OK but not ready
    summary: dict[str, Any]

    def count(self, code: str) -> int:
        return sum(1 for call in self.calls if call.code == code)

    def answers(self) -> Counter[tuple[str, str]]:
        """Calls by (status, message)."""
        return Counter((call.code, call.message) for call in self.calls)


@dataclass(frozen=True, kw_only=True)
class Load:
    """What the generator sends: the gRPC request body (length-prefixed message) in body_file,
    to path, over connections, each call with a deadline."""

    target: str
    body_file: Path
    path: str = "/inference.GRPCInferenceService/ModelInfer"
    connections: int = 4
    deadline_s: float = 10.0
    pinning: Pinning = UNPINNED  # the generator runs on pinning.client_cpus


def _call(line: dict[str, Any]) -> Call:
    code = line["code"]
    if line["kind"] == "probe" and code == OK and not line.get("ready"):
        code = "NOT_READY"
    return Call(
        at_s=line["at_us"] / 1e6,
        lag_s=line["lag_us"] / 1e6,
        latency_s=line["latency_us"] / 1e6,
        code=code,
        message=line.get("message", ""),
        bytes=line["bytes"],
    )


def read(path: Path) -> Run:
    calls: list[Call] = []
    probes: list[Call] = []
    summary: dict[str, Any] = {}
    with path.open() as lines:
        for text in lines:
            line = json.loads(text)
            if line["kind"] == "summary":
                summary = line
            else:
                (probes if line["kind"] == "probe" else calls).append(_call(line))
    return Run(calls, probes, summary)


def run(
    load: Load,
    out: Path,
    *,
    duration_s: float,
    rate: float = 0.0,
    concurrency: int = 0,
    probe_every_s: float = 0.0,
    seed: int = 0,
) -> Run:
    """An open loop at rate calls/s, or (rate 0) a closed loop of concurrency callers, for
    duration_s; every call's record (written to out, read back)."""
    mode = ["-mode", "open", "-rate", str(rate)] if rate else ["-mode", "closed"]
    command = [
        *load.pinning.prefix(load.pinning.client_cpus),
        str(BINARY),
        "-target",
        load.target,
        "-path",
        load.path,
        "-body",
        str(load.body_file),
        *mode,
        "-concurrency",
        str(concurrency),
        "-duration",
        f"{duration_s}s",
        "-conns",
        str(load.connections),
        "-deadline",
        f"{load.deadline_s}s",
        "-seed",
        str(seed),
        "-probe-every",
        f"{probe_every_s}s",
        "-out",
        str(out),
    ]
    timeout_s = duration_s + 2 * load.deadline_s + 60
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"openloop exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return read(out)
