"""A small golden input and its reference answer, written beside the graphs so the server can
check the model once more on the provider and dtype it really uses (service/worker/engine/
golden.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from export.verify import Reference

GOLDEN_FILE = "golden.npz"  # service/worker/engine/golden.py reads the same name


def write_golden(
    folder: Path, reference: Reference, *, embed_dim: int, dtype: str, seed: int = 7
) -> Path:
    """Two sequences of 8 positions, the second padded at the end, with the float64
    reference's output and weights (stored as float32)."""
    rng = np.random.default_rng(seed)
    embeddings = rng.standard_normal((2, 8, embed_dim)).astype(dtype)
    mask = np.zeros((2, 8), dtype=bool)
    mask[1, 5:] = True
    output, weights = reference(embeddings.astype(np.float32), mask, torch.float64)
    path = folder / GOLDEN_FILE
    np.savez(
        path,
        embeddings=embeddings,
        key_padding_mask=mask,
        output=output.astype(np.float32),
        attention_weights=weights.astype(np.float32),
    )
    return path
