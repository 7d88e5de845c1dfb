"""`CausalHiFTGenerator`: the CosyVoice 3 vocoder, 80-bin mel at 50 Hz -> 24 kHz waveform, causal throughout.

As HiFT (NSF source, HiFi-GAN upsampler x8 x5 x3 fused with the source's STFT, 16-point iSTFT with hop 4), but:
every conv is causal (`conv_pre` reads `conv_pre_look_right` frames to the right); the upsamplers are
nearest-neighbour repeats followed by a causal conv (not transposed convs); the F0 predictor is causal and runs in
float64; the source is deterministic (fixed initial phases and noise, see `source.py`).

Streaming (the official pipeline): each call re-runs the vocoder over all mel so far. With finalize=False the last
`f0_look_right` frames are only right context of the F0 predictor, the `conv_pre_look_right` frames before them
only right context of conv_pre, and one more frame (`hop_samples` samples) is cut from the end; those frames give
their audio in a later call. Output samples of a non-final call equal the final call's on the same samples.

Parameter names equal the official `hift.pt` keys (`*.parametrizations.weight.original0/1` weight norm).

Legend: B batch, T mel frames, N = T * hop_samples samples, C channels.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from vocalis.config.cv3 import CausalHiFTConfig
from vocalis.errors import InputError
from vocalis.models.cv3.source import (
    CausalConv1d,
    CausalConvRNNF0Predictor,
    CausalSourceModule,
    source_noise_tables,
)
from vocalis.models.hift.generator import Snake, prepare_official_state_dict

__all__ = ["CausalHiFTGenerator", "SourceTables", "prepare_official_state_dict"]

_MAX_MAGNITUDE = 1e2  # iSTFT magnitude clip


class CausalUpsample(nn.Conv1d):
    """Nearest-neighbour x`stride` repeat, then a causal conv (left padding kernel - 1): (B, C, L) -> (B, C', stride L)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size)
        self.stride_up = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.repeat_interleave(x, self.stride_up, dim=2)
        return super().forward(F.pad(h, (self.kernel_size[0] - 1, 0)))


class CausalDownsample(nn.Conv1d):
    """Strided conv padded `stride - 1` frames on the left: (B, C, L) -> (B, C', ceil(L / stride))."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.stride[0] - 1, 0)))


class CausalResBlock(nn.Module):
    """HiFi-GAN residual block with Snake activations and left-causal convs."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            weight_norm(CausalConv1d(channels, channels, kernel_size, dilation=d)) for d in dilations
        )
        self.convs2 = nn.ModuleList(weight_norm(CausalConv1d(channels, channels, kernel_size)) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, L) -> (B, C, L)."""
        for conv1, conv2, act1, act2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            x = conv2(act2(conv1(act1(x)))) + x
        return x


class SourceTables:
    """The fixed source tables (initial phases, uniform noise), replayed lazily and kept per device.

    Plain object, not buffers: they are not in `hift.pt`, and a model built on the meta device keeps them real.
    The noise grows in steps of `grow_samples` up to the official 5 minutes (regenerated from the start, which
    gives the same prefix).
    """

    def __init__(self, rng_shapes: tuple[int, int, int, int], config: CausalHiFTConfig,
                 grow_samples: int = 30 * 24000) -> None:
        self.rng_shapes = rng_shapes  # flow vocab, flow input size, spk embed dim, flow output size
        self.config = config
        self.grow_samples = grow_samples
        self._cpu: tuple[torch.Tensor, torch.Tensor] | None = None
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, num_samples: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(rand_ini (1, H), noise (1, >= num_samples, H)) on `device`."""
        limit = self.config.source_noise_samples
        if num_samples > limit:
            raise InputError(f"{num_samples} samples exceed the vocoder's fixed source noise ({limit}); "
                             "synthesise shorter segments")
        if self._cpu is None or self._cpu[1].shape[1] < num_samples:
            size = min(limit, math.ceil(num_samples / self.grow_samples) * self.grow_samples)
            self._cpu = source_noise_tables(*self.rng_shapes, self.config, size)
            self._on.clear()
        cached = self._on.get(device)
        if cached is None or cached[1].shape[1] < num_samples:
            cached = (self._cpu[0].to(device), self._cpu[1].to(device))
            self._on[device] = cached
        return cached


