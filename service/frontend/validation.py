"""Checks on decoded inputs, so that nothing malformed ever reaches a batch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.errors import InvalidInput
from service.text import shown
from service.values import check_finite


@dataclass(frozen=True)
class InputLimits:
    max_seq_len: int
    max_batch_size: int


def bounded_positions(shape: list[int], limits: InputLimits) -> int:
    """n * seq of a declared [seq, d] or [n, seq, d] shape, within the limits: an estimate
    (of an answer's size) that a shape refused later cannot inflate."""
    if len(shape) not in (2, 3):
        return 0
    n, seq = (shape[0] if len(shape) == 3 else 1), shape[-2]
    return max(0, min(n, limits.max_batch_size)) * max(0, min(seq, limits.max_seq_len))


def answer_estimate(
    shape: list[int],
    payload: int | None,
    *,
    itemsize: int,
    embed_dim: int,
    num_heads: int,
    limits: InputLimits,
    output: bool,
    weights: bool,
) -> tuple[int, int]:
    """(output, weights) bytes of an answer carried in the message, estimated before
    computing it: the output is as large as the input's payload bytes, or, for an input in
    client shared memory (payload None), as its declared shape within the limits; the
    weights add h * seq float32 values per position. output / weights: whether each is
    carried in the message (not asked for, or asked for in client shared memory: 0)."""
    if payload is None:
        payload = bounded_positions(shape, limits) * embed_dim * itemsize
    if not weights:
        return (payload if output else 0), 0
    positions = payload // (embed_dim * itemsize)
    seq = max(0, min(shape[-2:][0] if shape else 0, limits.max_seq_len))
    return (payload if output else 0), positions * num_heads * seq * 4


def sequence_batch_shape(
    shape: list[int], *, embed_dim: int, limits: InputLimits, model: str
) -> tuple[int, int, int]:
    """[seq, d] or [n, seq, d] -> (n, seq, d), or InvalidInput saying what was expected."""
    expected = f"[seq, {embed_dim}] or [n, seq, {embed_dim}]"
    if len(shape) not in (2, 3):
        raise InvalidInput(f"embeddings has shape {shape}; model {shown(model)} expects {expected}")
    count, seq, dim = shape if len(shape) == 3 else [1, *shape]
    if count == 0 or seq == 0:
        raise InvalidInput(
            f"embeddings is empty (shape {shape}); expected at least one position: {expected}"
        )
    if dim != embed_dim:
        raise InvalidInput(
            f"embeddings has d={dim} (shape {shape}); model {shown(model)} expects d={embed_dim}"
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
    return count, seq, dim


def as_sequence_batch(
    embeddings: np.ndarray, *, embed_dim: int, limits: InputLimits, model: str
) -> np.ndarray:
    """[seq, d] or [n, seq, d] -> [n, seq, d] of finite values, or InvalidInput saying what
    was expected."""
    shape = sequence_batch_shape(
        list(embeddings.shape), embed_dim=embed_dim, limits=limits, model=model
    )
    batch = embeddings.reshape(shape)
    check_finite(batch)
    return batch
