"""`FrameLabeller`: 16 kHz speech -> the phone model's 25 Hz phone-state labels, one per frame. The phone-based
built-in model's prompt tokenizer (docs/builtin-model.md, ladder rung L3): a classifier over the label set, not a
learned codebook, trained with cross-entropy against the labels the teacher's alignment gives each frame.

    wav 16 kHz -> Whisper log-mel (128, T) 100 Hz -> ConvSubsampler x4 -> transformer (25 Hz) -> Linear(d, V)

Legend: B batch, T mel frames (100 Hz), T4 = ceil(T / 4) label frames (25 Hz), V labels.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vocalis.checkpoint import load_strict, read_safetensors, write_safetensors
from vocalis.errors import ModelLoadError
from vocalis.models.speech_tokenizer.encoder import ConvSubsampler, TransformerStack, length_mask
from vocalis.models.speech_tokenizer.model import pad_mels


@dataclass(frozen=True, slots=True)
class LabellerConfig:
    """Mel encoder -> per-frame logits over `num_labels`. The defaults are the `builtin` preset (~1.9 M parameters)."""

    num_labels: int
    n_mels: int = 128
    d_model: int = 192
    num_heads: int = 4
    ffn_dim: int = 512
    layers: int = 4
    dropout: float = 0.1
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.num_labels < 2:
            raise ValueError(f"num_labels must be >= 2, got {self.num_labels}")
        if self.d_model % self.num_heads or (self.d_model // self.num_heads) % 2:
            raise ValueError(f"d_model {self.d_model} must split into {self.num_heads} heads of even size (RoPE)")
        if self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Presets without `num_labels` (the phone model's label count): see `labeller_config`.
LABELLER_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"d_model": 64, "num_heads": 2, "ffn_dim": 128, "layers": 2, "dropout": 0.0},  # tests
    "builtin": {},
}


def labeller_config(name: str, num_labels: int) -> LabellerConfig:
    if name not in LABELLER_PRESETS:
        raise ValueError(f"unknown labeller preset {name!r}; choose from {sorted(LABELLER_PRESETS)}")
    return LabellerConfig(num_labels=num_labels, **LABELLER_PRESETS[name])


class FrameLabeller(nn.Module):
    """Mel encoder + a per-frame label head. See the module docstring for the data flow."""

    def __init__(self, config: LabellerConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.subsample = ConvSubsampler(c.n_mels, c.d_model)
        self.encoder = TransformerStack(c.layers, c.d_model, c.num_heads, c.ffn_dim, c.dropout, c.rope_theta)
        self.head = nn.Linear(c.d_model, c.num_labels)

    def forward(self, mel: torch.Tensor, mel_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mel (B, n_mels, T), mel_lens (B,)) -> (logits (B, T4, V), lens (B,))."""
        if mel.dim() != 3 or mel.shape[1] != self.config.n_mels:
            raise ValueError(f"expected mel (B, {self.config.n_mels}, T), got {tuple(mel.shape)}")
        x, lens = self.subsample(mel, mel_lens.to(torch.int64))  # (B, T4, d)
        return self.head(self.encoder(x, length_mask(lens, x.shape[1]))), lens

    def loss(self, mel: torch.Tensor, mel_lens: torch.Tensor, labels: torch.Tensor, label_lens: torch.Tensor
             ) -> tuple[torch.Tensor, dict[str, float]]:
        """Cross-entropy per labelled frame. labels (B, N) padded, label_lens (B,): row b's frames
        [0, min(T4_b, N_b)) are scored (the audio's and the alignment's frame counts may differ by one at the end).
        Metrics: `acc` (argmax == label over the scored frames)."""
        logits, lens = self(mel, mel_lens)
        n = min(logits.shape[1], labels.shape[1])
        scored = length_mask(torch.minimum(lens, label_lens.to(lens.device)), n)  # (B, n)
        logits, labels = logits[:, :n][scored], labels[:, :n][scored]  # (F, V), (F,)
        loss = F.cross_entropy(logits.float(), labels)
        with torch.no_grad():
            acc = float((logits.argmax(-1) == labels).float().mean()) if labels.numel() else 0.0
        return loss, {"acc": acc}

    @torch.no_grad()
    def tokenize_mels(self, mels: Sequence[torch.Tensor]) -> list[list[int]]:
        """Several clips' 128-bin log-mels (`frontend.audio.whisper_log_mel` of 16 kHz audio, each (128, T_i) on this
        model's device) -> their 25 Hz labels (argmax per frame), one padded forward pass in eval mode."""
        mel, mel_lens = pad_mels(mels)
        was_training = self.training
        self.eval()
        try:
            logits, lens = self(mel, mel_lens.to(mel.device))
        finally:
            self.train(was_training)
        return [row[: int(n)].tolist() for row, n in zip(logits.argmax(-1).cpu(), lens.cpu())]


# A model directory's prompt tokenizer for the phone model: these two files in place of a speech tokenizer.
LABELLER_WEIGHTS = "labeller.safetensors"
LABELLER_JSON = "labeller.json"  # {"format_version": 1, "config": LabellerConfig}
_FORMAT_VERSION = 1


def save_labeller(model: FrameLabeller, directory: str | os.PathLike) -> Path:
    """Write `labeller.safetensors` + `labeller.json` into `directory` (each atomically) -> the weights path."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(model.state_dict(), out / LABELLER_WEIGHTS)
    tmp = out / (LABELLER_JSON + ".tmp")
    tmp.write_text(json.dumps({"format_version": _FORMAT_VERSION, "config": model.config.to_dict()}, indent=1),
                   encoding="utf-8")
    tmp.replace(out / LABELLER_JSON)
    return out / LABELLER_WEIGHTS


def load_labeller(directory: str | os.PathLike, device: str | torch.device = "cpu") -> FrameLabeller:
    """The labeller a model directory holds, in eval mode without gradients; ModelLoadError when unreadable."""
    d = Path(directory)
    try:
        data = json.loads((d / LABELLER_JSON).read_text(encoding="utf-8"))
        if data.get("format_version") != _FORMAT_VERSION:
            raise ValueError(f"format_version {data.get('format_version')!r}, expected {_FORMAT_VERSION}")
        config = LabellerConfig(**data["config"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ModelLoadError(f"cannot read {d / LABELLER_JSON}: {exc}") from exc
    model = FrameLabeller(config)
    load_strict(model, read_safetensors(d / LABELLER_WEIGHTS), LABELLER_WEIGHTS)
    return model.to(device).eval().requires_grad_(False)
