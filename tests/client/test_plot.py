"""Heatmaps: one panel per head on one colour scale, padding never shown, checked in the
PNG's pixels; the client's --plot and --save against a real server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib import colormaps
from PIL import Image

from service.plot import DPI, PANEL_INCHES, grid_shape, plot_attention
from tests.harness.reference import attend_alone, layer_for
from tests.harness.server_process import ServerProcess


def _constant_heads(heads: int, seq: int) -> np.ndarray:
    """Head i's weights are all (i + 1) / heads: each panel has one known colour."""
    return np.stack([np.full((seq, seq), (i + 1) / heads, np.float32) for i in range(heads)])


def _rgb(image: Image.Image, x: int, y: int) -> np.ndarray:
    return np.array(image.getpixel((x, y))[:3], dtype=int)


def _expected(value: float) -> np.ndarray:
    return np.round(np.array(colormaps["viridis"](value)[:3]) * 255).astype(int)


@pytest.mark.parametrize(("heads", "grid"), [(1, (1, 1)), (5, (2, 3)), (12, (3, 4))])
def test_one_panel_per_head_on_a_shared_scale(tmp_path: Path, heads: int, grid) -> None:
    path = tmp_path / "heads.png"
    layout = plot_attention(_constant_heads(heads, 6), path, tokens=list("abcdef"))
    image = Image.open(path).convert("RGB")
    rows, columns = grid
    assert grid_shape(heads) == grid
    assert layout.grid == grid
    assert image.size == (layout.width_px, layout.height_px)
    assert image.size == (
        round((PANEL_INCHES * columns + 1.2) * DPI),
        round((PANEL_INCHES * rows + 0.5) * DPI),
    )
    assert len(layout.panels) == heads
    assert layout.vmax == pytest.approx(1.0)
    for head, (left, top, right, bottom) in enumerate(layout.panels):
        centre = _rgb(image, (left + right) // 2, (top + bottom) // 2)
        assert np.abs(centre - _expected((head + 1) / heads)).max() <= 3, head
    # Grid cells past the last head are left blank (white).
    if heads < rows * columns:
        left, top, right, bottom = layout.panels[-1]
        width = right - left
        empty = _rgb(image, right + width // 2 + 20, (top + bottom) // 2)
        assert (empty >= 250).all()


def test_padding_is_never_shown(tmp_path: Path) -> None:
    """Padded rows and columns (weight 1.0, the largest) are dropped before drawing: the
    colour scale ends at the largest real weight and the panel shows only real cells."""
    weights = np.full((2, 5, 5), 0.2, np.float32)
    weights[:, 3:, :] = weights[:, :, 3:] = 1.0
    weights[1, :3, :3] = 0.4
    mask = np.array([False, False, False, True, True])
    tokens = ["[CLS]", "hi", "[SEP]", "[PAD]", "[PAD]"]
    layout = plot_attention(weights, tmp_path / "p.png", tokens=tokens, key_padding_mask=mask)
    assert layout.vmax == pytest.approx(0.4)
    image = Image.open(tmp_path / "p.png").convert("RGB")
    left, top, right, bottom = layout.panels[0]
    for fx in (0.1, 0.5, 0.9):  # the whole panel is the 0.2 colour: no padded cell in it
        for fy in (0.1, 0.5, 0.9):
            x, y = int(left + fx * (right - left)), int(top + fy * (bottom - top))
            assert np.abs(_rgb(image, x, y) - _expected(0.5)).max() <= 3
    with pytest.raises(ValueError, match="3 tokens for a sequence of 5"):
        plot_attention(weights, tmp_path / "q.png", tokens=tokens[:3])


def test_long_sequences_stay_readable(tmp_path: Path) -> None:
    """seq 512: same figure size, no per-token labels, still one panel per head."""
    rng = np.random.default_rng(0)
    weights = rng.dirichlet(np.ones(512), size=(4, 512)).astype(np.float32)
    small = plot_attention(weights[:, :8, :8], tmp_path / "small.png")
    layout = plot_attention(weights, tmp_path / "long.png", tokens=[f"t{i}" for i in range(512)])
    assert (layout.width_px, layout.height_px) == (small.width_px, small.height_px)
    assert Image.open(tmp_path / "long.png").size == (layout.width_px, layout.height_px)
    assert len(layout.panels) == 4


def test_client_plots_and_saves_what_the_server_returned(
    tmp_path: Path, server: ServerProcess
) -> None:
    """Against conftest's server, in each gateway mode."""
    png, npz = tmp_path / "weights.png", tmp_path / "answer.npz"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "service.client",
            "--target",
            server.target,
            "--model",
            "small",
            "--seq",
            "6",
            "--weights",
            "--plot",
            str(png),
            "--save",
            str(npz),
            "--tokens",
            "a b c d e f",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "wrote" in done.stdout
    saved = np.load(npz)
    assert saved["output"].shape == (6, 64)
    assert saved["attention_weights"].shape == (4, 6, 6)
    # The client's input is rng(seed 0) standard normal; the newest "small" is seed 7.
    x = np.random.default_rng(0).standard_normal((6, 64), dtype=np.float32)
    want_output, want_weights = attend_alone(layer_for(64, 4, seed=7), x)
    np.testing.assert_allclose(saved["output"], want_output, atol=1e-5, rtol=0)
    np.testing.assert_allclose(saved["attention_weights"], want_weights, atol=1e-6, rtol=0)
    image = Image.open(png)
    assert image.size == (
        round((PANEL_INCHES * 2 + 1.2) * DPI),
        round((PANEL_INCHES * 2 + 0.5) * DPI),
    )


def test_client_refuses_plot_without_weights() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "service.client", "--plot", "x.png"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert "add --weights" in done.stderr
