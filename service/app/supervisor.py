"""The supervisor (python -m service): starts the worker and the front ends, serves one
/metrics for all of them, restarts a child that dies, and orders the drain on SIGTERM.

It does no per-request work and imports neither gRPC nor ONNX Runtime, so it stays small
and responsive to signals while its children are busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from threading import Thread
from typing import Any

from service import drain_clock
from service.app import run_dir
from service.app.children import initial_log_state, run_frontend, run_worker
from service.app.stderr_relay import FIFO_BYTES, StderrRelay
from service.memory.budget import default_queue_bytes, memory_limit_bytes
from service.observability import logs, metrics
from service.observability.gpu_metrics import GpuCollector
from service.observability.process_files import ProcessFiles
from service.observability.process_metrics import ProcessCollector
from service.restart_budget import RestartBudget
from service.settings import Settings

log = logging.getLogger("service")
EXIT_MARGIN_S = 5.0  # past the grace period, a child still running is killed


def _bare(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _reservation_addresses(host: str) -> list[tuple[socket.AddressFamily, str]]:
    """Where gRPC will bind host: IPv4 addresses on a dual-stack IPv6 socket when the machine
    has IPv6 (as v4-mapped addresses), else on an IPv4 one. A SO_REUSEPORT group needs the
    same family, so the reservation binds as gRPC will."""
    bare = _bare(host)
    if ":" in bare:
        return [(socket.AF_INET6, bare)]
    mapped = "::" if bare == "0.0.0.0" else f"::ffff:{bare}"
    return (
        [(socket.AF_INET6, mapped), (socket.AF_INET, bare)]
        if socket.has_ipv6
        else [(socket.AF_INET, bare)]
    )


def _check_free(family: socket.AddressFamily, address: str, port: int) -> None:
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # As every server binds: connections of a previous run closed within the last minute
        # (TIME_WAIT) do not make the port taken; a listener does.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        probe.bind((address, port))


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound (not listening) SO_REUSEPORT socket holding the gRPC port, so every front end
    (and a restarted one) binds the same number, also when port 0 asked for a free one."""
    error: OSError | None = None
    for family, address in _reservation_addresses(host):
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            if port:
                _check_free(family, address, port)  # SO_REUSEPORT alone would share a taken one
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind((address, port))
            return sock
        except OSError as err:
            sock.close()
            error = err
    assert error is not None
    raise error


@dataclass(eq=False)
class Child:
    role: str  # "worker" or "frontend-<index>"
    process: BaseProcess
    report: Connection
    started: bool = False  # reported ready (worker) or bound (front end)
    gateway_pid: int | None = None  # a front end's gateway, once it reported one
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    last_seen: float = field(default_factory=time.monotonic)  # its latest report or beat


