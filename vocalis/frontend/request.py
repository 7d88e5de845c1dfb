"""Typed synthesis requests and audio chunks: the data that flows through every inference path."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

import numpy as np

from vocalis.errors import InputError
from vocalis.frontend.voice import Voice

MIN_SPEED, MAX_SPEED = 0.25, 4.0


class Mode(str, Enum):
    """How the LLM and the flow are prompted.

    sft: speaker embedding only. zero_shot: prompt text + prompt speech for the LLM, prompt speech/mel for the
    flow. cross_lingual: the flow is prompted, the LLM is not. instruct: the LLM reads an instruction before the
    text, the flow is prompted. vc: no LLM; source speech tokens are re-voiced by the flow.
    """

    SFT = "sft"
    ZERO_SHOT = "zero_shot"
    CROSS_LINGUAL = "cross_lingual"
    INSTRUCT = "instruct"
    VC = "vc"


@dataclass(frozen=True)
class SynthesisRequest:
    """One utterance to synthesise.

    text: a string, or an iterable of text pieces arriving over time (bi-streaming; no normalisation).
    source_speech_ids: speech tokens to re-voice (vc only).
    adapter: the LoRA adapter of the engine's bank the LLM runs with (None: the base model).
    """

    voice: Voice
    mode: Mode
    text: str | Iterable[str] = ""
    instruct: str = ""
    source_speech_ids: tuple[int, ...] = ()
    speed: float = 1.0
    seed: int | None = None
    language: str = "auto"
    text_frontend: bool = True
    adapter: str | None = None

    def __post_init__(self) -> None:
        if not (MIN_SPEED <= self.speed <= MAX_SPEED):
            raise InputError(f"speed must be between {MIN_SPEED} and {MAX_SPEED}, got {self.speed}")
        if self.mode is Mode.VC:
            if not self.source_speech_ids:
                raise InputError("voice conversion needs source speech")
        elif isinstance(self.text, str) and not self.text.strip():
            raise InputError("text is empty")
        if self.mode is Mode.INSTRUCT and not self.instruct.strip():
            raise InputError("instruct mode needs an instruction text")
        if self.mode in (Mode.ZERO_SHOT, Mode.CROSS_LINGUAL, Mode.VC) and not self.voice.has_prompt_speech:
            raise InputError(f"{self.mode.value} needs a voice made from a prompt recording")
        if self.mode is Mode.ZERO_SHOT and not self.voice.prompt_text_ids:
            raise InputError("zero-shot needs the prompt recording's transcript (prompt text)")

    @property
    def bistream(self) -> bool:
        return not isinstance(self.text, str) and self.mode is not Mode.VC


@dataclass(frozen=True)
class AudioChunk:
    """A piece of output audio. samples: (N,) float32 in [-1, 1].

    speech_ids: on the last chunk of a sentence, the speech ids the LLM wrote for it (word timestamps read a phone
    model's labels from them, `frontend.word_times`); () on every other chunk.
    """

    samples: np.ndarray
    sample_rate: int
    segment: int  # index of the text segment (sentence) it belongs to
    final: bool  # last chunk of the whole request
    speech_ids: tuple[int, ...] = ()

    @property
    def duration(self) -> float:
        return len(self.samples) / self.sample_rate
