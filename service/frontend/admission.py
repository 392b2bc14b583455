"""What both APIs do between decoding a request and awaiting its answer."""

from __future__ import annotations

import time

import grpc
import numpy as np

from service.catalog import ServedModel
from service.dataplane import DataPlane, Result
from service.errors import InvalidInput
from service.frontend.validation import InputLimits, as_sequence_batch


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
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
    context: grpc.aio.ServicerContext,
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
    return await plane.infer(
        model,
        cast,
        with_weights=with_weights,
        deadline=deadline_of(context),
    )
