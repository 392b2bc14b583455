"""What the control messages carry besides plain numbers: the errors that cross between the
processes (by name), and model snapshots, statistics and index rows as JSON values and back.
The messages themselves are records (records.py), turned into bytes by codec.py."""

from __future__ import annotations

from typing import Any

import numpy as np

from service import errors
from service.catalog import BatchCaps, ModelSpec, ModelView, ServedModel
from service.dataplane import Duration, IndexEntry, VersionStats
from service.ipc.keys import ModelKey
from service.ipc.records import ErrorText

CANCELLED = "Cancelled"  # the kind of a Fail for a request the front end cancelled
INTERNAL = "Internal"  # the kind of an error no front end rebuilds: INTERNAL for the client

# Errors a client may see the message of, by name; anything else arrives as INTERNAL.
ERRORS: dict[str, type[errors.ServingError]] = {
    kind.__name__: kind
    for kind in (
        errors.InvalidInput,
        errors.NonFiniteOutput,
        errors.ModelNotFound,
        errors.QueueFull,
        errors.DeadlineExpired,
        errors.ShuttingDown,
        errors.NotSupported,
        errors.ModelLoadFailed,
        errors.ModelControlDisabled,
        errors.RegionNotFound,
        errors.RegionExists,
        errors.RegionsExhausted,
    )
}


class WorkerError(RuntimeError):
    """The worker failed a request unexpectedly (logged there); INTERNAL for the client."""


def error_kind(error: BaseException) -> str:
    """The nearest class a front end can rebuild (SchedulerFailed -> ShuttingDown)."""
    for kind in type(error).__mro__:
        if kind.__name__ in ERRORS:
            return kind.__name__
    return INTERNAL


def error_text(error: BaseException, internal: str) -> ErrorText:
    """What a front end is told of error: its kind and message, or for an unexpected one
    (logged in the worker) only internal."""
    kind = error_kind(error)
    return ErrorText(kind, str(error) if kind != INTERNAL else internal)


def rebuild_error(kind: str, message: str) -> Exception:
    known = ERRORS.get(kind)
    return known(message) if known is not None else WorkerError(message)


def model_to_json(model: ServedModel) -> dict[str, Any]:
    spec = model.spec
    return {
        ModelKey.KEY: model.key,
        ModelKey.NAME: spec.name,
        ModelKey.VERSION: spec.version,
        ModelKey.EMBED_DIM: spec.embed_dim,
        ModelKey.NUM_HEADS: spec.num_heads,
        ModelKey.CAUSAL: spec.causal,
        ModelKey.DTYPE: spec.dtype.name,
        ModelKey.WEIGHTS_SHA256: spec.weights_sha256,
        ModelKey.WEIGHTS_SOURCE: spec.weights_source,
        ModelKey.PROVIDER: model.provider,
        ModelKey.CAPS: [list(cap) for cap in model.batch_caps.caps],
        ModelKey.HAS_WEIGHTS_GRAPH: model.has_weights_graph,
    }


def model_from_json(data: dict[str, Any]) -> ModelView:
    spec = ModelSpec(
        name=data[ModelKey.NAME],
        version=int(data[ModelKey.VERSION]),
        embed_dim=int(data[ModelKey.EMBED_DIM]),
        num_heads=int(data[ModelKey.NUM_HEADS]),
        causal=bool(data[ModelKey.CAUSAL]),
        dtype=np.dtype(data[ModelKey.DTYPE]),
        weights_sha256=data[ModelKey.WEIGHTS_SHA256],
        weights_source=data[ModelKey.WEIGHTS_SOURCE],
    )
    caps = BatchCaps(tuple((int(length), int(size)) for length, size in data[ModelKey.CAPS]))
    return ModelView(
        data[ModelKey.KEY],
        spec,
        data[ModelKey.PROVIDER],
        caps,
        bool(data[ModelKey.HAS_WEIGHTS_GRAPH]),
    )


def _duration(data: list[int]) -> Duration:
    return Duration(count=int(data[0]), ns=int(data[1]))


def stats_to_json(stats: VersionStats) -> dict[str, Any]:
    def pair(duration: Duration) -> list[int]:
        return [duration.count, duration.ns]

    return {
        "inference_count": stats.inference_count,
        "execution_count": stats.execution_count,
        "last_inference_ms": stats.last_inference_ms,
        "success": pair(stats.success),
        "fail": pair(stats.fail),
        "queue": pair(stats.queue),
        "compute_infer": pair(stats.compute_infer),
        "batches": {str(size): pair(d) for size, d in stats.batches.items()},
    }


def stats_from_json(data: dict[str, Any]) -> VersionStats:
    stats = VersionStats(
        inference_count=int(data["inference_count"]),
        execution_count=int(data["execution_count"]),
        last_inference_ms=int(data["last_inference_ms"]),
        success=_duration(data["success"]),
        fail=_duration(data["fail"]),
        queue=_duration(data["queue"]),
        compute_infer=_duration(data["compute_infer"]),
    )
    for size, duration in data["batches"].items():
        stats.batches[int(size)] = _duration(duration)
    return stats


def index_to_json(entry: IndexEntry) -> list[Any]:
    return [entry.name, entry.version, entry.state, entry.reason]


def index_from_json(row: list[Any]) -> IndexEntry:
    return IndexEntry(str(row[0]), int(row[1]), str(row[2]), str(row[3]))