class Supervisor:
    """run() returns the process's exit code: 0 after a clean drain, 1 when it cannot start,
    a child keeps dying, or a child died (or had to be killed) during the drain."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._context = multiprocessing.get_context("spawn")  # no inherited threads or locks
        self._run_dir = run_dir.create()
        self._metrics_dir = self._run_dir / "metrics"
        self._children: dict[str, Child] = {}
        self._stderr: dict[str, StderrRelay] = {}  # each child role's standard error
        self._restarts = RestartBudget(settings.max_restarts, settings.restart_window_s)
        self._stopping = False
        self._code = 0
        self._stop = asyncio.Event()
        self._bound = asyncio.Event()
        self._signalled_at: float | None = None
        self._port_socket: socket.socket | None = None
        self._metrics_http: tuple[Any, Thread] | None = None
        self._served = metrics.ServedSetCollector()
        self._restarted = metrics.process_restarts_counter()
        # Each at 0 from the start: a series that first appears at 1 shows Prometheus no
        # increase, and the restart alert would miss the first restart.
        for process in ("worker", "frontend", "gateway"):
            self._restarted.labels(process)
        self._watchdog: asyncio.Task[None] | None = None
        self._log_settings = logs.LogSettingsFile(self._run_dir)
        self._following: asyncio.Task[None] | None = None
        self.grpc_port = self.http_port = 0
        self._http_socket: socket.socket | None = None
        self.queue_bytes = settings.max_queue_bytes or default_queue_bytes(memory_limit_bytes())

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal)
        try:
            if self._start():
                await self._serve()
        finally:
            await self._shutdown()
        return self._code

    def _start(self) -> bool:
        settings = self._settings
        self._metrics_dir.mkdir()
        # Read by prometheus-client in every child at import: their metrics go to files here.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(self._metrics_dir)
        # Every process follows this file: a change through v2/logging reaches them all.
        self._log_settings.write(initial_log_state(settings))
        self._following = asyncio.get_running_loop().create_task(
            logs.follow(self._log_settings), name="log-settings"
        )
        try:
            self._port_socket = reserve_port(settings.host, settings.grpc_port)
        except OSError as err:
            return self._cannot_start(
                f"cannot bind gRPC to {settings.host}:{settings.grpc_port}: {err}"
            )
        self.grpc_port = self._port_socket.getsockname()[1]
        if settings.http_port:
            try:
                self._http_socket = reserve_port(settings.host, settings.http_port)
            except OSError as err:
                return self._cannot_start(
                    f"cannot bind HTTP/REST to {settings.host}:{settings.http_port}: {err}"
                )
            self.http_port = self._http_socket.getsockname()[1]
        try:
            self._metrics_http = _serve_metrics(
                settings,
                self._metrics_dir,
                [self._served, self._restarted, ProcessCollector(self._pids), GpuCollector()],
            )
        except OSError as err:
            return self._cannot_start(
                f"cannot bind metrics to {settings.host}:{settings.metrics_port}: {err}"
            )
        refused = _refused_at_start(settings)
        if refused:
            return self._cannot_start(refused)
        self._spawn("worker")
        for index in range(settings.frontends):
            self._spawn(f"frontend-{index}")
        if settings.watchdog_timeout_s > 0:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch(), name="watchdog")
        return True

    async def _watch(self) -> None:
        """Kill a child whose event loop has stopped turning (hung, or stopped): its exit
        then takes the usual path (calls in flight fail at once, a restart)."""
        timeout = self._settings.watchdog_timeout_s
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            now = time.monotonic()
            for child in list(self._children.values()):
                silent = now - child.last_seen
                if child.process.exitcode is None and silent > timeout and not self._stopping:
                    log.error(
                        "%s sent no heartbeat for %.1fs (hung or stopped); killing it",
                        child.role,
                        silent,
                    )
                    child.last_seen = now  # once: the kill's exit restarts it
                    child.process.kill()

    def _cannot_start(self, reason: str) -> bool:
        log.error("cannot start: %s", reason)
        self._code = 1
        return False

    async def _serve(self) -> None:
        bound = asyncio.ensure_future(self._bound.wait())
        stopped = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({bound, stopped}, return_when=asyncio.FIRST_COMPLETED)
        bound.cancel()
        if self._bound.is_set() and not self._stop.is_set():
            assert self._metrics_http is not None
            # Tests and tools parse "listening grpc_port=N metrics_port=N http_port=N".
            log.info(
                "listening grpc_port=%d metrics_port=%d http_port=%d host=%s (%d front ends)",
                self.grpc_port,
                self._metrics_http[0].server_port,
                self.http_port,
                self._settings.host,
                self._settings.frontends,
            )
        await stopped

    # -- children ----------------------------------------------------------------------------

    def _pids(self) -> dict[str, int]:
        """Every process of the server by role (called from the metrics thread)."""
        pids = {"supervisor": os.getpid()}
        for child in list(self._children.values()):
            if child.process.pid is not None and child.process.exitcode is None:
                pids[child.role] = child.process.pid
                if child.gateway_pid is not None:
                    pids[_gateway_role(child.role)] = child.gateway_pid
        return pids

    def _relay_stderr(self, role: str, fifo_bytes: int | None = FIFO_BYTES) -> None:
        if role in self._stderr:
            return  # made for the first of role's processes, kept for every restart
        try:
            relay = StderrRelay(self._run_dir, role, fifo_bytes)
        except OSError as err:  # no FIFO in this file system: its lines go out raw
            log.warning("%s's standard error is not relayed into the log: %s", role, err)
        else:
            relay.start()
            self._stderr[role] = relay

    def _spawn(self, role: str) -> None:
        settings = self._settings
        self._relay_stderr(role)
        if role != "worker" and settings.grpc_gateway != "off":
            # Its front end opens it for the gateway, which writes there only as it dies.
            self._relay_stderr(_gateway_role(role), fifo_bytes=None)
        receive, send = self._context.Pipe(duplex=False)
        if role == "worker":
            target: Any = run_worker
            args: tuple[Any, ...] = (settings, self._run_dir, send)
        else:
            index = int(role.removeprefix("frontend-"))
            target = run_frontend
            ports = (self.grpc_port, self.http_port)
            args = (settings, self._run_dir, index, ports, self.queue_bytes, send)
        process = self._context.Process(target=target, args=args, name=role, daemon=False)
        process.start()
        send.close()
        child = Child(role, process, receive)
        self._children[role] = child
        loop = asyncio.get_running_loop()
        loop.add_reader(receive.fileno(), self._on_report, child)
        loop.add_reader(process.sentinel, self._on_exit, child)
        log.info("started %s (pid %d)", role, process.pid)

    def _on_report(self, child: Child) -> None:
        try:
            message = child.report.recv()
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(child.report.fileno())
            return
        child.last_seen = time.monotonic()
        kind = message[0]
        if kind in ("ready", "bound"):
            child.started = True
            if all(c.started for role, c in self._children.items() if role != "worker"):
                self._bound.set()
        elif kind == "failed":
            child.started = False
        elif kind == "served" and child.role == "worker":
            self._served.set(message[1])
        elif kind == "gateway":
            child.gateway_pid = int(message[1])
            if message[2:] == ("restarted",):  # by its front end, which serves on meanwhile
                self._restarted.labels("gateway").inc()

    def _on_exit(self, child: Child) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(child.process.sentinel)
        with contextlib.suppress(OSError, ValueError):
            loop.remove_reader(child.report.fileno())
        child.process.join(1)  # the sentinel fires as it exits; reaping takes a moment
        code = child.process.exitcode
        # Its last words, and its gateway's (which dies with it), before the news of its exit.
        for role in dict.fromkeys((child.role, _gateway_role(child.role))):
            if role in self._stderr:
                self._stderr[role].end()
        child.exited.set()
        _mark_dead(child.process.pid)
        if child.role == "worker":
            self._served.set(())  # nothing is served until a worker reports again
        if self._stopping:
            log.info("%s exited (code %s)", child.role, code)
            return
        if not child.started:
            if code is not None and _killed_by_a_stop_signal(code):
                # Ctrl-C (or SIGTERM to the group) early in start-up: the child, with no
                # handler yet, died of it before this process handled its own copy.
                log.info(
                    "%s stopped by signal %d before it was serving; stopping", child.role, -code
                )
                self._stop.set()
                return
            if self._signalled_at is not None:
                # The signal reached it first, in its interpreter's own start (exit code 1,
                # "Fatal Python error: ... KeyboardInterrupt"): part of the stop under way.
                log.info("%s exited (code %s) before it was serving; stopping", child.role, code)
                return
            log.error("%s exited with code %s before it was serving; stopping", child.role, code)
            self._fail()
            return
        if not self._restarts.take():
            log.error(
                "%s exited with code %s; more than %d restarts within %.0fs: giving up",
                child.role,
                code,
                self._settings.max_restarts,
                self._settings.restart_window_s,
            )
            self._fail()
            return
        log.warning("%s exited with code %s; restarting it", child.role, code)
        self._restarted.labels("worker" if child.role == "worker" else "frontend").inc()
        self._spawn(child.role)

    def _serving(self) -> bool:
        return bool(self._children) and all(c.started for c in self._children.values())

    def _fail(self) -> None:
        self._code = 1
        self._stop.set()

    def _on_signal(self) -> None:
        if self._signalled_at is not None:
            log.warning("another shutdown signal: ignored, the drain ends within the grace period")
            return
        self._signalled_at = time.monotonic()
        failed = drain_clock.record(self._run_dir)  # before the children hear of it
        if failed is not None:
            log.warning(
                "cannot record the shutdown signal's time (%s): each process times the drain "
                "from when it hears of it",
                failed,
            )
        if not self._serving():
            log.info("shutdown signal received during start-up; stopping without serving")
        else:
            log.info(
                "shutdown signal received; draining for up to %.1fs", self._settings.grace_period_s
            )
        self._stop.set()

    # -- shutdown ----------------------------------------------------------------------------

    async def _shutdown(self) -> None:
        """SIGTERM to every child at once: front ends drain their calls, the worker serves
        them until they have gone. Past the grace period (and a margin), SIGKILL."""
        self._stopping = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._following is not None:
            self._following.cancel()
        started = self._signalled_at or time.monotonic()
        deadline = started + self._settings.grace_period_s + EXIT_MARGIN_S
        alive = [c for c in self._children.values() if c.process.exitcode is None]
        for child in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.process.pid or 0, signal.SIGTERM)
        for child in alive:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(child.exited.wait(), max(0.0, deadline - time.monotonic()))
            if child.process.exitcode is None:
                log.error("%s still running after the grace period; killing it", child.role)
                child.process.kill()
                child.process.join(5)
            if (
                self._signalled_at is not None
                and child.started
                and not _stopped_as_asked(child.process.exitcode)
            ):
                # A crash (or a kill at the period's end) is not a clean drain: say so to
                # whatever runs the server (systemd, a container runtime, a test). A child
                # not yet serving had nothing to lose: Ctrl-C in its interpreter's own start
                # ends it with code 1 ("Fatal Python error: ... KeyboardInterrupt").
                log.error(
                    "%s exited with code %s during the drain; the server exits 1",
                    child.role,
                    child.process.exitcode,
                )
                self._code = 1
        if self._metrics_http is not None:
            httpd, _ = self._metrics_http
            # shutdown() waits for the server's 0.5 s poll: on a thread, it need not delay us.
            Thread(target=_close_http, args=(httpd,), daemon=True, name="metrics-close").start()
        self._release()
        log.info("stopped")

    def _release(self) -> None:
        """Once every child has exited: their standard error read to the end, the ports'
        reservations and the run directory gone."""
        for relay in self._stderr.values():
            relay.close()
        for reservation in (self._port_socket, self._http_socket):
            if reservation is not None:
                reservation.close()
        shutil.rmtree(self._run_dir, ignore_errors=True)


def _killed_by_a_stop_signal(exitcode: int | None) -> bool:
    """Ended by SIGTERM's or SIGINT's default action: a child still starting up, with no
    handler for them yet."""
    return exitcode in (-signal.SIGTERM, -signal.SIGINT)


def _stopped_as_asked(exitcode: int | None) -> bool:
    """A child's exit after the drain's signal that is not a failure."""
    return exitcode == 0 or _killed_by_a_stop_signal(exitcode)


def _serve_metrics(settings: Settings, metrics_dir: Path, own: list[Any]) -> tuple[Any, Thread]:
    """/metrics: every process's series, summed by prometheus-client's multiprocess mode,
    and the served set as the worker reported it."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(metrics.EveryFamily(ProcessFiles(str(metrics_dir))))
    for collector in own:
        registry.register(collector)
    return start_http_server(settings.metrics_port, addr=_bare(settings.host), registry=registry)


def _mark_dead(pid: int | None) -> None:
    """A dead child's live gauges (queue depth, in flight) stop counting."""
    if pid is None:
        return
    from prometheus_client import multiprocess

    with contextlib.suppress(OSError):
        multiprocess.mark_process_dead(pid)


def _close_http(httpd: Any) -> None:
    httpd.shutdown()
    httpd.server_close()


def _refused_at_start(settings: Settings) -> str:
    """What every front end would refuse at its start ("" if nothing), checked before the
    worker is started: TLS files that cannot be used, --restricted-api specs or key files,
    tracing's OTEL_* variables. A bad setting fails at once, not after the models load."""
    from service.frontend.restricted import Restrictions
    from service.observability import tracing
    from service.transport.tls import TlsError, server_tls

    try:
        server_tls(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
        Restrictions.parse(settings.restricted_api)
        if settings.tracing == "on":
            tracing.check()
    except (TlsError, ValueError) as err:  # TracingError is a ValueError
        return str(err)
    return ""


def _gateway_role(role: str) -> str:
    """The name of front end role's gateway in logs and metrics (gateway-K)."""
    return role.replace("frontend-", "gateway-")
