"""CosyVoice 3's causal HiFT for streams: each call decodes only the mel its new samples depend on.

The official pipeline re-runs the vocoder over all mel so far at every streaming call and keeps the samples past
those already yielded, so a stream's vocoder work grows with the square of its length. Here the F0 predictor and
the source, a small part of the cost, still run over all mel: the source's phase is a running sum from the first
frame, computed exactly as officially. The decoder (conv_pre, the up-sampling stages with their resblocks, the
source STFT branch, conv_post, iSTFT) runs over a window: the frames of the new samples plus `left_context_frames`
before them. Every decoder op is causal (conv_pre only looks right), so an output sample depends on a bounded run
of frames before it; the window's first frames, where the zero and reflect padding of its start differ from the
full run, are cut. What is kept equals the full re-run to float rounding (convolutions over other lengths).

Legend: R rows of a call, C = 80 mel channels, T frames kept so far, W window frames, hop = samples per frame.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vocalis.config.cv3 import CausalHiFTConfig
from vocalis.models.cv3.hift import CausalHiFTGenerator


def _resblock_reach(kernels: Sequence[int], dilations: Sequence[Sequence[int]]) -> int:
    """Samples (at its stage's rate) a causal resblock reads before its output: each dilated conv (k - 1) d,
    each plain conv k - 1; the stage's blocks run side by side, so the widest counts."""
    return max(sum((k - 1) * d + (k - 1) for d in dils) for k, dils in zip(kernels, dilations))


def left_context_frames(config: CausalHiFTConfig) -> int:
    """Mel frames before a decoded sample's own frame that can reach it: an upper bound summing, stage by stage,
    the up-sampler's causal conv, the main and source resblocks, the source's down-sampler and centred STFT, and
    conv_post with the iSTFT, each in frames of its rate (paths through the network take a subset of these)."""
    up = math.prod(config.upsample_rates)  # STFT frames per mel frame
    n_fft, hop = config.istft_n_fft, config.istft_hop_len
    main = _resblock_reach(config.resblock_kernel_sizes, config.resblock_dilation_sizes)
    frames = 0.0
    rate = 1
    for i, (u, k) in enumerate(zip(config.upsample_rates, config.upsample_kernel_sizes)):
        rate *= u
        src = _resblock_reach(config.source_resblock_kernel_sizes[i : i + 1],
                              config.source_resblock_dilation_sizes[i : i + 1])
        down = 2 * (up // rate)  # the source down-sampler's kernel, in STFT frames
        frames += (k - 1 + main + src) / rate + (down + n_fft // hop) / up
    frames += (7 + 1 + n_fft // hop) / up  # conv_post (kernel 7), the last stage's reflect frame, the iSTFT
    return math.ceil(frames) + 1  # + 1: the repeat-up-samplers' alignment within a frame


@dataclass(eq=False)
class VocoderRow:
    """One stream's vocoder call: all mel kept so far (C, T), the call's finalize flag, samples already given;
    `vocode` sets the frames it decoded (a cost counter)."""

    mel: torch.Tensor
    finalize: bool
    num_yielded: int
    decoded_frames: int = 0


@torch.inference_mode()
def vocode(hift: CausalHiFTGenerator, rows: list[VocoderRow], window: bool = True) -> list[torch.Tensor]:
    """Each row's samples past `num_yielded` (float32, CPU): the causal HiFT's output over the row's whole mel,
    decoding a window of it (`window`) or all of it (the official re-run). Rows with equal decoder input length
    and finalize flag share one decoder call; the HiFT is not run padded (its STFTs see the end of the signal)."""
    cfg = hift.config
    context = left_context_frames(cfg)
    inputs = []
    for row in rows:
        mel = row.mel[None]  # (1, C, T)
        f0 = hift.f0(mel, row.finalize)  # (1, T'), float64, over all mel: the source's phase runs from frame 0
        src = hift.source(f0, mel.dtype)  # (1, 1, T' hop)
        if not row.finalize:
            mel = mel[:, :, : -hift.f0_predictor.look_right]
        start = max(0, row.num_yielded // cfg.hop_samples - context) if window else 0
        inputs.append((mel[:, :, start:], src[:, :, start * cfg.hop_samples :], start * cfg.hop_samples))
        row.decoded_frames = mel.shape[2] - start
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, ((mel, _, _), row) in enumerate(zip(inputs, rows)):
        groups.setdefault((mel.shape[2], row.finalize), []).append(i)
    out: dict[int, torch.Tensor] = {}
    for (_, finalize), members in groups.items():
        mel = torch.cat([inputs[i][0] for i in members])  # (G, C, W)
        src = torch.cat([inputs[i][1] for i in members])  # (G, 1, W hop)
        wav = hift.decode(mel, src, finalize)  # (G, N)
        for g, i in enumerate(members):
            out[i] = wav[g, rows[i].num_yielded - inputs[i][2] :].float().cpu()
    return [out[i] for i in range(len(rows))]


def stretch(mel: torch.Tensor, speed: float) -> torch.Tensor:
    """A whole utterance's mel (C, T) at `speed` (linear interpolation over time, as officially)."""
    return F.interpolate(mel[None], size=max(1, int(mel.shape[1] / speed)), mode="linear")[0]
