"""A small random BERT saved as a Hugging Face folder (config.json, model.safetensors,
tokenizer.json), made on the spot: tests never need a hub or the 83 MB MiniLM."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import BertConfig, BertModel

WORDS = ["the", "cat", "sat", "on", "mat", "because", "it", "was", "tired", ".", "a", "dog"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _tokenizer(folder: Path) -> None:
    vocab = {token: i for i, token in enumerate([*SPECIAL, *WORDS])}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.BertProcessing(
        ("[SEP]", vocab["[SEP]"]), ("[CLS]", vocab["[CLS]"])
    )
    tokenizer.save(str(folder / "tokenizer.json"))


def make_tiny_bert(
    folder: Path, *, hidden: int = 32, heads: int = 4, layers: int = 2, seed: int = 0
) -> BertModel:
    """Save a random BertModel (biases and LayerNorms randomised too) and return it in eval."""
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(SPECIAL) + len(WORDS),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * hidden,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    model = BertModel(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                parameter.uniform_(-0.3, 0.3)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    _tokenizer(folder)
    return model


def bert_block(
    model: BertModel, layer: int, hidden: torch.Tensor, key_padding_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own BertSelfAttention + attention.output.dense on a padded batch."""
    attention = model.encoder.layer[layer].attention
    additive = key_padding_mask[:, None, None, :].to(hidden.dtype) * torch.finfo(hidden.dtype).min
    with torch.inference_mode():
        context, probs = attention.self(hidden, attention_mask=additive)
        return attention.output.dense(context), probs
