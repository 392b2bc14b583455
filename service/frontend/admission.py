"""What both APIs do between decoding a request and awaiting its answer."""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from service.catalog import ServedModel
from service.dataplane import DataPlane, Result
from service.errors import InvalidInput
from service.frontend.validation import InputLimits, as_sequence_batch
from service.observability import tracing


class HasDeadline(Protocol):
    """What admission needs of a call: a gRPC ServicerContext, or the REST front end's."""

    def time_remaining(self) -> float | None: ...


def deadline_of(context: HasDeadline) -> float | None:
    """The client's deadline on the time.monotonic() clock, if it set one."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


async def admit_and_run(
    plane: DataPlane,
    model: ServedModel,
    received: np.ndarray,
    limits: InputLimits,
    *,
    with_weights: bool,
    context: HasDeadline,
) -> Result:
    """Validate decoded embeddings against the model, then queue them in the model's dtype."""
    batch = as_sequence_batch(
        received, embed_dim=model.spec.embed_dim, limits=limits, model=model.spec.name
    )
    if with_weights and not model.has_weights_graph:
        raise InvalidInput(
            f"model {model.spec.name!r} version {model.spec.version} was exported without "
            "the attention_weights graph; do not ask for the weights"
        )
    cast = batch.astype(model.spec.dtype, copy=False)
    if cast is not batch and not np.isfinite(cast).all():
        # Finite float32 values above float16's range (65504) become inf in the cast.
        bad = int(np.count_nonzero(~np.isfinite(cast)))
        raise InvalidInput(
            f"embeddings holds {bad} values outside {cast.dtype}'s finite range (largest "
            f"{float(np.finfo(cast.dtype).max):g}), the dtype of model {model.spec.name!r}; "
            "scale them down"
        )
    result = await plane.infer(
        model,
        cast,
        with_weights=with_weights,
        deadline=deadline_of(context),
        tag=tracing.current_tag(),
    )
    if tracing.enabled():
        try:
            _record_spans(model, cast, result)
        except BaseException:
            result.release()  # the caller never sees the result, so it cannot release it
            raise
    return result


def _record_spans(model: ServedModel, cast: np.ndarray, result: Result) -> None:
    tracing.record_batch(
        model=model.spec.name,
        version=model.spec.version,
        sequences=cast.shape[0],
        length=cast.shape[1],
        queue_s=result.queue_s,
        compute_s=result.compute_s,
        started_at=result.started_at,
        batch_size=result.batch_size,
        padding=result.padding,
        batch_id=result.batch_id,
        tags=result.batch_tags,
    )
