"""Speaker similarity: cosine of speaker embeddings of an output and its prompt recording.

Two embedders: resemblyzer (GE2E d-vector; its wheel ships the weights; install with
`pip install --no-deps resemblyzer webrtcvad-wheels`) and CAM++ (`campplus.onnx` of a model directory, the
encoder CosyVoice 2 conditions on; seed-tts-eval uses a WavLM verifier instead, so numbers are not comparable
with published SIM scores).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import numpy as np

from vocalis.errors import InputError
from vocalis.frontend.speaker import CampplusSpeakerEncoder

log = logging.getLogger(__name__)
SAMPLE_RATE = 16000


class SpeakerEmbedder(Protocol):
    """16 kHz mono float32 (N,) -> embedding (D,)."""

    name: str

    def embed(self, wav16k: np.ndarray) -> np.ndarray: ...


class ResemblyzerEmbedder:
    name = "resemblyzer"

    def __init__(self) -> None:
        try:
            from resemblyzer import VoiceEncoder, preprocess_wav
        except ImportError as exc:
            raise InputError(
                f"resemblyzer is not usable ({exc}); install it with "
                "`pip install --no-deps resemblyzer webrtcvad-wheels`"
            ) from None
        self._preprocess = preprocess_wav
        self.encoder = VoiceEncoder(device="cpu", verbose=False)

    def embed(self, wav16k: np.ndarray) -> np.ndarray:
        # Already at resemblyzer's 16 kHz: no source_sr, so it skips its (slow) librosa resampling; it still
        # normalises the volume and trims long silences (VAD).
        wav = self._preprocess(wav16k.astype(np.float32))
        if wav.size < SAMPLE_RATE // 4:
            raise ValueError("less than 0.25 s of voiced audio")
        return np.asarray(self.encoder.embed_utterance(wav), dtype=np.float32)


class CampplusEmbedder:
    name = "campplus"

    def __init__(self, onnx_path: Path) -> None:
        self.encoder = CampplusSpeakerEncoder(onnx_path)

    def embed(self, wav16k: np.ndarray) -> np.ndarray:
        return self.encoder.embed(wav16k)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    denom = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(np.dot(a, b) / denom) if denom > 0 else 0.0


def make_embedders(model_dir: str | Path | None) -> list[SpeakerEmbedder]:
    """resemblyzer when installed (a warning otherwise), plus CAM++ when `model_dir/campplus.onnx` exists."""
    embedders: list[SpeakerEmbedder] = []
    try:
        embedders.append(ResemblyzerEmbedder())
    except InputError as exc:
        log.warning("%s", exc)
    if model_dir is not None:
        onnx = Path(model_dir) / "campplus.onnx"
        if onnx.is_file():
            embedders.append(CampplusEmbedder(onnx))
        else:
            log.warning("%s has no campplus.onnx: no CAM++ similarity", model_dir)
    return embedders

