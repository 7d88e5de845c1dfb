"""HiFT over a batch of mel chunks of different lengths: padding + masks, equal to one chunk at a time.

HiFT is not causal (same-padded convs, transposed convs, a centred STFT), so right-padding a short row would
change its last samples. Every conv here reads zero-padded input exactly as the unbatched module does: each
conv's input is zeroed beyond the row's valid length (Snake, leaky ReLU and ELU map 0 to 0, and a transposed
conv's valid outputs only read valid inputs), and the STFT/iSTFT, whose centring reflects the signal's own
edge, run per row. The NSF source draws random numbers, so it runs per row with that request's generator, in
the module's draw order: a batched chunk sounds exactly like the same chunk vocoded alone.

`hift_body` (mel + source STFT + lengths -> conv_post output) is plain tensor code so the ONNX backend can
export it, and graph-safe (masks from the lengths tensor): `BucketedBody` runs it on (rows, frames) buckets as
one graph each; `vocode_batch` wraps a body with the per-row parts.

Legend: B rows, T mel frames (padded), N samples, F = N / istft_hop + 1 STFT frames, C channels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from vocalis.errors import InputError
from vocalis.models.hift.generator import HiFTGenerator, ResBlock
from vocalis.token2wav.graphs import HIFT_FRAME_BUCKETS, ROW_BUCKETS, BucketGraphs, bucket
from vocalis.token2wav.static_solve import half_copy

_MAX_MAGNITUDE = 1e2  # the module's iSTFT magnitude clip

HiftBody = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _mask(lengths: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
    """(B,) lengths -> (B, 1, size) 1.0 on valid positions."""
    return (torch.arange(size, device=lengths.device)[None, :] < lengths[:, None]).unsqueeze(1).to(dtype)


def _resblock(block: ResBlock, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`ResBlock.forward` with every conv input zero beyond the valid length (x must be masked already)."""
    for conv1, conv2, act1, act2 in zip(block.convs1, block.convs2, block.activations1, block.activations2):
        xt = conv1(act1(x)) * mask
        x = conv2(act2(xt)) * mask + x
    return x


def hift_body(hift: HiFTGenerator, mel: torch.Tensor, s_stft: torch.Tensor, mel_lens: torch.Tensor) -> torch.Tensor:
    """mel (B, 80, T), source STFT (B, n_fft + 2, F = T*hop/istft_hop + 1, zero beyond each row), mel_lens (B,)
    -> conv_post output (B, n_fft + 2, F); beyond a row's valid frames the values are meaningless."""
    cfg = hift.config
    lens = mel_lens.to(torch.long)
    m = _mask(lens, mel.shape[2], mel.dtype)
    x = hift.conv_pre(mel * m) * m
    for i, (up, rate) in enumerate(zip(hift.ups, cfg.upsample_rates)):
        x = up(F.leaky_relu(x, cfg.lrelu_slope))
        lens = lens * rate
        if i == len(hift.ups) - 1:
            x = hift.reflection_pad(x)  # the left edge is shared by every row
            lens = lens + 1
        m = _mask(lens, x.shape[2], x.dtype)
        x = x * m
        x = x + _resblock(hift.source_resblocks[i], hift.source_downs[i](s_stft) * m, m)
        xs = _resblock(hift.resblocks[i * hift.num_kernels], x, m)
        for j in range(1, hift.num_kernels):
            xs = xs + _resblock(hift.resblocks[i * hift.num_kernels + j], x, m)
        x = xs / hift.num_kernels
    return hift.conv_post(F.leaky_relu(x) * m)  # (B, n_fft + 2, F)


