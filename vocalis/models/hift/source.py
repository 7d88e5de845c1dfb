"""Neural source filter (NSF) excitation for HiFT: F0 per sample -> harmonic sine source.

`SineGen2` is the sine generator the official code picks for any rate other than 22050 Hz (so for
CosyVoice 2 at 24 kHz). It integrates the phase at frame rate (rad/sample linearly interpolated down by
the upsampling factor, cumulative sum, then linearly interpolated back up), which keeps fp32 phases
from drifting over long utterances.

The module draws three random tensors per call, in the official order, so that a seeded run reproduces
the official waveform exactly:
1. `rand(B, harmonics + 1)`: initial phase per harmonic (the fundamental's is forced to 0);
2. a standard normal tensor shaped and laid out like the sine waves (additive noise);
3. a standard normal tensor shaped like `uv` (the noise branch; HiFT ignores it, but drawing it keeps
   the generator state identical to the official one for the following calls).
Tensors 2 and 3 are drawn with `empty_like(...).normal_()`, which fills the same memory layout as the
official `randn_like` does (the sine tensor is a transposed view, and the CPU normal kernel's values
depend on the layout).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vocalis.config import HiFTConfig

# The official code switches to its first sine generator at exactly this rate (CosyVoice 1).
_SINEGEN1_RATE = 22050


class SineGen2(nn.Module):
    """Harmonic sine generator: F0 (B, L, 1) per sample -> sines (B, L, H), uv (B, L, 1), noise (B, L, H).

    H = harmonic_num + 1 (fundamental plus overtones). No parameters.
    """

    def __init__(
        self,
        sampling_rate: int,
        upsample_scale: int,
        harmonic_num: int,
        sine_amp: float,
        noise_std: float,
        voiced_threshold: float,
    ) -> None:
        super().__init__()
        self.sampling_rate = sampling_rate
        self.upsample_scale = upsample_scale
        self.dim = harmonic_num + 1
        self.sine_amp = sine_amp
        self.noise_std = noise_std
        self.voiced_threshold = voiced_threshold

    def _f0_to_sines(self, fn: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Harmonic frequencies (B, L, H) in Hz -> unit sines (B, L, H) (a transposed view, as officially)."""
        # Phase advance in cycles per sample; the integer part is irrelevant to the phase.
        rad = (fn / self.sampling_rate) % 1  # (B, L, H)
        rand_ini = torch.rand(fn.shape[0], fn.shape[2], generator=generator, device=fn.device, dtype=fn.dtype)
        rand_ini[:, 0] = 0
        # Only the first sample gets the random phase (as in the official code).
        rad[:, 0, :] = rad[:, 0, :] + rand_ini
        rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / self.upsample_scale, mode="linear")
        rad = rad.transpose(1, 2)  # (B, L / scale, H)
        phase = torch.cumsum(rad, dim=1) * 2 * math.pi  # (B, L / scale, H)
        # The frame-rate phase is scaled by the factor before linear upsampling back to samples.
        phase = F.interpolate(
            phase.transpose(1, 2) * self.upsample_scale, scale_factor=self.upsample_scale, mode="linear"
        )
        phase = phase.transpose(1, 2)  # (B, L, H), stored as (B, H, L)
        return torch.sin(phase)

    def forward(
        self, f0: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`f0` (B, L, 1) Hz per sample -> (sine_waves (B, L, H), uv (B, L, 1), noise (B, L, H))."""
        harmonics = torch.arange(1, self.dim + 1, device=f0.device, dtype=f0.dtype)
        fn = f0 * harmonics.view(1, 1, -1)  # (B, L, H)
        sine_waves = self._f0_to_sines(fn, generator) * self.sine_amp
        uv = (f0 > self.voiced_threshold).to(f0.dtype)  # (B, L, 1)
        # Unvoiced samples get noise of about the sine amplitude; voiced ones a small noise floor.
        noise_amp = uv * self.noise_std + (1 - uv) * self.sine_amp / 3
        noise = noise_amp * torch.empty_like(sine_waves).normal_(generator=generator)
        sine_waves = sine_waves * uv + noise
        return sine_waves, uv, noise


class SourceModuleHnNSF(nn.Module):
    """Harmonic-plus-noise source: F0 (B, L, 1) per sample -> (excitation (B, L, 1), noise (B, L, 1), uv (B, L, 1)).

    The excitation is `tanh(l_linear(sines))`, merging the harmonics into one channel.
    """

    def __init__(self, config: HiFTConfig) -> None:
        super().__init__()
        if config.sampling_rate == _SINEGEN1_RATE:
            raise ValueError("the 22050 Hz (CosyVoice 1) sine generator is not implemented; use 24000 Hz")
        self.sine_amp = config.nsf_alpha
        self.l_sin_gen = SineGen2(
            sampling_rate=config.sampling_rate,
            upsample_scale=config.hop_samples,
            harmonic_num=config.nb_harmonics,
            sine_amp=config.nsf_alpha,
            noise_std=config.nsf_sigma,
            voiced_threshold=config.nsf_voiced_threshold,
        )
        self.l_linear = nn.Linear(config.nb_harmonics + 1, 1)
        self.l_tanh = nn.Tanh()

    def forward(
        self, f0: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`f0` (B, L, 1) -> (sine_merge (B, L, 1), noise (B, L, 1), uv (B, L, 1))."""
        with torch.no_grad():
            sine_waves, uv, _ = self.l_sin_gen(f0, generator)
        sine_merge = self.l_tanh(self.l_linear(sine_waves))
        noise = torch.empty_like(uv).normal_(generator=generator) * self.sine_amp / 3
        return sine_merge, noise, uv
