"""`ConvRNNF0Predictor`: mel frames -> F0 in Hz, one value per frame (HiFT's pitch head).

Despite the official name there is no recurrence: five weight-normalised k=3 convolutions with ELU,
then a per-frame linear head. Attribute names follow the checkpoint (`f0_predictor.condnet.{0,2,4,6,8}`,
`f0_predictor.classifier`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from vocalis.config import HiFTConfig

_NUM_CONV_LAYERS = 5


class ConvRNNF0Predictor(nn.Module):
    """F0 predictor: `(B, in_channels, T)` mel -> `(B, T)` non-negative F0 in Hz (for `f0_num_class` 1)."""

    def __init__(self, config: HiFTConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        in_channels = config.in_channels
        for _ in range(_NUM_CONV_LAYERS):
            # ELU sits between the convs, so the convs land at the even indices of the checkpoint.
            layers.append(weight_norm(nn.Conv1d(in_channels, config.f0_cond_channels, kernel_size=3, padding=1)))
            layers.append(nn.ELU())
            in_channels = config.f0_cond_channels
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(config.f0_cond_channels, config.f0_num_class)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """`mel` (B, C_mel, T) -> F0 (B, T) in Hz; `(B, T, num_class)` if `f0_num_class` > 1."""
        x = self.condnet(mel)  # (B, C, T)
        x = self.classifier(x.transpose(1, 2))  # (B, T, num_class)
        return torch.abs(x.squeeze(-1))
