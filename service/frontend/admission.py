"""What both APIs do between decoding a request and awaiting its answer."""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from service.catalog import ServedModel
from service.dataplane import DataPlane, RegionTensor, Result, Targets
from service.errors import InvalidInput
from service.frontend.validation import InputLimits, as_sequence_batch, sequence_batch_shape
from service.observability import tracing
from service.text import model_reference
from service.values import in_model_dtype


class HasDeadline(Protocol):
    """What admission needs of a call: a gRPC ServicerContext, or the REST front end's."""

    def time_remaining(self) -> float | None: ...


class WithTimeout:
    """A call's deadline, or a sooner one of the request's own (V2's timeout parameter)."""

    def __init__(self, context: HasDeadline, within_s: float) -> None:
        self._context = context
        self._deadline = time.monotonic() + within_s

    def time_remaining(self) -> float | None:
        own = self._deadline - time.monotonic()
        other = self._context.time_remaining()
        return own if other is None else min(own, other)


def deadline_of(context: HasDeadline) -> float | None:
    """The client's deadline on the time.monotonic() clock, if it set one."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


async def admit_and_run(
    plane: DataPlane,
    model: ServedModel,
    received: np.ndarray | RegionTensor,
    limits: InputLimits,
    *,
    with_weights: bool,
    context: HasDeadline,
    targets: Targets | None = None,
) -> Result:
    """Validate decoded embeddings against the model, then queue them in the model's dtype.
    Embeddings in a client's region are checked here by shape; their values, the worker
    checks once it has read them (with the same messages)."""
    name = model.spec.name
    embeddings = received
    if isinstance(received, RegionTensor):
        sequence_batch_shape(
            list(received.shape), embed_dim=model.spec.embed_dim, limits=limits, model=name
        )
    else:
        embeddings = as_sequence_batch(
            received, embed_dim=model.spec.embed_dim, limits=limits, model=name
        )
    if with_weights and not model.has_weights_graph:
        raise InvalidInput(
            f"{model_reference(model.spec.name, model.spec.version)} was exported without "
            "the attention_weights graph; do not ask for the weights"
        )
    if isinstance(embeddings, np.ndarray):
        embeddings = in_model_dtype(embeddings, model.spec.dtype, name)
    result = await plane.infer(
        model,
        embeddings,
        with_weights=with_weights,
        deadline=deadline_of(context),
        tag=tracing.current_tag(),
        targets=targets,
    )
    if tracing.enabled():
        try:
            _record_spans(model, embeddings.shape, result)
        except BaseException:
            result.release()  # the caller never sees the result, so it cannot release it
            raise
    return result


def _record_spans(model: ServedModel, shape: tuple[int, ...], result: Result) -> None:
    tracing.record_batch(
        model=model.spec.name,
        version=model.spec.version,
        sequences=shape[0],
        length=shape[1],
        queue_s=result.queue_s,
        compute_s=result.compute_s,
        started_at=result.started_at,
        batch_size=result.batch_size,
        padding=result.padding,
        batch_id=result.batch_id,
        tags=result.batch_tags,
    )
