"""Entry points of the child processes: the worker and each front end. Each runs its own
event loop, reports to the supervisor over a pipe, and drains on SIGTERM."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import multiprocessing
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import NoReturn

from service import drain_clock
from service.app import stderr_relay
from service.memory.malloc import keep_freed_memory
from service.observability import logs
from service.settings import Settings

log = logging.getLogger("service")
PR_SET_PDEATHSIG = 1
HEARTBEAT_S = 1.0  # how often a child tells the supervisor its event loop still turns


def initial_log_state(settings: Settings) -> logs.LogState:
    return logs.LogState(settings.log_level.upper(), settings.log_format)


def configure_logging(settings: Settings, process: str, run_dir: Path) -> None:
    """This process's logging, as the run directory's settings say now (they may have changed
    since the server started), else as the flags say. What else it writes to standard error
    (gRPC core, ONNX Runtime) is relayed by the supervisor as its log lines."""
    state = logs.LogSettingsFile(run_dir).read() or initial_log_state(settings)
    logs.configure(process, state, output_fd=stderr_relay.attach(run_dir, process))


def _die_with_parent() -> None:
    """SIGTERM when the supervisor dies, even by SIGKILL: a child never outlives it."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    parent = multiprocessing.parent_process()
    # The parent died before the call (in a container the supervisor itself is pid 1, so
    # compare with its pid rather than with 1).
    if parent is not None and os.getppid() != parent.pid:
        os._exit(1)


def _child_setup(settings: Settings, process: str, run_dir: Path) -> None:
    _die_with_parent()
    # A terminal's Ctrl-C reaches the whole process group; the supervisor orders the drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(settings, process, run_dir)
    if settings.malloc_reuse == "on":
        keep_freed_memory()


def exit_now(code: int) -> NoReturn:
    """Exit without the interpreter's teardown (ONNX Runtime sessions, gRPC; ~0.5 s), which
    could otherwise push the exit past the grace period."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run(
    settings: Settings, run_dir: Path, main: Callable[[], Awaitable[int]], report: Connection
) -> NoReturn:
    from service.app.loops import event_loop_factory

    async def with_heartbeat() -> int:
        beating = asyncio.create_task(_heartbeat(report), name="heartbeat")
        following = asyncio.create_task(
            logs.follow(logs.LogSettingsFile(run_dir)), name="log-settings"
        )
        try:
            return await main()
        finally:
            beating.cancel()
            following.cancel()

    with asyncio.Runner(loop_factory=event_loop_factory(settings.event_loop)) as runner:
        exit_now(runner.run(with_heartbeat()))


async def _heartbeat(report: Connection) -> None:
    """From the event loop itself: a loop that stops turning stops the beat, and the
    supervisor's watchdog restarts the process."""
    while True:
        try:
            report.send(("alive",))
        except (BrokenPipeError, OSError):
            return  # the supervisor is gone; PDEATHSIG ends this process
        await asyncio.sleep(HEARTBEAT_S)


async def _until_signal(start: Awaitable[object]) -> tuple[bool, float | None]:
    """Run start; (True, None) once done, (False, when) if SIGTERM came first (start is
    cancelled: never report serving after a shutdown signal)."""
    loop = asyncio.get_running_loop()
    starting = asyncio.ensure_future(start)
    signalled: list[float] = []

    def on_signal() -> None:
        if not signalled:
            signalled.append(loop.time())
            starting.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_signal)
    try:
        await starting
    except asyncio.CancelledError:
        if not signalled:
            raise
        return False, signalled[0]
    return True, None


async def _wait_for_signal() -> float:
    loop = asyncio.get_running_loop()
    got: asyncio.Future[float] = loop.create_future()

    def on_signal() -> None:
        if not got.done():
            got.set_result(loop.time())
        else:
            log.warning("another shutdown signal: ignored, the drain under way ends in time")

    loop.add_signal_handler(signal.SIGTERM, on_signal)
    return await got


def run_worker(settings: Settings, run_dir: Path, report: Connection) -> NoReturn:
    _child_setup(settings, "worker", run_dir)
    from service.worker.server import StartupError, WorkerServer

    async def main() -> int:
        server = WorkerServer(
            settings, run_dir, report_served=lambda rows: report.send(("served", rows))
        )
        try:
            started, signalled_at = await _until_signal(server.start())
        except StartupError as err:
            log.error("cannot start: %s", err)
            report.send(("failed", str(err)))
            return 1
        if started:
            report.send(("ready", os.getpid()))
            signalled_at = await _wait_for_signal()
        assert signalled_at is not None
        drain_from = drain_clock.started(run_dir, signalled_at)
        spent = asyncio.get_running_loop().time() - drain_from
        await server.stop(max(0.0, settings.grace_period_s - spent))
        return 0

    _run(settings, run_dir, main, report)


def run_frontend(
    settings: Settings,
    run_dir: Path,
    index: int,
    ports: tuple[int, int],
    queue_bytes: int,
    report: Connection,
) -> NoReturn:
    _child_setup(settings, f"frontend-{index}", run_dir)
    from service.frontend.server import FrontendServer, StartupError
    from service.worker_socket import socket_path

    async def main() -> int:
        server = FrontendServer(
            settings,
            socket_path(run_dir),
            f"frontend-{index}",
            queue_bytes,
            gateway_restarted=lambda pid: report.send(("gateway", pid, "restarted")),
        )
        try:
            started, signalled_at = await _until_signal(server.start(*ports))
        except StartupError as err:
            log.error("cannot start: %s", err)
            report.send(("failed", str(err)))
            return 1
        if started:
            report.send(("bound", server.port))
            if server.gateway_pid is not None:  # its CPU and memory are in /metrics too
                report.send(("gateway", server.gateway_pid))
            signalled_at = await _wait_for_signal()
        assert signalled_at is not None
        drain_from = drain_clock.started(run_dir, signalled_at)
        await server.stop(signalled_at=drain_from)
        return 0 if server.drained else 1  # the supervisor then exits 1 too

    _run(settings, run_dir, main, report)
