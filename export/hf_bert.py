"""The self-attention block of a Hugging Face BERT-style layer, read from the files alone.

A folder with config.json and model.safetensors (no transformers, no hub): layer N's
attention.self.{query,key,value} and attention.output.dense map onto our fused layout. The
residual and attention.output.LayerNorm that follow in BERT are not part of the block served.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from export.verify import Reference
from export.weights import StateDictError, check_finite

PARTS = ("query", "key", "value")
# position_embedding_type values whose self-attention is plain scaled dot product.
PLAIN_POSITIONS = ("absolute", None)


@dataclass(frozen=True)
class HfConfig:
    """The fields of config.json the block depends on."""

    hidden_size: int
    num_heads: int
    num_layers: int


def read_config(folder: Path) -> HfConfig:
    """d, h and the layer count from config.json; StateDictError when it is not BERT-like."""
    path = folder / "config.json"
    if not path.is_file():
        raise StateDictError(f"{folder} has no config.json (expected a Hugging Face model folder)")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as err:
        raise StateDictError(f"{path} is not a JSON object: {err}") from None
    if not isinstance(config, dict):
        raise StateDictError(f"{path} is not a JSON object")
    missing = [k for k in ("hidden_size", "num_attention_heads") if k not in config]
    if missing:
        raise StateDictError(f"{path} lacks {missing}; is it a BERT-style model?")
    kind = config.get("position_embedding_type")
    if kind not in PLAIN_POSITIONS:
        raise StateDictError(
            f"{path}: position_embedding_type={kind!r} adds position terms to the attention "
            f"scores; only 'absolute' is supported"
        )
    return HfConfig(
        _count(config, path, "hidden_size", 1),
        _count(config, path, "num_attention_heads", 1),
        _count(config, path, "num_hidden_layers", 0),
    )


def _count(config: dict[str, object], path: Path, key: str, least: int) -> int:
    """config[key] as an integer of at least least (num_hidden_layers may be absent: 0)."""
    value = config.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise StateDictError(f"{path}: {key} is {value!r}; expected an integer >= {least}")
    return value


def _layer_prefix(names: list[str], layer: int) -> str:
    """'encoder.layer.N.' or 'bert.encoder.layer.N.' (checkpoints with a task head)."""
    suffix = f"encoder.layer.{layer}.attention.self.query.weight"
    found = [name[: -len("attention.self.query.weight")] for name in names if name.endswith(suffix)]
    if len(found) != 1:
        layers = sorted(
            {n.split("encoder.layer.")[1].split(".")[0] for n in names if ".layer." in n}
        )
        raise StateDictError(
            f"no unique self-attention for layer {layer} in model.safetensors "
            f"(layers found: {layers})"
        )
    return found[0]


def read_block(folder: Path, layer: int) -> dict[str, torch.Tensor]:
    """Layer N's eight tensors under their Hugging Face names (query.weight, ..., dense.bias)."""
    path = folder / "model.safetensors"
    if not path.is_file():
        raise StateDictError(f"{folder} has no model.safetensors")
    block = {}
    try:
        opened = safe_open(str(path), framework="np")
    except Exception as err:  # safetensors' own error types, and OSError
        raise StateDictError(f"{path} cannot be read as safetensors: {err}") from None
    with opened as tensors:
        names = list(tensors.keys())
        prefix = _layer_prefix(names, layer)
        wanted = {
            f"{part}.{kind}": f"{prefix}attention.self.{part}.{kind}"
            for part in PARTS
            for kind in ("weight", "bias")
        }
        wanted |= {
            f"dense.{kind}": f"{prefix}attention.output.dense.{kind}" for kind in ("weight", "bias")
        }
        absent = sorted(full for full in wanted.values() if full not in names)
        if absent:
            raise StateDictError(f"{path} lacks {absent}")
        for short, full in wanted.items():
            block[short] = torch.from_numpy(np.asarray(tensors.get_tensor(full), np.float32))
    check_finite(block, f"{path} layer {layer}")
    return block


