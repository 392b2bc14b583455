"""The gRPC server: wires models, batcher and servicers; owns startup and graceful drain."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from dataclasses import dataclass
from threading import Thread
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2
from prometheus_client import start_http_server

from service.app.models import ServedSet, build_controller
from service.errors import ModelNotFound, ShuttingDown
from service.frontend.attention_servicer import AttentionServicer
from service.frontend.compression import Unpacker
from service.frontend.delivery import AnswerBudget, install_disconnect_filter
from service.frontend.handlers import add_servicer
from service.frontend.restricted import RestrictedApiInterceptor, Restrictions
from service.frontend.streaming import StreamCloser
from service.frontend.v2_servicer import InferenceServicer
from service.frontend.validation import InputLimits
from service.generated.attention.v1 import attention_pb2, attention_pb2_grpc
from service.generated.inference import grpc_service_pb2, grpc_service_pb2_grpc
from service.memory.budget import default_queue_bytes, memory_limit_bytes
from service.observability import metrics
from service.settings import Settings
from service.transport.grpc_options import GRPC_MAX_MESSAGE_BYTES, server_options
from service.transport.proto_pool import pool_of
from service.transport.tls import ReloadingCredentials, TlsError, server_tls
from service.worker.batching.batcher import Batcher
from service.worker.batching.protocol import BatchLimits
from service.worker.engine.model_control import ModelController
from service.worker.engine.onnx_model import CPU, CUDA, OnnxModel, choose_providers, warm_up_shapes
from service.worker.engine.registry import ModelRegistry

log = logging.getLogger(__name__)
ServingStatus = health_pb2.HealthCheckResponse.ServingStatus.ValueType

ENVELOPE_BYTES = 1 << 20
REFUSE_LINGER_S = 0.2
# Kept back from the grace period so answers (and UNAVAILABLE for what could not be computed)
# are written before the server closes.
WRITE_MARGIN_S = 0.2  # headroom for the non-tensor fields and protobuf framing


def _close_http(httpd: WSGIServer) -> None:
    httpd.shutdown()
    httpd.server_close()


class StartupError(RuntimeError):
    """The server cannot serve anything; the message says why."""


@dataclass(frozen=True)
class BoundPorts:
    grpc: int
    metrics: int


def bind_host(host: str) -> str:
    """host as a bare address: IPv6 literals are accepted with or without brackets."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def grpc_address(host: str, port: int) -> str:
    bare = bind_host(host)
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


def queue_bytes(settings: Settings) -> int:
    """--max-queue-bytes, or its default derived from the memory this process may use."""
    return settings.max_queue_bytes or default_queue_bytes(memory_limit_bytes())


# With no model served at start (explicit mode, an empty repository in poll mode) the limits
# assume a layer this large: BERT-large and most 7B-class layers fit (d 1024..4096), and a
# client cannot make the server receive gRPC's largest message (2 GiB) before any model exists.
UNSEEN_EMBED_DIM = 4096
UNSEEN_NUM_HEADS = 32


def message_limits(registry: ModelRegistry, settings: Settings) -> tuple[int, int]:
    """(receive, send) byte limits from the largest legal request and response of the models
    served at start, or of an UNSEEN_EMBED_DIM layer when there is none yet."""
    served = registry.all()
    largest_d = max((model.spec.embed_dim for model in served), default=UNSEEN_EMBED_DIM)
    largest_h = max((model.spec.num_heads for model in served), default=UNSEEN_NUM_HEADS)
    positions = settings.max_batch_size * settings.max_seq_len
    request = positions * largest_d * 4 + ENVELOPE_BYTES
    weights = positions * largest_h * settings.max_seq_len * 4
    return min(request, GRPC_MAX_MESSAGE_BYTES), min(request + weights, GRPC_MAX_MESSAGE_BYTES)