class BucketedBody:
    """`hift_body` on static shapes (a `HiftBody`): rows and mel frames padded to `ROW_BUCKETS` x
    `HIFT_FRAME_BUCKETS` (padded rows have length 0, the source STFT is zero-padded), one function per bucket run
    by a `graphs.BucketGraphs` mode, the output cut back. Equal to `hift_body` on the valid frames: every conv
    input is zeroed past a row's length whatever the padding. dtype: the body's convs cast once (fp32 output)."""

    def __init__(self, hift: HiFTGenerator, mode: str = "eager", dtype: torch.dtype = torch.float32) -> None:
        self.body = half_copy(hift, dtype)
        self.dtype = dtype
        self.frame_rate = 1  # STFT frames per mel frame
        for rate in hift.config.upsample_rates:
            self.frame_rate *= rate
        self.graphs = BucketGraphs(lambda key: self._call, mode)

    def _call(self, mel: torch.Tensor, s_stft: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        return hift_body(self.body, mel.to(self.dtype), s_stft.to(self.dtype), lens).float()

    def __call__(self, mel: torch.Tensor, s_stft: torch.Tensor, mel_lens: torch.Tensor) -> torch.Tensor:
        """mel (B, 80, T), s_stft (B, n_fft + 2, F), mel_lens (B,) -> (B, n_fft + 2, F) fp32."""
        out = []
        for a in range(0, mel.shape[0], ROW_BUCKETS[-1]):
            m, s, lens = (t[a : a + ROW_BUCKETS[-1]] for t in (mel, s_stft, mel_lens))
            rows, frames = bucket(m.shape[0], ROW_BUCKETS), bucket(m.shape[2], HIFT_FRAME_BUCKETS)
            padded = (F.pad(m, (0, frames - m.shape[2], 0, 0, 0, rows - m.shape[0])),
                      F.pad(s, (0, frames * self.frame_rate + 1 - s.shape[2], 0, 0, 0, rows - m.shape[0])),
                      F.pad(lens, (0, rows - m.shape[0])))
            out.append(self.graphs((rows, frames), *padded)[: m.shape[0], :, : s.shape[2]])
        return out[0] if len(out) == 1 else torch.cat(out)


def _window(hift: HiFTGenerator, like: torch.Tensor) -> torch.Tensor:
    n_fft = hift.config.istft_n_fft
    return torch.hann_window(n_fft, periodic=True, dtype=torch.float64, device=like.device).to(like.dtype)


def _stft(hift: HiFTGenerator, s: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """Source (B, N) -> real and imaginary STFT parts on channels (B, n_fft + 2, N / istft_hop + 1)."""
    n_fft, hop = hift.config.istft_n_fft, hift.config.istft_hop_len
    spec = torch.view_as_real(torch.stft(s, n_fft, hop, n_fft, window=window, return_complex=True))
    return torch.cat([spec[..., 0], spec[..., 1]], dim=1)


def _istft(hift: HiFTGenerator, x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """conv_post output (B, n_fft + 2, F) -> waveform (B, (F - 1) * istft_hop), clamped like the module's."""
    cfg = hift.config
    n_bins = cfg.istft_n_fft // 2 + 1
    magnitude = torch.clip(torch.exp(x[:, :n_bins]), max=_MAX_MAGNITUDE)
    phase = torch.sin(x[:, n_bins:])
    z = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
    wav = torch.istft(z, cfg.istft_n_fft, cfg.istft_hop_len, cfg.istft_n_fft, window=window)
    return torch.clamp(wav, -cfg.audio_limit, cfg.audio_limit)


def decode_with_body(hift: HiFTGenerator, body: HiftBody, mel: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """`HiFTGenerator.decode` with its conv body replaced: mel (B, 80, T), source (B, 1, N) -> speech (B, N)."""
    window = _window(hift, mel)
    lens = torch.full((mel.shape[0],), mel.shape[2], dtype=torch.long, device=mel.device)
    return _istft(hift, body(mel, _stft(hift, s[:, 0], window), lens).to(mel.dtype), window)


def vocode_batch(
    hift: HiFTGenerator,
    mels: Sequence[torch.Tensor],
    cache_sources: Sequence[torch.Tensor | None],
    generators: Sequence[torch.Generator | None],
    body: HiftBody | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Like `HiFTGenerator.inference` once per row: mels[i] (80, T_i), cache_sources[i] (1, 1, S) or None
    -> per row (speech (N_i,), source (1, 1, N_i)), N_i = T_i * hop_samples. `body` replaces `hift_body`
    (e.g. an ONNX Runtime session)."""
    n_fft = hift.config.istft_n_fft
    dev = hift.conv_post.bias.device
    dtype = hift.f0_predictor.classifier.weight.dtype  # the module's (a backend may reduce the body's convs)
    lens = torch.tensor([m.shape[1] for m in mels], device=dev)
    t_max = int(lens.max())
    mel = torch.zeros(len(mels), mels[0].shape[0], t_max, dtype=dtype, device=dev)
    for r, m in enumerate(mels):
        mel[r, :, : m.shape[1]] = m.to(device=dev, dtype=dtype)

    # F0 predictor: same-padded convs, each input zeroed beyond the row (ELU(0) = 0).
    mask = _mask(lens, t_max, dtype)
    f0 = mel * mask
    for layer in hift.f0_predictor.condnet:
        f0 = layer(f0) * mask if isinstance(layer, torch.nn.Conv1d) else layer(f0)
    f0 = torch.abs(hift.f0_predictor.classifier(f0.transpose(1, 2)).squeeze(-1))  # (B, T)

    sources: list[torch.Tensor] = []
    specs: list[torch.Tensor] = []
    window = _window(hift, mel)
    for r, m in enumerate(mels):
        t_r = m.shape[1]
        f0_r = hift.f0_upsamp(f0[r : r + 1, None, :t_r]).transpose(1, 2)  # (1, N, 1)
        s, _, _ = hift.m_source(f0_r, generators[r])
        s = s.transpose(1, 2)  # (1, 1, N)
        cache = cache_sources[r]
        if cache is not None and cache.shape[2] > 0:
            if cache.shape[2] > s.shape[2]:
                raise InputError(f"cache_source has {cache.shape[2]} samples but the chunk has only {s.shape[2]}")
            s[:, :, : cache.shape[2]] = cache.to(s.device)
        sources.append(s)
        specs.append(_stft(hift, s[:, 0], window)[0])  # (n_fft + 2, F_r)
    frames = max(s.shape[1] for s in specs)
    s_stft = torch.zeros(len(mels), n_fft + 2, frames, dtype=dtype, device=dev)
    for r, s in enumerate(specs):
        s_stft[r, :, : s.shape[1]] = s

    x = (body or (lambda a, b, c: hift_body(hift, a, b, c)))(mel, s_stft, lens)
    return [(_istft(hift, x[r : r + 1, :, : spec.shape[1]].to(dtype), window)[0], sources[r])
            for r, spec in enumerate(specs)]
