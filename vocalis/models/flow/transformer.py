"""Transformer block of the flow estimator (the Matcha/diffusers `BasicTransformerBlock` layout).

Pre-norm self-attention then pre-norm GELU feed-forward, both residual. Submodule names (`norm1`, `attn1.to_q`,
`attn1.to_out.0`, `norm3`, `ff.net.0.proj`, `ff.net.2`) equal the official checkpoint keys.

Shapes: B batch, T frames, D model width, H heads, E head width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SelfAttention(nn.Module):
    """Multi-head self-attention: bias-free q/k/v projections, biased output projection, additive float mask."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        inner = num_heads * head_dim
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.dropout = dropout
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Dropout(dropout)])

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x (B, T, D), bias (B, T, T) added to the scores (0 = visible, -1e10 = hidden) -> (B, T, D)."""
        b, t, _ = x.shape
        q = self.to_q(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, E)
        k = self.to_k(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.to_v(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.unsqueeze(1), dropout_p=p)  # (B, H, T, E)
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)  # (B, T, H*E)
        return self.to_out[1](self.to_out[0](out))


class GELUProjection(nn.Module):
    """Linear projection followed by exact (erf) GELU; the first stage of the feed-forward."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x))


class FeedForward(nn.Module):
    """`net = [GELU projection to 4D, Dropout, Linear back to D]`."""

    def __init__(self, dim: int, mult: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        inner = dim * mult
        self.net = nn.ModuleList([GELUProjection(dim, inner), nn.Dropout(dropout), nn.Linear(inner, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.net:
            x = layer(x)
        return x


class BasicTransformerBlock(nn.Module):
    """`x + attn1(norm1(x))`, then `x + ff(norm3(x))`; no cross-attention (hence no `norm2`/`attn2`)."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, dropout: float = 0.0, act_fn: str = "gelu") -> None:
        super().__init__()
        if act_fn != "gelu":
            raise ValueError(f"unsupported transformer activation {act_fn!r}; CosyVoice 2 uses 'gelu'")
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = SelfAttention(dim, num_heads, head_dim, dropout)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim, dropout=dropout)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x (B, T, D), bias (B, T, T) -> (B, T, D)."""
        x = x + self.attn1(self.norm1(x), bias)
        return x + self.ff(self.norm3(x))
