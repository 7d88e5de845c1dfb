"""Resemblyzer's pretrained GE2E voice encoder as a `SpeakerEncoder` (256-d d-vector).

The built-in model conditions its flow on these embeddings: the encoder is a real pretrained speaker model
whose weights ship inside the `resemblyzer` wheel (`pip install --no-deps resemblyzer webrtcvad-wheels`), so
Vocalis needs no download and no speaker model of its own. A model directory selects it with
`speaker_encoder.json` = `{"kind": "resemblyzer"}`. The network loads on first use, so loading a model (and
the CI) does not pay for it unless a prompt wav is embedded.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import numpy as np
import torch

from vocalis.errors import ModelLoadError
from vocalis.frontend.speaker import SpeakerEncoder

logger = logging.getLogger(__name__)

SPEAKER_ENCODER_JSON = "speaker_encoder.json"
EMBED_DIM = 256
_MIN_SAMPLES = 16000 // 4  # resemblyzer needs a few of its 10 ms frames of voiced audio


class ResemblyzerSpeakerEncoder(SpeakerEncoder):
    """16 kHz audio -> VAD-trimmed, volume-normalised -> resemblyzer `embed_utterance` -> (256,) unit vector."""

    dim = EMBED_DIM

    def __init__(self) -> None:
        self._device = "cpu"
        self._encoder = None
        self._preprocess = None
        self._lock = threading.Lock()

    def _load(self) -> None:
        with self._lock:
            if self._encoder is not None:
                return
            try:
                from resemblyzer import VoiceEncoder, preprocess_wav
            except ImportError as exc:
                raise ModelLoadError(
                    f"this model's speaker encoder is resemblyzer, which is not usable ({exc}); install it with "
                    "`pip install --no-deps resemblyzer webrtcvad-wheels`"
                ) from None
            self._preprocess = preprocess_wav
            self._encoder = VoiceEncoder(device=self._device, verbose=False)

    def to(self, device: str | torch.device) -> ResemblyzerSpeakerEncoder:
        with self._lock:
            self._device = str(torch.device(device))
            if self._encoder is not None:
                self._encoder = type(self._encoder)(device=self._device, verbose=False)
        return self

    def embed(self, wav16k: np.ndarray | torch.Tensor) -> np.ndarray:
        self._load()
        wav = wav16k.detach().cpu().numpy() if isinstance(wav16k, torch.Tensor) else np.asarray(wav16k)
        wav = wav.astype(np.float32).reshape(-1)
        trimmed = self._preprocess(wav)  # type: ignore[misc]
        if trimmed.size < _MIN_SAMPLES:  # VAD found (almost) no speech: embed the untrimmed audio instead
            trimmed = wav
        with torch.inference_mode():
            return np.asarray(self._encoder.embed_utterance(trimmed), dtype=np.float32)  # type: ignore[union-attr]


def speaker_encoder_from_json(path: Path) -> SpeakerEncoder:
    """`speaker_encoder.json` of a model directory -> its encoder."""
    try:
        kind = json.loads(path.read_text(encoding="utf-8"))["kind"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if kind == "resemblyzer":
        return ResemblyzerSpeakerEncoder()
    raise ModelLoadError(f"{path}: unknown speaker encoder kind {kind!r} (known: resemblyzer)")


def write_speaker_encoder_json(directory: Path, kind: str = "resemblyzer") -> Path:
    path = directory / SPEAKER_ENCODER_JSON
    path.write_text(json.dumps({"kind": kind}) + "\n", encoding="utf-8")
    return path
