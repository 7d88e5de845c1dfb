"""Tiny stand-ins for the two ONNX frontend models and a tiny model directory, made on the fly.

They have the official models' input/output signatures (speech tokenizer: feats (1, 128, T) float32 +
lengths (1,) int32 -> ids (1, T/4); speaker: fbank (1, T, 80) -> (1, 192)), so the real ONNX code path runs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile as sf
import torch
from torch import nn

from vocalis.model_dir import BUNDLED_TOKENIZER, CAMPPLUS_ONNX, SPEECH_TOKENIZER_ONNX, random_model, save_vocalis


class _TinySpeechTokenizer(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(128, 16, kernel_size=4, stride=4)
        self.proj = nn.Linear(16, vocab)

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = self.conv(feats).transpose(1, 2)  # (1, T/4, 16)
        return self.proj(h).argmax(-1)[:, : (lengths[0] // 4).long()]  # int64 end: ORT rejects mixed Slice types


class _TinySpeaker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(80, 192)

    def forward(self, fbank: torch.Tensor) -> torch.Tensor:
        return self.proj(fbank.mean(dim=1))


def write_frontend_onnx(directory: Path, speech_vocab: int = 6561, tokenizer_file: str = SPEECH_TOKENIZER_ONNX) -> None:
    """`tokenizer_file` (CosyVoice 3: speech_tokenizer_v3.onnx, the same signature) and campplus.onnx."""
    torch.manual_seed(5)
    torch.onnx.export(
        _TinySpeechTokenizer(speech_vocab), (torch.randn(1, 128, 64), torch.tensor([64], dtype=torch.int32)),
        str(directory / tokenizer_file), input_names=["feats", "feats_length"], output_names=["indices"],
        dynamic_axes={"feats": {2: "T"}, "indices": {1: "N"}}, dynamo=False,
    )
    torch.onnx.export(
        _TinySpeaker(), (torch.randn(1, 50, 80),), str(directory / CAMPPLUS_ONNX), input_names=["input"],
        output_names=["output"], dynamic_axes={"input": {1: "T"}}, dynamo=False,
    )


def make_tiny_model_dir(directory: Path) -> Path:
    """Random tiny weights in our layout, the bundled tokenizer and the two tiny ONNX models."""
    save_vocalis(random_model(), directory, tokenizer_src=BUNDLED_TOKENIZER)
    write_frontend_onnx(directory)
    return directory


def write_voice_like_wav(path: Path, seconds: float = 2.0, sr: int = 24000, channels: int = 1, seed: int = 0) -> Path:
    """A harmonic, amplitude-modulated tone with a little noise: not speech, but audio with content."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    f0 = 140 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sr
    wav = sum(np.sin(k * phase) / k for k in range(1, 6)) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t) ** 2)
    wav = 0.3 * wav / np.abs(wav).max() + 0.01 * rng.standard_normal(len(t))
    data = np.stack([wav] * channels, axis=1) if channels > 1 else wav
    sf.write(path, data.astype(np.float32), sr)
    return path
