"""A voice: everything a reference clip contributes to synthesis, computed once and reusable.

`prompt_speech_ids` and `prompt_mel` are aligned (2 mel frames per token), as the flow requires.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save

from vocalis.errors import InputError, ModelLoadError

_VOICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")


def check_voice_name(name: str) -> str:
    """Voice names become file names: letters, digits, `_ . -`, no path separators, at most 64 chars."""
    if not _VOICE_NAME.fullmatch(name) or ".." in name:
        raise InputError(f"invalid voice name {name!r}: use 1-64 letters, digits, '_', '.', '-'")
    return name


@dataclass(frozen=True)
class Voice:
    """Prompt features of one speaker.

    prompt_text_ids: Qwen2 ids of the clip's transcript (empty for cross-lingual/sft-only voices).
    prompt_speech_ids: 25 Hz speech tokens of the clip (may be empty: sft voices carry only an embedding).
    prompt_mel: (2 * len(prompt_speech_ids), 80) 24 kHz log-mel of the clip.
    embedding: (192,) speaker x-vector (normalised inside the flow).
    """

    name: str
    prompt_text: str
    prompt_text_ids: tuple[int, ...]
    prompt_speech_ids: tuple[int, ...]
    prompt_mel: torch.Tensor
    embedding: torch.Tensor

    def __post_init__(self) -> None:
        if self.prompt_mel.ndim != 2 or self.prompt_mel.shape[0] != 2 * len(self.prompt_speech_ids):
            raise ValueError(
                f"voice {self.name!r}: prompt mel {tuple(self.prompt_mel.shape)} is not 2 frames per "
                f"prompt token ({len(self.prompt_speech_ids)} tokens)"
            )
        if self.embedding.ndim != 1:
            raise ValueError(f"voice {self.name!r}: embedding must be 1-D, got {tuple(self.embedding.shape)}")

    @property
    def has_prompt_speech(self) -> bool:
        return len(self.prompt_speech_ids) > 0

    def save(self, path: Path) -> None:
        """One safetensors file; tensors plus text metadata. Written atomically."""
        meta = {"name": self.name, "prompt_text": self.prompt_text, "prompt_text_ids": json.dumps(self.prompt_text_ids)}
        tensors = {
            "prompt_speech_ids": torch.tensor(self.prompt_speech_ids, dtype=torch.int64),
            "prompt_mel": self.prompt_mel.float().contiguous(),
            "embedding": self.embedding.float().contiguous(),
        }
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_bytes(_sorted_header(save(tensors, metadata=meta)))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Voice:
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            tensors = load_file(str(path))
            return cls(
                name=meta["name"],
                prompt_text=meta.get("prompt_text", ""),
                prompt_text_ids=tuple(json.loads(meta.get("prompt_text_ids", "[]"))),
                prompt_speech_ids=tuple(int(t) for t in tensors["prompt_speech_ids"].tolist()),
                prompt_mel=tensors["prompt_mel"],
                embedding=tensors["embedding"],
            )
        except (OSError, KeyError, ValueError, SafetensorError) as exc:
            raise ModelLoadError(f"cannot read voice file {path}: {exc}") from exc


def _sorted_header(data: bytes) -> bytes:
    """safetensors bytes with the header's keys sorted, so that the same voice saves to the same bytes: the library
    writes the metadata in its hash map's order, which changes from one save to the next. Readers look keys up by
    name; the header keeps its length (the same keys and values), padded with spaces as the format allows."""
    n = int.from_bytes(data[:8], "little")
    text = json.dumps(json.loads(data[8 : 8 + n]), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    return data if len(text) > n else data[:8] + text.ljust(n, b" ") + data[8 + n :]


def voice_from_spk2info(name: str, entry: dict[str, object], mel_dim: int = 80) -> Voice:
    """One `spk2info.pt` entry (official zero-shot dict, an sft embedding-only dict, or the
    `speech_token`/`speech_feat`/`embedding` variant) as a `Voice`."""

    def tensor(*keys: str) -> torch.Tensor | None:
        for key in keys:
            value = entry.get(key)
            if isinstance(value, torch.Tensor):
                return value
        return None

    emb = tensor("flow_embedding", "embedding", "llm_embedding")
    if emb is None:
        raise ModelLoadError(f"spk2info entry {name!r} has no speaker embedding")
    speech = tensor("flow_prompt_speech_token", "llm_prompt_speech_token", "speech_token")
    mel = tensor("prompt_speech_feat", "speech_feat")
    text_ids = tensor("prompt_text")
    speech_ids = tuple(int(t) for t in speech.reshape(-1).tolist()) if speech is not None else ()
    mel2 = mel.reshape(-1, mel_dim).float() if mel is not None else torch.zeros(0, mel_dim)
    n = min(len(speech_ids), mel2.shape[0] // 2)
    raw_text = entry.get("prompt_text") if isinstance(entry.get("prompt_text"), str) else ""
    return Voice(
        name=name,
        prompt_text=str(raw_text),
        prompt_text_ids=tuple(int(t) for t in text_ids.reshape(-1).tolist()) if text_ids is not None else (),
        prompt_speech_ids=speech_ids[:n],
        prompt_mel=mel2[: 2 * n],
        embedding=emb.reshape(-1).float(),
    )
