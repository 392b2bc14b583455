"""Multi-head self-attention with the parameter layout of torch.nn.MultiheadAttention."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional


def check_hyper_parameters(embed_dim: int, num_heads: int) -> None:
    """Raise ValueError unless d and h describe a valid multi-head layer."""
    if embed_dim < 1:
        raise ValueError(f"embed_dim must be a positive integer, got {embed_dim}")
    if num_heads < 1:
        raise ValueError(f"num_heads must be a positive integer, got {num_heads}")
    if embed_dim % num_heads:
        raise ValueError(
            f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}); "
            f"valid head counts for {embed_dim}: "
            f"{[h for h in range(1, min(embed_dim, 64) + 1) if embed_dim % h == 0]}"
        )


class MultiHeadSelfAttention(nn.Module):
    """Self-attention over [batch, seq, d] with a boolean key padding mask (true = padding).

    Parameter names match ``nn.MultiheadAttention(batch_first=True)`` so its state dict loads
    as it is. Q, K and V come from one fused projection, as in the fast implementations.
    """

    def __init__(
        self, embed_dim: int, num_heads: int, *, bias: bool = True, causal: bool = False
    ) -> None:
        super().__init__()
        check_hyper_parameters(embed_dim, num_heads)
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.causal = causal
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.query_scale = self.head_dim**-0.5  # 1.0 once folded into the q projection

    def fold_query_scale(self) -> None:
        """Fold 1/sqrt(d/h) into the q rows of the projection (the exporter does, in float32):
        q leaves the projection already scaled, and the graph holds no separate scale that an
        optimizer pass could move past Q·Kᵀ (in float16 that product overflows unscaled)."""
        with torch.no_grad():
            self.in_proj_weight[: self.embed_dim] *= self.query_scale
            if self.in_proj_bias is not None:
                self.in_proj_bias[: self.embed_dim] *= self.query_scale
        self.query_scale = 1.0

    def _project(self, embeddings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (already scaled by 1/sqrt(d/h)), k, v as [b, h, t, d/h]."""
        batch, seq, _ = embeddings.shape
        qkv = functional.linear(embeddings, self.in_proj_weight, self.in_proj_bias)
        qkv = qkv.view(batch, seq, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        query, key, value = qkv.unbind(0)
        # Scale q before Q·Kᵀ, not the scores after it: in float16 the product of unscaled q
        # overflows (inf, then NaN) from ~64x unit inputs on.
        if self.query_scale != 1.0:
            query = query * self.query_scale
        return query, key, value

    def forward(
        self, embeddings: torch.Tensor, key_padding_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (output [b, t, d], per-head attention weights [b, h, t, t])."""
        batch, seq, _ = embeddings.shape
        query, key, value = self._project(embeddings)
        scores = query @ key.transpose(-1, -2)
        blocked = key_padding_mask[:, None, None, :]
        if self.causal:
            positions = torch.arange(seq, device=embeddings.device)
            blocked = blocked | (positions[None, :] > positions[:, None])
        # The dtype's lowest finite value, not -inf: a query whose keys are all blocked (only
        # ever a padding position) then gets finite weights instead of NaN.
        scores = scores.masked_fill(blocked, torch.finfo(scores.dtype).min)
        weights = scores.softmax(dim=-1)

        heads = (weights @ value).transpose(1, 2).reshape(batch, seq, self.embed_dim)
        return self.out_proj(heads), weights

    def fused_output(
        self, embeddings: torch.Tensor, key_padding_mask: torch.Tensor
    ) -> torch.Tensor:
        """The same output through scaled_dot_product_attention, which torch exports as
        ONNX's opset-23 ``Attention`` op: the weights are never materialized as an output."""
        batch, seq, _ = embeddings.shape
        query, key, value = self._project(embeddings)
        # ONNX Runtime 1.31 takes a boolean mask (true = attend) as [batch, 1, seq, seq] only;
        # it refuses the broadcastable [batch, 1, 1, seq].
        keep = (~key_padding_mask)[:, None, None, :].expand(batch, 1, seq, seq)
        if self.causal:
            keep = keep & torch.ones(seq, seq, dtype=torch.bool, device=keep.device).tril()
        heads = functional.scaled_dot_product_attention(
            query, key, value, attn_mask=keep, scale=1.0
        )
        return self.out_proj(heads.transpose(1, 2).reshape(batch, seq, self.embed_dim))


class WithWeights(nn.Module):
    """The graph that also returns the weights, always as float32 (the contract's dtype)."""

    def __init__(self, attention: MultiHeadSelfAttention) -> None:
        super().__init__()
        self.attention = attention

    def forward(
        self, embeddings: torch.Tensor, key_padding_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        output, weights = self.attention(embeddings, key_padding_mask)
        return output, weights.float()


class OutputOnly(nn.Module):
    """The graph for callers that do not want the weights: they are never an output."""

    def __init__(self, attention: MultiHeadSelfAttention) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, embeddings: torch.Tensor, key_padding_mask: torch.Tensor) -> torch.Tensor:
        return self.attention(embeddings, key_padding_mask)[0]


class FusedOutputOnly(nn.Module):
    """The output-only graph with one fused attention op (opset 23), for providers whose
    fused kernels are faster; the server uses it only where its load-time check says so."""

    def __init__(self, attention: MultiHeadSelfAttention) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, embeddings: torch.Tensor, key_padding_mask: torch.Tensor) -> torch.Tensor:
        return self.attention.fused_output(embeddings, key_padding_mask)
