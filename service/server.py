"""The gRPC server: wires models, batcher and servicers; owns startup and graceful drain."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from threading import Thread
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from service import metrics
from service.attention_servicer import AttentionServicer
from service.batch_types import BatchLimits
from service.batcher import Batcher
from service.engine import CPU, CUDA, choose_providers
from service.generated.attention.v1 import attention_pb2, attention_pb2_grpc
from service.generated.inference import grpc_service_pb2, grpc_service_pb2_grpc
from service.grpc_options import GRPC_MAX_MESSAGE_BYTES, server_options
from service.handlers import add_servicer
from service.model_repository import discover
from service.registry import ModelRegistry
from service.settings import Settings
from service.v2_servicer import InferenceServicer
from service.validation import InputLimits

log = logging.getLogger(__name__)
ServingStatus = health_pb2.HealthCheckResponse.ServingStatus.ValueType

ENVELOPE_BYTES = 1 << 20  # headroom for the non-tensor fields and protobuf framing


class StartupError(RuntimeError):
    """The server cannot serve anything; the message says why."""


@dataclass(frozen=True)
class BoundPorts:
    grpc: int
    metrics: int


def message_limits(registry: ModelRegistry, settings: Settings) -> tuple[int, int]:
    """(receive, send) byte limits from the largest legal request and response."""
    largest_d = max(model.spec.embed_dim for model in registry.all())
    largest_h = max(model.spec.num_heads for model in registry.all())
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
        self.registry: ModelRegistry | None = None
        self.ports: BoundPorts | None = None  # set once bound, before warm-up
        self.ready = False  # warm and not draining: V2 ServerReady / ModelReady
        self.service_names = [
            attention_pb2.DESCRIPTOR.services_by_name["AttentionService"].full_name,
            grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
        ]

    async def start(self) -> BoundPorts:
        settings = self._settings
        try:
            providers = choose_providers(settings.provider)
        except RuntimeError as err:
            raise StartupError(str(err)) from err
        found = discover(settings.model_repository)
        registry = await asyncio.to_thread(
            ModelRegistry.load,
            found,
            providers=providers,
            intra_op_threads=settings.intra_op_threads,
            intra_op_spinning=settings.intra_op_spinning == "on",
            default_model=settings.default_model,
        )
        if not registry.names():
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
        self.registry = registry
        limits = InputLimits(settings.max_seq_len, settings.max_batch_size)
        self._batcher = Batcher(
            BatchLimits(
                max_batch_size=settings.max_batch_size,
                max_queue_delay_s=settings.max_queue_delay_s,
                max_queue_size=settings.max_queue_size,
                max_padding_ratio=settings.max_padding_ratio,
                max_inflight_batches=settings.max_inflight_batches,
            )
        )
        receive_bytes, send_bytes = message_limits(registry, settings)
        server = grpc.aio.server(
            options=server_options(receive_bytes=receive_bytes, send_bytes=send_bytes)
        )
        add_servicer(
            server,
            attention_pb2_grpc.add_AttentionServiceServicer_to_server,
            AttentionServicer(
                registry,
                self._batcher,
                limits,
                max_stream_inflight_requests=settings.max_stream_inflight_requests,
            ),
        )
        add_servicer(
            server,
            grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server,
            InferenceServicer(registry, self._batcher, settings, lambda: self.ready),
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{settings.host}:{settings.grpc_port}"
        try:
            grpc_port = server.add_insecure_port(address)
        except RuntimeError as err:
            raise StartupError(f"cannot bind gRPC to {address}: {err}") from err
        await server.start()
        self._server = server
        try:
            self._metrics_http = start_http_server(settings.metrics_port, addr=settings.host)
        except OSError as err:
            raise StartupError(
                f"cannot bind metrics to {settings.host}:{settings.metrics_port}: {err}"
            ) from err
        ports = self.ports = BoundPorts(grpc_port, self._metrics_http[0].server_port)
        log.info("listening grpc_port=%d metrics_port=%d host=%s (warming up)",
                 ports.grpc, ports.metrics, settings.host)  # fmt: skip
        await self._warm_up(registry)
        await self._batcher.start()
        self.ready = True
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("ready: serving %s", registry.names())
        return ports

    async def _warm_up(self, registry: ModelRegistry) -> None:
        settings = self._settings
        for model in registry.all():
            await asyncio.to_thread(model.warm_up)
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

    async def stop(self) -> None:
        """NOT_SERVING, refuse new calls, finish accepted ones (at most grace_period_s)."""
        grace = self._settings.grace_period_s
        self.ready = False
        await self._health.enter_graceful_shutdown()
        if self.registry is not None:
            for model in self.registry.all():
                metrics.MODEL_READY.labels(model.spec.name, str(model.spec.version)).set(0)
        if self._server is not None and self._batcher is not None:
            flushing = asyncio.create_task(self._batcher.drain())
            await self._server.stop(grace)
            flushing.cancel()
        if self._batcher is not None:
            await self._batcher.stop()
        if self._metrics_http is not None:
            httpd, thread = self._metrics_http
            httpd.shutdown()
            httpd.server_close()
            thread.join(timeout=5)
        log.info("stopped")
