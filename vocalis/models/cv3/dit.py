"""`DiT`: the CosyVoice 3 flow estimator, velocity v(x, t | mu, spks, cond) over 80-bin mel frames.

Input embedding: [x, cond, mu, spks repeated over time] (320 channels) -> linear -> plus a causal convolutional
position embedding (two grouped k=31 convs, each left-padded and followed by Mish). Then `depth` adaLN-zero blocks:
LayerNorm (no affine) modulated by the timestep embedding (shift, scale, gate for attention, then for the
feed-forward), rotary self-attention, tanh-GELU feed-forward, gated residuals. A final modulated norm
(scale, shift) and a linear projection back to 80 channels.

Rotary embedding (x-transformers' convention): one `dim_head`-wide table with interleaved pairs applied to the
whole q/k projections before the heads are split, so only the first `dim_head` channels (the first head) rotate.

`streaming=True` makes attention block-causal (blocks of `static_chunk_size` frames from the first frame, prompt
included), so a streaming call's output on whole leading blocks does not change when frames are appended.

Parameter names equal the official `flow.pt` keys under `decoder.estimator.`.

Legend: B batch, T mel frames, D model width, H heads, Dh head width, C mel channels (80).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vocalis.config.cv3 import DiTConfig
from vocalis.models.flow.encoder import chunk_attention_mask

_NORM_EPS = 1e-6
_TIME_SCALE = 1000.0  # t in [0, 1] is scaled before the sinusoids
_ROTARY_BASE = 10000.0


def timestep_features(t: torch.Tensor, width: int) -> torch.Tensor:
    """t (B,) -> (B, width): sin then cos of 1000 t 10000^(-i / (width/2 - 1)), i = 0 .. width/2 - 1."""
    half = width // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000.0) / (half - 1)))  # (half,)
    angles = _TIME_SCALE * t.unsqueeze(1) * freqs.unsqueeze(0)  # (B, half)
    return torch.cat((angles.sin(), angles.cos()), dim=-1).to(t.dtype)


def rotary_angles(inv_freq: torch.Tensor, num_frames: int) -> torch.Tensor:
    """(T, Dh) angles for positions 0 .. T-1, each frequency repeated twice (interleaved pairs)."""
    positions = torch.arange(num_frames, device=inv_freq.device, dtype=torch.float32)
    angles = positions[:, None] * inv_freq.float()[None, :]  # (T, Dh/2), fp32 whatever the module dtype
    return angles.repeat_interleave(2, dim=-1)  # (T, Dh)


def apply_rotary(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x (B, T, E) with E >= Dh: rotate channel pairs (2i, 2i+1) of the first Dh channels by `angles` (T, Dh).

    Computed in fp32 whatever x's dtype, then cast back.
    """
    width = angles.shape[-1]
    head, rest = x[..., :width].float(), x[..., width:]
    pairs = head.unflatten(-1, (-1, 2))  # (B, T, Dh/2, 2)
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)  # (B, T, Dh)
    head = head * angles.cos() + rotated * angles.sin()
    return torch.cat((head.to(x.dtype), rest), dim=-1)


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int, freq_dim: int) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.time_mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """t (B,) -> (B, D)."""
        return self.time_mlp(timestep_features(t, self.freq_dim))


class CausalConvPositionEmbedding(nn.Module):
    """Two grouped convolutions, each causal (left padding kernel - 1) and followed by Mish."""

    def __init__(self, dim: int, kernel_size: int, groups: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, D) -> (B, T, D)."""
        h = x.transpose(1, 2)  # (B, D, T)
        h = self.conv1(F.pad(h, (self.kernel_size - 1, 0)))
        h = self.conv2(F.pad(h, (self.kernel_size - 1, 0)))
        return h.transpose(1, 2)


class InputEmbedding(nn.Module):
    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        c = config
        self.proj = nn.Linear(2 * c.mel_dim + c.mu_dim + c.spk_dim, c.dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(c.dim, c.conv_pos_kernel, c.conv_pos_groups)

    def forward(self, x: torch.Tensor, cond: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor) -> torch.Tensor:
        """x, cond (B, T, C), mu (B, T, C_mu), spks (B, C_spk) -> (B, T, D)."""
        spks = spks.unsqueeze(1).expand(-1, x.shape[1], -1)  # (B, T, C_spk)
        h = self.proj(torch.cat((x, cond, mu, spks), dim=-1))
        return self.conv_pos_embed(h) + h


class AdaLayerNormZero(nn.Module):
    """Modulation of one block: `linear(SiLU(t))` -> 6 D-wide vectors (shift, scale, gate) x (attention, ff)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 6 * dim)


