"""Causal F0 predictor and deterministic NSF source of the CosyVoice 3 HiFT.

`CausalConvRNNF0Predictor`: five weight-normalised causal convolutions with ELU (the first, kernel 4, reads
`f0_look_right` frames to the right; the others are left-causal, kernel 3) and a per-frame linear head. The
official vocoder always runs it in float64 ("precision is crucial for causal inference"); `forward_float64` does
that without changing the module's own dtype.

`CausalSourceModule`: in eval mode the source is deterministic. The sine generator's initial phases (`rand_ini`)
and its noise (a uniform [0, 1) buffer `sine_noise`, 5 minutes long) were drawn once in the official constructors
from torch's default CPU generator; `source_noise_tables` replays those draws. The harmonic phase is integrated at
frame rate and held constant over each frame (nearest up-sampling), so a longer mel reproduces the source of
any shorter prefix exactly, which is what lets streaming re-run the vocoder over the mel so far.

Legend: B batch, T mel frames, N = T * hop samples, H = harmonics + 1.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.nn.utils.parametrizations import weight_norm

from vocalis.config.cv3 import CausalHiFTConfig
from vocalis.errors import InputError

_NUM_CONV_LAYERS = 5
_HIFT_RNG_SEED = 0  # the official flow decoder re-seeds every generator with 0; the vocoder's draws follow


def causal_padding(kernel_size: int, dilation: int = 1) -> int:
    """Frames a causal conv pads (the official rule; (k - 1) * d for every kernel used here)."""
    return (kernel_size * dilation - dilation) // 2 * 2 + (kernel_size + 1) % 2


class CausalConv1d(nn.Conv1d):
    """Stride-1 conv padded on one side: `left` (causal) or `right` (look-ahead), output length = input length.

    `context` replaces the zero padding: past frames for `left`, future frames for `right` (exactly
    `causal_padding` of them).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1,
                 side: str = "left") -> None:
        super().__init__(in_channels, out_channels, kernel_size, dilation=dilation)
        if side not in ("left", "right"):
            raise ValueError(f"side must be 'left' or 'right', got {side!r}")
        self.side = side
        self.causal_padding = causal_padding(kernel_size, dilation)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, C, L) -> (B, C_out, L)."""
        if context is None:
            pad = (self.causal_padding, 0) if self.side == "left" else (0, self.causal_padding)
            return super().forward(F.pad(x, pad))
        if context.shape[2] != self.causal_padding:
            raise InputError(f"context has {context.shape[2]} frames, the conv needs {self.causal_padding}")
        h = torch.cat((context, x), dim=2) if self.side == "left" else torch.cat((x, context), dim=2)
        return super().forward(h)


class CausalConvRNNF0Predictor(nn.Module):
    """Mel (B, C_mel, T) -> F0 (B, T) in Hz (T - f0_look_right frames when not finalizing). No recurrence."""

    def __init__(self, config: CausalHiFTConfig) -> None:
        super().__init__()
        c = config.f0_cond_channels
        layers: list[nn.Module] = [
            weight_norm(CausalConv1d(config.in_channels, c, config.f0_look_right + 1, side="right")), nn.ELU()
        ]
        for _ in range(_NUM_CONV_LAYERS - 1):
            layers += [weight_norm(CausalConv1d(c, c, 3, side="left")), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(c, config.f0_num_class)

    @property
    def look_right(self) -> int:
        return self.condnet[0].causal_padding

    def forward(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """finalize=False: the last `look_right` frames are only right context of the first conv."""
        if finalize:
            x = self.condnet[0](mel)
        else:
            n = self.look_right
            if mel.shape[2] <= n:
                raise InputError(f"a non-final vocoder call needs more than {n} mel frames, got {mel.shape[2]}")
            x = self.condnet[0](mel[:, :, :-n], mel[:, :, -n:])
        for layer in self.condnet[1:]:
            x = layer(x)
        return torch.abs(self.classifier(x.transpose(1, 2)).squeeze(-1))  # (B, T')

    def forward_float64(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """`forward` with every parameter and the input in float64, returned in float64; the module is untouched."""
        params = {name: p.double() for name, p in self.named_parameters()}
        return functional_call(self, params, (mel.double(),), {"finalize": finalize})


def source_noise_tables(
    flow_vocab_size: int,
    flow_input_size: int,
    spk_embed_dim: int,
    flow_output_size: int,
    config: CausalHiFTConfig,
    num_samples: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The official vocoder's fixed tables: rand_ini (1, H) and the first `num_samples` of sine_noise (1, N, H).

    Replays, on a private generator, every draw the official constructors make after the flow decoder re-seeds
    with 0: the start noise (1, 80, 15000), the flow's token embedding (normal) and speaker projection, the F0
    predictor's five convs and head (kaiming-uniform weights, uniform biases), then rand_ini and the noise
    buffer. Uniform draws are serial, so a shorter buffer is a prefix of the full one.
    """
    gen = torch.Generator(device="cpu").manual_seed(_HIFT_RNG_SEED)

    def uniform(*shape: int) -> None:
        torch.empty(shape).uniform_(generator=gen)

    torch.randn((1, 80, 15000), generator=gen)  # flow.decoder.rand_noise
    torch.empty(flow_vocab_size, flow_input_size).normal_(generator=gen)  # flow.input_embedding
    uniform(flow_output_size, spk_embed_dim)  # flow.spk_embed_affine_layer weight, then bias
    uniform(flow_output_size)
    c, k0 = config.f0_cond_channels, config.f0_look_right + 1
    for shape in [(c, config.in_channels, k0)] + [(c, c, 3)] * (_NUM_CONV_LAYERS - 1):
        uniform(*shape)
        uniform(c)
    uniform(config.f0_num_class, c)  # f0_predictor.classifier
    uniform(config.f0_num_class)
    harmonics = config.nb_harmonics + 1
    rand_ini = torch.rand((1, harmonics), generator=gen)
    rand_ini[:, 0] = 0
    noise = torch.rand((1, num_samples, harmonics), generator=gen)
    return rand_ini, noise


