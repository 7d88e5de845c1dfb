"""The reference synthesis path: one request at a time, correct and clear.

text -> sentences -> LLM speech tokens -> token2wav, for every mode (see `Mode`), streaming or not, with text
given whole or as pieces arriving over time. Everything a request changes lives in locals and its
`StreamState`; the shared modules are never written to.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import torch

from vocalis.config import ENDOFPROMPT_TOKEN, MAX_PROMPT_SECONDS, PROMPT_SAMPLE_RATE_16K, StreamConfig
from vocalis.runtime.backends import vllm_precision
from vocalis.errors import InputError
from vocalis.frontend import audio as audio_fe
from vocalis.frontend import text as text_fe
from vocalis.frontend.tokenizer import TextTokenizer
from vocalis.frontend.request import AudioChunk, Mode, SynthesisRequest
from vocalis.reference.token2wav import FlowPrompt, Token2Wav
from vocalis.model_dir import LoadedModel
from vocalis.frontend.voice import Voice

if TYPE_CHECKING:
    from vocalis.engine.vllm.engine import VLLMEngine

log = logging.getLogger(__name__)

AudioSource = str | Path | BinaryIO


class Synthesizer:
    """Drives a `LoadedModel` for one request at a time (the fast engine batches many)."""

    def __init__(self, model: LoadedModel, stream: StreamConfig | None = None, max_text_chars: int = 20000):
        self.model = model
        self.token2wav = Token2Wav(model.flow, model.hift, stream)
        self.max_text_chars = max_text_chars
        self.sample_rate = model.config.sample_rate
        self._vllm: VLLMEngine | None = None  # the vllm backend's engine, made when first needed

    @property
    def tokenizer(self) -> TextTokenizer:
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
                "use a model directory with speech_tokenizer_v2.onnx"
            )
        return tuple(self.model.speech_tokenizer.tokenize(wav16k))

    def make_voice(self, prompt_wav: AudioSource, prompt_text: str = "", name: str = "prompt",
                   language: str = "auto") -> Voice:
        """Prompt recording (+ its transcript) -> `Voice`. Without a transcript the voice is cross-lingual only."""
        if self.model.speaker_encoder is None:
            raise InputError(
                f"the {self.model.describe()} has no speaker encoder, so it cannot clone a voice; "
                "use a model directory with campplus.onnx"
            )
        start = prompt_wav.tell() if hasattr(prompt_wav, "seek") else None  # a file object is read twice
        wav16k = audio_fe.load_wav(prompt_wav, PROMPT_SAMPLE_RATE_16K, max_seconds=MAX_PROMPT_SECONDS)
        if start is not None:
            prompt_wav.seek(start)  # type: ignore[union-attr]
        speech_ids = self.speech_tokens(wav16k)
        embedding = torch.as_tensor(self.model.speaker_encoder.embed(wav16k)).float().reshape(-1)
        wav24k = audio_fe.load_wav(prompt_wav, self.sample_rate, max_seconds=MAX_PROMPT_SECONDS)
        mel, speech_ids = audio_fe.align_prompt(audio_fe.prompt_mel(wav24k), speech_ids)
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
        return text_fe.normalize(text, language=language, split=split,
                                 token_len=lambda s: len(self.tokenizer.encode(s)))

    # ---- request preparation: public, so other front ends (the async engine) follow the same rules -----------
    def segments(self, request: SynthesisRequest) -> list[list[int]]:
        """Text -> token ids per sentence; no sentence dropped, none repeated."""
        assert isinstance(request.text, str)
        if request.text_frontend:
            pieces = self._normalize(request.text, request.language)
        else:
            pieces = [request.text]
        ids = [self.tokenizer.encode(p) for p in pieces]
        ids = [x for x in ids if x]
        if not ids:
            raise InputError("text has nothing to say after normalisation (only punctuation or symbols?)")
        return ids

    def llm_prompt(self, request: SynthesisRequest) -> tuple[list[int], list[int]]:
        """(prompt text ids, prompt speech ids) the LLM sees before the text."""
        voice = request.voice
        if request.mode is Mode.ZERO_SHOT:
            return list(voice.prompt_text_ids), list(voice.prompt_speech_ids)
        if request.mode is Mode.INSTRUCT:
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

    # ---- synthesis -----------------------------------------------------------------------------------
    def generators(self, seed: int | None) -> tuple[torch.Generator, torch.Generator]:
        """Separate streams for LLM sampling and the vocoder's source noise, so streaming and non-streaming
        draw the same speech tokens for the same seed."""
        base = seed if seed is not None else random.SystemRandom().randrange(2**62)
        llm_gen = torch.Generator(device=self.device)
        llm_gen.manual_seed(base)
        voc_gen = torch.Generator(device=self.device)
        voc_gen.manual_seed(base + 1)
        return llm_gen, voc_gen

    def _speech_token_streams(self, request: SynthesisRequest, gen: torch.Generator) -> Iterator[Iterator[int]]:
        """One iterator of speech tokens per segment."""
        if request.mode is Mode.VC:
            yield iter(request.source_speech_ids)
            return
        prompt_text_ids, prompt_speech_ids = self.llm_prompt(request)
        sampling = self.model.config.sampling
        engine = self._vllm_engine()
        if engine is not None:  # the vllm backend: the same requests, decoded by vLLM (no RAS, no bi-streaming)
            if request.bistream:
                engine.make_bistream_request()  # raises InputError
            for text_ids in self.segments(request):
                params = engine.sampling_params(len(text_ids), sampling)
                yield engine.stream(engine.make_request(text_ids, prompt_text_ids, prompt_speech_ids, params,
                                                        generator=gen))
            return
        if request.bistream:
            pieces = (self.tokenizer.encode(p) for p in request.text if p)
            yield self.model.llm.generate_bistream(pieces, prompt_text_ids, prompt_speech_ids, sampling=sampling,
                                                   generator=gen)
            return
        for text_ids in self.segments(request):
            yield self.model.llm.generate(text_ids, prompt_text_ids, prompt_speech_ids, sampling=sampling,
                                          generator=gen)

    def _vllm_engine(self) -> VLLMEngine | None:
        """With the vllm backend applied, its engine (worker started on first use); else None (torch decoding)."""
        precision = vllm_precision(self.model)
        if precision is None:
            return None
        if self._vllm is None:
            from vocalis.engine.vllm.engine import VLLMEngine

            self._vllm = VLLMEngine(self.model.llm, precision=precision)
        return self._vllm

    def run(self, request: SynthesisRequest, stream: bool = False) -> Iterator[AudioChunk]:
        """Audio for `request`: one chunk per segment, or several per segment when streaming.

        A streaming chunk goes out as soon as it is computed. Only a segment's last chunk is held back until the
        next segment has audio or the request ends: it is the request's last (`final`) exactly when no segment
        after it produces any."""
        llm_gen, voc_gen = self.generators(request.seed)
        prompt = self.flow_prompt(request)
        held: AudioChunk | None = None
        for segment, tokens in enumerate(self._speech_token_streams(request, llm_gen)):
            for wav, ends_segment in self._token_audio(tokens, prompt, request.speed, stream, voc_gen):
                chunk = AudioChunk(wav.reshape(-1).numpy().astype(np.float32), self.sample_rate, segment, False)
                if held is not None:
                    yield held
                    held = None
                if ends_segment:
                    held = chunk
                else:
                    yield chunk
        if held is None:  # every segment with audio ends on a held chunk, so none had any
            raise InputError("nothing was synthesised (the model produced no speech tokens)")
        yield AudioChunk(held.samples, held.sample_rate, held.segment, True)

    def _token_audio(self, tokens: Iterable[int], prompt: FlowPrompt, speed: float, stream: bool,
                     gen: torch.Generator) -> Iterator[tuple[torch.Tensor, bool]]:
        """(waveform, whether it ends the segment) as the tokens arrive."""
        t2w = self.token2wav
        if not stream:
            ids = list(tokens)
            if ids:
                yield t2w.offline(torch.tensor([ids], dtype=torch.int32), prompt, speed, gen), True
            return
        state = t2w.new_state(prompt, gen)
        ids: list[int] = []
        for tok in tokens:
            ids.append(tok)
            if t2w.ready(state, len(ids)):
                yield t2w.stream_step(state, torch.tensor([ids], dtype=torch.int32), speed), False
        if ids:  # also flushes the tail held back by the last chunk
            yield t2w.finish(state, torch.tensor([ids], dtype=torch.int32), speed), True