class AdaLayerNormZeroFinal(nn.Module):
    """Final modulation: `linear(SiLU(t))` -> (scale, shift)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)


class Attention(nn.Module):
    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        inner = config.heads * config.dim_head
        self.heads = config.heads
        self.to_q = nn.Linear(config.dim, inner)
        self.to_k = nn.Linear(config.dim, inner)
        self.to_v = nn.Linear(config.dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, config.dim), nn.Dropout(config.dropout)])

    def forward(self, x: torch.Tensor, angles: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        """x (B, T, D), angles (T, Dh), attn_mask (B, 1, T, T) or (B, 1, 1, T) bool (True = attend) -> (B, T, D)."""
        b, t, _ = x.shape
        q = apply_rotary(self.to_q(x), angles)  # (B, T, H*Dh)
        k = apply_rotary(self.to_k(x), angles)
        v = self.to_v(x)
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in (q, k, v))  # (B, H, T, Dh)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # (B, H, T, Dh)
        out = out.transpose(1, 2).reshape(b, t, -1)  # (B, T, H*Dh)
        return self.to_out[1](self.to_out[0](out))


class FeedForward(nn.Module):
    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        inner = config.dim * config.ff_mult
        self.ff = nn.Sequential(
            nn.Sequential(nn.Linear(config.dim, inner), nn.GELU(approximate="tanh")),
            nn.Dropout(config.dropout),
            nn.Linear(inner, config.dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(x)


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """LayerNorm without affine, then x (1 + scale) + shift; shift/scale (B, D) broadcast over time."""
    h = F.layer_norm(x, (x.shape[-1],), eps=_NORM_EPS)
    return h * (1 + scale[:, None]) + shift[:, None]


class DiTBlock(nn.Module):
    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.attn_norm = AdaLayerNormZero(config.dim)
        self.attn = Attention(config)
        self.ff = FeedForward(config)

    def forward(
        self, x: torch.Tensor, silu_t: torch.Tensor, angles: torch.Tensor, attn_mask: torch.Tensor,
        valid: torch.Tensor,
    ) -> torch.Tensor:
        """x (B, T, D), silu_t (B, D) = SiLU(timestep embedding), valid (B, T, 1) -> (B, T, D)."""
        shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = self.attn_norm.linear(silu_t).chunk(6, dim=1)
        attn = self.attn(_modulate(x, shift_a, scale_a), angles, attn_mask) * valid  # padded frames give 0
        x = x + gate_a[:, None] * attn
        return x + gate_f[:, None] * self.ff(_modulate(x, shift_f, scale_f))


def dit_attention_mask(mask: torch.Tensor, streaming: bool, chunk_size: int) -> torch.Tensor:
    """Frame mask (B, 1, T) -> SDPA bool mask (B, 1, T, T): valid keys, block-causal when streaming."""
    valid = mask.bool()
    if streaming and chunk_size > 0:
        keys = chunk_attention_mask(valid, chunk_size)  # (B, T, T)
    else:
        keys = chunk_attention_mask(valid, 0).expand(-1, valid.shape[-1], -1)  # (B, T, T)
    return keys.unsqueeze(1)


class DiT(nn.Module):
    """Flow estimator: (x, mask, mu, t, spks, cond) -> velocity, the `CausalConditionalDecoder` call signature."""

    inv_freq: torch.Tensor

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.config = config
        self.time_embed = TimestepEmbedding(config.dim, config.time_freq_dim)
        self.input_embed = InputEmbedding(config)
        self.rotary_embed = nn.Module()
        exponent = torch.arange(0, config.dim_head, 2, device="cpu").float() / config.dim_head
        # persistent: the official module saves it, so flow.pt has `decoder.estimator.rotary_embed.inv_freq`
        self.rotary_embed.register_buffer("inv_freq", 1.0 / _ROTARY_BASE**exponent)
        self.transformer_blocks = nn.ModuleList(DiTBlock(config) for _ in range(config.depth))
        self.norm_out = AdaLayerNormZeroFinal(config.dim)
        self.proj_out = nn.Linear(config.dim, config.mel_dim)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        mu: torch.Tensor,
        t: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        streaming: bool = False,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (B, C, T) noisy mel, mask (B, 1, T) valid frames, mu (B, C_mu, T), t (B,) or scalar, spks (B, C_spk),
        cond (B, C, T) prompt-mel condition -> velocity (B, C, T).

        `attn_mask` (B, 1, T, T) bool overrides the mask built from `mask` and `streaming` (an engine builds it
        once per solve and passes it to every Euler step).
        """
        b, _, num_frames = x.shape
        if t.ndim == 0:
            t = t.expand(b)
        if attn_mask is None:
            attn_mask = dit_attention_mask(mask, streaming, self.config.static_chunk_size)
        valid = mask.transpose(1, 2).to(x.dtype)  # (B, T, 1)
        # (B, D): every block reads SiLU(t); t's sines in t's dtype (fp32 under a half-precision estimator)
        silu_t = F.silu(self.time_embed(t)).to(x.dtype)
        h = self.input_embed(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks)  # (B, T, D)
        angles = rotary_angles(self.rotary_embed.inv_freq, num_frames)  # (T, Dh)
        for block in self.transformer_blocks:
            h = block(h, silu_t, angles, attn_mask, valid)
        scale, shift = self.norm_out.linear(silu_t).chunk(2, dim=1)
        h = _modulate(h, shift, scale)
        return self.proj_out(h).transpose(1, 2)  # (B, C, T)
