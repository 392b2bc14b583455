"""Checks on decoded inputs, so that nothing malformed ever reaches a batch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.errors import InvalidInput


@dataclass(frozen=True)
class InputLimits:
    max_seq_len: int
    max_batch_size: int


def as_sequence_batch(
    embeddings: np.ndarray, *, embed_dim: int, limits: InputLimits, model: str
) -> np.ndarray:
    """[seq, d] or [n, seq, d] -> [n, seq, d], or InvalidInput saying what was expected."""
    shape = list(embeddings.shape)
    expected = f"[seq, {embed_dim}] or [n, seq, {embed_dim}]"
    if embeddings.ndim not in (2, 3):
        raise InvalidInput(f"embeddings has shape {shape}; model {model!r} expects {expected}")
    batch = embeddings if embeddings.ndim == 3 else embeddings[None]
    count, seq, dim = batch.shape
    if count == 0 or seq == 0:
        raise InvalidInput(
            f"embeddings is empty (shape {shape}); expected at least one position: {expected}"
        )
    if dim != embed_dim:
        raise InvalidInput(
            f"embeddings has d={dim} (shape {shape}); model {model!r} expects d={embed_dim}"
        )
    if seq > limits.max_seq_len:
        raise InvalidInput(
            f"sequence length {seq} exceeds this server's max_seq_len {limits.max_seq_len}"
        )
    if count > limits.max_batch_size:
        raise InvalidInput(
            f"request holds {count} sequences; at most max_batch_size={limits.max_batch_size} "
            "per request (send more requests: the server batches them)"
        )
    if not np.isfinite(batch).all():
        bad = int(np.count_nonzero(~np.isfinite(batch)))
        raise InvalidInput(
            f"embeddings holds {bad} non-finite values (NaN or inf); expected finite"
        )
    return batch
