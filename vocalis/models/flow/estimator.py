"""Flow-matching velocity estimator `CausalConditionalDecoder`: a causal 1-D U-Net with transformer blocks.

One resolution level (no temporal down/upsampling): a down block, `num_mid_blocks` mid blocks and an up block
fed with the down block's skip, then a final conv block and a 1x1 projection to the mel channels. Each block is
a time-conditioned causal resnet followed by `n_blocks` transformer blocks. Every convolution is left-padded and
attention is either full (padding mask only) or block-causal in `static_chunk_size` frames counted from frame 0,
so in streaming mode frame i depends only on frames of its own and earlier chunks.

Attribute names equal the official `decoder.estimator.*` checkpoint keys.

Shapes: B batch, C channels, T frames, D model width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vocalis.config import EstimatorConfig
from vocalis.models.flow.transformer import BasicTransformerBlock

# Masked attention positions get this additive bias (the official `mask_to_bias` value, not -inf).
_MASK_BIAS = -1.0e10
# The sinusoidal time embedding scales t in [0, 1] by this before taking sines.
_TIME_SCALE = 1000.0


class SinusoidalPosEmb(nn.Module):
    """t (B,) -> (B, dim): `[sin(1000 t f_k), cos(1000 t f_k)]`, `f_k = exp(-k ln(10000) / (dim/2 - 1))`."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        if dim % 2:
            raise ValueError("sinusoidal embedding width must be even")
        self.dim = dim

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        if t.ndim < 1:
            t = t.unsqueeze(0)
        half = self.dim // 2
        step = math.log(10000) / (half - 1)
        freq = torch.exp(torch.arange(half, device=t.device).float() * -step)  # (dim/2,)
        e = _TIME_SCALE * t.unsqueeze(1) * freq.unsqueeze(0)  # (B, dim/2)
        return torch.cat((e.sin(), e.cos()), dim=-1)


