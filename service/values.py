"""Checks on an input's values, made where its bytes are first read: in the front end for a
tensor in the message, in the worker for one in a client's shared-memory region."""

from __future__ import annotations

import numpy as np

from service.errors import InvalidInput
from service.text import shown


def check_finite(batch: np.ndarray) -> None:
    if not np.isfinite(batch).all():
        bad = int(np.count_nonzero(~np.isfinite(batch)))
        raise InvalidInput(
            f"embeddings holds {bad} non-finite values (NaN or inf); expected finite"
        )


def in_model_dtype(batch: np.ndarray, dtype: np.dtype, model: str) -> np.ndarray:
    """batch (finite) in the model's dtype; InvalidInput where the cast overflows."""
    cast = batch.astype(dtype, copy=False)
    if cast is not batch and not np.isfinite(cast).all():
        # Finite float32 values above float16's range (65504) become inf in the cast.
        bad = int(np.count_nonzero(~np.isfinite(cast)))
        raise InvalidInput(
            f"embeddings holds {bad} values outside {cast.dtype}'s finite range (largest "
            f"{float(np.finfo(cast.dtype).max):g}), the dtype of model {shown(model)}; "
            "scale them down"
        )
    return cast
