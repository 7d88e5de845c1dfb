"""`UpsampleConformerEncoder`: 25 Hz token embeddings -> 50 Hz features for the flow decoder.

Pipeline (CosyVoice 2 flow encoder, parameter names as in the official `flow.pt` under `encoder.`):
linear embed + rel-pos scaling -> pre-lookahead conv (3 tokens) -> `num_blocks` conformer layers
(rel-pos self-attention + feed-forward, pre-norm) -> causal x2 `Upsample1D` -> linear embed ->
`num_up_blocks` conformer layers -> final LayerNorm.

With `streaming=True` attention is block-causal (blocks of `static_chunk_size` positions before the
upsampling, `static_chunk_size * up_stride` after), counted from the first position; the convolutions are
causal except the pre-lookahead conv, which reads `pre_lookahead_len` positions to the right (zeros, or
explicit right-context tokens). So streaming output for a prefix is unchanged when later tokens arrive.

Legend: B batch, T positions, D model width, H heads, Dh head width, C channels.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vocalis.config import FlowEncoderConfig

# LayerNorm eps of the conformer layers' pre-norms (the embed and final norms use torch's default 1e-5).
_LAYER_NORM_EPS = 1e-12


def padding_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """`(B,)` valid lengths -> `(B, 1, max_len)` bool, True on valid positions (lengths may exceed max_len)."""
    positions = torch.arange(max_len, device=lengths.device)
    return (positions[None, :] < lengths[:, None]).unsqueeze(1)


def chunk_attention_mask(valid: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Key mask for self-attention.

    valid: (B, 1, T) bool. chunk_size > 0 gives block-causal attention, query i seeing every key
    j < (i // chunk_size + 1) * chunk_size, returned as (B, T, T); chunk_size 0 returns `valid` itself
    (full attention over the valid keys, broadcast over queries).
    """
    if chunk_size > 0:
        t = valid.size(-1)
        positions = torch.arange(t, device=valid.device)
        block_end = (positions // chunk_size + 1) * chunk_size  # (T,)
        causal = positions[None, :] < block_end[:, None]  # (T_query, T_key)
        mask = valid & causal.unsqueeze(0)  # (B, T, T)
    else:
        mask = valid
    # A query row with no visible key (empty sequence) would give NaN; the official code opens such rows
    # fully and relies on later masking, and so do we.
    empty = ~mask.any(dim=-1, keepdim=True)
    return mask | empty


def relative_positional_table(length: int, dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """ESPnet relative positional table: (1, 2*length - 1, dim) for relative positions length-1 ... -(length-1).

    Computed in fp32 then cast, so it does not depend on the activation dtype's precision.
    """
    positions = torch.arange(length - 1, -length, -1, device=device, dtype=torch.float32)[:, None]  # (2T-1, 1)
    div_term = torch.exp(
        torch.arange(0, dim, 2, device=device, dtype=torch.float32) * -(math.log(10000.0) / dim)
    )  # (dim/2,)
    angles = positions * div_term  # (2T-1, dim/2)
    table = torch.stack([torch.sin(angles), torch.cos(angles)], dim=-1).flatten(1)  # (2T-1, dim), sin/cos interleaved
    return table.unsqueeze(0).to(dtype)


class RelPositionalEncoding(nn.Module):
    """Scales the input by sqrt(D) and returns the relative positional table for its length (no parameters)."""

    def __init__(self, dim: int, dropout_rate: float) -> None:
        super().__init__()
        self.dim = dim
        self.xscale = math.sqrt(dim)
        self.dropout = nn.Dropout(dropout_rate)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (B, T, D) -> (scaled x (B, T, D), pos_emb (1, 2T-1, D))."""
        pos_emb = relative_positional_table(x.size(1), self.dim, x.device, x.dtype)
        return self.dropout(x * self.xscale), self.dropout(pos_emb)


class LinearNoSubsampling(nn.Module):
    """Linear + LayerNorm + dropout, then positional scaling (`out.0`, `out.1` in the checkpoint)."""

    def __init__(self, idim: int, odim: int, dropout_rate: float, positional_dropout_rate: float) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.Linear(idim, odim), nn.LayerNorm(odim, eps=1e-5), nn.Dropout(dropout_rate))
        self.pos_enc = RelPositionalEncoding(odim, positional_dropout_rate)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (B, T, idim) -> (B, T, odim), pos_emb (1, 2T-1, odim)."""
        return self.pos_enc(self.out(x))


class RelPositionMultiHeadedAttention(nn.Module):
    """Transformer-XL style self-attention with learned content/position biases (`pos_bias_u`, `pos_bias_v`)."""

    def __init__(self, num_heads: int, dim: int, dropout_rate: float) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"attention width {dim} is not divisible by {num_heads} heads")
        self.h = num_heads
        self.d_k = dim // num_heads
        self.linear_q = nn.Linear(dim, dim)
        self.linear_k = nn.Linear(dim, dim)
        self.linear_v = nn.Linear(dim, dim)
        self.linear_out = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout_rate)
        self.linear_pos = nn.Linear(dim, dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(num_heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.empty(num_heads, self.d_k))
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.size(0), x.size(1), self.h, self.d_k)  # (B, T, H, Dh)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos_emb: torch.Tensor) -> torch.Tensor:
        """x: (B, T, D); mask: bool (B, 1, T) or (B, T, T), True = may attend; pos_emb: (1, 2T-1, D)."""
        b, t, _ = x.shape
        q = self._heads(self.linear_q(x))  # (B, T, H, Dh)
        k = self._heads(self.linear_k(x)).transpose(1, 2)  # (B, H, T, Dh)
        v = self._heads(self.linear_v(x)).transpose(1, 2)  # (B, H, T, Dh)
        p = self._heads(self.linear_pos(pos_emb)).transpose(1, 2)  # (1, H, 2T-1, Dh)

        content = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))  # (B, H, T, T)
        position = torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1))  # (B, H, T, 2T-1)
        # rel-shift: key j of query i reads table index (T-1) - (i - j), i.e. relative position i - j.
        idx = torch.arange(t, device=x.device)
        rel_index = (idx[None, :] - idx[:, None] + t - 1).expand(b, self.h, t, t)
        position = torch.gather(position, -1, rel_index)  # (B, H, T, T)
        scores = (content + position) / math.sqrt(self.d_k)

        blocked = ~mask.unsqueeze(1)  # (B, 1, 1|T, T)
        scores = scores.masked_fill(blocked, -float("inf"))
        attn = torch.softmax(scores, dim=-1).masked_fill(blocked, 0.0)
        out = torch.matmul(self.dropout(attn), v)  # (B, H, T, Dh)
        out = out.transpose(1, 2).reshape(b, t, self.h * self.d_k)  # (B, T, D)
        return self.linear_out(out)


