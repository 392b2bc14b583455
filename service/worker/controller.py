"""How the worker opens and warms a model version with this server's settings."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from service.catalog import VersionPolicy
from service.observability import metrics
from service.settings import Settings
from service.worker.engine.cuda import cuda_options_for
from service.worker.engine.model_control import Hooks, ModelController
from service.worker.engine.onnx_model import OnnxModel, count_sessions, warm_up_shapes
from service.worker.engine.registry import ModelRegistry
from service.worker.engine.repository import VersionFiles, discover

log = logging.getLogger(__name__)


def build_controller(
    settings: Settings,
    providers: list[str],
    registry: ModelRegistry[OnnxModel],
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
            cpu_arena=settings.cpu_arena,
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
        follow_symlinks=follow,
        hooks=Hooks(
            open_model=open_model, prepare=prepare, settle=settle, changed=changed, event=event
        ),
    )
