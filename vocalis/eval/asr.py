"""Speech recognisers for WER/CER: a small protocol, an offline pocketsphinx implementation, and a plug-in hook.

Plugging in your own recogniser (Whisper, Paraformer, ...): write a factory that returns any callable
`(wav, sample_rate) -> text`, and pass its import path as `--asr module:factory` (the module must be
importable, e.g. on PYTHONPATH). The factory is called once, with `language=` when it accepts that keyword:

    # my_asr.py
    import numpy as np, soxr, whisper

    def whisper_large(language: str = "auto"):
        model = whisper.load_model("large-v3")
        def transcribe(wav: np.ndarray, sample_rate: int) -> str:
            audio = soxr.resample(wav, sample_rate, 16000).astype(np.float32)
            return model.transcribe(audio, language=None if language == "auto" else language)["text"]
        return transcribe

    $ vocalis eval --manifest m.jsonl --audio out/ --asr my_asr:whisper_large --language en
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Protocol, runtime_checkable

import numpy as np
import soxr

from vocalis.errors import InputError

log = logging.getLogger(__name__)


@runtime_checkable
class Transcriber(Protocol):
    """wav (N,) float32 mono in [-1, 1] at `sample_rate` Hz -> the recognised text (any casing/punctuation)."""

    def __call__(self, wav: np.ndarray, sample_rate: int) -> str: ...


class PocketsphinxTranscriber:
    """CMU pocketsphinx with the US English acoustic model, language model and dictionary its wheel ships.

    Offline and small; far less accurate than Whisper-class models, so its WER suits comparing systems on
    the same sentences, not absolute claims.
    """

    sample_rate = 16000

    def __init__(self) -> None:
        try:
            from pocketsphinx import Decoder
        except ImportError:
            raise InputError("the pocketsphinx ASR is not installed: pip install 'vocalis[eval]'") from None
        self._decoder_class = Decoder

    def __call__(self, wav: np.ndarray, sample_rate: int) -> str:
        if sample_rate != self.sample_rate:
            wav = soxr.resample(wav, sample_rate, self.sample_rate)
        pcm = (np.clip(wav, -1.0, 1.0) * 32767).astype("<i2").tobytes()  # 16-bit little-endian PCM
        # a fresh decoder (~0.3 s) per utterance: one reused decoder carries its live cepstral-mean normalisation
        # over, so a transcript depended on what was heard before (2 of 20 teacher clips changed after model clips)
        decoder = self._decoder_class(samprate=self.sample_rate, loglevel="FATAL")
        decoder.start_utt()
        decoder.process_raw(pcm, full_utt=True)
        decoder.end_utt()
        hyp = decoder.hyp()
        return hyp.hypstr if hyp is not None else ""


def load_transcriber(spec: str, language: str = "auto") -> Transcriber | None:
    """`pocketsphinx`, `none` (no WER/CER), or `module:factory` (see the module docstring)."""
    if spec == "none":
        return None
    if spec == "pocketsphinx":
        if language not in ("auto", "en") and not language.startswith("en"):
            log.warning("pocketsphinx recognises US English only; WER for language %r will be meaningless", language)
        return PocketsphinxTranscriber()
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InputError(f"--asr {spec!r}: use 'pocketsphinx', 'none' or 'module:factory'")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except ImportError as exc:
        raise InputError(f"--asr {spec!r}: cannot import {module_name!r}: {exc}") from None
    except AttributeError:
        raise InputError(f"--asr {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    try:
        accepts_language = "language" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        accepts_language = False
    transcriber = factory(language=language) if accepts_language else factory()
    if not callable(transcriber):
        raise InputError(f"--asr {spec!r}: the factory returned {type(transcriber).__name__}, not a callable")
    return transcriber