class PositionwiseFeedForward(nn.Module):
    """w_1 -> SiLU -> dropout -> w_2."""

    def __init__(self, dim: int, hidden: int, dropout_rate: float) -> None:
        super().__init__()
        self.w_1 = nn.Linear(dim, hidden)
        self.activation = nn.SiLU()
        self.dropout = nn.Dropout(dropout_rate)
        self.w_2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(self.dropout(self.activation(self.w_1(x))))


class ConformerEncoderLayer(nn.Module):
    """Pre-norm self-attention + feed-forward block (no macaron, no conv module, as configured in CosyVoice 2)."""

    def __init__(self, dim: int, num_heads: int, hidden: int, dropout_rate: float, attention_dropout_rate: float):
        super().__init__()
        self.self_attn = RelPositionMultiHeadedAttention(num_heads, dim, attention_dropout_rate)
        self.feed_forward = PositionwiseFeedForward(dim, hidden, dropout_rate)
        self.norm_ff = nn.LayerNorm(dim, eps=_LAYER_NORM_EPS)
        self.norm_mha = nn.LayerNorm(dim, eps=_LAYER_NORM_EPS)
        self.dropout = nn.Dropout(dropout_rate)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos_emb: torch.Tensor) -> torch.Tensor:
        """x: (B, T, D) -> (B, T, D)."""
        x = x + self.dropout(self.self_attn(self.norm_mha(x), mask, pos_emb))
        return x + self.dropout(self.feed_forward(self.norm_ff(x)))


