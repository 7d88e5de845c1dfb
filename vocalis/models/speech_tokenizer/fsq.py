"""Finite scalar quantisation (FSQ): a vector of D bounded scalars, each rounded to one of L levels.

The index of a code is `sum_i digit_i * L**i` with digits in [0, L), so the codebook has L**D entries
and needs no learned table. Rounding passes gradients straight through (identity), which lets the CTC
loss train the encoder across the bottleneck. With L = 3, D = 8 this is the official S3 tokenizer's
scheme (tanh, x0.999, round, +1).
"""

from __future__ import annotations

import math

import torch
from torch import nn

# Keeps the bounded value strictly inside the outermost rounding interval, so every level is reachable
# but none beyond (0.999 in the official tokenizer).
_BOUND_SHRINK = 1e-3


class FSQ(nn.Module):
    """`forward(z (..., D)) -> (quantised (..., D) in [-1, 1], indices (...) int64 in [0, L**D))`."""

    def __init__(self, levels: int, dim: int) -> None:
        super().__init__()
        if levels < 2:
            raise ValueError(f"FSQ needs at least 2 levels, got {levels}")
        self.levels = levels
        self.dim = dim
        self.half_width = levels // 2  # digit = rounded value + half_width
        # Even L needs an offset of 0.5 so that L integers fit symmetrically in the tanh range.
        self.offset = 0.0 if levels % 2 else 0.5
        self.bound = (levels - 1) / 2 * (1 - _BOUND_SHRINK)
        self.shift = math.atanh(self.offset / self.bound)  # makes z = 0 map to 0 for even L too
        self.register_buffer("powers", levels ** torch.arange(dim, dtype=torch.int64), persistent=False)

    @property
    def codebook_size(self) -> int:
        return self.levels**self.dim

    def bounded(self, z: torch.Tensor) -> torch.Tensor:
        """Unbounded `z` (..., D) -> values in (-L/2, L/2) before rounding."""
        return torch.tanh(z + self.shift) * self.bound - self.offset

    def forward(self, z: torch.Tensor, quantize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """`z` (..., D) -> (quantised (..., D) scaled to [-1, 1], indices (...)).

        `quantize=False` passes the bounded values on unrounded (indices are still computed): a warm-up in
        which the CTC decoder can read everything the encoder writes, before the bottleneck is made discrete.
        """
        if z.shape[-1] != self.dim:
            raise ValueError(f"FSQ expects last dimension {self.dim}, got {tuple(z.shape)}")
        b = self.bounded(z)
        rounded = b + (torch.round(b) - b).detach() if quantize else b  # straight-through estimator
        digits = torch.round(b).detach().to(torch.int64) + self.half_width  # (..., D) in [0, L)
        return rounded / self.half_width, (digits * self.powers).sum(-1)

    def indices_to_digits(self, indices: torch.Tensor) -> torch.Tensor:
        """Indices (...) -> digits (..., D) in [0, L), least significant first."""
        return torch.div(indices.to(torch.int64).unsqueeze(-1), self.powers, rounding_mode="floor") % self.levels

    def indices_to_codes(self, indices: torch.Tensor) -> torch.Tensor:
        """Indices (...) -> quantised vectors (..., D) in [-1, 1], the inverse of `forward`'s index."""
        return (self.indices_to_digits(indices) - self.half_width).to(torch.float32) / self.half_width
