"""The server's side of model control: how a version is opened and warmed with this server's
settings, and how metrics and health follow the served set."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from grpc_health.v1 import health, health_pb2

from service.observability import metrics
from service.settings import Settings
from service.worker.engine.cuda import cuda_options_for
from service.worker.engine.model_control import Hooks, ModelController
from service.worker.engine.onnx_model import OnnxModel, count_sessions, warm_up_shapes
from service.worker.engine.registry import ModelRegistry
from service.worker.engine.repository import VersionFiles, VersionPolicy, discover

log = logging.getLogger(__name__)


def build_controller(
    settings: Settings,
    providers: list[str],
    registry: ModelRegistry,
    *,
    settle: Callable[[OnnxModel], Awaitable[None]],
    changed: Callable[[], None],
) -> ModelController:
    follow = settings.repository_follow_symlinks == "on"
    found = discover(settings.model_repository, quiet=True, follow_symlinks=follow)
    # Each session's arena bound: a share of --gpu-mem-fraction over the sessions at start.
    cuda = cuda_options_for(
        providers,
        tf32=settings.cuda_tf32 == "on",
        memory_fraction=settings.gpu_mem_fraction,
        sessions=count_sessions(found, settings.fused_attention, providers[0]),
    )

    def open_model(files: VersionFiles) -> OnnxModel:
        model = OnnxModel(
            files,
            providers,
            settings.intra_op_threads,
            intra_op_spinning=settings.intra_op_spinning == "on",
            cpu_arena=settings.cpu_arena == "on",
            cuda=cuda,
            fused=settings.fused_attention,
        )
        # What GetModel shows until warm-up has measured caps.
        model.measure_batch_caps(
            max_batch_size=settings.max_batch_size, max_seq_len=settings.max_seq_len, budget_s=0
        )
        return model

    def prepare(model: OnnxModel) -> None:
        largest = (settings.max_batch_size, settings.max_seq_len)
        model.warm_up(warm_up_shapes(model.provider, *largest))
        log.info("%s: %s", model.key, model.choose_output_graph(*largest))
        caps = model.measure_batch_caps(
            max_batch_size=settings.max_batch_size,
            max_seq_len=settings.max_seq_len,
            budget_s=settings.batch_cap_budget_s,
        )
        log.info("%s warm; batch caps: %s", model.key, caps.describe())

    def event(name: str, action: str, outcome: str) -> None:
        metrics.MODEL_LOAD_EVENTS.labels(name, action, outcome).inc()

    return ModelController(
        registry,
        settings.model_repository,
        mode=settings.model_control_mode,
        policy=VersionPolicy.parse(settings.version_policy),
        hooks=Hooks(
            open_model=open_model, prepare=prepare, settle=settle, changed=changed, event=event
        ),
        follow_symlinks=follow,
    )


class ServedSet:
    """Keeps attention_model_ready, attention_engine_info and the per-model health entries
    (service name = model name) equal to what the registry serves."""

    def __init__(self, registry: ModelRegistry, health_servicer: health.aio.HealthServicer):
        self._registry = registry
        self._health = health_servicer
        self._shown: set[tuple[str, str, str]] = set()  # (model, version, provider)
        self._tasks: set[asyncio.Task[None]] = set()
        self._health_order = asyncio.Lock()  # FIFO: updates land in the order of the changes
        self._needs: Callable[[OnnxModel], tuple[int, int]] | None = None
        self._limits = (0, 0)

    def check_limits(
        self, needs: Callable[[OnnxModel], tuple[int, int]], limits: tuple[int, int]
    ) -> None:
        """From now on, warn about a newly served version whose largest legal call (receive,
        send bytes) exceeds the gRPC message limits the server was started with."""
        self._needs, self._limits = needs, limits

    def sync(self, *, ready: bool) -> None:
        """Call on the event loop after every change (and once the server is ready)."""
        served = {
            (model.spec.name, str(model.spec.version), model.provider)
            for model in self._registry.all()
        }
        self._warn_too_large(served - self._shown)
        for name, version, provider in self._shown - served:
            metrics.MODEL_READY.remove(name, version)
            metrics.ENGINE_INFO.remove(name, version, provider)
        for name, version, provider in served:
            metrics.MODEL_READY.labels(name, version).set(1 if ready else 0)
            metrics.ENGINE_INFO.labels(name, version, provider).set(1)
        names = {name for name, _, _ in served}
        statuses = {
            name: health_pb2.HealthCheckResponse.SERVING
            if ready and name in names
            else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in names | {name for name, _, _ in self._shown}
        }
        self._shown = served
        task = asyncio.ensure_future(self._set_health(statuses))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _warn_too_large(self, new: set[tuple[str, str, str]]) -> None:
        if self._needs is None:
            return
        for model in self._registry.all():
            if (model.spec.name, str(model.spec.version), model.provider) not in new:
                continue
            needs = self._needs(model)
            if needs[0] > self._limits[0] or needs[1] > self._limits[1]:
                log.warning(
                    "%s takes calls of up to %d bytes (answers %d) but the gRPC limits were set "
                    "at start to %d (%d) from the models served then: larger calls get "
                    "RESOURCE_EXHAUSTED until a restart", model.key, *needs, *self._limits,
                )  # fmt: skip

    async def _set_health(self, statuses: dict[str, int]) -> None:
        # set() can wait (a Watch call holds its entry while it writes): without the lock, an
        # older update could finish after a newer one and leave a stale status.
        async with self._health_order:
            for name, status in statuses.items():
                await self._health.set(name, status)  # type: ignore[arg-type]
