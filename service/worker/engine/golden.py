"""The load-time golden check: a version reproduces, on the provider and dtype it will really
run on, the answer its exporter stored (golden.npz beside the graphs), or it is not served."""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

GOLDEN_FILE = "golden.npz"  # written by export/golden.py
# Error allowed = ATOL + RTOL * largest |golden value|, per compute dtype. float32 is exported
# to ~1e-6 relative; 1e-4 leaves room for another device's summation order. With TF32 allowed
# (--cuda-tf32 on: 10-bit mantissa products) float32 gets 5e-3. A broken graph, provider or
# fp16 path is off by far more (a wrong head, NaN, overflow to inf).
TOLERANCE = {np.dtype(np.float32): (1e-4, 1e-5), np.dtype(np.float16): (2e-2, 1e-3)}
TF32_TOLERANCE = (5e-3, 1e-5)

Run = Callable[[np.ndarray, np.ndarray, bool], tuple[np.ndarray, np.ndarray | None]]


class GoldenMismatch(ValueError):
    """The model did not reproduce its golden output; the message says by how much."""


def golden_path(version_folder: Path) -> Path:
    return version_folder / GOLDEN_FILE


def tolerance_for(dtype: np.dtype, *, tf32: bool = False) -> tuple[float, float]:
    """(rtol, atol) for a compute dtype; float32 with TF32 products allowed gets TF32's."""
    if tf32 and np.dtype(dtype) == np.float32:
        return TF32_TOLERANCE
    return TOLERANCE[np.dtype(dtype)]


def _compare(
    name: str, got: np.ndarray, want: np.ndarray, dtype: np.dtype, tolerance: tuple[float, float]
) -> float:
    """The max abs error, or GoldenMismatch when it is past tolerance or not finite."""
    if got.shape != want.shape:
        raise GoldenMismatch(f"{name} has shape {list(got.shape)}, golden {list(want.shape)}")
    got64, want64 = got.astype(np.float64), want.astype(np.float64)
    if not np.isfinite(got64).all():
        raise GoldenMismatch(f"{name} has non-finite values (NaN or inf)")
    error, scale = float(np.max(np.abs(got64 - want64))), float(np.max(np.abs(want64)))
    rtol, atol = tolerance
    if not error <= atol + rtol * scale:  # also true for a NaN in a corrupted golden file
        raise GoldenMismatch(
            f"{name} differs from the golden output by up to {error:.3e} (allowed "
            f"{atol:.0e} + {rtol:.0e} x {scale:.3g} for {dtype})"
        )
    return error


def check_golden(
    path: Path, run: Run, dtype: np.dtype, *, has_weights_graph: bool, tf32: bool = False
) -> float:
    """Run the golden input through each graph; return the largest output error."""
    tolerance = tolerance_for(dtype, tf32=tf32)
    try:
        with np.load(path, allow_pickle=False) as golden:
            data = {key: golden[key] for key in golden.files}
        embeddings, mask = data["embeddings"].astype(dtype), data["key_padding_mask"].astype(bool)
        want_output, want_weights = data["output"], data["attention_weights"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
        raise GoldenMismatch(f"cannot read {path.name}: {err}") from err
    real = ~mask
    rows = np.broadcast_to(real[:, None, :], want_weights.shape[:3])
    try:
        output, _ = run(embeddings, mask, False)
        weights = None
        if has_weights_graph:
            full_output, weights = run(embeddings, mask, True)
    except Exception as err:  # ONNX Runtime's own types: a golden that does not fit the graph
        raise GoldenMismatch(f"the golden input does not run: {err}") from err
    worst = _compare("output", output[real], want_output[real], dtype, tolerance)
    if weights is not None:
        output = full_output
        worst = max(worst, _compare("output", output[real], want_output[real], dtype, tolerance))
        _compare("attention_weights", weights[rows], want_weights[rows], dtype, tolerance)
    return worst
