"""V2 ModelInfer sent by h2load (nghttp2's C HTTP/2 load generator, Debian's nghttp2-client):
a client that costs next to nothing, the way serving systems are commonly measured.

A gRPC call is an HTTP/2 POST of one length-prefixed message (a compressed flag of 0, a
4-byte big-endian length, the serialized request) with `content-type: application/grpc` and
`te: trailers`; h2load posts the same bytes on every stream. It counts HTTP statuses only,
and a gRPC error is HTTP 200 with a non-zero grpc-status in its trailers, so every run is
checked three ways: a real gRPC call with the same bytes must answer OK before and after it;
h2load must report every request done, none failed, errored or timed out, all 2xx; and the
DATA bytes it received must be what that many answers of the checked size carry (an error
carries none). A run that fails a check is a FAILED row that says which."""

from __future__ import annotations

import math
import resource
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench import cputime, scrape
from bench.h2load_output import (
    PREFIX_BYTES,
    Summary,
    answers_short,
    log_figures,
    parse_log,
    parse_output,
)
from bench.payloads import METHODS, build_payloads
from bench.stats import Lengths

INSTALL_HINT = "apt-get install nghttp2-client (Debian, Ubuntu; `make bench` does it as root)"
HEADERS = ("content-type: application/grpc", "te: trailers")
MIN_WARMUP_MS = 200  # the warm-up also measures the rate that sizes the measured run


