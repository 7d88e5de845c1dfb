"""Building blocks of the speech tokenizer: x4 convolutional subsampling and pre-norm RoPE transformer layers.

Padding convention: `mask` (B, T) is True on valid frames. Padded frames are zeroed after every
convolution, so a padded batch gives the same valid outputs as each utterance on its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def length_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """Lengths (B,) -> bool mask (B, max_len), True on valid frames."""
    return torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]


def subsampled_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """Frame counts after two (k3, s2, p1) convolutions: ceil(ceil(T / 2) / 2)."""
    for _ in range(2):
        lengths = torch.div(lengths - 1, 2, rounding_mode="floor") + 1
    return lengths


class ConvSubsampler(nn.Module):
    """Mel (B, n_mels, T) at 100 Hz -> features (B, ceil(T / 4), d_model) at 25 Hz."""

    def __init__(self, n_mels: int, d_model: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(n_mels, d_model, kernel_size=3, stride=2, padding=1)
        self.conv2 = nn.Conv1d(d_model, d_model, kernel_size=3, stride=2, padding=1)

    def forward(self, mel: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mel (B, n_mels, T), lengths (B,)) -> (x (B, T4, d_model), lengths (B,))."""
        x = mel * length_mask(lengths, mel.shape[2])[:, None, :]
        for conv in (self.conv1, self.conv2):
            x = F.gelu(conv(x))
            lengths = torch.div(lengths - 1, 2, rounding_mode="floor") + 1
            x = x * length_mask(lengths, x.shape[2])[:, None, :]  # the bias made the padding non-zero
        return x.transpose(1, 2), lengths


def rotary_tables(length: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (length, head_dim / 2) for rotary position embeddings."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.arange(length, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (first half, second half) of `x` (B, H, T, Dh) by position."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class TransformerLayer(nn.Module):
    """Pre-norm self-attention (RoPE, key padding mask) + GELU feed-forward, both residual."""

    def __init__(self, d_model: int, num_heads: int, ffn_dim: int, dropout: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.attn_norm = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.attn_out = nn.Linear(d_model, d_model)
        self.ffn_norm = nn.LayerNorm(d_model)
        self.ffn_in = nn.Linear(d_model, ffn_dim)
        self.ffn_out = nn.Linear(ffn_dim, d_model)
        self.dropout = nn.Dropout(dropout)
        self.attn_dropout = dropout

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """`x` (B, T, d_model), `mask` (B, T) valid frames, `rotary` cos/sin (T, Dh / 2) -> (B, T, d_model)."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.num_heads, d // self.num_heads).unbind(2)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))  # (B, H, T, Dh)
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        attn = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[:, None, None, :], dropout_p=self.attn_dropout if self.training else 0.0
        )  # (B, H, T, Dh)
        x = x + self.dropout(self.attn_out(attn.transpose(1, 2).reshape(b, t, d)))
        return x + self.dropout(self.ffn_out(self.dropout(F.gelu(self.ffn_in(self.ffn_norm(x))))))


class TransformerStack(nn.Module):
    """`num_layers` `TransformerLayer`s and a final LayerNorm; padded frames are zeroed on output."""

    def __init__(self, num_layers: int, d_model: int, num_heads: int, ffn_dim: int, dropout: float, theta: float):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(d_model, num_heads, ffn_dim, dropout) for _ in range(num_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head_dim = d_model // num_heads
        self.theta = theta

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`x` (B, T, d_model), `mask` (B, T) -> (B, T, d_model)."""
        rotary = rotary_tables(x.shape[1], self.head_dim, self.theta, x.device)
        for layer in self.layers:
            x = layer(x, mask, rotary)
        return self.norm(x) * mask[..., None]