class TimestepEmbedding(nn.Module):
    """`linear_2(silu(linear_1(x)))`."""

    def __init__(self, in_channels: int, time_embed_dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, time_embed_dim)
        self.act = nn.SiLU()
        self.linear_2 = nn.Linear(time_embed_dim, time_embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class CausalConv1d(nn.Conv1d):
    """Stride-1 conv that left-pads by `kernel_size - 1` zeros, so output frame i sees input frames <= i."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size)
        self.causal_padding = kernel_size - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.causal_padding, 0)))


class Transpose(nn.Module):
    """Swap two dims inside an `nn.Sequential` (LayerNorm over channels of a (B, C, T) tensor)."""

    def __init__(self, dim0: int, dim1: int) -> None:
        super().__init__()
        self.dim0 = dim0
        self.dim1 = dim1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(self.dim0, self.dim1)


class CausalBlock1D(nn.Module):
    """`block(x * m) * m` with `block = [CausalConv1d(k=3), Transpose, LayerNorm, Transpose, Mish]`."""

    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            CausalConv1d(dim, dim_out, 3), Transpose(1, 2), nn.LayerNorm(dim_out), Transpose(1, 2), nn.Mish()
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x (B, C, T), mask (B, 1, T) -> (B, C_out, T)."""
        return self.block(x * mask) * mask


class CausalResnetBlock1D(nn.Module):
    """Two causal conv blocks with the time embedding added in between, plus a 1x1 residual projection."""

    def __init__(self, dim: int, dim_out: int, time_emb_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_emb_dim, dim_out))
        self.block1 = CausalBlock1D(dim, dim_out)
        self.block2 = CausalBlock1D(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """x (B, C, T), mask (B, 1, T), temb (B, E) -> (B, C_out, T)."""
        h = self.block1(x, mask)
        h = h + self.mlp(temb).unsqueeze(-1)
        h = self.block2(h, mask)
        return h + self.res_conv(x * mask)


def attention_bias(mask: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention bias (B, T, T) from a padding mask (B, 1, T).

    `chunk_size > 0` gives the block-causal mask: query i sees keys j < (i // chunk_size + 1) * chunk_size,
    blocks counted from frame 0; `chunk_size == 0` gives full attention over the unpadded keys.
    """
    keep = mask.bool()  # (B, 1, T)
    t = mask.shape[-1]
    if chunk_size > 0:
        pos = torch.arange(t, device=mask.device)
        limit = (torch.div(pos, chunk_size, rounding_mode="trunc") + 1) * chunk_size
        keep = keep & (pos.unsqueeze(0) < limit.unsqueeze(1)).unsqueeze(0)  # (B, T, T)
    else:
        keep = keep.expand(-1, t, -1)  # (B, T, T)
    # a fill, not (1 - keep) * bias: fp16 cannot hold the bias (its lowest value stands in), and an exported fp16
    # graph would multiply 0 by an infinite constant
    bias = max(_MASK_BIAS, torch.finfo(dtype).min)
    return torch.zeros(keep.shape, dtype=dtype, device=mask.device).masked_fill(~keep, bias)


class CausalConditionalDecoder(nn.Module):
    """Velocity field v(x_t, t | mu, spks, cond) of conditional flow matching.

    forward(x (B, 80, T), mask (B, 1, T), mu (B, 80, T), t (B,), spks (B, 80), cond (B, 80, T)) -> (B, 80, T).
    """

    def __init__(self, config: EstimatorConfig) -> None:
        super().__init__()
        if len(config.channels) != 1:
            raise ValueError("CausalConditionalDecoder supports exactly one resolution level (channels=(C,))")
        self.config = config
        self.static_chunk_size = config.static_chunk_size
        width = config.channels[0]
        time_embed_dim = width * 4
        self.time_embeddings = SinusoidalPosEmb(config.in_channels)
        self.time_mlp = TimestepEmbedding(config.in_channels, time_embed_dim)

        def transformers() -> nn.ModuleList:
            return nn.ModuleList(
                BasicTransformerBlock(width, config.num_heads, config.attention_head_dim, config.dropout, config.act_fn)
                for _ in range(config.n_blocks)
            )

        # Single level: the "downsample"/"upsample" are stride-1 causal convs, as at the official last level.
        self.down_blocks = nn.ModuleList(
            [
                nn.ModuleList(
                    [
                        CausalResnetBlock1D(config.in_channels, width, time_embed_dim),
                        transformers(),
                        CausalConv1d(width, width, 3),
                    ]
                )
            ]
        )
        self.mid_blocks = nn.ModuleList(
            nn.ModuleList([CausalResnetBlock1D(width, width, time_embed_dim), transformers()])
            for _ in range(config.num_mid_blocks)
        )
        self.up_blocks = nn.ModuleList(
            [
                nn.ModuleList(
                    [
                        CausalResnetBlock1D(2 * width, width, time_embed_dim),
                        transformers(),
                        CausalConv1d(width, width, 3),
                    ]
                )
            ]
        )
        self.final_block = CausalBlock1D(width, width)
        self.final_proj = nn.Conv1d(width, config.out_channels, 1)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        mu: torch.Tensor,
        t: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        streaming: bool = False,
    ) -> torch.Tensor:
        """Velocity (B, 80, T), zero on padded frames. `streaming` selects the block-causal attention mask."""
        # t's sines in t's dtype (fp32 under a half-precision estimator: 1000 t needs its resolution), then x's
        temb = self.time_mlp(self.time_embeddings(t).to(t.dtype)).to(x.dtype)  # (B, 4*D)
        spk_map = spks.unsqueeze(-1).expand(-1, -1, x.shape[-1])  # (B, 80, T)
        h = torch.cat([x, mu, spk_map, cond], dim=1)  # (B, 320, T)
        chunk = self.static_chunk_size if streaming else 0

        skips = []
        for resnet, blocks, downsample in self.down_blocks:
            h = resnet(h, mask, temb)
            h = self._attend(h, mask, blocks, chunk)
            skips.append(h)  # the skip is taken before the (stride-1) downsample conv
            h = downsample(h * mask)

        for resnet, blocks in self.mid_blocks:
            h = resnet(h, mask, temb)
            h = self._attend(h, mask, blocks, chunk)

        for resnet, blocks, upsample in self.up_blocks:
            skip = skips.pop()
            h = torch.cat([h[:, :, : skip.shape[-1]], skip], dim=1)  # (B, 2D, T)
            h = resnet(h, mask, temb)
            h = self._attend(h, mask, blocks, chunk)
            h = upsample(h * mask)

        h = self.final_block(h, mask)
        return self.final_proj(h * mask) * mask

    @staticmethod
    def _attend(h: torch.Tensor, mask: torch.Tensor, blocks: nn.ModuleList, chunk_size: int) -> torch.Tensor:
        """Run transformer blocks over channels-first h (B, D, T) -> (B, D, T)."""
        x = h.transpose(1, 2)  # (B, T, D)
        bias = attention_bias(mask, chunk_size, x.dtype)  # (B, T, T)
        for block in blocks:
            x = block(x, bias)
        return x.transpose(1, 2)  # (B, D, T)
