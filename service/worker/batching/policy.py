"""Pure functions of the batcher: choose a batch, merge it (pad + mask), split the results."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

# --max-padding-ratio auto, by where the models run. A CPU spends a padded position's compute
# in full: with lengths uniform in 16..256 and 64 callers on one core, 0.5 ran 211-220
# sequences/s, 0.1 228-236, 0.05 235-237 and 0 (equal lengths only) 230; lengths 16..48 ran
# 821-981 with 0.5 and 1039-1052 with 0.05. A GPU computes a batch's positions side by side
# and pays per batch, so there the bound stays loose and batches large.
AUTO_MAX_PADDING_CPU = 0.05
AUTO_MAX_PADDING_GPU = 0.5
# max_padding x positions is a float; a padded count at the bound may not exceed it by this.
PADDING_SLACK = 1e-9


def padding_ratio(counts: Sequence[int], lengths: Sequence[int]) -> float:
    """Fraction of positions that would be padding if these requests ran together."""
    longest = max(lengths)
    total = sum(counts) * longest
    real = sum(count * length for count, length in zip(counts, lengths, strict=True))
    return 1.0 - real / total


def choose_batch(
    counts: Sequence[int],
    lengths: Sequence[int],
    *,
    max_sequences: int,
    max_padding: float,
    cap_for: Callable[[int], int] | None = None,
    group_by_length: bool = True,
) -> list[int]:
    """Indices of the requests to run together, the oldest (index 0) always first.

    Others join in order of how close their length is to the oldest's (ties: the older
    first; in arrival order when group_by_length is off) while the batch stays within
    max_sequences, within cap_for(its longest length) (the measured batch caps) and the
    padding within max_padding, so short and long requests do not pay for each other.
    O(n log n) in the queue length.
    """

    def limit(longest: int) -> int:
        return max_sequences if cap_for is None else min(max_sequences, cap_for(longest))

    chosen = [0]
    sequences, real, longest = counts[0], counts[0] * lengths[0], lengths[0]
    anchor = lengths[0]
    candidates: Sequence[int] = range(1, len(counts))
    if group_by_length:
        candidates = sorted(candidates, key=lambda i: (abs(lengths[i] - anchor), i))
    for index in candidates:
        if sequences >= limit(longest):
            break
        count, length = counts[index], lengths[index]
        trial_longest = max(longest, length)
        if sequences + count > limit(trial_longest):
            continue
        trial_real = real + count * length
        trial_total = (sequences + count) * trial_longest
        # Positions are whole numbers: a batch exactly at the bound (2 of 40 at 0.05) joins,
        # where 1 - 38/40 in floating point came out just above 0.05.
        if trial_total - trial_real > max_padding * trial_total + PADDING_SLACK:
            continue
        chosen.append(index)
        sequences, real, longest = sequences + count, trial_real, trial_longest
    return chosen


def merge(requests: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Stack [n_i, seq_i, d] arrays into one [sum n_i, max seq, d] batch and its padding mask."""
    if len(requests) == 1:  # a batch of one: itself, nothing padded
        alone = requests[0]
        return alone, np.zeros(alone.shape[:2], dtype=bool)
    total = sum(r.shape[0] for r in requests)
    longest = max(r.shape[1] for r in requests)
    first = requests[0]
    if all(r.shape[1] == longest for r in requests):  # nothing to pad: one copy, or none
        together = first if len(requests) == 1 else np.concatenate(requests)
        return together, np.zeros((total, longest), dtype=bool)
    embeddings = np.zeros((total, longest, first.shape[2]), dtype=first.dtype)
    mask = np.ones((total, longest), dtype=bool)
    row = 0
    for request in requests:
        count, seq = request.shape[:2]
        embeddings[row : row + count, :seq] = request
        mask[row : row + count, :seq] = False
        row += count
    return embeddings, mask


def split(
    output: np.ndarray, weights: np.ndarray | None, shapes: Sequence[tuple[int, int]]
) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """Undo merge: each request's [n, seq, d] output and [n, h, seq, seq] weights."""
    parts = []
    row = 0
    for count, seq in shapes:
        rows = slice(row, row + count)
        part_weights = None if weights is None else weights[rows, :, :seq, :seq]
        parts.append((output[rows, :seq], part_weights))
        row += count
    if row != output.shape[0]:
        raise ValueError(f"split covers {row} rows, the batch has {output.shape[0]}")
    return parts