class CausalHiFTGenerator(nn.Module):
    def __init__(self, config: CausalHiFTConfig, tables: SourceTables | None = None) -> None:
        """`tables`: the fixed source tables; None replays them for the released model's flow shapes
        (6561-token embedding, 80 wide, 192-d x-vectors), set them for any other model (see `SourceTables`)."""
        super().__init__()
        self.config = config
        self.tables = tables if tables is not None else SourceTables((6561, 80, 192, 80), config)
        n_fft = config.istft_n_fft
        self.num_kernels = len(config.resblock_kernel_sizes)
        self.m_source = CausalSourceModule(config)
        self.conv_pre = weight_norm(
            CausalConv1d(config.in_channels, config.base_channels, config.conv_pre_look_right + 1, side="right")
        )
        self.ups = nn.ModuleList(
            weight_norm(CausalUpsample(config.base_channels // 2**i, config.base_channels // 2 ** (i + 1), k, u))
            for i, (u, k) in enumerate(zip(config.upsample_rates, config.upsample_kernel_sizes))
        )
        # the source STFT is brought to each stage's rate: cumulative products of the reversed rates ([15, 3, 1])
        down_rates = [1, *reversed(config.upsample_rates[1:])]
        cum_rates = [math.prod(down_rates[: i + 1]) for i in range(len(down_rates))][::-1]
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (u, k, dils) in enumerate(
            zip(cum_rates, config.source_resblock_kernel_sizes, config.source_resblock_dilation_sizes)
        ):
            channels = config.base_channels // 2 ** (i + 1)
            down = CausalConv1d(n_fft + 2, channels, 1) if u == 1 else CausalDownsample(n_fft + 2, channels, 2 * u, u)
            self.source_downs.append(down)
            self.source_resblocks.append(CausalResBlock(channels, k, tuple(dils)))
        self.resblocks = nn.ModuleList(
            CausalResBlock(config.base_channels // 2 ** (i + 1), k, tuple(dils))
            for i in range(len(config.upsample_rates))
            for k, dils in zip(config.resblock_kernel_sizes, config.resblock_dilation_sizes)
        )
        last = config.base_channels // 2 ** len(config.upsample_rates)
        self.conv_post = weight_norm(CausalConv1d(last, n_fft + 2, 7))
        self.f0_predictor = CausalConvRNNF0Predictor(config)

    # ---- STFT ----------------------------------------------------------------------------------------------
    def _window(self, like: torch.Tensor) -> torch.Tensor:
        # periodic Hann built in float64 then rounded (the official scipy window)
        n_fft = self.config.istft_n_fft
        return torch.hann_window(n_fft, periodic=True, dtype=torch.float64, device=like.device).to(like.dtype)

    def _stft(self, s: torch.Tensor) -> torch.Tensor:
        """Source (B, N) -> real and imaginary parts stacked on channels (B, n_fft + 2, N / hop + 1)."""
        n_fft, hop = self.config.istft_n_fft, self.config.istft_hop_len
        x = s.float() if s.dtype == torch.bfloat16 else s  # FFTs have no bf16
        spec = torch.view_as_real(torch.stft(x, n_fft, hop, n_fft, window=self._window(x), return_complex=True))
        return torch.cat((spec[..., 0], spec[..., 1]), dim=1).to(s.dtype)

    def _istft(self, magnitude: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
        n_fft, hop = self.config.istft_n_fft, self.config.istft_hop_len
        if magnitude.dtype == torch.bfloat16:
            magnitude, phase = magnitude.float(), phase.float()
        magnitude = torch.clip(magnitude, max=_MAX_MAGNITUDE)
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        return torch.istft(spec, n_fft, hop, n_fft, window=self._window(magnitude))

    # ---- maths ---------------------------------------------------------------------------------------------
    def f0(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """Mel (B, C_mel, T) -> F0 (B, T') in Hz, computed in float64, returned in float64; T' = T - f0_look_right
        when not finalizing."""
        return self.f0_predictor.forward_float64(mel, finalize=finalize)

    def source(self, f0: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """F0 per frame (B, T') -> excitation (B, 1, N'), N' = T' * hop_samples (F0 cast to `dtype` first)."""
        per_sample = torch.repeat_interleave(f0.to(dtype), self.config.hop_samples, dim=1).unsqueeze(-1)  # (B, N', 1)
        rand_ini, noise = self.tables.get(per_sample.shape[1], per_sample.device)
        s = self.m_source(per_sample, rand_ini, noise[:, : per_sample.shape[1]])  # (B, N', 1)
        return s.transpose(1, 2)

    def decode(self, x: torch.Tensor, s: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """Mel `x` (B, C_mel, T) and source `s` (B, 1, T * hop) -> waveform (B, N), clamped to `audio_limit`.

        finalize=True: N = T * hop. finalize=False: the last `conv_pre_look_right` frames are only conv_pre's right
        context and one more frame is cut, N = (T - conv_pre_look_right - 1) * hop.
        """
        cfg = self.config
        look = cfg.conv_pre_look_right
        up = math.prod(cfg.upsample_rates)  # STFT frames per mel frame
        s_stft = self._stft(s.squeeze(1))  # (B, n_fft + 2, N / hop + 1)
        if finalize:
            x = self.conv_pre(x)  # (B, C, T)
        else:
            if x.shape[2] <= look:
                raise InputError(f"a non-final vocoder call needs more than {look} mel frames to decode")
            x = self.conv_pre(x[:, :, :-look], x[:, :, -look:])  # (B, C, T - look)
            s_stft = s_stft[:, :, : -up * look]
        for i, upsample in enumerate(self.ups):
            x = upsample(F.leaky_relu(x, cfg.lrelu_slope))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")  # one extra frame to match the centred STFT
            x = x + self.source_resblocks[i](self.source_downs[i](s_stft))
            xs = self.resblocks[i * self.num_kernels](x)
            for j in range(1, self.num_kernels):
                xs = xs + self.resblocks[i * self.num_kernels + j](x)
            x = xs / self.num_kernels
        x = self.conv_post(F.leaky_relu(x))  # default slope here, as trained
        n_bins = cfg.istft_n_fft // 2 + 1
        wav = self._istft(torch.exp(x[:, :n_bins]), torch.sin(x[:, n_bins:]))  # (B, N)
        if not finalize:
            wav = wav[:, : -cfg.hop_samples]
        return torch.clamp(wav, -cfg.audio_limit, cfg.audio_limit)

    @torch.inference_mode()
    def inference(self, speech_feat: torch.Tensor, finalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Mel (B, C_mel, T) -> (speech (B, N), source (B, 1, N_src)).

        finalize=True: N = N_src = T * hop. finalize=False: N_src = (T - f0_look_right) * hop and
        N = (T - f0_look_right - conv_pre_look_right - 1) * hop.
        """
        f0 = self.f0(speech_feat, finalize)  # (B, T'), float64
        s = self.source(f0, speech_feat.dtype)  # (B, 1, N_src)
        mel = speech_feat if finalize else speech_feat[:, :, : -self.f0_predictor.look_right]
        return self.decode(mel, s, finalize), s
