"""The native gateway (service/gateway/, Go) that serves a front end's gRPC port when
--grpc-gateway is on: it answers plain V2 ModelInfer calls itself, over its own link to the
worker, and hands every other call to this Python process on a Unix socket. This module
starts it with this front end's settings, watches it, and stops it in the drain.

Why a second process: per call, gRPC in Python costs the front end several hundred
microseconds of CPU before any work of ours (bench/grpc_floor.py); the gateway's HTTP/2
and message handling cost a fraction of that, and it copies the tensor from the wire into
shared memory once without parsing it into Python objects."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

from prometheus_client import multiprocess
from prometheus_client.utils import floatToGoString

from service import drain_clock
from service.dataplane import DEADLINE_SLACK_S
from service.frontend.gateway_spans import SpanSink
from service.frontend.restricted import Restrictions
from service.observability import logs, metrics, stderr_fifo, tracing
from service.settings import Settings
from service.transport import grpc_options

log = logging.getLogger(__name__)
BINARY = "attention-gateway"
# Both drains' timing (this front end's, server.py, and its gateway's): refuse new calls this
# long before closing, and fail what is left of the grace period's work this long before its
# end, so that the UNAVAILABLE answers are written before the server closes.
REFUSE_LINGER_S = 0.2
WRITE_MARGIN_S = 0.2
# As the supervisor's children beat (service/app/children.py): a gateway whose beat stops for
# --watchdog-timeout-s is killed, and its front end restarted with it.
HEARTBEAT_S = 1.0
START_TIMEOUT_S = 10.0
# The API groups of the calls the gateway answers itself (it hands the rest to Python): it
# checks their keys, which it reads from the file descriptor this variable names.
ANSWERED_GROUPS = ("inference", "health")
RESTRICTED_FD_VARIABLE = "ATTENTION_GATEWAY_RESTRICTED_FD"
# The descriptor its log lines go to, where its standard error is the supervisor's FIFO for
# what Go's runtime writes (a panic, a goroutine dump), read back as log lines.
LOG_FD_VARIABLE = "ATTENTION_GATEWAY_LOG_FD"
# The series the gateway writes (metrics_spec(), as JSON), in its environment.
METRICS_VARIABLE = "ATTENTION_GATEWAY_METRICS"


class GatewayError(RuntimeError):
    """The gateway cannot start; the message says why."""


def locate_binary(configured: str) -> str | None:
    """--grpc-gateway-binary, else the one beside this interpreter, else on PATH; None when
    there is none."""
    if configured:
        return configured
    beside = Path(sys.executable).parent / BINARY
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(BINARY)


def find_binary(configured: str) -> str:
    """locate_binary's answer, or GatewayError saying where it was looked for."""
    found = locate_binary(configured)
    if found is None:
        raise GatewayError(
            f"--grpc-gateway on, but no {BINARY} beside {sys.executable} or on PATH "
            "(make setup builds it; or set --grpc-gateway-binary, or --grpc-gateway off)"
        )
    return found


def gateway_off_reason(settings: Settings) -> str:
    """Why the gateway would have to hand every call to Python, or ''."""
    if settings.tracing == "on":
        untraceable = _untraceable_here()
        if untraceable:
            return untraceable
    return ""


def _untraceable_here() -> str:
    """Why the gateway cannot trace as this process does (tracing on), or ''."""
    if not tracing.gateway_sampler():
        return "the gateway applies only the samplers OTEL_TRACES_SAMPLER names"
    propagators = os.environ.get("OTEL_PROPAGATORS", "tracecontext,baggage")
    names = {name.strip() for name in propagators.split(",") if name.strip()}
    if "tracecontext" not in names or names - {"tracecontext", "baggage"}:
        return f"OTEL_PROPAGATORS={propagators!r}: the gateway reads only W3C traceparent"
    return ""


