"""The loaded models, and the lookup that turns a request's (model, version) into one."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from service.engine.onnx_model import BrokenModel, OnnxModel
from service.engine.repository import VERSION_RULE, VersionFiles, parse_version
from service.errors import ModelNotFound
from service.text import shown

log = logging.getLogger(__name__)
SERVER_LABEL = "_server"  # metric label of calls that name no model


class ModelRegistry:
    """Name -> versions (newest last). Immutable once loaded."""

    def __init__(self, models: Iterable[OnnxModel], default_model: str) -> None:
        self._versions: dict[str, dict[int, OnnxModel]] = {}
        for model in models:
            self._versions.setdefault(model.spec.name, {})[model.spec.version] = model
        self.default_model = default_model

    @classmethod
    def load(
        cls,
        found: Iterable[VersionFiles],
        *,
        providers: list[str],
        intra_op_threads: int,
        intra_op_spinning: bool = False,
        cpu_arena: bool = False,
        default_model: str,
    ) -> ModelRegistry:
        """Load every version that works; a broken one is logged and skipped."""
        models = []
        for files in found:
            try:
                model = OnnxModel(
                    files,
                    providers,
                    intra_op_threads,
                    intra_op_spinning=intra_op_spinning,
                    cpu_arena=cpu_arena,
                )
            except BrokenModel as err:
                log.error("not serving %s version %d: %s", files.name, files.version, err)
                continue
            log.info(
                "loaded %s version %d (d=%d, h=%d, causal=%s) on %s",
                files.name, files.version, model.spec.embed_dim, model.spec.num_heads,
                model.spec.causal, model.provider,
            )  # fmt: skip
            models.append(model)
        return cls(models, default_model)

    def names(self) -> list[str]:
        return sorted(self._versions)

    def versions(self, name: str) -> list[OnnxModel]:
        """Newest first."""
        return [self._versions[name][v] for v in sorted(self._versions[name], reverse=True)]

    def all(self) -> list[OnnxModel]:
        return [model for name in self.names() for model in self.versions(name)]

    def metric_label(self, name: str) -> str:
        """The model label for metrics: a served name, or '_unknown' (bounded cardinality)."""
        name = name or self.default_model
        return name if name in self._versions else "_unknown"

    def resolve(self, name: str, version: str) -> OnnxModel:
        """Empty name = default model, empty version = newest; else ModelNotFound."""
        name = name or self.default_model
        if name not in self._versions:
            raise ModelNotFound(f"unknown model {shown(name)}; this server serves {self.names()}")
        versions = self._versions[name]
        if not version:
            return versions[max(versions)]
        number = parse_version(version)
        if number is None:
            raise ModelNotFound(
                f"model {shown(name)} has no version {shown(version)}: a version is "
                f"{VERSION_RULE}; available versions: {sorted(versions)}"
            )
        if number not in versions:
            raise ModelNotFound(
                f"model {shown(name)} has no version {shown(version)}; "
                f"available versions: {sorted(versions)}"
            )
        return versions[number]
