"""HiFT's GAN discriminators: multi-period (waveform folded by period) and multi-resolution spectrogram.

Same architecture as the official recipe (Matcha/HiFi-GAN `MultiPeriodDiscriminator` with periods
2, 3, 5, 7, 11 and CosyVoice's `MultiResSpecDiscriminator` with STFT (n_fft, hop, win) = (1024, 120, 600),
(2048, 240, 1200), (512, 50, 240)); the official release ships no discriminator weights, so names are ours.

Each sub-discriminator maps a waveform (B, N) to logits (B, L_k) and the list of its hidden feature maps
(for the feature-matching loss). Legend: B batch, N samples, C channels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

LRELU_SLOPE = 0.1


@dataclass(frozen=True, slots=True)
class DiscriminatorConfig:
    """Sizes of `HiFTDiscriminator`. Defaults are the official recipe; tests use smaller channels."""

    periods: tuple[int, ...] = (2, 3, 5, 7, 11)
    period_channels: tuple[int, ...] = (32, 128, 512, 1024, 1024)  # last conv has stride 1
    resolutions: tuple[tuple[int, int, int], ...] = ((1024, 120, 600), (2048, 240, 1200), (512, 50, 240))
    spec_channels: int = 32
    spec_layers: tuple[tuple[int, int], ...] = field(default=((1, 1), (1, 2), (1, 2), (1, 2), (1, 1)))  # strides

    def __post_init__(self) -> None:
        if not self.periods and not self.resolutions:
            raise ValueError("the discriminator needs at least one period or one resolution")
        if any(p < 1 for p in self.periods):
            raise ValueError(f"periods must be >= 1, got {self.periods}")
        for n_fft, hop, win in self.resolutions:
            if not 0 < hop <= win <= n_fft:
                raise ValueError(f"resolution (n_fft, hop, win) = {(n_fft, hop, win)} needs 0 < hop <= win <= n_fft")


class PeriodDiscriminator(nn.Module):
    """Waveform folded into (N / p, p) columns; 2-D convs along time only, so each phase is judged apart."""

    def __init__(self, period: int, channels: tuple[int, ...]) -> None:
        super().__init__()
        self.period = period
        convs = []
        c_in = 1
        for i, c_out in enumerate(channels):
            stride = 3 if i < len(channels) - 1 else 1
            convs.append(weight_norm(nn.Conv2d(c_in, c_out, (5, 1), (stride, 1), padding=(2, 0))))
            c_in = c_out
        self.convs = nn.ModuleList(convs)
        self.conv_post = weight_norm(nn.Conv2d(c_in, 1, (3, 1), 1, padding=(1, 0)))

    def forward(self, wav: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`wav` (B, N) -> (logits (B, L), feature maps [(B, C_i, N_i, period)])."""
        b, n = wav.shape
        if n % self.period:
            wav = F.pad(wav, (0, self.period - n % self.period), mode="reflect")
        x = wav.view(b, 1, -1, self.period)  # (B, 1, N / p, p)
        fmaps = []
        for conv in self.convs:
            x = F.leaky_relu(conv(x), LRELU_SLOPE)
            fmaps.append(x)
        x = self.conv_post(x)
        fmaps.append(x)
        return x.flatten(1), fmaps


class SpectrogramDiscriminator(nn.Module):
    """Linear STFT magnitude (time x frequency image) -> 2-D convs striding along frequency."""

    def __init__(self, n_fft: int, hop: int, win: int, channels: int, strides: tuple[tuple[int, int], ...]) -> None:
        super().__init__()
        self.n_fft, self.hop, self.win = n_fft, hop, win
        convs = []
        c_in = 1
        for i, (st, sf) in enumerate(strides):
            # the last layer looks at a 3x3 neighbourhood; the others are wide along frequency
            kernel, pad = ((3, 3), (1, 1)) if i == len(strides) - 1 else ((3, 9), (1, 4))
            convs.append(weight_norm(nn.Conv2d(c_in, channels, kernel, (st, sf), padding=pad)))
            c_in = channels
        self.convs = nn.ModuleList(convs)
        self.conv_post = weight_norm(nn.Conv2d(channels, 1, 3, 1, padding=1))

    def magnitude(self, wav: torch.Tensor) -> torch.Tensor:
        """`wav` (B, N) -> |STFT| (B, 1, frames, n_fft / 2 + 1), computed in fp32 (cuFFT has no bf16)."""
        with torch.autocast(device_type=wav.device.type, enabled=False):
            wav = wav.float()
            window = torch.hann_window(self.win, device=wav.device)
            spec = torch.stft(wav, self.n_fft, self.hop, self.win, window, return_complex=True)  # (B, F, frames)
            return spec.abs().transpose(1, 2).unsqueeze(1)

    def forward(self, wav: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`wav` (B, N) -> (logits (B, L), feature maps [(B, C, frames, F_i)])."""
        x = self.magnitude(wav)
        fmaps = []
        for conv in self.convs:
            x = F.leaky_relu(conv(x), LRELU_SLOPE)
            fmaps.append(x)
        x = self.conv_post(x)
        fmaps.append(x)
        return x.flatten(1), fmaps


class HiFTDiscriminator(nn.Module):
    """All sub-discriminators: `forward(wav (B, N)) -> (logits [(B, L_k)], feature maps [[...]])`, MPD first."""

    def __init__(self, config: DiscriminatorConfig | None = None) -> None:
        super().__init__()
        cfg = config or DiscriminatorConfig()
        self.config = cfg
        self.period = nn.ModuleList(PeriodDiscriminator(p, cfg.period_channels) for p in cfg.periods)
        self.spectral = nn.ModuleList(
            SpectrogramDiscriminator(n_fft, hop, win, cfg.spec_channels, cfg.spec_layers)
            for n_fft, hop, win in cfg.resolutions
        )

    def forward(self, wav: torch.Tensor) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        if wav.dim() == 3:  # (B, 1, N) as some callers keep the channel axis
            wav = wav.squeeze(1)
        logits, fmaps = [], []
        for disc in (*self.period, *self.spectral):
            out, maps = disc(wav)
            logits.append(out)
            fmaps.append(maps)
        return logits, fmaps
