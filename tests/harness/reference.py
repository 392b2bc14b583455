"""Ground truth for numerical tests: torch.nn.MultiheadAttention with the exported weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from export.verify import reference_forward, reference_layer
from export.weights import build_module


def layer_for(embed_dim: int, num_heads: int, *, seed: int = 0, bias: bool = True):
    """nn.MultiheadAttention with the weights a default export with this seed gets."""
    _, state, _ = build_module(embed_dim, num_heads, bias=bias, seed=seed)
    return reference_layer(state, embed_dim, num_heads, bias=bias)


def attend_alone(
    layer: torch.nn.MultiheadAttention, embeddings: np.ndarray, *, causal: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Reference output [n, seq, d] and weights [n, h, seq, seq] with no padding."""
    batch = embeddings if embeddings.ndim == 3 else embeddings[None]
    mask = np.zeros(batch.shape[:2], dtype=bool)
    output, weights = reference_forward(layer, batch, mask, causal=causal)
    if embeddings.ndim == 2:
        return output[0], weights[0]
    return output, weights


def cpu_session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