class AttentionServer:
    """start() binds, warms up and reports SERVING; stop() drains within the grace period."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._batcher: Batcher | None = None
        self._metrics_http: tuple[WSGIServer, Thread] | None = None
        self._streams = StreamCloser()
        self._background: set[asyncio.Task[None]] = set()
        self.registry: ModelRegistry | None = None
        self.models: ModelController | None = None  # changes the registry after start
        self._served: ServedSet | None = None
        self._poller: asyncio.Task[None] | None = None
        self.tls: ReloadingCredentials | None = None  # set by start() when TLS is on
        self.ports: BoundPorts | None = None  # set once bound, before warm-up
        self.ready = False  # warm and not draining: V2 ServerReady / ModelReady
        self.service_names = [
            attention_pb2.DESCRIPTOR.services_by_name["AttentionService"].full_name,
            grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
        ]

    async def start(self) -> BoundPorts:
        settings = self._settings
        try:  # before the models load: a bad certificate should fail at once
            self.tls = server_tls(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
        except TlsError as err:
            raise StartupError(str(err)) from err
        restrictions = self._restrictions()
        try:
            providers = choose_providers(settings.provider)
        except RuntimeError as err:
            raise StartupError(str(err)) from err
        registry = self.registry = await self._load_models(providers)
        limits = InputLimits(settings.max_seq_len, settings.max_batch_size)
        limit_bytes = queue_bytes(settings)
        log.info("queue bounds: %d requests, %d bytes of embeddings",
                 settings.max_queue_size, limit_bytes)  # fmt: skip
        self._batcher = Batcher(
            BatchLimits(
                max_batch_size=settings.max_batch_size,
                max_queue_delay_s=settings.max_queue_delay_s,
                max_queue_size=settings.max_queue_size,
                max_padding_ratio=settings.max_padding_ratio,
                group_by_length=settings.length_grouping == "on",
                max_inflight_batches=settings.max_inflight_batches,
                max_inflight_batches_per_model=settings.max_inflight_batches_per_model,
                max_queue_bytes=limit_bytes,
            ),
            on_failure=self._on_batcher_failure,
        )
        receive_bytes, send_bytes = message_limits(registry, settings)
        assert self._served is not None
        self._served.check_limits(
            lambda model: message_limits(ModelRegistry([model], ""), settings),
            (receive_bytes, send_bytes),
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
            ),
        )
        # Per front-end process: with N of them, pass settings.max_undelivered_bytes // N.
        answers = AnswerBudget(
            settings.max_undelivered_bytes, settings.max_undelivered_bytes_per_connection
        )
        unpack = Unpacker(settings.grpc_compression, max_bytes=receive_bytes)
        add_servicer(
            server,
            attention_pb2_grpc.add_AttentionServiceServicer_to_server,
            AttentionServicer(
                registry,
                self._batcher,
                limits,
                max_stream_inflight_requests=settings.max_stream_inflight_requests,
                max_stream_pending_bytes=settings.max_stream_pending_bytes,
                streams=self._streams,
                answers=answers,
            ),
            unpack,
        )
        add_servicer(
            server,
            grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server,
            InferenceServicer(
                registry,
                self._batcher,
                settings,
                lambda: self.ready,
                streams=self._streams,
                repository=self.models,
                answers=answers,
            ),
            unpack,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME],
            server,
            pool=pool_of(
                [
                    attention_pb2.DESCRIPTOR,
                    grpc_service_pb2.DESCRIPTOR,
                    health_pb2.DESCRIPTOR,
                    reflection_pb2.DESCRIPTOR,
                ]
            ),
        )
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = grpc_address(settings.host, settings.grpc_port)
        try:
            grpc_port = (
                server.add_secure_port(address, self.tls.server())
                if self.tls is not None
                else server.add_insecure_port(address)
            )
        except RuntimeError as err:
            raise StartupError(f"cannot bind gRPC to {address}: {err}") from err
        await server.start()
        self._server = server
        try:
            self._metrics_http = start_http_server(
                settings.metrics_port, addr=bind_host(settings.host)
            )
        except OSError as err:
            raise StartupError(
                f"cannot bind metrics to {settings.host}:{settings.metrics_port}: {err}"
            ) from err
        ports = self.ports = BoundPorts(grpc_port, self._metrics_http[0].server_port)
        if self.tls is not None:
            log.info("gRPC port serves TLS%s; metrics port plain HTTP",
                     " and requires client certificates" if self.tls.mutual else "")  # fmt: skip
        log.info("listening grpc_port=%d metrics_port=%d host=%s (warming up)",
                 ports.grpc, ports.metrics, settings.host)  # fmt: skip
        await self._warm_up(registry)
        await self._batcher.start()
        self.ready = True
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        assert self._served is not None
        assert self.models is not None
        self._served.sync(ready=True)
        if settings.model_control_mode == "poll":
            self._poller = asyncio.create_task(
                self.models.poll_forever(settings.repository_poll_s), name="repository-poll"
            )
        log.info("ready: serving %s (--model-control-mode %s, --version-policy %s)",
                 registry.names(), settings.model_control_mode,
                 settings.version_policy)  # fmt: skip
        return ports

    def _restrictions(self) -> Restrictions:
        """--restricted-api, checked before anything loads; warns when explicit mode leaves
        loading and unloading open to anyone who reaches the port."""
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

    async def _load_models(self, providers: list[str]) -> ModelRegistry:
        """The versions served at start, loaded by the model controller (not yet warm)."""
        settings = self._settings
        registry = ModelRegistry([], settings.default_model)
        served = self._served = ServedSet(registry, self._health)
        self.models = build_controller(
            settings,
            providers,
            registry,
            settle=self._settle,
            changed=lambda: served.sync(ready=self.ready),
        )
        try:
            await self.models.start(settings.load_model)
        except ModelNotFound as err:
            raise StartupError(str(err)) from err
        if not registry.names() and settings.model_control_mode == "none":
            raise StartupError(
                f"no servable model under {settings.model_repository} (expected "
                "<name>/<version>/model.onnx; run `python -m export` or `make export`)"
            )
        fell_back = [m.key for m in registry.all() if CUDA in providers and m.provider != CUDA]
        if fell_back and settings.provider == "cuda":
            raise StartupError(
                f"--provider cuda, but ONNX Runtime put {fell_back} on {CPU}: are the CUDA 13 / "
                "cuDNN 9 libraries installed (pip install 'onnxruntime-gpu[cuda,cudnn]')?"
            )
        for key in fell_back:
            log.warning("%s runs on %s although a GPU is present", key, CPU)
        if not registry.names():
            log.warning(
                "no model loaded yet (--model-control-mode %s)", settings.model_control_mode
            )
        return registry

    async def _settle(self, model: OnnxModel) -> None:
        """Wait until no request for model is queued or computing (before its release)."""
        if self._batcher is not None:
            await self._batcher.settle(model)

    async def _warm_up(self, registry: ModelRegistry) -> None:
        settings = self._settings
        assert self._batcher is not None
        largest = (settings.max_batch_size, settings.max_seq_len)
        for model in registry.all():
            # On the threads that will run its batches (CUDA keeps per-thread handles), at the
            # largest shape first on CUDA; then the fused graph is timed against the unfused.
            shapes = warm_up_shapes(model.provider, *largest)
            await self._batcher.on_every_thread(functools.partial(model.warm_up, shapes))
            choice = await asyncio.to_thread(model.choose_output_graph, *largest)
            log.info("%s: %s", model.key, choice)
            caps = await asyncio.to_thread(
                model.measure_batch_caps,
                max_batch_size=settings.max_batch_size,
                max_seq_len=settings.max_seq_len,
                budget_s=settings.batch_cap_budget_s,
            )
            log.info("%s batch caps (%s): %s", model.key,
                     "measured" if settings.batch_cap_budget_s > 0 else "not measured",
                     caps.describe())  # fmt: skip
            version = str(model.spec.version)
            metrics.MODEL_READY.labels(model.spec.name, version).set(1)
            metrics.ENGINE_INFO.labels(model.spec.name, version, model.provider).set(1)

    async def _set_health(
        self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType
    ) -> None:
        for name in ["", *self.service_names]:
            await self._health.set(name, status)

    def _on_batcher_failure(self, error: BaseException) -> None:
        """The scheduler died: nothing more can be computed here, so say so to probes."""
        self.ready = False
        task = asyncio.ensure_future(self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _freeze_models(self) -> None:
        """The served set stays as it is while draining: no more polls, no explicit loads."""
        if self._poller is not None:
            self._poller.cancel()
        if self.models is not None:
            self.models.close()

    async def stop(self, *, signalled_at: float | None = None) -> None:
        """The drain, all within grace_period_s of the call: NOT_SERVING while still serving
        for shutdown_not_serving_s, then refuse new work with UNAVAILABLE and finish what was
        accepted, then close; whatever is left then fails with UNAVAILABLE."""
        settings = self._settings
        # From the signal (loop.time()), not from whenever the busy loop got round to this.
        started = asyncio.get_running_loop().time() if signalled_at is None else signalled_at
        deadline = started + settings.grace_period_s

        def remaining() -> float:
            return max(0.0, deadline - asyncio.get_running_loop().time())

        was_ready, self.ready = self.ready, False
        self._freeze_models()
        await self._health.enter_graceful_shutdown()
        if self.registry is not None:
            for model in self.registry.all():
                metrics.MODEL_READY.labels(model.spec.name, str(model.spec.version)).set(0)
        if was_ready:
            log.info(
                "NOT_SERVING for %.1fs while endpoints update", settings.shutdown_not_serving_s
            )
            await asyncio.sleep(min(settings.shutdown_not_serving_s, remaining()))
        if self._batcher is not None:
            self._batcher.refuse_new()
            self._streams.close_all()
            log.info("refusing new requests; finishing accepted ones for up to %.1fs", remaining())
            with contextlib.suppress(TimeoutError):
                margin = min(WRITE_MARGIN_S, settings.grace_period_s / 5)
                await asyncio.wait_for(self._batcher.drain(), timeout=remaining() - margin)
            over = ShuttingDown("the grace period ended before it was computed; retry")
            self._batcher.fail_queued(over)
            self._batcher.fail_running(over)
            # Calls already on the wire when gRPC closes are cancelled by its core (CANCELLED,
            # which clients do not retry); refusing a moment longer answers them UNAVAILABLE.
            await asyncio.sleep(min(REFUSE_LINGER_S, remaining() / 2))
        if self._server is not None:
            # Lets finished handlers write their answers; cancels what is still running.
            await self._server.stop(remaining())
        if self._batcher is not None:
            await self._batcher.stop(timeout_s=remaining())
        if self._metrics_http is not None:
            # shutdown() waits for the server's 0.5 s poll; on a daemon thread of its own that
            # wait need not delay the exit.
            httpd, _ = self._metrics_http
            Thread(target=_close_http, args=(httpd,), daemon=True, name="metrics-close").start()
        log.info("stopped")
