"""Attention weights as heatmaps: one panel per head, query tokens down, key tokens across.

Importable from notebooks (plot_attention); the client's --plot uses it. matplotlib is
imported only here and only when called, so the serving side never needs it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PANEL_INCHES = 3.0
DPI = 100
MAX_LABELLED_TOKENS = 48  # past this, tick labels overlap: axes show positions instead


@dataclass(frozen=True)
class HeatmapLayout:
    """What was drawn: image size in pixels, and each head's panel as (left, top, right,
    bottom) pixels, so tests and notebooks can find the panels."""

    width_px: int
    height_px: int
    grid: tuple[int, int]  # (rows, columns)
    panels: list[tuple[int, int, int, int]]
    vmax: float


def grid_shape(num_heads: int) -> tuple[int, int]:
    """Rows and columns close to square, wider than tall (12 heads: 3 x 4)."""
    columns = math.ceil(math.sqrt(num_heads))
    return math.ceil(num_heads / columns), columns


def _real_positions(
    weights: np.ndarray, tokens: Sequence[str] | None, key_padding_mask: np.ndarray | None
) -> tuple[np.ndarray, list[str] | None]:
    """Drop padded queries and keys: padding is never shown."""
    if weights.ndim != 3 or weights.shape[1] != weights.shape[2]:
        raise ValueError(f"weights must be [h, seq, seq], got {list(weights.shape)}")
    seq = weights.shape[1]
    keep = np.ones(seq, bool) if key_padding_mask is None else ~np.asarray(key_padding_mask, bool)
    if keep.shape != (seq,):
        raise ValueError(f"key_padding_mask must be [{seq}], got {list(keep.shape)}")
    if tokens is not None and len(tokens) != seq:
        raise ValueError(f"{len(tokens)} tokens for a sequence of {seq}")
    kept_tokens = None if tokens is None else [t for t, k in zip(tokens, keep, strict=True) if k]
    return weights[:, keep][:, :, keep], kept_tokens


def plot_attention(
    weights: np.ndarray,
    path: Path | str,
    *,
    tokens: Sequence[str] | None = None,
    key_padding_mask: np.ndarray | None = None,
    title: str = "",
) -> HeatmapLayout:
    """Write a PNG of weights [h, seq, seq] (or [1, h, seq, seq]): a grid of h panels on one
    colour scale (0 .. largest weight) with a colour bar; token labels when given and short."""
    import matplotlib  # only plotting needs it

    matplotlib.use("Agg")
    from matplotlib import pyplot

    weights = np.asarray(weights, dtype=np.float32)
    if weights.ndim == 4 and weights.shape[0] == 1:
        weights = weights[0]
    weights, labels = _real_positions(weights, tokens, key_padding_mask)
    heads, seq = weights.shape[0], weights.shape[1]
    rows, columns = grid_shape(heads)
    vmax = float(weights.max()) if weights.size else 1.0
    figure, axes = pyplot.subplots(
        rows,
        columns,
        figsize=(PANEL_INCHES * columns + 1.2, PANEL_INCHES * rows + 0.5),
        dpi=DPI,
        squeeze=False,
        layout="constrained",
    )
    labelled = labels is not None and seq <= MAX_LABELLED_TOKENS
    image = None
    for head, ax in enumerate(axes.flat):
        if head >= heads:
            ax.set_axis_off()
            continue
        image = ax.imshow(
            weights[head],
            cmap="viridis",
            vmin=0.0,
            vmax=vmax,
            interpolation="nearest",
            aspect="auto",
        )
        ax.set_title(f"head {head}", fontsize=9)
        if labelled:
            assert labels is not None
            ax.set_xticks(range(seq), labels, rotation=90, fontsize=6)
            ax.set_yticks(range(seq), labels, fontsize=6)
        else:
            ax.tick_params(labelsize=6)
    assert image is not None  # heads >= 1
    figure.colorbar(image, ax=axes, shrink=0.8, label="attention weight")
    figure.suptitle(title or f"attention weights: {heads} heads, query down, key across")
    figure.canvas.draw()
    width, height = figure.canvas.get_width_height()
    panels = []
    for ax in axes.flat[:heads]:
        left, bottom, right, top = ax.get_window_extent().extents
        panels.append((round(left), round(height - top), round(right), round(height - bottom)))
    figure.savefig(path, dpi=DPI)
    pyplot.close(figure)
    return HeatmapLayout(width, height, (rows, columns), panels, vmax)
