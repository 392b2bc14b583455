"""Every export proves itself: ONNX Runtime against a float64 reference of the source layer."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
import torch

from export.onnx_graphs import GraphFiles

# The server's default --max-seq-len (service/settings.py; a test keeps them equal): every
# length a default server accepts is verified.
MAX_VERIFIED_SEQ = 512

# (embeddings float32 [b, t, d], key_padding_mask [b, t], torch dtype) -> (output, weights
# [b, h, t, t]). float64 is the ground truth; float32 shows what float32 itself can reach.
Reference = Callable[[np.ndarray, np.ndarray, torch.dtype], tuple[np.ndarray, np.ndarray]]


class ParityError(RuntimeError):
    """The exported graphs disagree with the reference beyond tolerance, or are not finite."""


@dataclass(frozen=True)
class Tolerance:
    """Allowed error = atol + rtol * (largest |reference| value), as numpy.allclose but scaled
    by the whole tensor's magnitude: float error grows with the values summed, so an absolute
    bar refuses sound layers with large outputs and passes nothing more for small ones. Past
    that, an error within FLOAT32_SLACK x torch's own float32 error still passes: with very
    large scores the softmax loses digits in any float32 implementation."""

    rtol: float
    atol: float

    def bound(self, scale: float, float32_error: float) -> float:
        # A float32 reference that overflowed grants no slack.
        slack = FLOAT32_SLACK * float32_error if np.isfinite(float32_error) else 0.0
        return max(self.atol + self.rtol * scale, slack)


FLOAT32_SLACK = 4.0


# float32: measured relative errors are ~1e-6 (see README); 1e-4 leaves room for other CPUs
# while any real mistake (a swapped or transposed projection, a wrong scale) is O(1).
# float16 keeps ~3 significant digits.
DEFAULT_TOLERANCE = {
    "float32": Tolerance(rtol=1e-4, atol=1e-6),
    "float16": Tolerance(rtol=1e-2, atol=1e-4),
}


@dataclass(frozen=True)
class ParityReport:
    """Largest errors over real (non-padding) positions; relative = abs / largest |reference|."""

    max_abs_error_output: float
    max_abs_error_weights: float
    max_rel_error_output: float
    max_rel_error_weights: float
    output_scale: float  # largest |reference output| seen
    float32_error_output: float  # torch's own float32 result against float64, for scale
    float32_error_weights: float
    cases: int
    max_seq: int
    max_abs_error_fused: float | None = None  # the fused output graph's, when exported


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


def multihead_reference(layer: torch.nn.MultiheadAttention, *, causal: bool) -> Reference:
    """nn.MultiheadAttention in float64 as a Reference."""
    layers = {
        torch.float32: copy.deepcopy(layer).float(),
        torch.float64: copy.deepcopy(layer).double(),
    }

    def forward(
        embeddings: np.ndarray, mask: np.ndarray, dtype: torch.dtype
    ) -> tuple[np.ndarray, np.ndarray]:
        x = torch.from_numpy(embeddings).to(dtype).numpy()
        return reference_forward(layers[dtype], x, mask, causal=causal)

    return forward


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


def _check_finite(name: str, values: np.ndarray) -> None:
    bad = int(np.size(values) - np.count_nonzero(np.isfinite(values)))
    if bad:
        raise ParityError(f"{name} has {bad} non-finite values (NaN or inf) at real positions")


def _worst(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """(max abs error, max |want|); np.max propagates NaN, unlike Python's max."""
    return float(np.max(np.abs(got - want))), float(np.max(np.abs(want)))


