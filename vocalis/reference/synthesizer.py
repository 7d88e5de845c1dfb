"""The reference synthesis path: one request at a time, correct and clear.

text -> sentences -> LLM speech tokens -> token2wav, for every mode (see `Mode`), streaming or not, with text
given whole or as pieces arriving over time. Everything a request changes lives in locals and its
`StreamState`; the shared modules are never written to.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from vocalis.backends.choice import Runtime, vllm_precision
from vocalis.config import SamplingConfig, StreamConfig
from vocalis.errors import InputError
from vocalis.frontend.pieces import PieceReader
from vocalis.frontend.prompt import AudioSource, FlowPrompt, Frontend
from vocalis.frontend.request import AudioChunk, Mode, SynthesisRequest
from vocalis.model_dir import LoadedModel
from vocalis.reference.decode import generate, generate_bistream
from vocalis.reference.token2wav import Token2Wav

if TYPE_CHECKING:
    from vocalis.backends.vllm.engine import VLLMEngine

log = logging.getLogger(__name__)

__all__ = ["AudioSource", "Synthesizer"]


class Synthesizer(Frontend):
    """Drives a `LoadedModel` for one request at a time (the fast engine batches many)."""

    def __init__(self, model: LoadedModel, stream: StreamConfig | None = None, max_text_chars: int = 20000,
                 runtime: Runtime | None = None):
        super().__init__(model, max_text_chars)
        self.runtime = runtime  # what `apply_backend` applied to `model` (the vllm backend decodes in vLLM)
        self.token2wav = Token2Wav(model.flow, model.hift, stream)
        self._vllm: VLLMEngine | None = None  # the vllm backend's engine, made when first needed

    # ---- synthesis -----------------------------------------------------------------------------------
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
            pieces = _read(self.piece_reader(request.language, request.text_frontend), request.text)
            yield generate_bistream(self.model.llm, pieces, prompt_text_ids, prompt_speech_ids, sampling=sampling,
                                    generator=gen)
            return
        for text_ids in self.segments(request):
            yield self.generate(text_ids, prompt_text_ids, prompt_speech_ids, sampling, gen)

    def generate(self, text_ids: list[int], prompt_text_ids: list[int], prompt_speech_ids: list[int],
                 sampling: SamplingConfig, generator: torch.Generator) -> Iterator[int]:
        """One sentence's speech ids (the reference decode loop; the bench replaces it to force a length)."""
        return generate(self.model.llm, text_ids, prompt_text_ids, prompt_speech_ids, sampling=sampling,
                        generator=generator)

    def _vllm_engine(self) -> VLLMEngine | None:
        """With the vllm backend applied, its engine (worker started on first use); else None (torch decoding)."""
        precision = vllm_precision(self.runtime)
        if precision is None:
            return None
        if self._vllm is None:
            from vocalis.backends.vllm.engine import VLLMEngine

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


def _read(reader: PieceReader, pieces: Iterable[str]) -> Iterator[list[int]]:
    """Text pieces -> token ids a sentence at a time, as the engine reads them (`frontend.pieces`)."""
    for piece in pieces:
        if piece and (ids := reader.feed(piece)):
            yield ids
    if ids := reader.flush():
        yield ids
