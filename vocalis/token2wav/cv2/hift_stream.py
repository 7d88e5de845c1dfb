"""HiFT for streaming requests: each request's held-back mel frames and source samples, and the cross-fade of
its seams (8 mel frames / 3840 samples, as the reference), around the batched vocoder (`hift.vocode_batch`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from vocalis.config import StreamConfig
from vocalis.models.hift.generator import HiFTGenerator
from vocalis.token2wav.cv2.hift import HiftBody, vocode_batch
from vocalis.token2wav.cv2.state import StreamState


class HiftStreamer:
    """The shared HiFT driven for many requests' chunks; the seam caches live on each `StreamState`."""

    def __init__(self, hift: HiFTGenerator, body: HiftBody | None, stream: StreamConfig) -> None:
        self.hift = hift
        self.body = body
        self.stream = stream
        self.window = torch.from_numpy(np.hamming(2 * self.stream.source_cache_len))  # float64, as the reference

    def vocode(self, items: list[tuple[StreamState, bool]], mels: list[torch.Tensor]) -> list[np.ndarray]:
        inputs = []
        for (s, _), mel in zip(items, mels):
            mel = mel.float()
            if s.speed != 1.0:
                mel = F.interpolate(mel[None], size=max(1, int(mel.shape[1] / s.speed)), mode="linear")[0]
            if s.cache_mel is not None:
                mel = torch.cat([s.cache_mel.to(mel.device), mel], dim=1)
            inputs.append(mel)
        results = []
        for group in _hift_groups([m.shape[1] for m in inputs], inputs[0].device.type == "cpu"):
            results += vocode_batch(self.hift, [inputs[i] for i in group], [items[i][0].cache_source for i in group],
                                    [items[i][0].generator for i in group], body=self.body)
        n = self.stream.source_cache_len
        out = []
        for (s, final), mel, (speech, source) in zip(items, inputs, results):
            speech = speech.float().cpu()
            if s.cache_speech is not None:
                speech = speech.clone()
                speech[:n] = (speech[:n].double() * self.window[:n] + s.cache_speech.double() * self.window[n:]).float()
            if final:
                out.append(speech.numpy())
                continue
            s.cache_mel = mel[:, -self.stream.mel_cache_len :].clone()
            s.cache_source = source[:, :, -n:].clone()
            s.cache_speech = speech[-n:].clone()
            out.append(speech[:-n].numpy())
        return out


# On a CPU, HiFT's activations outgrow the caches past ~200 mel frames per call (~10 MB per conv layer): a batch of
# 8 x 100 frames took 0.47 s a row against 0.36 s in pairs (2-core AMX Xeon), so a CPU call holds rows up to this
# many frames in all (at least one row). A GPU takes the whole batch in one call.
_HIFT_CPU_FRAMES = 200


def _hift_groups(frames: list[int], cpu: bool) -> list[list[int]]:
    """Consecutive row indices per HiFT call: all in one call off the CPU, else packed up to `_HIFT_CPU_FRAMES`."""
    if not cpu:
        return [list(range(len(frames)))]
    groups: list[list[int]] = []
    total = 0
    for i, f in enumerate(frames):
        if groups and total + f <= _HIFT_CPU_FRAMES:
            groups[-1].append(i)
            total += f
        else:
            groups.append([i])
            total = f
    return groups

