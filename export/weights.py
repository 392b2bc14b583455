"""Where the weights come from: a saved nn.MultiheadAttention state dict or a seeded init."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from export.model import MultiHeadSelfAttention


class StateDictError(ValueError):
    """The given state dict cannot be loaded into the layer; the message says why."""


@dataclass(frozen=True)
class WeightsSource:
    """Provenance recorded in the ONNX metadata."""

    description: str


def expected_shapes(embed_dim: int, *, bias: bool) -> dict[str, tuple[int, ...]]:
    """The state dict keys and shapes of nn.MultiheadAttention(d, h, batch_first=True)."""
    shapes: dict[str, tuple[int, ...]] = {
        "in_proj_weight": (3 * embed_dim, embed_dim),
        "out_proj.weight": (embed_dim, embed_dim),
    }
    if bias:
        shapes["in_proj_bias"] = (3 * embed_dim,)
        shapes["out_proj.bias"] = (embed_dim,)
    return shapes


def load_state_dict_file(path: Path) -> dict[str, torch.Tensor]:
    """Read a state dict saved with torch.save (tensors only: weights_only=True)."""
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise StateDictError(f"state dict file {path} {what}; expected a torch.save() file")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types for a corrupt or foreign file
        raise StateDictError(f"cannot read {path} as a torch state dict: {err}") from err
    if not isinstance(loaded, dict) or not all(
        isinstance(value, torch.Tensor) for value in loaded.values()
    ):
        raise StateDictError(
            f"{path} must hold a dict of tensors (nn.MultiheadAttention.state_dict()), "
            f"got {type(loaded).__name__}"
        )
    return loaded


def check_state_dict(state: dict[str, torch.Tensor], embed_dim: int, *, bias: bool) -> None:
    """Raise StateDictError naming every missing, unexpected or misshapen key."""
    expected = expected_shapes(embed_dim, bias=bias)
    problems = []
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        hint = ""
        if {"q_proj_weight", "bias_k", "bias_v"} & set(unexpected):
            hint = " (only self-attention with kdim = vdim = d and add_bias_kv=False is supported)"
        problems.append(f"unexpected keys {unexpected}{hint}")
    for name, shape in expected.items():
        if name in state and tuple(state[name].shape) != shape:
            problems.append(f"{name} has shape {list(state[name].shape)}, expected {list(shape)}")
    if problems:
        raise StateDictError(
            f"state dict does not fit nn.MultiheadAttention(embed_dim={embed_dim}, bias={bias}): "
            + "; ".join(problems)
        )


def check_finite(state: dict[str, torch.Tensor], origin: str) -> None:
    """Raise StateDictError naming every tensor with NaN or inf values: such a layer would
    export and then answer NaN to every request."""
    problems = []
    for name in sorted(state):
        bad = int((~torch.isfinite(state[name])).sum())
        if bad:
            problems.append(f"{name} ({bad} of {state[name].numel()})")
    if problems:
        raise StateDictError(
            f"{origin} has non-finite values (NaN or inf) in " + ", ".join(problems)
        )


def seeded_state_dict(embed_dim: int, *, bias: bool, seed: int) -> dict[str, torch.Tensor]:
    """Reproducible weights: nn.MultiheadAttention's Xavier init, plus small random biases
    (not zeros, so that the bias path is exercised by every parity check)."""
    generator = torch.Generator().manual_seed(seed)

    def uniform(shape: tuple[int, ...], bound: float) -> torch.Tensor:
        return (torch.rand(shape, generator=generator) * 2 - 1) * bound

    xavier_in = math.sqrt(6.0 / (embed_dim + 3 * embed_dim))
    xavier_out = math.sqrt(6.0 / (2 * embed_dim))
    state = {
        "in_proj_weight": uniform((3 * embed_dim, embed_dim), xavier_in),
        "out_proj.weight": uniform((embed_dim, embed_dim), xavier_out),
    }
    if bias:
        state["in_proj_bias"] = uniform((3 * embed_dim,), 0.1)
        state["out_proj.bias"] = uniform((embed_dim,), 0.1)
    return state


def weights_sha256(state: dict[str, torch.Tensor]) -> str:
    """A digest of names, shapes and float32 values, independent of how the file was saved."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().to(torch.float32).contiguous()
        digest.update(f"{name}:{list(tensor.shape)};".encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def build_module(
    embed_dim: int,
    num_heads: int,
    *,
    bias: bool = True,
    causal: bool = False,
    state_dict_path: Path | None = None,
    seed: int = 0,
) -> tuple[MultiHeadSelfAttention, dict[str, torch.Tensor], WeightsSource]:
    """The layer in eval mode with its weights, the state dict, and where it came from."""
    module = MultiHeadSelfAttention(embed_dim, num_heads, bias=bias, causal=causal)
    if state_dict_path is None:
        state = seeded_state_dict(embed_dim, bias=bias, seed=seed)
        source = WeightsSource(f"seeded-random-init(seed={seed})")
    else:
        state = load_state_dict_file(state_dict_path)
        check_state_dict(state, embed_dim, bias=bias)
        check_finite(state, str(state_dict_path))
        file_hash = hashlib.sha256(state_dict_path.read_bytes()).hexdigest()
        source = WeightsSource(f"state-dict({state_dict_path.name}, file-sha256={file_hash})")
    state = {name: tensor.detach().to(torch.float32) for name, tensor in state.items()}
    module.load_state_dict(state, strict=True)
    return module.eval(), state, source