class H2loadError(RuntimeError):
    """A run that cannot be measured or whose answers were not all OK; says why, with
    h2load's own figures where it ran (raw)."""

    def __init__(self, reason: str, raw: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.raw = raw or {}


def find() -> str | None:
    """The h2load executable on PATH, or None."""
    return shutil.which("h2load")


def frame(message: bytes) -> bytes:
    """One gRPC message as it goes in a request body: uncompressed, length-prefixed."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


def unframe(body: bytes) -> bytes:
    """The message of a body holding exactly one uncompressed gRPC message."""
    if len(body) < PREFIX_BYTES or body[0] != 0:
        raise ValueError("not an uncompressed gRPC message")
    size = int.from_bytes(body[1:PREFIX_BYTES], "big")
    if len(body) != PREFIX_BYTES + size:
        raise ValueError(f"prefix says {size} bytes, the body holds {len(body) - PREFIX_BYTES}")
    return body[PREFIX_BYTES:]


def request_message(seq: int, embed_dim: int, model: str) -> bytes:
    """The serialized V2 ModelInfer (output only) the load generator sends at this length:
    the same bytes, from the same builder and seed."""
    payloads = build_payloads(
        "v2", Lengths(seq, seq), embed_dim=embed_dim, sequences=1, weights_fraction=0.0, model=model
    )
    return payloads[seq, False].body


@dataclass(frozen=True)
class Shape:
    """h2load's -c (connections) and -m (concurrent streams on each)."""

    connections: int
    streams: int

    @property
    def label(self) -> str:
        return f"c={self.connections} m={self.streams}"

    @property
    def in_flight(self) -> int:
        return self.connections * self.streams


ONE_CALLER = Shape(1, 1)


def shapes(streams: int) -> tuple[Shape, Shape]:
    """One caller, and that many concurrent streams on one connection (as the load
    generator's headline runs: one channel, that many callers)."""
    return ONE_CALLER, Shape(1, streams)


def command(
    h2load: str,
    target: str,
    body_file: Path,
    shape: Shape,
    *,
    requests: int = 0,
    duration_ms: int = 0,
    log_file: Path | None = None,
    metadata: tuple[tuple[str, str], ...] = (),
) -> list[str]:
    """h2load posting body_file to ModelInfer: -n requests, or for -D duration_ms; metadata:
    more headers on every call (a key, a traceparent)."""
    bound = ["-n", str(requests)] if requests else ["-D", f"{duration_ms}ms"]
    every = (*HEADERS, *(f"{name}: {value}" for name, value in metadata))
    headers = [token for header in every for token in ("-H", header)]
    log = [f"--log-file={log_file}"] if log_file else []
    return [
        h2load,
        *bound,
        "-c",
        str(shape.connections),
        "-m",
        str(shape.streams),
        "-d",
        str(body_file),
        *headers,
        *log,
        f"http://{target}{METHODS['v2']}",
    ]


def grpc_check(
    target: str, message: bytes, timeout_s: float = 60.0, metadata: tuple[tuple[str, str], ...] = ()
) -> int:
    """Send message as a real gRPC ModelInfer (with metadata); the answer's size (bytes of
    the message), or H2loadError with the status when it is not OK."""
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(target, options=options) as channel:
        call = channel.unary_unary(METHODS["v2"])  # bytes in, bytes out
        try:
            answer = call(message, timeout=timeout_s, metadata=metadata or None)
        except grpc.RpcError as err:
            code, details = err.code(), err.details()  # type: ignore[attr-defined]
            raise H2loadError(
                f"a gRPC call with the same request answered {code.name}: {details}"
            ) from err
    return len(answer)


def run(argv: list[str], timeout_s: float) -> tuple[str, float]:
    """Run h2load; (its output, the CPU seconds it used)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        raise H2loadError(
            f"h2load ran past {timeout_s:.0f} s (a server that stopped answering?)"
        ) from err
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise H2loadError(f"h2load exited {done.returncode}: {done.stderr.strip()[-400:]}")
    used = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return done.stdout, used


@dataclass(frozen=True)
class Target:
    """A server to measure: its gRPC address, and what to read its CPU and metrics from."""

    address: str
    pid: int = 0  # its CPU (and its live descendants') is measured; 0: none
    roles: dict[str, int] | None = None  # named processes (worker, frontend-0, ..)
    metrics_url: str = ""


@dataclass(frozen=True)
class Plan:
    """How one row is run."""

    shape: Shape
    duration_s: float
    warmup_s: float
    client_prefix: tuple[str, ...] = ()  # taskset -c CPUS
    min_requests: int = 20
    metadata: tuple[tuple[str, str], ...] = ()  # headers every call carries


def measure(h2load: str, server: Target, message: bytes, plan: Plan, scratch: Path) -> dict:
    """One h2load run: a warm-up that gives the rate, then -n (rate x duration) requests,
    checked; H2loadError saying why when a check fails."""
    scratch.mkdir(parents=True, exist_ok=True)
    body_file = scratch / f"h2load-{len(message)}.bin"
    body_file.write_bytes(frame(message))
    answer_bytes = grpc_check(server.address, message, metadata=plan.metadata)
    warm = _warm_up(h2load, server, body_file, plan)
    requests = max(
        plan.min_requests,
        2 * plan.shape.in_flight,
        math.ceil(warm.requests_per_s * plan.duration_s),
    )
    log_file = scratch / "h2load-log.tsv"
    log_file.unlink(missing_ok=True)  # h2load appends to it
    argv = [
        *plan.client_prefix,
        *command(
            h2load,
            server.address,
            body_file,
            plan.shape,
            requests=requests,
            log_file=log_file,
            metadata=plan.metadata,
        ),
    ]
    result = _measured(argv, server, plan, requests, log_file, answer_bytes)
    try:
        grpc_check(server.address, message, metadata=plan.metadata)
    except H2loadError as err:
        raise H2loadError(f"after the run, {err}", result["h2load"]) from err
    return result


def _warm_up(h2load: str, server: Target, body_file: Path, plan: Plan) -> Summary:
    duration_ms = max(MIN_WARMUP_MS, round(plan.warmup_s * 1000))
    argv = [
        *plan.client_prefix,
        *command(
            h2load,
            server.address,
            body_file,
            plan.shape,
            duration_ms=duration_ms,
            metadata=plan.metadata,
        ),
    ]
    output, _ = run(argv, timeout_s=duration_ms / 1000 * 4 + 60)
    summary = _parsed(output)
    problems = summary.problems()
    if problems or not summary.done:
        raise H2loadError(f"warm-up: {'; '.join(problems) or 'no request done'}")
    return summary


def _parsed(output: str) -> Summary:
    try:
        return parse_output(output)
    except ValueError as err:
        raise H2loadError(str(err)) from err


def _measured(
    argv: list[str],
    server: Target,
    plan: Plan,
    requests: int,
    log_file: Path,
    answer_bytes: int,
) -> dict[str, Any]:
    metrics = scrape.scrape(server.metrics_url) if server.metrics_url else None
    cpu_before = cputime.family_cpu_s(server.pid) if server.pid else None
    output, client_cpu_s = run(argv, timeout_s=plan.duration_s * 4 + 60)
    cpu_after = cputime.family_cpu_s(server.pid) if server.pid else None
    metrics_after = scrape.scrape(server.metrics_url) if metrics else None
    summary = _parsed(output)
    entries = parse_log(log_file.read_text())
    figures = log_figures(entries)
    raw = {
        "command": shlex.join(argv),
        "summary": vars(summary),
        "answer_bytes": answer_bytes,
        "logged": len(entries),
    }
    problems = summary.problems(requests)
    short = answers_short(summary, answer_bytes)
    if short:
        problems.append(
            f"{short} of {summary.done} answers carried no message: gRPC errors "
            "(HTTP 200 with a grpc-status other than 0)"
        )
    if len(entries) != summary.done or figures["requests"] != summary.done:
        problems.append(
            f"h2load logged {figures['requests']} answered of {len(entries)} "
            f"lines for {summary.done} done"
        )
    if problems:
        raise H2loadError("; ".join(problems), raw)
    done = figures["requests"]
    result: dict[str, Any] = {
        **figures,
        "sequences_per_s": figures["requests_per_s"],
        "errors": {},
        "rejected": 0,
        "client_cpu_utilization": client_cpu_s / figures["window_s"],
        "client_cpu_us_per_request": client_cpu_s / done * 1e6,
        "h2load": raw,
    }
    if cpu_before is not None and cpu_after is not None:
        result |= server_cpu(cpu_before, cpu_after, server, done, figures["window_s"])
    if metrics is not None and metrics_after is not None:
        result["server_metrics"] = scrape.summarize(metrics, metrics_after)
    return result


def server_cpu(
    before: dict[int, float],
    after: dict[int, float],
    server: Target,
    done: int,
    window_s: float,
) -> dict[str, Any]:
    """The server's CPU over the run, in all and by process, per request answered."""
    each = cputime.by_process(before, after, server.roles or {}, server.pid)
    used = sum(each.values())
    return {
        "server_cpu_s": used,
        "server_cpu_ms_per_request": used / done * 1000,
        "server_cpu_ms_per_sequence": used / done * 1000,
        "server_cpu_utilization": used / window_s,
        "server_cpu_by_process_s": each,
        "server_cpu_us_per_request_by_process": {role: s / done * 1e6 for role, s in each.items()},
    }
