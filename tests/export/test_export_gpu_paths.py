"""Export-side fixes for the GPU path: q scaled before Q·Kᵀ (float16 cannot overflow there),
and the fused-attention output graph (opset-23 Attention), verified like every graph."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from export.model import MultiHeadSelfAttention
from export.onnx_graphs import FUSED_OPSET
from export.pipeline import ExportRequest, ExportResult, run_export
from export.verify import reference_forward
from export.weights import build_module
from tests.harness.reference import cpu_session, layer_for

D, H = 64, 4


def _ops(path) -> list[str]:
    return [node.op_type for node in onnx.load(str(path)).graph.node]


def test_query_leaves_the_projection_already_scaled(small_export: ExportResult) -> None:
    """In the file itself, Q·Kᵀ multiplies the projection's q directly: 1/sqrt(d/h) is folded
    into the q rows of the projection weights, so no Mul or Div is left for an ONNX Runtime
    pass to move past the product, and nothing scales the scores after it."""
    model = onnx.load(str(small_export.files.output_only))
    constants = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    producer = {out: node for node in model.graph.node for out in node.output}
    scores = next(
        node
        for node in model.graph.node
        if node.op_type == "MatMul" and not any(name in constants for name in node.input)
    )  # the first activation x activation product is Q·Kᵀ; the second is weights·V
    assert producer[scores.input[0]].op_type not in ("Mul", "Div")
    assert not [node for node in model.graph.node if node.op_type in ("Mul", "Div")]
    consumers = [node.op_type for node in model.graph.node if scores.output[0] in node.input]
    assert consumers == ["Where"]  # the mask, then Softmax
    assert {p.key: p.value for p in model.metadata_props}["query_scale_folded"] == "true"
    _, state, _ = build_module(D, H, bias=True, seed=0)
    (w_t,) = [value for value in constants.values() if value.shape == (D, 3 * D)]
    (bias,) = [value for value in constants.values() if value.shape == (3 * D,)]
    scale = (D // H) ** -0.5
    np.testing.assert_allclose(w_t[:, :D], state["in_proj_weight"][:D].numpy().T * scale, rtol=1e-6)
    np.testing.assert_allclose(w_t[:, D:], state["in_proj_weight"][D:].numpy().T, rtol=0)
    np.testing.assert_allclose(bias[:D], state["in_proj_bias"][:D].numpy() * scale, rtol=1e-6)


def _emulated_float16(scale: float, *, prescaled: bool, folded: bool = False) -> tuple[int, float]:
    """torch float16 arithmetic on CPU (float16 storage, float32 accumulation in matmuls):
    (non-finite outputs, relative error against float64) at scale x unit inputs."""
    module, _, _ = build_module(512, 8, bias=True, seed=0)
    if folded:
        module.fold_query_scale()
    half = module.half().eval()
    layer = layer_for(512, 8).double()
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2, 64, 512)) * scale).astype(np.float16)
    mask = np.zeros((2, 64), dtype=bool)
    mask[1, 40:] = True
    with torch.inference_mode():
        if prescaled:
            got = half(torch.from_numpy(x), torch.from_numpy(mask))[0]
        else:  # the ordering before the fix: the product of unscaled q, then the scale
            q, k, v = half._project(torch.from_numpy(x))  # q comes scaled by 1/sqrt(64)
            scores = ((q * 8.0) @ k.transpose(-1, -2)) * 0.125
            scores = scores.masked_fill(torch.from_numpy(mask)[:, None, None, :], -65504.0)
            heads = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 64, 512)
            got = half.out_proj(heads)
    want, _ = reference_forward(layer, x.astype(np.float64), mask, causal=False)
    real = ~mask
    got_real = got.float().numpy()[real]
    finite = np.isfinite(got_real)
    error = float(np.max(np.abs(got_real[finite] - want[real][finite]), initial=0.0))
    return int((~finite).sum()), error / float(np.max(np.abs(want[real])))


def test_float16_cannot_overflow_in_the_scores_at_64x_inputs() -> None:
    assert _emulated_float16(64, prescaled=False)[0] > 0  # what the old ordering did
    assert _emulated_float16(64, prescaled=True)[0] == 0
    assert _emulated_float16(64, prescaled=True, folded=True)[0] == 0  # as exported


@pytest.mark.parametrize(("scale", "bound"), [(1, 2e-3), (4, 1e-2)])
def test_float16_accuracy_within_the_stated_input_range(scale: float, bound: float) -> None:
    """README's float16 range: unit-scale and 4x inputs stay within float16's tolerance."""
    nonfinite, relative = _emulated_float16(scale, prescaled=True)
    assert nonfinite == 0
    assert relative < bound


def test_fused_graph_is_one_attention_op_at_opset_23(small_export: ExportResult) -> None:
    assert small_export.files.fused is not None
    fused = onnx.load(str(small_export.files.fused))
    assert max(op.version for op in fused.opset_import if op.domain in ("", "ai.onnx")) == (
        FUSED_OPSET
    )
    ops = _ops(small_export.files.fused)
    assert ops.count("Attention") == 1
    assert "Softmax" not in ops
    assert "Attention" not in _ops(small_export.files.output_only)
    assert small_export.parity.max_abs_error_fused is not None
    assert small_export.parity.max_abs_error_fused < 1e-5


@pytest.mark.parametrize("kind", ["end", "start", "holes", "none"])
def test_fused_graph_equals_torch_with_every_padding(small_export: ExportResult, kind: str) -> None:
    assert small_export.files.fused is not None
    fused = cpu_session(small_export.files.fused)
    plain = cpu_session(small_export.files.output_only)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 33, D), dtype=np.float32)
    mask = np.zeros((3, 33), dtype=bool)
    if kind == "end":
        mask[1, 20:] = True
    elif kind == "start":
        mask[2, :9] = True
    elif kind == "holes":
        mask[:, 1::3] = True
    feeds = {"embeddings": x, "key_padding_mask": mask}
    (got,) = fused.run(None, feeds)
    (unfused,) = plain.run(None, feeds)
    want, _ = reference_forward(layer_for(D, H), x, mask, causal=False)
    real = ~mask
    assert np.isfinite(got[real]).all()
    np.testing.assert_allclose(got[real], want[real], atol=1e-5, rtol=0)
    np.testing.assert_allclose(got[real], unfused[real], atol=1e-5, rtol=0)


@pytest.mark.heavy  # more variants of the fused export the tests above cover (~17 s)
def test_fused_causal_and_float16_exports_verify(tmp_path) -> None:
    causal = run_export(
        ExportRequest(name="c", embed_dim=16, num_heads=2, causal=True, out=tmp_path)
    )
    assert causal.files.fused is not None
    session = cpu_session(causal.files.fused)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 12, 16), dtype=np.float32)
    changed = x.copy()
    changed[:, 8:] += 1.0
    mask = np.zeros((1, 12), bool)
    (a,) = session.run(None, {"embeddings": x, "key_padding_mask": mask})
    (b,) = session.run(None, {"embeddings": changed, "key_padding_mask": mask})
    np.testing.assert_array_equal(a[:, :8], b[:, :8])
    half = run_export(
        ExportRequest(name="h", embed_dim=32, num_heads=4, dtype="float16", out=tmp_path)
    )
    assert half.files.fused is not None
    types = {
        v.name: v.type.tensor_type.elem_type for v in onnx.load(str(half.files.fused)).graph.output
    }
    assert types == {"output": onnx.TensorProto.FLOAT16}
    assert half.parity.max_abs_error_fused is not None
    skipped = run_export(
        ExportRequest(name="n", embed_dim=16, num_heads=2, fused=False, out=tmp_path)
    )
    assert skipped.files.fused is None
    assert not (skipped.folder / "model.fused.onnx").exists()


def test_module_fused_path_equals_the_unfused_one() -> None:
    torch.manual_seed(0)
    module = MultiHeadSelfAttention(32, 4, causal=True).eval()
    for parameter in module.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    x = torch.randn(2, 9, 32)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[1, 6:] = True
    with torch.inference_mode():
        want = module(x, mask)[0]
        got = module.fused_output(x, mask)
    torch.testing.assert_close(got[~mask], want[~mask], atol=1e-6, rtol=0)