class CausalSineGen(nn.Module):
    """F0 per sample (B, N, 1) -> (sine_waves (B, N, H), uv (B, N, 1)), deterministic given the fixed tables."""

    def __init__(self, config: CausalHiFTConfig) -> None:
        super().__init__()
        self.sampling_rate = config.sampling_rate
        self.upsample_scale = config.hop_samples
        self.dim = config.nb_harmonics + 1
        self.sine_amp = config.nsf_alpha
        self.noise_std = config.nsf_sigma
        self.voiced_threshold = config.nsf_voiced_threshold

    def forward(
        self, f0: torch.Tensor, rand_ini: torch.Tensor, noise: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """f0 (B, N, 1); rand_ini (1, H) initial phases; noise (1, N, H) uniform [0, 1)."""
        harmonics = torch.arange(1, self.dim + 1, device=f0.device, dtype=f0.dtype)
        rad = (f0 * harmonics.view(1, 1, -1) / self.sampling_rate) % 1  # (B, N, H) cycles per sample
        rad[:, 0, :] = rad[:, 0, :] + rand_ini.to(rad)
        rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / self.upsample_scale, mode="linear")  # (B, H, T)
        phase = torch.cumsum(rad, dim=2) * 2 * math.pi  # (B, H, T)
        # causal: the frame-rate phase is held over each frame (nearest), never interpolated from the next frame
        phase = F.interpolate(phase * self.upsample_scale, scale_factor=self.upsample_scale, mode="nearest")
        sines = torch.sin(phase).transpose(1, 2) * self.sine_amp  # (B, N, H)
        uv = (f0 > self.voiced_threshold).to(f0.dtype)  # (B, N, 1)
        noise_amp = uv * self.noise_std + (1 - uv) * self.sine_amp / 3
        return sines * uv + noise_amp * noise.to(sines), uv


class CausalSourceModule(nn.Module):
    """Harmonic source: F0 per sample (B, N, 1) -> excitation tanh(l_linear(sines)) (B, N, 1)."""

    def __init__(self, config: CausalHiFTConfig) -> None:
        super().__init__()
        self.l_sin_gen = CausalSineGen(config)
        self.l_linear = nn.Linear(config.nb_harmonics + 1, 1)

    def forward(self, f0: torch.Tensor, rand_ini: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            sine_waves, _ = self.l_sin_gen(f0, rand_ini, noise)
        return torch.tanh(self.l_linear(sine_waves))
