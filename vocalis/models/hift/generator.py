"""`HiFTGenerator`: NSF + iSTFT HiFi-GAN vocoder, 80-bin mel at 50 Hz -> 24 kHz waveform.

Pipeline: F0 predictor -> per-sample F0 -> harmonic sine source; the source's STFT is fused into a
HiFi-GAN upsampler (x8, x5, x3) whose 18 output channels are the magnitude and phase of a 16-point iSTFT
with hop 4 (480 samples per mel frame in all). Attribute names equal the official `hift.pt` keys; weight
norm uses `torch.nn.utils.parametrizations.weight_norm`, giving `*.parametrizations.weight.original0/1`.

Shape legend: B batch, T mel frames, N = T * hop_samples output samples, C channels.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from vocalis.config import HiFTConfig
from vocalis.errors import InputError, ModelLoadError
from vocalis.models.hift.f0_predictor import ConvRNNF0Predictor
from vocalis.models.hift.source import SourceModuleHnNSF

logger = logging.getLogger(__name__)

_SNAKE_EPS = 1e-9  # keeps 1 / alpha finite; part of the trained function
_MAX_MAGNITUDE = 1e2  # iSTFT magnitude clip
_LEGACY_SUFFIXES = {  # torch.nn.utils.weight_norm names -> parametrizations names
    ".weight_g": ".parametrizations.weight.original0",
    ".weight_v": ".parametrizations.weight.original1",
}


def _fft_dtype(x: torch.Tensor) -> torch.Tensor:
    """bf16 (from training under bf16 autocast) -> fp32: FFTs and complex tensors have no bf16. Others unchanged."""
    return x.float() if x.dtype == torch.bfloat16 else x


def _same_padding(kernel_size: int, dilation: int) -> int:
    return (kernel_size * dilation - dilation) // 2


class Snake(nn.Module):
    """Snake activation `x + sin^2(alpha x) / alpha` with a learned per-channel alpha (linear scale)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` (B, C, L) -> (B, C, L)."""
        alpha = self.alpha[None, :, None]  # (1, C, 1)
        if torch.is_grad_enabled() and (x.requires_grad or alpha.requires_grad):
            return x + (1.0 / (alpha + _SNAKE_EPS)) * torch.pow(torch.sin(x * alpha), 2)
        # Inference: the same arithmetic in one buffer, bit-identical (pow(s, 2) is s * s). Five passes over fresh
        # temporaries cost far more at the batched vocoder's sizes, which outgrow the caches.
        y = x * alpha
        y.sin_()
        y.mul_(y)
        y.mul_(1.0 / (alpha + _SNAKE_EPS))
        return y.add_(x)


class ResBlock(nn.Module):
    """HiFi-GAN residual block with Snake activations: per dilation d, `x += conv2(snake(conv1_d(snake(x))))`."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            weight_norm(nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=_same_padding(kernel_size, d)))
            for d in dilations
        )
        self.convs2 = nn.ModuleList(
            weight_norm(nn.Conv1d(channels, channels, kernel_size, padding=_same_padding(kernel_size, 1)))
            for _ in dilations
        )
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` (B, C, L) -> (B, C, L)."""
        for conv1, conv2, act1, act2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            x = conv2(act2(conv1(act1(x)))) + x
        return x


class HiFTGenerator(nn.Module):
    """HiFT vocoder. `inference` is stochastic (NSF source); `decode` is deterministic given the source."""

    def __init__(self, config: HiFTConfig) -> None:
        super().__init__()
        self.config = config
        n_fft = config.istft_n_fft
        num_ups = len(config.upsample_rates)
        self.num_kernels = len(config.resblock_kernel_sizes)
        self.m_source = SourceModuleHnNSF(config)
        self.f0_upsamp = nn.Upsample(scale_factor=config.hop_samples)  # nearest: F0 per frame -> per sample
        self.conv_pre = weight_norm(nn.Conv1d(config.in_channels, config.base_channels, 7, padding=3))

        self.ups = nn.ModuleList()
        for i, (rate, k) in enumerate(zip(config.upsample_rates, config.upsample_kernel_sizes)):
            c_in, c_out = config.base_channels // 2**i, config.base_channels // 2 ** (i + 1)
            self.ups.append(weight_norm(nn.ConvTranspose1d(c_in, c_out, k, rate, padding=(k - rate) // 2)))

        # The source STFT (hop = istft hop) is downsampled to each upsampling stage's rate:
        # cumulative products of the reversed rates, e.g. [15, 3, 1] for (8, 5, 3).
        down_rates = [1, *reversed(config.upsample_rates[1:])]
        cum_rates = [math.prod(down_rates[: i + 1]) for i in range(len(down_rates))][::-1]
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (u, k, dils) in enumerate(
            zip(cum_rates, config.source_resblock_kernel_sizes, config.source_resblock_dilation_sizes)
        ):
            channels = config.base_channels // 2 ** (i + 1)
            if u == 1:
                self.source_downs.append(nn.Conv1d(n_fft + 2, channels, 1, 1))
            else:
                self.source_downs.append(nn.Conv1d(n_fft + 2, channels, u * 2, u, padding=u // 2))
            self.source_resblocks.append(ResBlock(channels, k, tuple(dils)))

        self.resblocks = nn.ModuleList()
        for i in range(num_ups):
            channels = config.base_channels // 2 ** (i + 1)
            for k, dils in zip(config.resblock_kernel_sizes, config.resblock_dilation_sizes):
                self.resblocks.append(ResBlock(channels, k, tuple(dils)))

        last_channels = config.base_channels // 2**num_ups
        self.conv_post = weight_norm(nn.Conv1d(last_channels, n_fft + 2, 7, padding=3))
        self.reflection_pad = nn.ReflectionPad1d((1, 0))
        self.f0_predictor = ConvRNNF0Predictor(config)

    def _window(self, like: torch.Tensor) -> torch.Tensor:
        # Periodic Hann built in float64 then rounded, like the official scipy window; computed per call so
        # the module holds no unsaved buffer (safe with meta-device construction).
        n_fft = self.config.istft_n_fft
        return torch.hann_window(n_fft, periodic=True, dtype=torch.float64, device=like.device).to(like.dtype)

    def _stft(self, s: torch.Tensor) -> torch.Tensor:
        """Source `s` (B, N) -> real and imaginary STFT parts stacked on channels (B, n_fft + 2, N / hop + 1)."""
        n_fft, hop = self.config.istft_n_fft, self.config.istft_hop_len
        dtype = s.dtype
        s = _fft_dtype(s)
        spec = torch.stft(s, n_fft, hop, n_fft, window=self._window(s), return_complex=True)
        spec = torch.view_as_real(spec)  # (B, n_fft / 2 + 1, frames, 2)
        return torch.cat([spec[..., 0], spec[..., 1]], dim=1).to(dtype)

    def _istft(self, magnitude: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
        """(B, n_fft / 2 + 1, frames) magnitude and phase -> waveform (B, (frames - 1) * hop); fp32 for bf16 input
        (a bf16 waveform would carry quantisation noise into the losses)."""
        n_fft, hop = self.config.istft_n_fft, self.config.istft_hop_len
        magnitude, phase = _fft_dtype(magnitude), _fft_dtype(phase)
        magnitude = torch.clip(magnitude, max=_MAX_MAGNITUDE)
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        return torch.istft(spec, n_fft, hop, n_fft, window=self._window(magnitude))

    def decode(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """Mel `x` (B, C_mel, T) and source `s` (B, 1, N) -> waveform (B, N), clamped to `audio_limit`."""
        cfg = self.config
        s_stft = self._stft(s.squeeze(1))  # (B, n_fft + 2, N / hop + 1)
        x = self.conv_pre(x)  # (B, base_channels, T)
        for i, up in enumerate(self.ups):
            x = F.leaky_relu(x, cfg.lrelu_slope)
            x = up(x)
            if i == len(self.ups) - 1:
                x = self.reflection_pad(x)  # one extra frame to match the centred STFT's N / hop + 1
            x = x + self.source_resblocks[i](self.source_downs[i](s_stft))
            xs = self.resblocks[i * self.num_kernels](x)
            for j in range(1, self.num_kernels):
                xs += self.resblocks[i * self.num_kernels + j](x)
            x = xs / self.num_kernels
        # Default slope (0.01) here, not lrelu_slope: that is what the weights were trained with.
        x = F.leaky_relu(x)
        x = self.conv_post(x)  # (B, n_fft + 2, N / hop + 1)
        n_bins = cfg.istft_n_fft // 2 + 1
        magnitude = torch.exp(x[:, :n_bins, :])
        phase = torch.sin(x[:, n_bins:, :])
        wav = self._istft(magnitude, phase)  # (B, N)
        return torch.clamp(wav, -cfg.audio_limit, cfg.audio_limit)

    def source(self, speech_feat: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Mel (B, C_mel, T) -> NSF excitation (B, 1, N). Random (initial phases, noise) unless seeded."""
        f0 = self.f0_predictor(speech_feat)  # (B, T)
        f0 = self.f0_upsamp(f0[:, None]).transpose(1, 2)  # (B, N, 1)
        s, _, _ = self.m_source(f0, generator)
        return s.transpose(1, 2)  # (B, 1, N)

    def forward(
        self, speech_feat: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Training path: mel (B, C_mel, T) -> (speech (B, N), predicted F0 (B, T) in Hz), with gradients.

        The F0 is returned for the F0 loss; it reaches the waveform only through the sine source, which
        is built without gradients (as officially), so the F0 head learns from the F0 loss alone.
        """
        f0 = self.f0_predictor(speech_feat)  # (B, T)
        s, _, _ = self.m_source(self.f0_upsamp(f0[:, None]).transpose(1, 2), generator)  # (B, N, 1)
        return self.decode(speech_feat, s.transpose(1, 2)), f0

    @torch.no_grad()
    def inference(
        self,
        speech_feat: torch.Tensor,
        cache_source: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mel `speech_feat` (B, C_mel, T) -> (speech (B, N), source (B, 1, N)).

        `cache_source` (B, 1, S), the tail of the previous chunk's source, replaces the first S source samples
        so consecutive streaming chunks share their excitation across the cross-fade. `generator` (on the
        mel's device) is used for every random draw; None uses the global RNG.
        """
        s = self.source(speech_feat, generator)  # (B, 1, N)
        if cache_source is not None and cache_source.shape[2] > 0:
            cache_len = cache_source.shape[2]
            if cache_len > s.shape[2]:
                raise InputError(f"cache_source has {cache_len} samples but the chunk has only {s.shape[2]}")
            s[:, :, :cache_len] = cache_source
        return self.decode(speech_feat, s), s


def hift_config_for(state: Mapping[str, torch.Tensor], base: HiFTConfig) -> HiFTConfig:
    """`base` at the width that HiFT weights `state` were trained at (a vocoder widened from a preset's)."""
    key = "conv_pre.parametrizations.weight.original1"
    if key not in state:
        raise ModelLoadError(f"HiFT weights have no {key}")
    return replace(base, base_channels=int(state[key].shape[0]))  # (base_channels, C_mel, 7)


def prepare_official_state_dict(
    sd: Mapping[str, torch.Tensor], model: nn.Module | None = None
) -> dict[str, torch.Tensor]:
    """Official `hift.pt` state dict -> keys of `HiFTGenerator`.

    Removes the `generator.` substring (as the official loader does) and renames legacy weight-norm keys
    (`X.weight_g` / `X.weight_v`) to `X.parametrizations.weight.original0` / `original1`. With `model`, also
    checks that keys and shapes match it exactly, raising `ModelLoadError` otherwise.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        new_key = key.replace("generator.", "")
        for old, new in _LEGACY_SUFFIXES.items():
            if new_key.endswith(old):
                new_key = new_key[: -len(old)] + new
                break
        if new_key in out:
            raise ModelLoadError(f"HiFT checkpoint holds '{new_key}' twice (legacy and current names?): key '{key}'")
        out[new_key] = value
    if model is not None:
        check_state_dict(out, model)
    return out


def check_state_dict(sd: Mapping[str, torch.Tensor], model: nn.Module) -> None:
    """Raise `ModelLoadError` unless `sd` has exactly the keys and shapes of `model.state_dict()`."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    if missing or unexpected:
        raise ModelLoadError(
            f"HiFT checkpoint keys do not match the model: missing {missing[:5]} ({len(missing)} in all), "
            f"unexpected {unexpected[:5]} ({len(unexpected)} in all)"
        )
    for key, value in sd.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise ModelLoadError(
                f"HiFT checkpoint tensor '{key}' has shape {tuple(value.shape)}, "
                f"the model expects {tuple(expected[key].shape)}"
            )


def remove_weight_norm(module: nn.Module) -> nn.Module:
    """Fold every weight-norm parametrization into a plain `weight` (in place) for faster inference.

    Outputs are unchanged; the state-dict keys become `X.weight`, so load official checkpoints before folding.
    Do not fold a `copy.deepcopy` of a model that stays in use: torch shares the generated parametrized
    class between copies, and removing the parametrization from one removes `weight` from the other.
    """
    count = 0
    for sub in module.modules():
        if parametrize.is_parametrized(sub, "weight"):
            parametrize.remove_parametrizations(sub, "weight", leave_parametrized=True)
            count += 1
    logger.debug("folded weight norm in %d layers", count)
    return module
