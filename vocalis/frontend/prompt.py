"""What every synthesis path does before the LLM and the flow: voices from recordings, text -> sentences -> ids,
the LLM's and the flow's prompts, and the request's random streams. The engine (`runtime.async_engine`) and the
reference path share it, so both follow the same rules."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import torch

from vocalis.config import (
    CAMPPLUS_ONNX,
    ENDOFPROMPT_TOKEN,
    MAX_PROMPT_SECONDS,
    PROMPT_SAMPLE_RATE_16K,
    SPEECH_TOKENIZER_ONNX,
)
from vocalis.errors import InputError
from vocalis.frontend import audio as audio_fe
from vocalis.frontend import text as text_fe
from vocalis.frontend.notices import notice
from vocalis.frontend.phones import PhoneTokenizer
from vocalis.frontend.pieces import PieceReader
from vocalis.frontend.request import Mode, SynthesisRequest
from vocalis.frontend.tokenizer import TextTokenizer
from vocalis.frontend.voice import Voice

if TYPE_CHECKING:
    from vocalis.model_dir import LoadedModel

AudioSource = str | Path | BinaryIO


@dataclass
class FlowPrompt:
    """What the flow is conditioned on: prompt tokens (1, P), prompt mel (1, 2P, 80), embedding (1, 192)."""

    speech_ids: torch.Tensor
    mel: torch.Tensor
    embedding: torch.Tensor

    @classmethod
    def empty(cls, embedding: torch.Tensor, mel_dim: int = 80) -> FlowPrompt:
        return cls(torch.zeros(1, 0, dtype=torch.int32), torch.zeros(1, 0, mel_dim), embedding.reshape(1, -1))


class Frontend:
    """Request preparation over a `LoadedModel`'s tokenizer, speech tokenizer and speaker encoder (stateless)."""

    speech_tokenizer_file = SPEECH_TOKENIZER_ONNX  # what a model directory of this family holds for it
    prompt_mel_fmax: float | None = audio_fe.PROMPT_FMAX  # the flow's mel (its training features)

    def __init__(self, model: LoadedModel, max_text_chars: int = 20000) -> None:
        self.model = model
        self.max_text_chars = max_text_chars
        self.sample_rate = model.config.sample_rate

    @property
    def tokenizer(self) -> TextTokenizer | PhoneTokenizer:
        """The BPE tokenizer, or for a phones model (`config.text_frontend`) the phone frontend (`PhoneTokenizer`)."""
        if self.model.tokenizer is None:
            raise InputError(f"the {self.model.describe()} has no text tokenizer files, so it cannot read text")
        return self.model.tokenizer

    @property
    def device(self) -> torch.device:
        return self.model.flow.input_embedding.weight.device

    # ---- voices ------------------------------------------------------------------------------------
    def speech_tokens(self, wav16k: np.ndarray) -> tuple[int, ...]:
        if self.model.speech_tokenizer is None:
            raise InputError(
                f"the {self.model.describe()} has no speech tokenizer, so it cannot use prompt or source audio; "
                f"use a model directory with {self.speech_tokenizer_file}"
            )
        return tuple(self.model.speech_tokenizer.tokenize(wav16k))

    def make_voice(self, prompt_wav: AudioSource, prompt_text: str = "", name: str = "prompt",
                   language: str = "auto") -> Voice:
        """Prompt recording (+ its transcript) -> `Voice`. Without a transcript the voice is cross-lingual only."""
        zeros = self.model.config.speaker_embedding == "zeros"  # the flow trained without x-vectors
        if self.model.speaker_encoder is None and not zeros:
            raise InputError(
                f"the {self.model.describe()} has no speaker encoder, so it cannot clone a voice; "
                f"use a model directory with {CAMPPLUS_ONNX}"
            )
        start = prompt_wav.tell() if hasattr(prompt_wav, "seek") else None  # a file object is read twice
        wav16k = audio_fe.load_wav(prompt_wav, PROMPT_SAMPLE_RATE_16K, max_seconds=MAX_PROMPT_SECONDS)
        if start is not None:
            prompt_wav.seek(start)  # type: ignore[union-attr]
        speech_ids = self.speech_tokens(wav16k)
        if zeros:
            embedding = torch.zeros(self.model.config.flow.spk_embed_dim)
        else:
            embedding = torch.as_tensor(self.model.speaker_encoder.embed(wav16k)).float().reshape(-1)
        wav24k = audio_fe.load_wav(prompt_wav, self.sample_rate, max_seconds=MAX_PROMPT_SECONDS)
        mel, speech_ids = audio_fe.align_prompt(audio_fe.prompt_mel(wav24k, self.prompt_mel_fmax), speech_ids)
        if not speech_ids:
            raise InputError("the prompt recording is too short to give any speech tokens")
        text_ids: tuple[int, ...] = ()
        if prompt_text.strip():
            norm = self._normalize(prompt_text, language, split=False)
            text_ids = tuple(self.tokenizer.encode(norm[0] if norm else prompt_text))
        return Voice(name, prompt_text, text_ids, tuple(speech_ids), torch.as_tensor(mel).float(), embedding)

    # ---- text ----------------------------------------------------------------------------------------
    def _normalize(self, text: str, language: str, split: bool = True) -> list[str]:
        if len(text) > self.max_text_chars:
            raise InputError(f"text is {len(text)} characters; the limit is {self.max_text_chars}")
        if language == "auto":  # a model reading one language (the built-in model) normalises every text as it
            language = getattr(self.tokenizer, "language", language)
        result = text_fe.normalize_text(text, language, split=split, token_len=lambda s: len(self.tokenizer.encode(s)))
        for note in result.notes:  # what the text frontend left unread (a code block), for the caller
            notice(note)
        self._notice_readings(result.pieces)
        return list(result.pieces)

    def _notice_readings(self, pieces: Sequence[str]) -> None:
        """Tell the caller what the tokenizer reads otherwise than written (a word transliterated or dropped)."""
        reads_otherwise = getattr(self.tokenizer, "warnings", None)
        if reads_otherwise is not None:
            for piece in pieces:
                for note in reads_otherwise(piece):
                    notice(note)

    def piece_reader(self, language: str = "auto", text_frontend: bool = True) -> PieceReader:
        """A reader of text sent in pieces: each complete sentence normalised as whole text is (`text_frontend`;
        else as written), as token ids; what it reads otherwise is noticed as for whole text."""
        read_as: list[str] = [language]

        def normalize(text: str) -> list[str]:
            read_as[0] = text_fe.resolve_language(getattr(self.tokenizer, "language", language)
                                                  if language == "auto" else language, text)
            if not text_frontend:
                self._notice_readings((text,))
                return [text]
            return self._normalize(text, language)

        return PieceReader(normalize, self.tokenizer.encode, lambda: read_as[0] not in ("zh", "ja"))

    # ---- request preparation ------------------------------------------------------------------------------
    def segments(self, request: SynthesisRequest) -> list[list[int]]:
        """Text -> token ids per sentence; no sentence dropped, none repeated."""
        assert isinstance(request.text, str)
        return [ids for _, ids in self._sentences(request.text, request.language, request.text_frontend)]

    def segment_texts(self, text: str, language: str = "auto", text_frontend: bool = True) -> list[str]:
        """The text each sentence of `segments` says (normalised), in order: what word timestamps align."""
        return [piece for piece, _ in self._sentences(text, language, text_frontend)]

    def _sentences(self, text: str, language: str, text_frontend: bool) -> list[tuple[str, list[int]]]:
        pieces = self._normalize(text, language) if text_frontend else [text]
        out = [(p, ids) for p in pieces if (ids := self.tokenizer.encode(p))]
        if not out:
            raise InputError("text has nothing to say after normalisation (only punctuation or symbols?)")
        return out

    def llm_prompt(self, request: SynthesisRequest) -> tuple[list[int], list[int]]:
        """(prompt text ids, prompt speech ids) the LLM sees before the text."""
        voice = request.voice
        if request.mode is Mode.ZERO_SHOT:
            return list(voice.prompt_text_ids), list(voice.prompt_speech_ids)
        if request.mode is Mode.INSTRUCT:
            if self.tokenizer.endofprompt_id is None:
                raise InputError(f"the {self.model.describe()} reads phones and takes no instructions")
            instruct = request.instruct.strip()
            if not instruct.endswith(ENDOFPROMPT_TOKEN):
                instruct += ENDOFPROMPT_TOKEN
            return self.tokenizer.encode(instruct), []
        return [], []

    def flow_prompt(self, request: SynthesisRequest) -> FlowPrompt:
        """The flow's prompt (speech ids (1, P), mel (1, 2P, 80), speaker embedding (1, E)); empty for SFT."""
        voice = request.voice
        emb = voice.embedding.reshape(1, -1)
        if request.mode is Mode.SFT or not voice.has_prompt_speech:
            return FlowPrompt.empty(emb, self.model.config.flow.output_size)
        return FlowPrompt(
            torch.tensor([voice.prompt_speech_ids], dtype=torch.int32),
            voice.prompt_mel.unsqueeze(0).float(),
            emb,
        )

    # ---- randomness ----------------------------------------------------------------------------------
    def generators(self, seed: int | None) -> tuple[torch.Generator, torch.Generator]:
        """Separate streams for LLM sampling and the vocoder's source noise, so streaming and non-streaming
        draw the same speech tokens for the same seed."""
        base = seed if seed is not None else random.SystemRandom().randrange(2**62)
        llm_gen = torch.Generator(device=self.device)
        llm_gen.manual_seed(base)
        voc_gen = torch.Generator(device=self.device)
        voc_gen.manual_seed(base + 1)
        return llm_gen, voc_gen
