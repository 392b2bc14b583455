"""What both sides know of a served model version: its spec, batch caps, and the registry
that turns a request's (model, version) into one. Shared by the worker, which holds ONNX
Runtime models, and the front ends, which hold ModelView snapshots of them; imports no
engine."""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np

from service.errors import InvalidInput, ModelNotFound
from service.settings import VERSION_POLICY
from service.text import shown, shown_names

# One strict rule for version folders and requested versions: ASCII digits, no leading zero,
# at most 18 digits. str.isdigit() also takes "²" (int() refuses it) and "１" or "١" (int()
# reads 1), and "01" would name the same version as "1"; all of those are not versions.
VERSION = re.compile(r"[1-9][0-9]{0,17}")
VERSION_RULE = "a positive decimal integer in ASCII digits without leading zeros, at most 18"


def parse_version(text: str) -> int | None:
    """The version a folder name or a request names, or None when it breaks the rule."""
    return int(text) if VERSION.fullmatch(text) else None


POLICY_RULE = "all or latest:N with N a positive integer"


@dataclass(frozen=True)
class VersionPolicy:
    """Which versions of a model are served: every one (latest None) or the newest N."""

    latest: int | None = None

    @classmethod
    def parse(cls, text: str) -> VersionPolicy:
        if VERSION_POLICY.fullmatch(text) is None:  # the rule the settings check
            raise ValueError(f"version policy {text!r} is not {POLICY_RULE}")
        return cls(None if text == "all" else int(text.removeprefix("latest:")))

    def select(self, versions: Iterable[int]) -> set[int]:
        newest_first = sorted(set(versions), reverse=True)
        return set(newest_first if self.latest is None else newest_first[: self.latest])

    def __str__(self) -> str:
        return "all" if self.latest is None else f"latest:{self.latest}"


def check_repository_name(name: str) -> None:
    """This server has one repository; Triton's clients send an empty name."""
    if name:
        raise InvalidInput(
            f"repository_name {shown(name)}: this server has one model repository; leave "
            "repository_name empty"
        )


@dataclass(frozen=True)
class ModelSpec:
    """What the ONNX metadata says about a model version."""

    name: str
    version: int
    embed_dim: int
    num_heads: int
    causal: bool
    dtype: np.dtype
    weights_sha256: str
    weights_source: str


def length_buckets(max_seq_len: int, smallest: int = 16) -> list[int]:
    """16, 32, 64, ... up to and including max_seq_len."""
    buckets = []
    length = smallest
    while length < max_seq_len:
        buckets.append(length)
        length *= 2
    return [*buckets, max_seq_len]


@dataclass(frozen=True)
class BatchCaps:
    """Ascending (longest sequence length, most sequences) pairs; the last covers the rest."""

    caps: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        lengths = [length for length, _ in self.caps]
        if not self.caps or lengths != sorted(set(lengths)):
            raise ValueError(f"caps must be non-empty and ascending by length, got {self.caps}")
        if any(size < 1 for _, size in self.caps):
            raise ValueError(f"every cap must be >= 1, got {self.caps}")

    @classmethod
    def uniform(cls, max_batch_size: int, max_seq_len: int) -> BatchCaps:
        """No measurement: every length may fill max_batch_size."""
        return cls(((max_seq_len, max_batch_size),))

    def cap_for(self, longest_seq: int) -> int:
        """Most sequences in a batch whose longest sequence has this length."""
        lengths = [length for length, _ in self.caps]
        index = min(bisect.bisect_left(lengths, longest_seq), len(self.caps) - 1)
        return self.caps[index][1]

    def describe(self) -> str:
        return ", ".join(f"seq<={length}: {size}" for length, size in self.caps)

    def merged(self) -> BatchCaps:
        """Buckets whose cap equals the next one's dropped: same caps, shorter to read."""
        kept: list[tuple[int, int]] = []
        for length, size in self.caps:
            if kept and kept[-1][1] == size:
                kept[-1] = (length, size)
            else:
                kept.append((length, size))
        return BatchCaps(tuple(kept))


