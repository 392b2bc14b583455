"""The exported graphs: contract, parity with torch.nn.MultiheadAttention, atomic publishing."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from export import pipeline
from export.pipeline import ExportRequest, ExportResult, run_export
from export.verify import ParityError, reference_forward
from tests.harness.reference import cpu_session, layer_for

D, H = 64, 4


@pytest.fixture(scope="module")
def sessions(small_export: ExportResult):
    return cpu_session(small_export.files.output_only), cpu_session(small_export.files.with_weights)


@pytest.fixture(scope="module")
def reference():
    return layer_for(D, H)


def _mask(kind: str, lengths: np.ndarray, seq: int, rng: np.random.Generator) -> np.ndarray:
    end = np.arange(seq)[None, :] >= lengths[:, None]
    if kind == "end":
        return end
    if kind == "start":
        return end[:, ::-1].copy()
    holes = rng.random((len(lengths), seq)) < 0.4
    holes[np.arange(len(lengths)), rng.integers(0, seq, len(lengths))] = False
    return holes


@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(1, 8),
    seq=st.integers(1, 256),
    kind=st.sampled_from(["end", "start", "holes"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_onnx_runtime_equals_torch(sessions, reference, batch, seq, kind, seed) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, seq + 1, size=batch)
    mask = _mask(kind, lengths, seq, rng)
    x = rng.standard_normal((batch, seq, D), dtype=np.float32)
    plain, full = sessions
    feeds = {"embeddings": x, "key_padding_mask": mask}
    (output,) = plain.run(None, feeds)
    full_output, weights = full.run(None, feeds)
    want_output, want_weights = reference_forward(reference, x, mask, causal=False)
    real = ~mask
    np.testing.assert_allclose(output[real], want_output[real], atol=1e-5, rtol=0)
    np.testing.assert_allclose(full_output[real], output[real], atol=1e-6, rtol=0)
    rows = np.broadcast_to(real[:, None, :], weights.shape[:3])
    np.testing.assert_allclose(weights[rows], want_weights[rows], atol=1e-6, rtol=0)


def test_padded_sequence_equals_the_same_sequence_alone(sessions) -> None:
    plain, _ = sessions
    rng = np.random.default_rng(0)
    alone = rng.standard_normal((1, 5, D), dtype=np.float32)
    (want,) = plain.run(None, {"embeddings": alone, "key_padding_mask": np.zeros((1, 5), bool)})
    batch = rng.standard_normal((3, 40, D), dtype=np.float32)
    batch[1, :5] = alone[0]
    mask = np.zeros((3, 40), bool)
    mask[1, 5:] = True
    (got,) = plain.run(None, {"embeddings": batch, "key_padding_mask": mask})
    np.testing.assert_allclose(got[1, :5], want[0], atol=1e-6, rtol=0)


def test_graph_contract(small_export: ExportResult) -> None:
    assert small_export.files.fused is not None
    for path, outputs in (
        (small_export.files.output_only, ["output"]),
        (small_export.files.with_weights, ["output", "attention_weights"]),
        (small_export.files.fused, ["output"]),
    ):
        model = onnx.load(str(path))
        onnx.checker.check_model(model, full_check=True)
        assert max(op.version for op in model.opset_import if op.domain in ("", "ai.onnx")) >= 17
        inputs = {i.name: i.type.tensor_type for i in model.graph.input}
        assert list(inputs) == ["embeddings", "key_padding_mask"]
        assert inputs["embeddings"].elem_type == onnx.TensorProto.FLOAT
        assert inputs["key_padding_mask"].elem_type == onnx.TensorProto.BOOL
        dims = [d.dim_param or d.dim_value for d in inputs["embeddings"].shape.dim]
        assert isinstance(dims[0], str)
        assert isinstance(dims[1], str)
        assert dims[2] == D
        assert [o.name for o in model.graph.output] == outputs
        meta = {p.key: p.value for p in model.metadata_props}
        assert meta["embed_dim"] == str(D)
        assert meta["num_heads"] == str(H)
        assert meta["causal"] == "false"
        assert meta["dtype"] == "float32"
        assert meta["weights_sha256"] == small_export.weights_sha256
        assert "seeded-random-init(seed=0)" in meta["weights_source"]
        assert "torch=" in meta["exporter"]


def test_float16_export_keeps_weights_float32(tmp_path: Path) -> None:
    result = run_export(
        ExportRequest(name="h", embed_dim=32, num_heads=4, dtype="float16", out=tmp_path)
    )
    assert result.parity.max_abs_error_output < 1e-2
    model = onnx.load(str(result.files.with_weights))
    types = {
        v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]
    }
    assert types == {
        "embeddings": onnx.TensorProto.FLOAT16,
        "key_padding_mask": onnx.TensorProto.BOOL,
        "output": onnx.TensorProto.FLOAT16,
        "attention_weights": onnx.TensorProto.FLOAT,
    }
    assert {p.key: p.value for p in model.metadata_props}["dtype"] == "float16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        run_export(ExportRequest(name="b", embed_dim=32, num_heads=4, dtype="int8", out=tmp_path))


def test_causal_export_masks_the_future(tmp_path: Path) -> None:
    result = run_export(
        ExportRequest(name="c", embed_dim=16, num_heads=2, causal=True, out=tmp_path)
    )
    plain = cpu_session(result.files.output_only)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 12, 16), dtype=np.float32)
    changed = x.copy()
    changed[:, 8:] += 1.0
    mask = np.zeros((1, 12), bool)
    (a,) = plain.run(None, {"embeddings": x, "key_padding_mask": mask})
    (b,) = plain.run(None, {"embeddings": changed, "key_padding_mask": mask})
    np.testing.assert_array_equal(a[:, :8], b[:, :8])
    assert not np.allclose(a[:, 8:], b[:, 8:])


@pytest.mark.heavy  # two full exports compared (~20 s); the export itself runs by default
def test_export_is_deterministic_and_never_overwrites(tmp_path: Path) -> None:
    first = run_export(ExportRequest(name="m", embed_dim=16, num_heads=2, out=tmp_path))
    second = run_export(ExportRequest(name="m", embed_dim=16, num_heads=2, out=tmp_path))
    assert (first.folder.name, second.folder.name) == ("1", "2")
    # The graphs themselves, not a hash of the seeded weights: same nodes, same weights.
    for graph in ("output_only", "with_weights"):
        a = onnx.load(str(getattr(first.files, graph)))
        b = onnx.load(str(getattr(second.files, graph)))
        assert a.graph.SerializeToString(deterministic=True) == b.graph.SerializeToString(
            deterministic=True
        )
    before = first.files.output_only.read_bytes()
    with pytest.raises(FileExistsError, match="--force"):
        run_export(
            ExportRequest(name="m", embed_dim=16, num_heads=2, version=1, seed=5, out=tmp_path)
        )
    assert first.files.output_only.read_bytes() == before
    replaced = run_export(
        ExportRequest(
            name="m", embed_dim=16, num_heads=2, version=1, seed=5, force=True, out=tmp_path
        )
    )
    assert replaced.weights_sha256 != first.weights_sha256
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["1", "2"]


def test_failed_verification_writes_nothing(tmp_path: Path, monkeypatch) -> None:
    """A wrong graph (query and key projections swapped) fails, and nothing is published."""
    real_export = pipeline.export_graphs

    def swapped(module, folder, metadata, **kwargs):
        broken = copy.deepcopy(module)
        with torch.no_grad():
            q, k, v = broken.in_proj_weight.detach().clone().chunk(3)
            broken.in_proj_weight.copy_(torch.cat([k, q, v]))
        return real_export(broken, folder, metadata, **kwargs)

    monkeypatch.setattr(pipeline, "export_graphs", swapped)
    with pytest.raises(ParityError, match="disagrees"):
        run_export(ExportRequest(name="m", embed_dim=16, num_heads=2, out=tmp_path))
    assert list((tmp_path / "m").iterdir()) == []


@pytest.mark.heavy  # the CLI over the export the default run covers (~15 s)
def test_cli_reports_what_it_wrote(tmp_path: Path) -> None:
    args = [
        sys.executable,
        "-m",
        "export",
        "--name",
        "cli",
        "--embed-dim",
        "32",
        "--num-heads",
        "4",
    ]
    done = subprocess.run(
        [*args, "--out", str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert "model.onnx" in done.stdout
    assert "model.with_weights.onnx" in done.stdout
    assert "model.fused.onnx" in done.stdout
    assert "fused output=" in done.stdout
    assert "max abs error output=" in done.stdout
    again = subprocess.run(
        [*args, "--out", str(tmp_path), "--if-missing"], capture_output=True, text=True, check=True
    )
    assert "nothing to do" in again.stdout
    bad = subprocess.run(
        [*args[:-1], "5", "--out", str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert bad.returncode == 1
    assert "divisible by num_heads" in bad.stderr
