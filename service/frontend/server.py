"""A front-end process's gRPC server: servicers over the worker link, health, reflection,
TLS; the drain on SIGTERM. Several front ends share the port (SO_REUSEPORT)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from service import status_texts
from service.errors import ShuttingDown
from service.frontend import caller, reflection
from service.frontend.attention_servicer import AttentionServicer
from service.frontend.compression import Unpacker
from service.frontend.delivery import AnswerBudget, install_disconnect_filter
from service.frontend.gateway import BINARY as GATEWAY_BINARY
from service.frontend.gateway import (
    REFUSE_LINGER_S,  # the drain's timing, one for both drains (the gateway's flags)
    WRITE_MARGIN_S,
    Gateway,
    GatewayError,
    gateway_off_reason,
    locate_binary,
    undelivered_share,
)
from service.frontend.handlers import add_servicer, add_taking_one_request
from service.frontend.limits import message_limits
from service.frontend.log_settings import LogControl
from service.frontend.rest.app import RestFrontend
from service.frontend.rest.protocol import ConnectionLimits
from service.frontend.restricted import RestrictedApiInterceptor, Restrictions
from service.frontend.served import ServedSet
from service.frontend.streaming import StreamCloser
from service.frontend.v2_plane import V2Plane
from service.frontend.v2_servicer import InferenceServicer
from service.frontend.validation import InputLimits
from service.frontend.worker_client import WorkerClient
from service.generated.attention.v1 import attention_pb2, attention_pb2_grpc
from service.generated.inference import grpc_service_pb2, grpc_service_pb2_grpc
from service.observability import tracing
from service.restart_budget import RestartBudget
from service.settings import Settings
from service.transport.grpc_options import (
    GATEWAY_HEADER_ALLOWANCE,
    MAX_CONCURRENT_STREAMS,
    server_options,
)
from service.transport.tls import ReloadingCredentials, TlsError, server_tls

log = logging.getLogger(__name__)

TRACING_FLUSH_S = 1.0  # at exit, the most time given to exporting the last spans
SERVICE_NAMES = [
    attention_pb2.DESCRIPTOR.services_by_name["AttentionService"].full_name,
    grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
]


class StartupError(RuntimeError):
    """The front end cannot serve; the message says why."""


def bind_host(host: str) -> str:
    """host as a bare address: IPv6 literals are accepted with or without brackets."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def grpc_address(host: str, port: int) -> str:
    bare = bind_host(host)
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