def to_multihead_state(block: dict[str, torch.Tensor], embed_dim: int) -> dict[str, torch.Tensor]:
    """Q, K, V stacked in nn.MultiheadAttention's order; nn.Linear and in_proj both hold W as
    [out, in], so no transpose."""
    for name, tensor in block.items():
        want = (embed_dim, embed_dim) if name.endswith("weight") else (embed_dim,)
        if tuple(tensor.shape) != want:
            raise StateDictError(f"{name} has shape {list(tensor.shape)}, expected {list(want)}")
    return {
        "in_proj_weight": torch.cat([block[f"{p}.weight"] for p in PARTS]),
        "in_proj_bias": torch.cat([block[f"{p}.bias"] for p in PARTS]),
        "out_proj.weight": block["dense.weight"],
        "out_proj.bias": block["dense.bias"],
    }


class BertSelfAttentionBlock(nn.Module):
    """The source block as BERT computes it (separate projections, additive mask of the
    dtype's lowest value), kept apart from our graph so that parity checks the mapping."""

    def __init__(self, block: dict[str, torch.Tensor], num_heads: int) -> None:
        super().__init__()
        embed_dim = block["dense.weight"].shape[0]
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads

        def linear(name: str) -> nn.Linear:
            layer = nn.Linear(embed_dim, embed_dim)
            layer.load_state_dict(
                {"weight": block[f"{name}.weight"], "bias": block[f"{name}.bias"]}
            )
            return layer

        self.query, self.key, self.value = linear("query"), linear("key"), linear("value")
        self.dense = linear("dense")

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:2], self.num_heads, self.head_dim).transpose(1, 2)

    def forward(
        self, hidden: torch.Tensor, key_padding_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention.output.dense(context) [b, t, d], probabilities [b, h, t, t])."""
        query, key, value = (self._heads(p(hidden)) for p in (self.query, self.key, self.value))
        scores = query @ key.transpose(-1, -2) / math.sqrt(self.head_dim)
        additive = (
            key_padding_mask[:, None, None, :].to(hidden.dtype) * torch.finfo(hidden.dtype).min
        )
        probs = (scores + additive).softmax(dim=-1)
        context = (probs @ value).transpose(1, 2).reshape(hidden.shape)
        return self.dense(context), probs


@dataclass(frozen=True)
class HfLayer:
    """One imported block: our state dict, the source module, and where it came from."""

    state: dict[str, torch.Tensor]
    source: BertSelfAttentionBlock
    embed_dim: int
    num_heads: int
    description: str


def load_hf_layer(folder: Path, layer: int = 0) -> HfLayer:
    """Read config.json and model.safetensors of folder and map layer N's block."""
    config = read_config(folder)
    if config.num_layers and not 0 <= layer < config.num_layers:
        raise StateDictError(f"--hf-layer {layer}: the model has layers 0..{config.num_layers - 1}")
    if config.hidden_size % config.num_heads:
        raise StateDictError(f"hidden_size {config.hidden_size} % heads {config.num_heads} != 0")
    block = read_block(folder, layer)
    state = to_multihead_state(block, config.hidden_size)
    digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    return HfLayer(
        state=state,
        source=BertSelfAttentionBlock(block, config.num_heads).eval(),
        embed_dim=config.hidden_size,
        num_heads=config.num_heads,
        description=f"hf-bert({folder.name}, layer={layer}, safetensors-sha256={digest})",
    )


def block_reference(source: BertSelfAttentionBlock) -> Reference:
    """The source block in float64 as a verify.Reference."""
    blocks = {dtype: copy.deepcopy(source).to(dtype) for dtype in (torch.float32, torch.float64)}

    def forward(
        embeddings: np.ndarray, mask: np.ndarray, dtype: torch.dtype
    ) -> tuple[np.ndarray, np.ndarray]:
        with torch.inference_mode():
            x = torch.from_numpy(embeddings).to(dtype)
            output, probs = blocks[dtype](x, torch.from_numpy(mask))
        return output.numpy(), probs.numpy()

    return forward
