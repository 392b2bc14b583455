"""The loaded models, and the lookup that turns a request's (model, version) into one."""

from __future__ import annotations

from collections.abc import Iterable

from service.errors import ModelNotFound
from service.text import shown
from service.worker.engine.onnx_model import OnnxModel
from service.worker.engine.repository import VERSION_RULE, parse_version

SERVER_LABEL = "_server"  # metric label of calls that name no model


class ModelRegistry:
    """Name -> versions: the set being served now. publish() and withdraw() swap in a new
    mapping (copy on write), so a lookup sees the set before or after a change, never half."""

    def __init__(self, models: Iterable[OnnxModel], default_model: str) -> None:
        self._versions: dict[str, dict[int, OnnxModel]] = {}
        for model in models:
            self._versions.setdefault(model.spec.name, {})[model.spec.version] = model
        self.default_model = default_model

    def publish(self, model: OnnxModel) -> OnnxModel | None:
        """Serve model (warm already); returns the object it replaces at that version."""
        name, version = model.spec.name, model.spec.version
        versions = dict(self._versions.get(name, {}))
        replaced = versions.get(version)
        versions[version] = model
        self._versions = {**self._versions, name: versions}
        return replaced

    def withdraw(self, name: str, version: int) -> OnnxModel | None:
        """Stop resolving (name, version); returns the model, whose queued work may remain."""
        versions = dict(self._versions.get(name, {}))
        model = versions.pop(version, None)
        if model is None:
            return None
        swapped = {**self._versions, name: versions}
        if not versions:
            del swapped[name]
        self._versions = swapped
        return model

    def loaded(self, name: str) -> dict[int, OnnxModel]:
        """Version -> model of one name (empty when none is served)."""
        return dict(self._versions.get(name, {}))

    def names(self) -> list[str]:
        return sorted(self._versions)

    def versions(self, name: str) -> list[OnnxModel]:
        """Newest first; empty when the model is not (or no longer) served."""
        versions = self._versions.get(name, {})
        return [versions[v] for v in sorted(versions, reverse=True)]

    def all(self) -> list[OnnxModel]:
        served = self._versions
        return [
            served[name][v] for name in sorted(served) for v in sorted(served[name], reverse=True)
        ]

    def metric_label(self, name: str) -> str:
        """The model label for metrics: a served name, or '_unknown' (bounded cardinality)."""
        name = name or self.default_model
        return name if name in self._versions else "_unknown"

    def resolve(self, name: str, version: str) -> OnnxModel:
        """Empty name = default model, empty version = newest; else ModelNotFound."""
        name = name or self.default_model
        served = self._versions
        if name not in served:
            raise ModelNotFound(f"unknown model {shown(name)}; this server serves {sorted(served)}")
        versions = served[name]
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
