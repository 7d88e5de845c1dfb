"""Per-utterance training features, computed once by `vocalis prepare`.

From one utterance: text ids (the model's BPE tokenizer), 25 Hz speech ids (the model's speech tokenizer),
a speaker x-vector (CAM++), the 24 kHz 80-bin mel at 50 Hz, F0 per mel frame, and the 24 kHz waveform as
int16 PCM (the vocoder's target). A bad utterance raises `Skip` with a short reason and a detail line.

Legend: N samples, T mel frames.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
import soxr

from vocalis.config import CAMPPLUS_ONNX, PROMPT_SAMPLE_RATE_16K, SAMPLE_RATE, SPEECH_TOKENIZER_ONNX
from vocalis.errors import AudioError, InputError
from vocalis.frontend.audio import SILENCE_PEAK, check_wav, prompt_mel
from vocalis.frontend.speaker import SpeakerEncoder
from vocalis.frontend.speech_tokenizer import OnnxSpeechTokenizer, SpeechTokenizer
from vocalis.frontend.tokenizer import TextTokenizer
from vocalis.train.f0 import yin_f0
from vocalis.train.manifest import Utterance

log = logging.getLogger(__name__)

TOKENIZER_DIRS = ("tokenizer", "CosyVoice-BlankEN")  # vocalis layout, official layout


class Skip(Exception):
    """An utterance left out of the training data: `reason` is a short category, the message the detail."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class FeatureConfig:
    min_seconds: float = 0.5
    max_seconds: float = 30.0  # the released speech tokenizer's limit
    speech_tokens: bool = True  # False: leave speech_token empty (data for training our own tokenizer)
    speaker_embeddings: bool = True  # False: zero vectors (no campplus.onnx)
    keep_audio: bool = True  # the vocoder needs it; 48 kB per second


def find_tokenizer_dir(model_dir: Path) -> Path:
    for name in TOKENIZER_DIRS:
        if (model_dir / name / "vocab.json").is_file() or (model_dir / name / "tokenizer.json").is_file():
            return model_dir / name
    raise InputError(f"{model_dir} has no text tokenizer (looked for {' or '.join(TOKENIZER_DIRS)}/vocab.json)")


class Featurizer:
    """Loads the frontend models of a model directory once; `__call__(utt)` -> one Parquet row (dict)."""

    def __init__(
        self,
        model_dir: str | Path,
        config: FeatureConfig,
        speech_tokenizer: SpeechTokenizer | Callable[[np.ndarray], list[int]] | None = None,
    ) -> None:
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise InputError(f"model directory not found: {model_dir}")
        self.config = config
        self.tokenizer = TextTokenizer.from_dir(find_tokenizer_dir(model_dir))
        self.speech_tokenizer = speech_tokenizer
        if config.speech_tokens and speech_tokenizer is None:
            if not (model_dir / SPEECH_TOKENIZER_ONNX).is_file():
                raise InputError(
                    f"{model_dir} has no {SPEECH_TOKENIZER_ONNX}: pass a speech tokenizer checkpoint, or prepare "
                    "without speech tokens (--no-speech-tokens) to train one first"
                )
            self.speech_tokenizer = OnnxSpeechTokenizer(model_dir / SPEECH_TOKENIZER_ONNX)
        self.speaker_encoder: SpeakerEncoder | None = None
        if config.speaker_embeddings:
            from vocalis.model_dir import speaker_encoder_of  # campplus.onnx or speaker_encoder.json (resemblyzer)

            self.speaker_encoder = speaker_encoder_of(model_dir)
            if self.speaker_encoder is None:
                raise InputError(f"{model_dir} has no {CAMPPLUS_ONNX} (nor speaker_encoder.json); prepare with "
                                 "--no-speaker-embeddings instead")

    def _load(self, utt: Utterance) -> tuple[np.ndarray, np.ndarray]:
        """-> (24 kHz, 16 kHz) mono float32, or Skip."""
        c = self.config
        if utt.wav.endswith("|"):
            raise Skip("unsupported", f"piped wav.scp entries are not supported: {utt.wav!r}")
        path = Path(utt.wav)
        if not path.is_file():
            raise Skip("missing", f"audio file not found: {path}")
        try:
            info = sf.info(str(path))
            seconds = info.frames / info.samplerate
            if seconds < c.min_seconds:
                raise Skip("too short", f"{seconds:.2f} s < {c.min_seconds:g} s")
            if seconds > c.max_seconds:
                raise Skip("too long", f"{seconds:.1f} s > {c.max_seconds:g} s")
            audio, rate = sf.read(str(path), dtype="float32", always_2d=True)  # (N, C)
        except (sf.SoundFileError, RuntimeError, ValueError) as exc:
            raise Skip("unreadable", f"cannot decode {path}: {exc}") from exc
        wav = audio.mean(axis=1, dtype=np.float32)
        try:
            check_wav(wav, rate, min_seconds=c.min_seconds, max_seconds=c.max_seconds, silence_peak=0.0, name=str(path))
        except AudioError as exc:
            raise Skip("corrupt", str(exc)) from exc
        if float(np.abs(wav).max()) < SILENCE_PEAK:
            raise Skip("silent", f"peak amplitude {float(np.abs(wav).max()):.1e}")
        wav24 = wav if rate == SAMPLE_RATE else soxr.resample(wav, rate, SAMPLE_RATE).astype(np.float32, copy=False)
        wav16 = soxr.resample(wav, rate, PROMPT_SAMPLE_RATE_16K).astype(np.float32, copy=False)
        peak = float(np.abs(wav24).max())
        if peak > 1.0:  # resampling overshoot; keep int16 storage lossless in range
            wav24, wav16 = wav24 / peak, wav16 / peak
        return wav24, wav16

    def __call__(self, utt: Utterance) -> dict[str, Any]:
        text = utt.text.strip()
        if not text:
            raise Skip("empty text", "the transcript is empty")
        text_token = self.tokenizer.encode(text)
        if not text_token:
            raise Skip("empty text", f"the transcript {text!r} has no tokens")
        wav24, wav16 = self._load(utt)
        speech_token: list[int] = []
        if self.speech_tokenizer is not None:
            speech_token = list(self.speech_tokenizer(wav16))
            if not speech_token:
                raise Skip("no speech tokens", "the speech tokenizer returned no ids")
        if self.speaker_encoder is not None:
            embedding = self.speaker_encoder(wav16).astype(np.float32)  # (192,) CAM++, (256,) resemblyzer
        else:
            embedding = np.zeros(192, dtype=np.float32)
        mel = prompt_mel(wav24).numpy().astype(np.float32)  # (T, 80)
        f0 = yin_f0(wav24, num_frames=mel.shape[0])  # (T,)
        pcm = np.round(np.clip(wav24, -1.0, 1.0) * 32767).astype("<i2") if self.config.keep_audio else None
        return {
            "utt": utt.utt,
            "wav": utt.wav,
            "text": text,
            "speaker": utt.speaker,
            "language": utt.language,
            "duration": len(wav24) / SAMPLE_RATE,
            "text_token": np.asarray(text_token, dtype=np.int32),
            "speech_token": np.asarray(speech_token, dtype=np.int32),
            "embedding": embedding,
            "num_frames": mel.shape[0],
            "mel": mel.reshape(-1),
            "f0": f0,
            "audio": pcm.tobytes() if pcm is not None else b"",
        }