class PreLookaheadLayer(nn.Module):
    """Residual conv pair that lets each position see `pre_lookahead_len` positions to its right."""

    def __init__(self, channels: int, pre_lookahead_len: int) -> None:
        super().__init__()
        self.pre_lookahead_len = pre_lookahead_len
        self.conv1 = nn.Conv1d(channels, channels, kernel_size=pre_lookahead_len + 1)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=3)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, T, C); context: (B, Tc <= pre_lookahead_len, C) embedded right context, else zeros."""
        h = x.transpose(1, 2)  # (B, C, T)
        if context is not None and context.size(1) > 0:
            if context.size(1) > self.pre_lookahead_len:
                raise ValueError(f"right context has {context.size(1)} positions, at most {self.pre_lookahead_len}")
            h = torch.cat([h, context.transpose(1, 2)], dim=2)  # (B, C, T + Tc)
        h = F.pad(h, (0, x.size(1) + self.pre_lookahead_len - h.size(2)))  # (B, C, T + lookahead)
        h = F.leaky_relu(self.conv1(h))  # (B, C, T)
        h = self.conv2(F.pad(h, (self.conv2.kernel_size[0] - 1, 0)))  # causal: (B, C, T)
        return h.transpose(1, 2) + x


class Upsample1D(nn.Module):
    """Nearest-neighbour x`stride` upsampling along time followed by a causal conv (kernel 2*stride + 1)."""

    def __init__(self, channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, out_channels, kernel_size=stride * 2 + 1)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (B, C, T), lengths (B,) -> (B, C_out, stride*T), lengths * stride."""
        h = torch.repeat_interleave(x, self.stride, dim=2)  # (B, C, stride*T)
        h = self.conv(F.pad(h, (self.stride * 2, 0)))
        return h, lengths * self.stride


class UpsampleConformerEncoder(nn.Module):
    """Speech-token embeddings (B, T, input_size) -> features (B, up_stride*T, output_size)."""

    def __init__(self, config: FlowEncoderConfig) -> None:
        super().__init__()
        c = config
        self.config = config
        dim = c.output_size
        self.embed = LinearNoSubsampling(c.input_size, dim, c.dropout_rate, c.positional_dropout_rate)
        self.after_norm = nn.LayerNorm(dim, eps=1e-5)
        self.pre_lookahead_layer = PreLookaheadLayer(dim, c.pre_lookahead_len)
        self.encoders = nn.ModuleList(
            ConformerEncoderLayer(dim, c.attention_heads, c.linear_units, c.dropout_rate, c.attention_dropout_rate)
            for _ in range(c.num_blocks)
        )
        self.up_layer = Upsample1D(dim, dim, c.up_stride)
        # The official code sizes this input with `input_size`; the signal here is `output_size` wide
        # (the two are equal, 512, in every released model).
        self.up_embed = LinearNoSubsampling(dim, dim, c.dropout_rate, c.positional_dropout_rate)
        self.up_encoders = nn.ModuleList(
            ConformerEncoderLayer(dim, c.attention_heads, c.linear_units, c.dropout_rate, c.attention_dropout_rate)
            for _ in range(c.num_up_blocks)
        )

    @property
    def output_size(self) -> int:
        return self.config.output_size

    def forward(
        self,
        xs: torch.Tensor,
        xs_lens: torch.Tensor,
        context: torch.Tensor | None = None,
        streaming: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode and upsample.

        xs: (B, T, input_size) token embeddings; xs_lens: (B,) valid lengths (values above T count as T, which
        is how callers holding back right context pass them); context: (B, Tc, input_size) embeddings of up
        to `pre_lookahead_len` tokens that follow xs, read only by the look-ahead conv (inference only).
        Returns (B, up_stride*T, output_size) and the valid mask (B, 1, up_stride*T).
        """
        c = self.config
        valid = padding_mask(xs_lens, xs.size(1))  # (B, 1, T)
        xs, pos_emb = self.embed(xs)
        if context is not None and context.size(1) > 0:
            if self.training:
                raise ValueError("right context is an inference-only input")
            context, _ = self.embed(context)  # the rel-pos table is offset-free; only the scaling matters
        mask = chunk_attention_mask(valid, c.static_chunk_size if streaming else 0)
        # Padding leaves the embed as LayerNorm bias, not zeros; zero it so the look-ahead conv sees a padded
        # row's end exactly as an unpadded one (the official code skips this; identical when unpadded).
        xs = self.pre_lookahead_layer(xs * valid.transpose(1, 2).to(xs.dtype), context)
        for layer in self.encoders:
            xs = layer(xs, mask, pos_emb)

        up, up_lens = self.up_layer(xs.transpose(1, 2), xs_lens)  # (B, D, stride*T)
        xs = up.transpose(1, 2)  # (B, stride*T, D)
        valid = padding_mask(up_lens, xs.size(1))  # (B, 1, stride*T)
        xs, pos_emb = self.up_embed(xs)
        mask = chunk_attention_mask(valid, c.static_chunk_size * c.up_stride if streaming else 0)
        for layer in self.up_encoders:
            xs = layer(xs, mask, pos_emb)
        return self.after_norm(xs), valid