def slab_bytes(settings: Settings, queue_bytes: int) -> int:
    """Shared memory for one front end's tensors in flight: --shared-memory-bytes, or room
    for the queue's bytes twice over (inputs and answers), shared by the front ends. The
    queue's bound follows the container's memory limit, so this does too; only pages written
    are taken, and they go back after a spike or once idle."""
    return settings.shared_memory_bytes or max(64 << 20, 2 * queue_bytes // settings.frontends)


class FrontendServer:
    """start() waits for the worker's served set, binds and serves; stop() drains."""

    def __init__(
        self,
        settings: Settings,
        socket_path: Path,
        name: str,
        queue_bytes: int,
        gateway_restarted: Callable[[int], None] = lambda pid: None,
    ):
        """gateway_restarted: told the pid of each gateway this front end restarts."""
        self._settings = settings
        self.name = name
        self._health = health.aio.HealthServicer()
        self._served = ServedSet(self._health)
        self._streams = StreamCloser()
        self._server: grpc.aio.Server | None = None
        self._rest: RestFrontend | None = None
        self._restrictions_in_force = Restrictions()
        self.tls: ReloadingCredentials | None = None
        self.port: int | None = None
        self._queue_bytes = queue_bytes
        self._worker_socket = socket_path
        self._gateway: Gateway | None = None
        self._gateway_on = False
        self._gateway_restarted = gateway_restarted
        self._gateway_restarts = RestartBudget(settings.max_restarts, settings.restart_window_s)
        self.plane = WorkerClient(
            socket_path, name, slab_bytes(settings, queue_bytes), on_change=self._changed
        )
        self._started = False
        self._draining = False
        self._background: set[asyncio.Future[None]] = set()

    @property
    def gateway_pid(self) -> int | None:
        """The pid of the gateway serving this front end's port; None without one."""
        return None if self._gateway is None else self._gateway.pid

    @property
    def ready(self) -> bool:
        """Warm worker connected, not draining: V2 ServerReady / ModelReady, REST's ready."""
        return self.plane.ready and self._started and not self._draining

    async def start(self, port: int, http_port: int = 0) -> int:
        """Serve gRPC on port and HTTP/REST on http_port (0: none); the gRPC port bound."""
        settings = self._settings
        try:  # before anything else: a bad certificate should fail at once
            self.tls = server_tls(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
        except TlsError as err:
            raise StartupError(str(err)) from err
        restrictions = self._restrictions_in_force = self._restrictions()
        if settings.tracing == "on":  # first: whether the gateway can serve depends on it
            try:
                tracing.start(max_queue_spans=settings.tracing_max_queue_spans)
            except tracing.TracingError as err:
                raise StartupError(str(err)) from err
        self._gateway_on = self._use_gateway()
        self.plane.start()
        await self.plane.wait_welcomed()
        receive_bytes, send_bytes = message_limits(self.plane.models.all(), settings)
        slab = slab_bytes(settings, self._queue_bytes)
        if receive_bytes + send_bytes > slab:
            log.warning(
                "the largest legal call and its answer take up to %d bytes of shared memory, "
                "more than this front end has (%d, --shared-memory-bytes): such calls get "
                "RESOURCE_EXHAUSTED",
                receive_bytes + send_bytes,
                slab,
            )
        self._served.check_limits(
            lambda model: message_limits([model], settings), (receive_bytes, send_bytes)
        )
        install_disconnect_filter()
        server = grpc.aio.server(
            # No interceptor when nothing is restricted: it would cost every call a hop.
            interceptors=[RestrictedApiInterceptor(restrictions)] if restrictions else [],
            options=server_options(
                receive_bytes=receive_bytes,
                send_bytes=send_bytes,
                max_connection_age_s=settings.max_connection_age_s,
                # A call in flight when its connection ages out gets what a drain gives it.
                max_connection_age_grace_s=settings.grace_period_s,
                max_connection_idle_s=settings.max_connection_idle_s,
                share_port=True,
                max_concurrent_streams=None if self._gateway_on else MAX_CONCURRENT_STREAMS,
                compression=settings.grpc_compression,
                max_metadata_bytes=settings.max_metadata_bytes
                + (GATEWAY_HEADER_ALLOWANCE if self._gateway_on else 0),
            ),
        )
        # Log settings go to every process through the run folder (the worker socket's).
        log_control = LogControl(self._worker_socket.parent)
        v2_plane = V2Plane(self.plane, settings, lambda: self.ready, log_control=log_control)
        # This front end's share of the undelivered-answers budget, for gRPC and REST alike:
        # every front end holds its own answers.
        self._answers = AnswerBudget(*undelivered_share(settings, gateway=self._gateway_on))
        self._add_servicers(
            server, v2_plane, Unpacker(settings.grpc_compression, max_bytes=receive_bytes)
        )
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self._gateway_on:
            bound = await self._serve_behind_gateway(server, port, receive_bytes)
        else:
            address = grpc_address(settings.host, port)
            try:
                bound = (
                    server.add_secure_port(address, self.tls.server())
                    if self.tls is not None
                    else server.add_insecure_port(address)
                )
            except RuntimeError as err:
                raise StartupError(f"cannot bind gRPC to {address}: {err}") from err
            await server.start()
        self._server, self.port = server, bound
        if http_port:
            await self._start_rest(v2_plane, http_port, receive_bytes)
        if self.tls is not None:
            log.info(
                "gRPC port serves TLS%s; metrics port plain HTTP",
                " and requires client certificates" if self.tls.mutual else "",
            )
        self._started = True
        self._changed()
        if self._gateway is not None:
            self._gateway.answer_health()
        return bound

    def _use_gateway(self) -> bool:
        """--grpc-gateway on, or auto with the gateway's executable found, unless a setting
        needs every call in Python (then the gateway would only add a hop)."""
        mode = self._settings.grpc_gateway
        if mode == "off":
            return False
        off = gateway_off_reason(self._settings)
        if not off and mode == "auto" and locate_binary(self._settings.grpc_gateway_binary) is None:
            off = f"no {GATEWAY_BINARY} beside {sys.executable} or on PATH (make setup builds it)"
        if off:
            log.log(
                logging.WARNING if mode == "on" else logging.INFO,
                "--grpc-gateway %s, but Python serves the gRPC port: %s",
                mode,
                off,
            )
        return not off

    async def _serve_behind_gateway(
        self, server: grpc.aio.Server, port: int, receive_bytes: int
    ) -> int:
        """Python serves gRPC on a Unix socket of the run folder, behind the gateway, which
        binds the port (and terminates TLS); the port bound."""
        settings = self._settings
        backend = self._worker_socket.parent / f"{self.name}.grpc.sock"
        backend.unlink(missing_ok=True)  # left by a front end that was killed
        caller.serve_behind_gateway()  # every call now comes through the gateway
        try:
            server.add_insecure_port(f"unix:{backend}")
        except RuntimeError as err:
            raise StartupError(f"cannot bind gRPC to {backend}: {err}") from err
        await server.start()
        self._gateway = Gateway(
            settings,
            name=self.name,
            backend=backend,
            worker_socket=self._worker_socket,
            slab_bytes=slab_bytes(settings, self._queue_bytes),
            receive_bytes=receive_bytes,
            restrictions=self._restrictions_in_force,
        )
        try:
            return await self._gateway.start(
                grpc_address(settings.host, port), self._gateway_exited
            )
        except GatewayError as err:
            raise StartupError(f"gateway: {err}") from err

    def _gateway_exited(self) -> None:
        """The gateway exited on its own (killed, crashed, or killed as hung): another takes
        the port while this front end serves on (REST, and what Python was answering), as
        the supervisor restarts its children and within the same budget. Past the budget,
        or in the drain, or before the port is known, the front end exits too, and the
        supervisor's rule applies to it."""
        if self._draining or self.port is None or not self._gateway_restarts.take():
            if not self._draining and self.port is not None:
                log.error(
                    "the gateway exited; more than %d restarts of it within %.0fs: giving up",
                    self._settings.max_restarts,
                    self._settings.restart_window_s,
                )
            _exit_now()
        log.warning("restarting the gateway")
        restart = asyncio.ensure_future(self._restart_gateway(self.port))
        self._background.add(restart)
        restart.add_done_callback(self._background.discard)

    async def _restart_gateway(self, port: int) -> None:
        assert self._gateway is not None
        if self._draining:  # began before this turn: nothing to serve the port for
            return
        try:
            await self._gateway.start(grpc_address(self._settings.host, port), self._gateway_exited)
        except GatewayError as err:
            if self._draining:  # the drain stopped it as it started: nothing is lost
                return
            log.error("cannot restart the gateway: %s", err)
            _exit_now()
        if self._draining:  # began while it started, and missed it: it has served nothing
            await self._gateway.discard()
            return
        if self._started:
            self._gateway.answer_health()
        assert self._gateway.pid is not None
        self._gateway_restarted(self._gateway.pid)

    async def _start_rest(self, v2_plane: V2Plane, port: int, receive_bytes: int) -> None:
        """The HTTP/REST front end, bodies bounded as gRPC messages are."""
        settings = self._settings
        rest = RestFrontend(
            v2_plane,
            max_body_bytes=receive_bytes,
            max_json_request_bytes=settings.max_json_request_bytes,
            max_json_answer_bytes=settings.max_json_answer_bytes,
            connections=ConnectionLimits(
                idle_s=settings.max_connection_idle_s,
                header_timeout_s=settings.http_header_timeout_s,
            ),
            grace_period_s=settings.grace_period_s,
            restrictions=self._restrictions_in_force,
            answers=self._answers,
        )
        context = None if self.tls is None else self.tls.ssl_context()
        try:
            await rest.start(bind_host(settings.host), port, context)
        except OSError as err:
            raise StartupError(f"cannot bind HTTP/REST to {settings.host}:{port}: {err}") from err
        self._rest = rest

    def _add_servicers(self, server: grpc.aio.Server, v2_plane: V2Plane, unpack: Unpacker) -> None:
        settings = self._settings
        limits = InputLimits(settings.max_seq_len, settings.max_batch_size)
        answers = self._answers
        add_servicer(
            server,
            attention_pb2_grpc.add_AttentionServiceServicer_to_server,
            AttentionServicer(
                self.plane,
                limits,
                max_stream_inflight_requests=settings.max_stream_inflight_requests,
                max_stream_pending_bytes=settings.max_stream_pending_bytes,
                streams=self._streams,
                answers=answers,
                shared_memory=v2_plane.shared_memory,  # the worker's regions, for both APIs
                restrictions=self._restrictions_in_force,
            ),
            unpack,
        )
        add_servicer(
            server,
            grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server,
            InferenceServicer(
                self.plane,
                settings,
                lambda: self.ready,
                streams=self._streams,
                v2_plane=v2_plane,
                restrictions=self._restrictions_in_force,
                answers=answers,
            ),
            unpack,
        )
        add_taking_one_request(server, health_pb2_grpc.add_HealthServicer_to_server, self._health)
        reflection.enable(
            server,
            [*SERVICE_NAMES, health.SERVICE_NAME],
            [attention_pb2.DESCRIPTOR, grpc_service_pb2.DESCRIPTOR, health_pb2.DESCRIPTOR],
        )

    def _restrictions(self) -> Restrictions:
        """--restricted-api, checked before serving; warns when explicit mode leaves loading
        and unloading open to anyone who reaches the port."""
        settings = self._settings
        try:
            restrictions = Restrictions.parse(settings.restricted_api)
        except ValueError as err:
            raise StartupError(str(err)) from err
        if restrictions.describe():
            log.info("restricted APIs: %s", restrictions.describe())
        if settings.model_control_mode == "explicit" and not restrictions.restricted(
            "model-repository"
        ):
            log.warning(
                "--model-control-mode explicit with the model-repository API unrestricted: "
                "anyone who reaches the gRPC port can load and unload models; set "
                "--restricted-api model-repository:KEY=@/path/to/secret"
            )
        return restrictions

    def _changed(self) -> None:
        """The worker's served set or readiness changed (or the link to it did)."""
        if not self._started or self._draining:
            return
        ready = self.ready
        self._served.sync(self.plane.models, ready=ready)
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ready
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        task = asyncio.ensure_future(self._set_health(status))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _set_health(
        self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType
    ) -> None:
        for name in ["", *SERVICE_NAMES]:
            await self._health.set(name, status)

    async def stop(self, *, signalled_at: float | None = None) -> None:
        """The drain, all within grace_period_s of the signal: NOT_SERVING while still serving
        for shutdown_not_serving_s, then refuse new work with UNAVAILABLE and finish what was
        accepted, then close; whatever is left then fails with UNAVAILABLE."""
        settings = self._settings
        loop = asyncio.get_running_loop()
        started = loop.time() if signalled_at is None else signalled_at
        deadline = started + settings.grace_period_s

        def remaining() -> float:
            return max(0.0, deadline - loop.time())

        was_ready = self.ready
        self._draining = True
        self.plane.draining = True
        # The gateway drains its own calls on the same schedule; Python answers the ones it
        # hands over until it has finished.
        gateway_stopped = asyncio.ensure_future(
            self._gateway.stop(remaining()) if self._gateway is not None else asyncio.sleep(0)
        )
        await self._health.enter_graceful_shutdown()
        if was_ready:
            # From the signal: a front end that heard it late has less of the period left.
            not_serving_s = min(
                started + settings.shutdown_not_serving_s - loop.time(), remaining()
            )
            log.info("NOT_SERVING for %.1fs while endpoints update", max(0.0, not_serving_s))
            await asyncio.sleep(max(0.0, not_serving_s))
        self.plane.accepting = False
        self._streams.refuse_new()
        await self.plane.flush()
        self._streams.close_all()
        log.info("refusing new requests; finishing accepted ones for up to %.1fs", remaining())
        with contextlib.suppress(TimeoutError):
            margin = min(WRITE_MARGIN_S, settings.grace_period_s / 5)
            await asyncio.wait_for(self.plane.wait_idle(), timeout=remaining() - margin)
        self.plane.fail_in_flight(ShuttingDown(status_texts.GRACE_PERIOD_ENDED))
        # Calls already on the wire when gRPC closes are cancelled by its core (CANCELLED,
        # which clients do not retry); refusing a moment longer answers them UNAVAILABLE.
        await asyncio.sleep(min(REFUSE_LINGER_S, remaining() / 2))
        await gateway_stopped
        # Both front ends at once: finished handlers write their answers; the rest is cancelled.
        closing = [] if self._server is None else [self._server.stop(remaining())]
        if self._rest is not None:
            closing.append(self._rest.stop(remaining()))
        await asyncio.gather(*closing)
        await self.plane.close()
        tracing.stop(min(TRACING_FLUSH_S, remaining()))
        log.info("front end %s stopped", self.name)

    @property
    def drained(self) -> bool:
        """After stop(): False when its gateway did not drain (hung and killed, or killed
        at the end of the grace period): calls it held were cut."""
        return self._gateway is None or self._gateway.drained


def _exit_now() -> NoReturn:
    """The gateway is gone for good: so is the front end, which the supervisor restarts
    (with a gateway of its own) or gives up on."""
    logging.shutdown()
    os._exit(1)
