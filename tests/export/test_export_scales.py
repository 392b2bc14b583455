"""Verification fits every scale and sees every failure: trained layers with large weights
export; a wrong graph, a NaN weight or a non-finite output does not."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from export.model import MultiHeadSelfAttention
from export.onnx_graphs import export_graphs
from export.pipeline import ExportRequest, run_export
from export.verify import (
    DEFAULT_TOLERANCE,
    MAX_VERIFIED_SEQ,
    ParityError,
    multihead_reference,
    verify_graphs,
)
from export.weights import StateDictError
from service.settings import Settings


def _trained_layer(embed_dim: int, num_heads: int, scale: float) -> torch.nn.MultiheadAttention:
    """nn.MultiheadAttention whose weights are `scale` times the default init (biases too)."""
    torch.manual_seed(0)
    layer = torch.nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)
    with torch.no_grad():
        layer.in_proj_weight.mul_(scale)
        layer.out_proj.weight.mul_(scale)
        layer.in_proj_bias.uniform_(-0.1 * scale, 0.1 * scale)
        layer.out_proj.bias.uniform_(-0.1 * scale, 0.1 * scale)
    return layer.eval()


def _save(tmp_path: Path, state: dict[str, torch.Tensor]) -> Path:
    path = tmp_path / "layer.pt"
    torch.save(state, path)
    return path


@pytest.mark.parametrize(
    ("embed_dim", "num_heads", "scale"),
    [
        pytest.param(128, 4, 0.25, marks=pytest.mark.heavy),
        pytest.param(128, 4, 1.0, marks=pytest.mark.heavy),
        pytest.param(128, 4, 4.0, marks=pytest.mark.heavy),
        pytest.param(128, 4, 16.0, marks=pytest.mark.heavy),
        (512, 8, 4.0),
    ],
)
def test_trained_layers_with_large_weights_export(
    tmp_path: Path, embed_dim: int, num_heads: int, scale: float
) -> None:
    """(512, 8, 4.0) is the report that opened issue 10: outputs ~30, refused before."""
    layer = _trained_layer(embed_dim, num_heads, scale)
    result = run_export(
        ExportRequest(
            name="trained",
            embed_dim=embed_dim,
            num_heads=num_heads,
            out=tmp_path,
            state_dict=_save(tmp_path, layer.state_dict()),
        )
    )
    parity = result.parity
    assert parity.max_seq == MAX_VERIFIED_SEQ
    assert parity.output_scale > scale * 0.2  # the outputs really grow with the weights
    assert parity.max_rel_error_output < DEFAULT_TOLERANCE["float32"].rtol
    # As good as float32 itself: within a small factor of torch's own float32 error.
    assert parity.max_abs_error_output <= 4 * parity.float32_error_output + 1e-6


def _export_then_verify(tmp_path: Path, exported: torch.nn.Module, truth) -> None:
    files = export_graphs(exported, tmp_path, {"embed_dim": "64"})
    verify_graphs(files, truth, embed_dim=64, tolerance=DEFAULT_TOLERANCE["float32"], max_seq=64)


def _module_from(layer: torch.nn.MultiheadAttention) -> MultiHeadSelfAttention:
    module = MultiHeadSelfAttention(layer.embed_dim, layer.num_heads)
    module.load_state_dict(layer.state_dict())
    return module.eval()


# One mistake at the large scale by default (~6 s each); every one at both scales when heavy.
@pytest.mark.parametrize(
    ("mistake", "scale"),
    [
        ("swap q and k", 16.0),
        *[
            pytest.param(mistake, scale, marks=pytest.mark.heavy)
            for mistake in ("swap q and k", "swap k and v", "transpose out_proj")
            for scale in (1.0, 16.0)
            if (mistake, scale) != ("swap q and k", 16.0)
        ],
    ],
)
def test_a_wrong_graph_fails_at_every_scale(tmp_path: Path, scale: float, mistake: str) -> None:
    layer = _trained_layer(64, 4, scale)
    wrong = copy.deepcopy(layer)
    with torch.no_grad():
        q, k, v = layer.in_proj_weight.chunk(3)
        if mistake == "swap q and k":
            wrong.in_proj_weight.copy_(torch.cat([k, q, v]))
        elif mistake == "swap k and v":
            wrong.in_proj_weight.copy_(torch.cat([q, v, k]))
        else:
            wrong.out_proj.weight.copy_(layer.out_proj.weight.T)
    with pytest.raises(ParityError, match="disagrees"):
        _export_then_verify(tmp_path, _module_from(wrong), multihead_reference(layer, causal=False))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused_by_name(tmp_path: Path, bad: float) -> None:
    state = _trained_layer(64, 4, 1.0).state_dict()
    state["out_proj.weight"][7, 3] = bad
    with pytest.raises(StateDictError, match=r"non-finite .* out_proj\.weight \(1 of 4096\)"):
        run_export(
            ExportRequest(
                name="nan",
                embed_dim=64,
                num_heads=4,
                out=tmp_path,
                state_dict=_save(tmp_path, state),
            )
        )
    assert not (tmp_path / "nan").exists()


def test_a_non_finite_output_fails_even_when_the_reference_is_fine(tmp_path: Path) -> None:
    """The weight check bypassed: a NaN reaching the graph is still caught (Python's max
    would have dropped it, reporting error 0)."""
    layer = _trained_layer(64, 4, 1.0)
    broken = copy.deepcopy(layer)
    with torch.no_grad():
        broken.out_proj.bias[5] = float("nan")
    with pytest.raises(ParityError, match="non-finite"):
        _export_then_verify(
            tmp_path, _module_from(broken), multihead_reference(layer, causal=False)
        )


def test_verified_length_is_the_servers_default_limit() -> None:
    assert Settings().max_seq_len == MAX_VERIFIED_SEQ


def test_tolerance_scales_with_the_output_and_float32() -> None:
    tolerance = DEFAULT_TOLERANCE["float32"]
    assert tolerance.bound(1.0, 0.0) == pytest.approx(1e-6 + 1e-4)
    assert tolerance.bound(500.0, 0.0) == pytest.approx(1e-6 + 5e-2)
    assert tolerance.bound(1.0, 1.0) == pytest.approx(4.0)  # float32 itself is this far off
    assert tolerance.bound(1.0, float("inf")) == pytest.approx(1e-6 + 1e-4)  # no slack