class ServedModel(Protocol):
    """What front ends and the registry read of a version (an OnnxModel or a ModelView)."""

    @property
    def key(self) -> str: ...

    @property
    def spec(self) -> ModelSpec: ...

    @property
    def provider(self) -> str: ...

    @property
    def batch_caps(self) -> BatchCaps: ...

    @property
    def label(self) -> str: ...

    @property
    def has_weights_graph(self) -> bool: ...


@dataclass(frozen=True)
class ModelView:
    """A front end's copy of what the worker serves: everything but the sessions."""

    key: str
    spec: ModelSpec
    provider: str
    batch_caps: BatchCaps
    has_weights_graph: bool

    @property
    def label(self) -> str:
        """Metric label: the model name (versions would multiply series)."""
        return self.spec.name

    @classmethod
    def of(cls, model: ServedModel) -> ModelView:
        return cls(model.key, model.spec, model.provider, model.batch_caps, model.has_weights_graph)


M = TypeVar("M", bound=ServedModel)


SERVER_LABEL = "_server"  # metric label of calls that name no model
UNKNOWN_LABEL = "_unknown"  # metric label of calls that name a model not served


class ModelRegistry(Generic[M]):
    """Name -> versions: the set being served now. publish() and withdraw() swap in a new
    mapping (copy on write), so a lookup sees the set before or after a change, never half."""

    def __init__(self, models: Iterable[M], default_model: str) -> None:
        self._versions: dict[str, dict[int, M]] = {}
        for model in models:
            self._versions.setdefault(model.spec.name, {})[model.spec.version] = model
        self.default_model = default_model
        # Successful lookups of the current mapping (every request makes one): at most one per
        # served version and its spellings ("" and the number), so it stays small.
        self._found: dict[tuple[str, str], M] = {}
        self._found_in = self._versions

    def publish(self, model: M) -> M | None:
        """Serve model (warm already); returns the object it replaces at that version."""
        name, version = model.spec.name, model.spec.version
        versions = dict(self._versions.get(name, {}))
        replaced = versions.get(version)
        versions[version] = model
        self._versions = {**self._versions, name: versions}
        return replaced

    def withdraw(self, name: str, version: int) -> M | None:
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

    def loaded(self, name: str) -> dict[int, M]:
        """Version -> model of one name (empty when none is served)."""
        return dict(self._versions.get(name, {}))

    def names(self) -> list[str]:
        return sorted(self._versions)

    def versions(self, name: str) -> list[M]:
        """Newest first; empty when the model is not (or no longer) served."""
        versions = self._versions.get(name, {})
        return [versions[v] for v in sorted(versions, reverse=True)]

    def all(self) -> list[M]:
        served = self._versions
        return [
            served[name][v] for name in sorted(served) for v in sorted(served[name], reverse=True)
        ]

    def metric_label(self, name: str) -> str:
        """The model label for metrics: a served name, or '_unknown' (bounded cardinality)."""
        name = name or self.default_model
        return name if name in self._versions else UNKNOWN_LABEL

    def resolve(self, name: str, version: str) -> M:
        """Empty name = default model, empty version = newest; else ModelNotFound."""
        if self._found_in is not self._versions:  # published or withdrawn since
            self._found, self._found_in = {}, self._versions
        found = self._found.get((name, version))
        if found is None:
            found = self._found[name, version] = self._lookup(name, version)
        return found

    def _lookup(self, name: str, version: str) -> M:
        name = name or self.default_model
        served = self._versions
        if name not in served:
            raise ModelNotFound(
                f"unknown model {shown(name)}; this server serves {shown_names(sorted(served))}",
                f"no model {shown(name)} is served here",
            )
        versions = served[name]
        if not version:
            return versions[max(versions)]
        number = parse_version(version)
        if number is None:
            raise ModelNotFound(
                f"model {shown(name)} has no version {shown(version)}: a version is "
                f"{VERSION_RULE}; available versions: {sorted(versions)}",
                f"no model {shown(name)} version {shown(version)} is served here",
            )
        if number not in versions:
            raise ModelNotFound(
                f"model {shown(name)} has no version {shown(version)}; "
                f"available versions: {sorted(versions)}",
                f"no model {shown(name)} version {shown(version)} is served here",
            )
        return versions[number]
