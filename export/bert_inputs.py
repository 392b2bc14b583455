"""A sentence as BERT's first layer sees it: the model's own tokenizer and embedding layer
(word + position + token type embeddings, then LayerNorm), read from the model folder."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import safe_open
from tokenizers import Tokenizer

EMBEDDING_TABLES = ("word_embeddings", "position_embeddings", "token_type_embeddings")


@dataclass(frozen=True)
class EmbeddedSentence:
    tokens: list[str]
    embeddings: np.ndarray  # [seq, d] float32: the input of encoder layer 0


def _tensor(tensors: object, names: list[str], suffix: str) -> np.ndarray:
    matches = [name for name in names if name.endswith(f"embeddings.{suffix}")]
    if len(matches) != 1:
        raise ValueError(f"model.safetensors has no unique embeddings.{suffix}")
    return np.asarray(tensors.get_tensor(matches[0]), np.float64)  # type: ignore[attr-defined]


def embed_sentence(folder: Path, sentence: str) -> EmbeddedSentence:
    """Tokenize with tokenizer.json (adds [CLS] and [SEP]) and embed as BertEmbeddings does."""
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()  # all-MiniLM's tokenizer.json pads to 128; padding is not served
    encoding = tokenizer.encode(sentence)
    ids, types = np.array(encoding.ids), np.array(encoding.type_ids)
    eps = float(json.loads((folder / "config.json").read_text()).get("layer_norm_eps", 1e-12))
    with safe_open(str(folder / "model.safetensors"), framework="np") as tensors:
        names = list(tensors.keys())
        words, positions, token_types = (
            _tensor(tensors, names, f"{table}.weight") for table in EMBEDDING_TABLES
        )
        gamma = _tensor(tensors, names, "LayerNorm.weight")
        beta = _tensor(tensors, names, "LayerNorm.bias")
    summed = words[ids] + positions[np.arange(len(ids))] + token_types[types]
    mean = summed.mean(-1, keepdims=True)
    variance = summed.var(-1, keepdims=True)
    normed = (summed - mean) / np.sqrt(variance + eps) * gamma + beta
    return EmbeddedSentence(list(encoding.tokens), normed.astype(np.float32))