def _restrictions_file(restrictions: dict[str, Any]) -> int:
    """An anonymous file (named on no file system) holding restrictions as JSON, to be read
    from its start; the caller closes it."""
    fd = os.memfd_create("restricted-api", os.MFD_CLOEXEC)
    try:
        data = json.dumps(restrictions).encode()
        while data:
            data = data[os.write(fd, data) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _family(collector: Any) -> Any:
    """The metric family a collector declares (its name without suffixes, its help)."""
    return next(iter(collector.describe()))


def undelivered_share(settings: Settings, *, gateway: bool) -> tuple[int, int]:
    """This front end's share of --max-undelivered-bytes and of its per-connection bound; with
    the gateway, the gateway and the Python process each hold half (answers wait in both)."""
    parts = settings.frontends * (2 if gateway else 1)
    total = max(1, settings.max_undelivered_bytes // parts)
    return total, min(total, max(1, settings.max_undelivered_bytes_per_connection // parts))


def forget_dead_processes(metrics_dir: str) -> None:
    """Live-summed gauges of processes gone without being marked dead (a gateway killed with
    its front end): removed, or their last values would count forever."""
    for path in Path(metrics_dir).glob("gauge_live*_*.db"):
        pid = path.stem.rsplit("_", 1)[-1]
        if pid.isdigit() and not _running(int(pid)):
            multiprocess.mark_process_dead(int(pid), metrics_dir)


def _running(pid: int) -> bool:
    """Whether pid is a live process (a zombie, killed and not yet reaped, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def metrics_spec() -> dict[str, Any]:
    """The series the gateway writes, named and described as metrics.py declares them."""
    requests = _family(metrics.REQUESTS)
    duration = _family(metrics.REQUEST_DURATION)
    in_flight = _family(metrics.IN_FLIGHT)
    undelivered = _family(metrics.UNDELIVERED_BYTES)
    refusals = _family(metrics.UNDELIVERED_REFUSALS)
    denials = _family(metrics.RESTRICTED_DENIALS)
    bounds = [*metrics.LATENCY_BUCKETS_S, float("inf")]
    return {
        "requests": {
            "family": requests.name,
            "sample": f"{requests.name}_total",
            "help": requests.documentation,
        },
        "duration": {
            "family": duration.name,
            "help": duration.documentation,
            # JSON has no infinity: the last bucket takes whatever the others do not.
            "bounds": [min(bound, 1e308) for bound in bounds],
            "labels": [floatToGoString(bound) for bound in bounds],
        },
        "in_flight": {
            "family": in_flight.name,
            "sample": in_flight.name,
            "help": in_flight.documentation,
        },
        "undelivered": {
            "family": undelivered.name,
            "sample": undelivered.name,
            "help": undelivered.documentation,
        },
        "undelivered_refusals": {
            "family": refusals.name,
            "sample": f"{refusals.name}_total",
            "help": refusals.documentation,
        },
        "restricted_denials": {
            "family": denials.name,
            "sample": f"{denials.name}_total",
            "help": denials.documentation,
        },
    }


class Gateway:
    """One gateway process: start() binds the port, stop() drains it; on_exit runs when it
    exits on its own (its front end then starts another on the same port: restart())."""

    def __init__(
        self,
        settings: Settings,
        *,
        name: str,
        backend: Path,
        worker_socket: Path,
        slab_bytes: int,
        receive_bytes: int,
        restrictions: Restrictions | None = None,
    ) -> None:
        self._settings = settings
        self._restrictions = restrictions or Restrictions()
        self._name = name
        self._backend = backend
        self._worker_socket = worker_socket
        self._run_dir = worker_socket.parent  # the supervisor's: log settings, stderr FIFOs
        self.log_name = name.replace("frontend-", "gateway-")  # gateway-K, in logs and metrics
        self._slab_bytes = slab_bytes
        self._receive_bytes = receive_bytes
        self._process: asyncio.subprocess.Process | None = None
        self.pid: int | None = None
        self._stopping = False
        self._killing = False  # by this front end, knowingly: stop() at the end, or discard()
        self.drained = True  # False once it ended its drain other than by exiting 0
        self._watch: asyncio.Task[None] | None = None
        self._beats: asyncio.Task[None] | None = None
        # Tracing on: where the gateway's sampled calls come to be made spans.
        spans = backend.with_name(f"{name}-spans.sock")
        self._spans = SpanSink(spans) if tracing.enabled() else None
        self._spans_started = False

    def _command(self, address: str) -> list[str]:
        s = self._settings
        share, share_connection = undelivered_share(s, gateway=True)
        state = logs.current()  # as this front end logs now: changed at run time, maybe
        command = [
            find_binary(s.grpc_gateway_binary),
            f"--listen={address}",
            f"--backend={self._backend}",
            f"--worker-socket={self._worker_socket}",
            f"--name={self._name}-gateway",
            f"--slab-bytes={self._slab_bytes}",
            f"--max-seq-len={s.max_seq_len}",
            f"--max-batch-size={s.max_batch_size}",
            f"--client-shared-memory={'true' if s.client_shared_memory == 'on' else 'false'}",
            f"--max-receive-bytes={self._receive_bytes}",
            f"--accept-encoding={grpc_options.accepted_encodings(s.grpc_compression)}",
            f"--max-undelivered-bytes={share}",
            f"--max-undelivered-bytes-per-connection={share_connection}",
            f"--max-metadata-bytes={s.max_metadata_bytes}",
            f"--max-connection-idle-s={s.max_connection_idle_s}",
            f"--max-connection-age-s={s.max_connection_age_s}",
            f"--max-concurrent-streams={grpc_options.MAX_CONCURRENT_STREAMS}",
            f"--max-stream-inflight-requests={s.max_stream_inflight_requests}",
            f"--max-stream-pending-bytes={s.max_stream_pending_bytes}",
            f"--keepalive-s={grpc_options.KEEPALIVE_TIME_MS / 1000}",
            f"--keepalive-timeout-s={grpc_options.KEEPALIVE_TIMEOUT_MS / 1000}",
            f"--min-client-ping-interval-s={grpc_options.MIN_CLIENT_PING_INTERVAL_MS / 1000}",
            f"--max-ping-strikes={grpc_options.MAX_PING_STRIKES}",
            f"--deadline-slack-s={DEADLINE_SLACK_S}",
            f"--shutdown-not-serving-s={s.shutdown_not_serving_s}",
            f"--grace-period-s={s.grace_period_s}",
            f"--drain-clock={drain_clock.path(self._run_dir)}",
            f"--refuse-linger-s={REFUSE_LINGER_S}",
            f"--write-margin-s={WRITE_MARGIN_S}",
            f"--heartbeat-s={HEARTBEAT_S if s.watchdog_timeout_s > 0 else 0}",
            # It writes its own log lines, in the format and at the level every process uses,
            # and follows their changes in the run directory's settings file.
            f"--log-process={self.log_name}",
            f"--log-level={state.level}",
            f"--log-format={state.format}",
            f"--log-settings={self._run_dir / logs.SETTINGS_FILE}",
        ]
        if self._spans is not None:
            command += [
                f"--trace-sampler={tracing.gateway_sampler()}",
                f"--spans-socket={self._spans.path}",
            ]
        if s.tls_cert and s.tls_key:
            command += [f"--tls-cert={s.tls_cert}", f"--tls-key={s.tls_key}"]
            if s.tls_client_ca:
                command.append(f"--tls-client-ca={s.tls_client_ca}")
        return command

    async def start(self, address: str, on_exit: Any) -> int:
        """Start the gateway on address (HOST:PORT); the port it bound."""
        metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if metrics_dir:
            forget_dead_processes(metrics_dir)
        env = {**os.environ, METRICS_VARIABLE: json.dumps(metrics_spec())}
        if self._spans is not None and not self._spans_started:
            self._spans.start()  # once: a restarted gateway connects to the same sink
            self._spans_started = True
        # The keys it checks: in a file only it inherits, never on its command line (which
        # anyone on the host can read) nor in its environment.
        restricted = _restrictions_file(self._restrictions.for_gateway(ANSWERED_GROUPS))
        env[RESTRICTED_FD_VARIABLE] = str(restricted)
        env.pop(LOG_FD_VARIABLE, None)  # set below, or not at all: never an inherited one
        log_fd: int | None = None
        relay: int | None = None
        try:
            # Its log lines go where this process's do (standard error, not its relay); what
            # Go's runtime writes, into its own relay where the supervisor made one. Its
            # standard output says "listening ADDRESS", or "failed WHY".
            own = logs.output_fd()
            log_fd = os.dup(2 if own is None else own)
            relay = stderr_fifo.open_writer(self._run_dir, self.log_name)
            if relay is not None:
                env[LOG_FD_VARIABLE] = str(log_fd)
            process = await asyncio.create_subprocess_exec(
                *self._command(address),
                env=env,
                stdout=asyncio.subprocess.PIPE,
                stderr=log_fd if relay is None else relay,
                pass_fds=(restricted, log_fd),
            )
        except OSError as err:
            raise GatewayError(f"cannot run the gateway: {err}") from err
        finally:
            for fd in (restricted, log_fd, relay):
                if fd is not None:
                    os.close(fd)
        self._process = process
        self.pid = None  # until it says it is listening
        assert process.stdout is not None
        try:
            line = await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT_S)
        except TimeoutError:
            line = b""
        if not line.startswith(b"listening "):
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            error = line.removeprefix(b"failed ").decode(errors="replace").strip()
            raise GatewayError(error or "the gateway did not start")
        self.pid = process.pid
        self._watch = asyncio.create_task(self._watch_exit(process, on_exit))
        if self._settings.watchdog_timeout_s > 0:
            self._beats = asyncio.create_task(self._watch_heartbeat(process))
        # As the supervisor logs its children: tools that follow the processes read this.
        log.info("started %s-gateway (pid %d): it serves the gRPC port", self._name, process.pid)
        return int(line.decode().rsplit(":", 1)[1])

    async def _watch_heartbeat(self, process: asyncio.subprocess.Process) -> None:
        """Kill the gateway once its heartbeat stops (stopped, or its runtime stalled): its
        exit then takes the usual path, as the supervisor's watchdog does for its children.
        A stopped gateway held its callers, and new connections, for good while the front
        end served on."""
        timeout = self._settings.watchdog_timeout_s
        assert process.stdout is not None
        while True:
            try:
                line = await asyncio.wait_for(process.stdout.readline(), timeout)
            except TimeoutError:
                # In the drain too: a hung gateway would hold it for the whole grace period.
                if process.returncode is not None:
                    return
                log.error(
                    "the gateway sent no heartbeat for %.1fs (stopped or stalled); killing it",
                    timeout,
                )
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                return
            if not line:
                return  # it exited: _watch_exit has it

    async def _watch_exit(self, process: asyncio.subprocess.Process, on_exit: Any) -> None:
        code = await process.wait()
        multiprocess.mark_process_dead(process.pid)  # its in-flight gauge goes with it
        if not self._stopping:
            log.error("the gateway exited with code %s", code)
            on_exit()
        elif code != 0 and not self._killing:
            self.drained = False
            log.error("the gateway exited with code %s during the drain", code)

    def answer_health(self) -> None:
        """The front end has started: from now on the gateway answers V2's health calls itself
        (SIGUSR1). Until then it hands them here, to be answered "not ready" while starting.
        Only a gateway that said it is listening is told: before its handlers are set,
        SIGUSR1 would kill it (a restart's, still starting, is told when it has started)."""
        process = self._process
        if process is not None and process.returncode is None and self.pid == process.pid:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGUSR1)

    async def discard(self) -> None:
        """Kill a gateway that has served nothing (started as the drain began), unless the
        drain's stop() has it already."""
        process = self._process
        if process is None or process.returncode is not None or self._stopping:
            return
        self._stopping = True
        await self._kill(process)

    async def _kill(self, process: asyncio.subprocess.Process) -> None:
        """Kill it knowingly (its exit code is no failed drain) and wait for its watchers."""
        self._killing = True
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        await self._watchers_done()

    async def _watchers_done(self) -> None:
        if self._beats is not None:
            self._beats.cancel()
        if self._watch is not None:
            await self._watch

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM: it drains as the front end does; killed if still there after timeout_s."""
        process = self._process
        if process is None or process.returncode is not None:
            return
        self._stopping = True
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), max(0.1, timeout_s))
        except TimeoutError:
            log.warning("the gateway had not finished its drain in %.1fs; killing it", timeout_s)
            self.drained = False  # the calls it still held are cut
            await self._kill(process)
        else:
            await self._watchers_done()
        if self._spans is not None:
            await asyncio.to_thread(self._spans.stop)  # after the gateway: its records are in
