"""A tiny prepared training corpus for the training tests: generated tones, the tiny model directory's
ONNX frontend, `vocalis prepare` in-process."""

from __future__ import annotations

import json
from pathlib import Path

from tiny_assets import make_tiny_model_dir, write_voice_like_wav

from vocalis.train.prepare import PrepareConfig, prepare


def write_manifest(directory: Path, n: int, *, equal: bool = False, seconds: float = 1.0) -> Path:
    """n utterances of 2 speakers; equal=True gives every one the same duration and token counts."""
    (directory / "wavs").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        dur = seconds if equal else seconds + 0.2 * (i % 4)
        wav = write_voice_like_wav(directory / "wavs" / f"u{i}.wav", seconds=dur, sr=24000 if i % 2 else 16000, seed=i)
        rows.append({"wav": f"wavs/{wav.name}", "text": f"hello number {i % 10} world", "speaker": f"spk{i % 2}"})
    path = directory / "manifest.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def prepared_corpus(directory: Path, n: int = 8, *, equal: bool = False, seconds: float = 1.0) -> Path:
    """-> the prepared folder (data.list inside); the model directory is `directory / "model"`."""
    model = directory / "model"
    if not model.exists():
        make_tiny_model_dir(model)
    manifest = write_manifest(directory / "raw", n, equal=equal, seconds=seconds)
    out = directory / "prepared"
    prepare(PrepareConfig(str(manifest), str(out), str(model), utts_per_shard=4))
    return out