def _sessions(files: GraphFiles) -> dict[str, ort.InferenceSession]:
    """Output-only graphs by name (plain, and fused when exported), and the weights graph."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    providers = ["CPUExecutionProvider"]
    paths = {"plain": files.output_only, "full": files.with_weights, "fused": files.fused}
    return {
        name: ort.InferenceSession(str(path), options, providers=providers)
        for name, path in paths.items()
        if path is not None
    }


def verify_graphs(
    files: GraphFiles,
    reference: Reference,
    *,
    embed_dim: int,
    tolerance: Tolerance,
    dtype: str = "float32",
    max_seq: int = MAX_VERIFIED_SEQ,
    seed: int = 1234,
) -> ParityReport:
    """Run every graph on CPU over random padded batches; ParityError past tolerance or on any
    non-finite value."""
    sessions = _sessions(files)
    full = sessions.pop("full")
    rng = np.random.default_rng(seed)
    keys = ("out", "w", "scale_out", "scale_w", "f32_out", "f32_w", "fused")
    worst = dict.fromkeys(keys, 0.0)

    def track(key: str, got: np.ndarray, want: np.ndarray, scale_key: str = "") -> None:
        error, scale = _worst(got.astype(np.float64), want)
        # NaN as inf: Python's max would drop a NaN (graph outputs are checked finite above).
        worst[key] = max(worst[key], error if np.isfinite(error) else np.inf)
        if scale_key:
            worst[scale_key] = max(worst[scale_key], scale)

    masks = padding_cases(rng, max_seq)
    for mask in masks:
        sent = rng.standard_normal((*mask.shape, embed_dim)).astype(dtype)
        feeds = {"embeddings": sent, "key_padding_mask": mask}
        outputs = {name: session.run(["output"], feeds)[0] for name, session in sessions.items()}
        full_output, full_weights = full.run(["output", "attention_weights"], feeds)
        # The reference sees the same (rounded) values the graph got.
        want_output, want_weights = reference(sent.astype(np.float32), mask, torch.float64)
        f32_output, f32_weights = reference(sent.astype(np.float32), mask, torch.float32)
        real = ~mask
        _check_finite("the reference output", want_output[real])
        # Weights of real queries, over every key (padded keys must carry zero weight).
        rows = np.broadcast_to(real[:, None, :], full_weights.shape[:3])
        for name, got in (*outputs.items(), ("full", full_output)):
            _check_finite(f"ONNX Runtime's output ({name} graph)", got[real])
            track("out", got[real], want_output[real], "scale_out")
            if name == "fused":
                track("fused", got[real], want_output[real])
        _check_finite("ONNX Runtime's attention_weights", full_weights[rows])
        track("w", full_weights[rows], want_weights[rows], "scale_w")
        track("f32_out", f32_output[real], want_output[real])
        track("f32_w", f32_weights[rows], want_weights[rows])
    return _judge(worst, len(masks), max_seq, tolerance, fused="fused" in sessions)


def _judge(
    worst: dict[str, float], cases: int, max_seq: int, tolerance: Tolerance, *, fused: bool
) -> ParityReport:
    report = ParityReport(
        worst["out"],
        worst["w"],
        worst["out"] / max(worst["scale_out"], 1e-30),
        worst["w"] / max(worst["scale_w"], 1e-30),
        worst["scale_out"],
        worst["f32_out"],
        worst["f32_w"],
        cases,
        max_seq,
        worst["fused"] if fused else None,
    )
    output_ok = worst["out"] <= tolerance.bound(worst["scale_out"], worst["f32_out"])
    weights_ok = worst["w"] <= tolerance.bound(worst["scale_w"], worst["f32_w"])
    if not (output_ok and weights_ok):
        raise ParityError(
            f"ONNX Runtime disagrees with the reference: output max abs error {worst['out']:.3e} "
            f"(relative {report.max_rel_error_output:.2e} of max |output| "
            f"{worst['scale_out']:.3g}; torch float32 {worst['f32_out']:.2e}), attention_weights "
            f"{worst['w']:.3e} (relative {report.max_rel_error_weights:.2e}; torch float32 "
            f"{worst['f32_w']:.2e}); tolerance {tolerance.atol:.0e} + {tolerance.rtol:.0e} x "
            f"max |reference|, or {FLOAT32_SLACK:g} x torch's float32 error"
        )
    return report
