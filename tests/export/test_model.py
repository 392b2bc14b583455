"""The torch module is torch.nn.MultiheadAttention's math; weights load and fail clearly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from export.model import MultiHeadSelfAttention, check_hyper_parameters
from export.verify import reference_forward
from export.weights import StateDictError, build_module, check_state_dict, weights_sha256


def _padded_batch(rng: np.random.Generator, batch: int, seq: int, d: int):
    lengths = rng.integers(1, seq + 1, size=batch)
    mask = np.arange(seq)[None, :] >= lengths[:, None]
    return rng.standard_normal((batch, seq, d), dtype=np.float32), mask


@pytest.mark.parametrize(("d", "h"), [(8, 1), (32, 4), (64, 8), (96, 3), (512, 8)])
@pytest.mark.parametrize("bias", [True, False])
def test_module_equals_torch_multihead_attention(d: int, h: int, bias: bool) -> None:
    torch.manual_seed(d + h)
    reference = torch.nn.MultiheadAttention(d, h, bias=bias, batch_first=True).eval()
    if bias:  # torch zero-inits biases; make them matter
        with torch.no_grad():
            reference.in_proj_bias.uniform_(-0.2, 0.2)
            reference.out_proj.bias.uniform_(-0.2, 0.2)
    module = MultiHeadSelfAttention(d, h, bias=bias).eval()
    module.load_state_dict(reference.state_dict(), strict=True)
    embeddings, mask = _padded_batch(np.random.default_rng(d), 4, 19, d)

    want_output, want_weights = reference_forward(reference, embeddings, mask, causal=False)
    with torch.inference_mode():
        output, weights = module(torch.from_numpy(embeddings), torch.from_numpy(mask))

    real = ~mask
    np.testing.assert_allclose(output.numpy()[real], want_output[real], atol=1e-5, rtol=0)
    np.testing.assert_allclose(weights.numpy(), want_weights, atol=1e-6, rtol=0)
    assert np.all(
        weights.numpy()[:, :, :, :][np.broadcast_to(mask[:, None, None, :], weights.shape)] == 0
    )


def test_causal_module_masks_the_future() -> None:
    module, _, _ = build_module(32, 4, causal=True)
    x = torch.randn(1, 10, 32)
    changed = x.clone()
    changed[:, 6:] = torch.randn(1, 4, 32)
    mask = torch.zeros(1, 10, dtype=torch.bool)
    with torch.inference_mode():
        before, weights = module(x, mask)
        after, _ = module(changed, mask)
    torch.testing.assert_close(before[:, :6], after[:, :6], atol=0, rtol=0)
    assert not torch.allclose(before[:, 6:], after[:, 6:])
    assert torch.all(weights[0].triu(1) == 0)


@pytest.mark.parametrize(
    ("d", "h", "message"),
    [
        (0, 1, "embed_dim must be a positive"),
        (8, 0, "num_heads must be a positive"),
        (10, 3, "must be divisible by num_heads"),
    ],
)
def test_bad_hyper_parameters_are_rejected(d: int, h: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_hyper_parameters(d, h)


def _saved(tmp_path: Path, state: object) -> Path:
    path = tmp_path / "weights.pt"
    torch.save(state, path)
    return path


def test_state_dict_from_a_trained_layer_loads(tmp_path: Path) -> None:
    reference = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    path = _saved(tmp_path, reference.state_dict())
    module, state, source = build_module(16, 2, state_dict_path=path)
    assert "weights.pt" in source.description
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[name], tensor)
        torch.testing.assert_close(module.state_dict()[name], tensor)


def test_state_dict_errors_name_the_problem(tmp_path: Path) -> None:
    good = torch.nn.MultiheadAttention(16, 2, batch_first=True).state_dict()
    missing = {k: v for k, v in good.items() if k != "out_proj.bias"}
    with pytest.raises(StateDictError, match=r"missing keys \['out_proj.bias'\]"):
        check_state_dict(missing, 16, bias=True)
    with pytest.raises(StateDictError, match=r"unexpected keys \['extra'\]"):
        check_state_dict({**good, "extra": torch.zeros(1)}, 16, bias=True)
    with pytest.raises(
        StateDictError, match=r"in_proj_weight has shape \[48, 16\], expected \[96, 32\]"
    ):
        check_state_dict(good, 32, bias=True)
    kv = torch.nn.MultiheadAttention(16, 2, batch_first=True, kdim=8, vdim=8).state_dict()
    with pytest.raises(StateDictError, match="only self-attention"):
        check_state_dict(kv, 16, bias=True)
    with pytest.raises(StateDictError, match="must hold a dict of tensors"):
        build_module(16, 2, state_dict_path=_saved(tmp_path, [1, 2, 3]))
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a torch file")
    with pytest.raises(StateDictError, match="cannot read"):
        build_module(16, 2, state_dict_path=garbage)
    with pytest.raises(StateDictError, match="does not exist"):
        build_module(16, 2, state_dict_path=tmp_path / "absent.pt")


def test_seeded_init_is_reproducible() -> None:
    _, first, _ = build_module(64, 4, seed=3)
    _, second, _ = build_module(64, 4, seed=3)
    _, other, _ = build_module(64, 4, seed=4)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert not all(torch.equal(first[name], other[name]) for name in first)
    assert weights_sha256(first) == weights_sha256(second)
    assert weights_sha256(first) != weights_sha256(other)
