"""Every export proves itself: ONNX Runtime against torch.nn.MultiheadAttention."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
import torch

from export.onnx_graphs import GraphFiles


class ParityError(RuntimeError):
    """The exported graphs disagree with the reference beyond tolerance."""


@dataclass(frozen=True)
class ParityReport:
    """Largest absolute differences seen over real (non-padding) positions."""

    max_abs_error_output: float
    max_abs_error_weights: float
    cases: int


def reference_layer(
    state: dict[str, torch.Tensor], embed_dim: int, num_heads: int, *, bias: bool
) -> torch.nn.MultiheadAttention:
    """torch's own layer with the exported weights: the ground truth."""
    layer = torch.nn.MultiheadAttention(embed_dim, num_heads, bias=bias, batch_first=True)
    layer.load_state_dict(state, strict=True)
    return layer.eval()


def reference_forward(
    layer: torch.nn.MultiheadAttention,
    embeddings: np.ndarray,
    key_padding_mask: np.ndarray,
    *,
    causal: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """nn.MultiheadAttention's output and per-head weights for a padded batch."""
    x = torch.from_numpy(embeddings)
    seq = x.shape[1]
    attn_mask = torch.ones(seq, seq, dtype=torch.bool).triu(1) if causal else None
    with torch.inference_mode():
        output, weights = layer(
            x,
            x,
            x,
            key_padding_mask=torch.from_numpy(key_padding_mask),
            attn_mask=attn_mask,
            need_weights=True,
            average_attn_weights=False,
        )
    return output.numpy(), weights.numpy()


def padding_cases(rng: np.random.Generator, max_seq: int) -> list[np.ndarray]:
    """Masks with padding at the end, at the start, in holes, and none at all."""
    cases = []
    for batch, seq in ((1, 1), (3, 7), (4, min(max_seq, 64)), (2, max_seq)):
        lengths = rng.integers(1, seq + 1, size=batch)
        lengths[0] = seq
        end = np.arange(seq)[None, :] >= lengths[:, None]
        start = end[:, ::-1].copy()
        holes = rng.random((batch, seq)) < 0.3
        holes[:, 0] = False
        cases += [end, start, holes, np.zeros((batch, seq), dtype=bool)]
    return cases


def verify_graphs(
    files: GraphFiles,
    layer: torch.nn.MultiheadAttention,
    *,
    causal: bool,
    tolerance: float,
    dtype: str = "float32",
    max_seq: int = 256,
    seed: int = 1234,
) -> ParityReport:
    """Run both graphs on CPU over random padded batches; raise ParityError past tolerance."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    providers = ["CPUExecutionProvider"]
    plain = ort.InferenceSession(str(files.output_only), options, providers=providers)
    full = ort.InferenceSession(str(files.with_weights), options, providers=providers)
    rng = np.random.default_rng(seed)
    worst_output = worst_weights = 0.0
    masks = padding_cases(rng, max_seq)
    for mask in masks:
        sent = rng.standard_normal((*mask.shape, layer.embed_dim)).astype(dtype)
        embeddings = sent.astype(np.float32)  # the reference sees the same (rounded) values
        feeds = {"embeddings": sent, "key_padding_mask": mask}
        (plain_output,) = plain.run(["output"], feeds)
        full_output, full_weights = full.run(["output", "attention_weights"], feeds)
        plain_output, full_output = plain_output.astype(np.float32), full_output.astype(np.float32)
        want_output, want_weights = reference_forward(layer, embeddings, mask, causal=causal)
        real = ~mask
        worst_output = max(
            worst_output,
            float(np.abs(plain_output - want_output)[real].max()),
            float(np.abs(full_output - want_output)[real].max()),
        )
        # Weights of real queries, over every key (padded keys must carry zero weight).
        query_rows = np.broadcast_to(real[:, None, :], full_weights.shape[:3])
        worst_weights = max(
            worst_weights, float(np.abs(full_weights - want_weights)[query_rows].max())
        )
    report = ParityReport(worst_output, worst_weights, len(masks))
    if worst_output > tolerance or worst_weights > tolerance:
        raise ParityError(
            f"ONNX Runtime disagrees with torch.nn.MultiheadAttention: max abs error "
            f"output={worst_output:.3e}, attention_weights={worst_weights:.3e}, "
            f"tolerance={tolerance:.1e}"
        )
    return report
