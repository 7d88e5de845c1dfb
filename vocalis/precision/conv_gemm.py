"""A stride-1 conv as one GEMM over its k shifted inputs side by side (im2col), the layout shared by every
reduced-precision conv: the weight (C_out, C_in, k) as (C_out, k * C_in), tap j's channels at
[j * C_in, (j + 1) * C_in), and the input frames as rows of their k taps.

Legend: B batch rows, C_in / C_out channels, k taps, n output frames.
"""

from __future__ import annotations

import torch

from vocalis.kernels import build


def gemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """Conv weight (C_out, C_in, k) -> GEMM weight (C_out, k * C_in)."""
    c_out, c_in, k = weight.shape
    return weight.permute(0, 2, 1).reshape(c_out, k * c_in)


def columns(full: torch.Tensor, k: int) -> torch.Tensor:
    """full (B, C_in, k - 1 + n), every frame's left context included -> (B, n, k * C_in): output frame i's taps."""
    n = full.shape[2] - k + 1
    src = full.transpose(1, 2)  # (B, k - 1 + n, C_in)
    return src if k == 1 else torch.cat([src[:, j : j + n] for j in range(k)], dim=2)


def columns_after(left: torch.Tensor, x: torch.Tensor, k: int) -> torch.Tensor:
    """`columns` of (left, x) joined on time: left (B, C_in, ctx) the frames before x (B, C_in, n) -> (B, ctx + n -
    k + 1, k * C_in). On the CPU one native copy from where each frame lies (conv_columns.cpp), not a
    concatenation and then the shifted copies."""
    ext = build.extension() if x.device.type == "cpu" else None
    if (ext is None or not hasattr(ext, "conv_columns") or left.dtype != x.dtype or left.device != x.device
            or (torch.is_grad_enabled() and x.requires_grad)):
        return columns(torch.cat([left, x], dim=2), k)
    return ext.conv_columns(left, x, k)
