"""`TTS`: the public façade. Load a model, pick or make a voice, get audio whole or streamed — on the engine.

Every call runs on the batching engine (`runtime.AsyncEngine`): blocking methods (`synthesize`, `stream`,
`convert_voice`) through its blocking face, async ones (`asynthesize`, `astream`) on the caller's event loop.
Calls from several threads or tasks at once batch together (LLM steps and token2wav steps across requests).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Self, TypedDict, Unpack

import numpy as np
import torch

from vocalis.backends.choice import Runtime, apply_backend, resolve
from vocalis.backends.load_precision import llm_load_converter
from vocalis.config import MAX_PROMPT_SECONDS, PROMPT_SAMPLE_RATE_16K
from vocalis.engine.config import EngineConfig
from vocalis.errors import InputError
from vocalis.frontend import audio as audio_fe
from vocalis.frontend.family import frontend_for
from vocalis.frontend.prompt import AudioSource
from vocalis.frontend.request import AudioChunk, Mode, SynthesisRequest
from vocalis.frontend.voice import Voice, check_voice_name
from vocalis.frontend.word_times import Aligner, WordTime, WordTimer, default_aligner
from vocalis.kernels.config import KernelConfig
from vocalis.kernels.threads import release_openmp_pool
from vocalis.model_dir import BUILTIN_MODEL, LoadedModel, load_model
from vocalis.runtime.async_engine import AsyncEngine
from vocalis.runtime.sync import BlockingEngine
from vocalis.token2wav.config import Token2WavConfig

Text = str | Iterable[str] | AsyncIterable[str]


class Options(TypedDict, total=False):
    """What a synthesis may say besides its text (see `TTS.request`)."""

    voice: str | Voice | None
    prompt_wav: AudioSource | None
    prompt_text: str | None
    instruct: str | None
    speed: float
    seed: int | None
    language: str
    text_frontend: bool
    adapter: str | None


class TTS:
    """Speech from text with a CosyVoice 2-architecture model.

    >>> tts = TTS.load()                      # built-in model; or TTS.load("path/to/CosyVoice2-0.5B")
    >>> wav = tts.synthesize("Hello there.")   # (N,) float32 at tts.sample_rate
    >>> for chunk in tts.stream("Hello there.", prompt_wav="me.wav", prompt_text="what I said"):
    ...     play(chunk.samples)
    >>> async for chunk in tts.astream("Hello there."):   # inside a coroutine
    ...     await send(chunk.samples)
    >>> wav, words = tts.synthesize_timed("Hello there.")  # words: [WordTime("hello", 0.16, 0.52), ...]

    engine: the LLM engine's memory and batching knobs; token2wav: the token2wav engine's (its default final
    chunk is the reference's full-attention pass, block-causal for the built-in model: `default_token2wav`).
    The engine starts on the first synthesis; `close()` (or a `with` block) stops it.
    """

    engine_type: type[AsyncEngine] = AsyncEngine  # what `engine` builds (the serving bench forces lengths with it)

    def __init__(self, model: LoadedModel, engine: EngineConfig | None = None,
                 token2wav: Token2WavConfig | None = None, runtime: Runtime | None = None) -> None:
        self.model = model
        self.runtime = runtime  # what `apply_backend` applied to `model` (None: nothing, plain torch)
        self.frontend = frontend_for(model)
        self.engine_config = engine
        self.token2wav_config = token2wav if token2wav is not None else self.default_token2wav(model)
        self._voices: dict[str, Voice] = dict(model.voices)
        self.adapters: tuple[str, ...] = ()  # LoRA adapters loaded with the LLM (`load(adapters=...)`)
        self.adapters_banked = False  # several adapters, kept apart: each request names one (or none)
        self.aligner: Aligner | None = None  # word timestamps' aligner (None: `word_times.default_aligner`)
        self._lock = threading.Lock()
        self._engine: AsyncEngine | None = None
        self._blocking: BlockingEngine | None = None

    @classmethod
    def load(cls, path: str | Path | None = None, device: str | torch.device = "cpu", *, backend: str = "torch",
             precision: str = "fp32", engine: EngineConfig | None = None, flow_steps: int | None = None,
             token2wav: Token2WavConfig | None = None, kernels: KernelConfig | None = None,
             adapters: Mapping[str, str | Path] | None = None) -> TTS:
        """A model directory (official CosyVoice2 or Vocalis layout), or None for the built-in model.

        backend: torch | onnx | tensorrt | compile | vllm | auto; precision: fp32 | bf16 | fp16 | int8 | auto
        (see `vocalis.backends.choice`; an unavailable choice raises InputError saying what to install).
        kernels: which native CPU kernels the backend may use (default: all that run here).
        flow_steps: Euler steps of the flow, a speed/quality setting (default: the model's, 10 for CosyVoice 2; the
        mel error of fewer is in docs/benchmarks.md); it sets `flow_steps` of the token2wav config in use.
        adapters: {name: folder or name under the model's `adapters/`} of LoRA adapters trained on this very model
        (`vocalis train llm --lora`). One is merged into the LLM weights at load (no cost per step; every request
        gets it); several stay apart (batched LoRA, `vocalis.adapters.batched`): a request names one with
        `adapter=` and runs with it, in the same batch as requests with other adapters or none (the base model).
        """
        dev = torch.device(device)
        resolve(backend, precision, dev, kernels)  # fail fast, before loading
        # the LLM converted to its precision as it loads (never whole in fp32); adapters merge into fp32 weights
        model = load_model(path, None if adapters else llm_load_converter(backend, precision, dev, kernels))
        names: tuple[str, ...] = ()
        banked = False
        model = model.to(dev)
        if adapters:
            from vocalis.adapters.batched import attach_at_load

            if len(adapters) > 1 and resolve(backend, precision, dev)[0] == "vllm":
                raise InputError("several adapters are served per request by our engine (--backend torch); the vllm "
                                 "backend takes one adapter, merged")
            banked, names = attach_at_load(model.llm, adapters, model.path)
        if model.kind == "cosyvoice3" and resolve(backend, precision, dev)[0] in ("onnx", "tensorrt"):
            raise InputError(f"the {backend} backend exports CosyVoice 2's flow and vocoder; a CosyVoice 3 model runs "
                             "with --backend torch (or compile)")  # at load, not as a failed export later
        runtime = apply_backend(model, backend, precision, dev, kernels=kernels)
        tts = cls(model, engine, token2wav, runtime)
        tts.adapters, tts.adapters_banked = names, banked
        if flow_steps is not None:
            tts.token2wav_config = dataclasses.replace(tts.token2wav_config, flow_steps=flow_steps)
        # the loading thread's OpenMP pool now idles: while it lives, the engine's loop thread (started by whichever
        # thread synthesises first) runs every op with fewer spinning workers (`threads.release_openmp_pool`)
        release_openmp_pool()
        return tts

    @staticmethod
    def default_token2wav(model: LoadedModel) -> Token2WavConfig:
        """The token2wav config a model runs with unless given one. A CosyVoice model's streams end on the
        reference's full-attention pass, so that streamed audio is the official output exactly. The built-in model
        has no reference to match and learned both attention modes alike (each training batch draws one), so its
        streams end block-causal like their other chunks: no second flow pass over the whole utterance."""
        builtin = model.path is not None and model.path.resolve() == BUILTIN_MODEL.resolve()
        return Token2WavConfig(final_attention="causal" if builtin else "full")

    # ---- the engine ------------------------------------------------------------------------------------
    @property
    def engine(self) -> AsyncEngine:
        """The running engine (started on first use)."""
        return self._faces()[0]

    def _faces(self) -> tuple[AsyncEngine, BlockingEngine]:
        with self._lock:
            if self._engine is None or self._blocking is None:
                self._engine = self.engine_type.from_model(self.model, self.engine_config, self.token2wav_config,
                                                           runtime=self.runtime)
                self._blocking = BlockingEngine(self._engine)
            return self._engine, self._blocking

    def hold_kv_budget(self) -> None:
        """Have the engine, when it is built, hold its whole KV budget from the start, as a long-running server
        wants (`EngineConfig.reserve_kv_cache`); no effect on an engine already running."""
        self.engine_config = dataclasses.replace(self.engine_config or EngineConfig(), reserve_kv_cache=True)

    def close(self) -> None:
        """Stop the engine; a later call starts a new one."""
        with self._lock:
            if self._blocking is not None:
                self._blocking.close()
            self._engine = self._blocking = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def sample_rate(self) -> int:
        return self.frontend.sample_rate

    # ---- voices ----------------------------------------------------------------------------------------
    @property
    def voices(self) -> list[str]:
        return sorted(self._voices)

    def voice(self, name: str) -> Voice:
        try:
            return self._voices[name]
        except KeyError:
            known = ", ".join(self.voices) or "none"
            raise InputError(f"unknown voice {name!r} (known voices: {known})") from None

    def add_voice(self, name: str, prompt_wav: AudioSource, prompt_text: str = "", language: str = "auto") -> Voice:
        """Make a reusable voice from a recording (and its transcript, for zero-shot cloning). Requests with it
        share its prompt's LLM prefix and flow prefix, computed once."""
        voice = self.frontend.make_voice(prompt_wav, prompt_text, check_voice_name(name), language)
        self._voices[name] = voice
        return voice

    # ---- requests --------------------------------------------------------------------------------------
    def check_adapter(self, adapter: str | None) -> None:
        """InputError unless `adapter` is None or one of the LoRA adapters loaded (`load(adapters=...)`)."""
        if adapter is not None and adapter not in self.adapters:
            raise InputError(f"unknown adapter {adapter!r} (loaded: {', '.join(self.adapters) or 'none'})")

    def request(
        self,
        text: Text,
        *,
        voice: str | Voice | None = None,
        prompt_wav: AudioSource | None = None,
        prompt_text: str | None = None,
        instruct: str | None = None,
        speed: float = 1.0,
        seed: int | None = None,
        language: str = "auto",
        text_frontend: bool = True,
        adapter: str | None = None,
    ) -> SynthesisRequest:
        """The typed request the other methods run; the mode follows from what is given (see `Mode`).
        adapter: one of the LoRA adapters loaded (`load(adapters=...)`); None: the base model (with one adapter
        loaded, it is merged and every request has it)."""
        self.check_adapter(adapter)
        if prompt_wav is not None and voice is not None:
            raise InputError("give either a voice or a prompt recording, not both")
        if prompt_wav is not None:
            chosen = self.frontend.make_voice(prompt_wav, prompt_text or "", language=language)
        elif isinstance(voice, Voice):
            chosen = voice
        elif voice is not None:
            chosen = self.voice(voice)
        elif self._voices:
            chosen = self._voices[self.voices[0]]
        else:
            raise InputError("this model has no built-in voices: pass voice=... or prompt_wav=...")
        if instruct:
            mode = Mode.INSTRUCT
        elif not chosen.has_prompt_speech:
            mode = Mode.SFT
        elif chosen.prompt_text_ids:
            mode = Mode.ZERO_SHOT
        else:
            mode = Mode.CROSS_LINGUAL
        return SynthesisRequest(chosen, mode, text, instruct or "", (), speed, seed, language, text_frontend,
                                adapter if self.adapters_banked else None)

    def vc_request(self, source_wav: AudioSource, *, voice: str | Voice | None = None,
                   prompt_wav: AudioSource | None = None, speed: float = 1.0, seed: int | None = None
                   ) -> SynthesisRequest:
        """Voice conversion: say what `source_wav` says in the target voice (no LLM)."""
        target = self.request("-", voice=voice, prompt_wav=prompt_wav, text_frontend=False).voice
        source = audio_fe.load_wav(source_wav, PROMPT_SAMPLE_RATE_16K, max_seconds=MAX_PROMPT_SECONDS)
        ids = self.frontend.speech_tokens(source)
        return SynthesisRequest(target, Mode.VC, "", "", ids, speed, seed)

    # ---- blocking ----------------------------------------------------------------------------------------
    def stream(self, text: str | Iterable[str], **options: Unpack[Options]) -> Iterator[AudioChunk]:
        """Audio chunks as they are made. `text` may be an iterable of pieces still being written.
        Options as `request` (voice, prompt_wav, prompt_text, instruct, speed, seed, language, text_frontend,
        adapter)."""
        return self.run(self.request(text, **options), stream=True)

    def synthesize(self, text: str, **options: Unpack[Options]) -> np.ndarray:
        """The whole utterance: (N,) float32 at `sample_rate`. Options as `request`."""
        chunks = self.run(self.request(text, **options), stream=False)
        return np.concatenate([c.samples for c in chunks])

    def convert_voice(self, source_wav: AudioSource, *, voice: str | Voice | None = None,
                      prompt_wav: AudioSource | None = None, speed: float = 1.0, seed: int | None = None,
                      stream: bool = False) -> Iterator[AudioChunk]:
        """Voice conversion: say what `source_wav` says in the target voice (no LLM)."""
        return self.run(self.vc_request(source_wav, voice=voice, prompt_wav=prompt_wav, speed=speed, seed=seed),
                        stream=stream)

    def run(self, request: SynthesisRequest, *, stream: bool = True) -> Iterator[AudioChunk]:
        """A prepared request's chunks, blocking (streaming: chunk by chunk; else one chunk per sentence)."""
        return self._faces()[1].stream(request, stream=stream)

    # ---- word timestamps -------------------------------------------------------------------------------
    def word_timer(self, text: str, language: str = "auto", text_frontend: bool = True) -> WordTimer:
        """A `WordTimer` for `text`'s chunks: the model's labels for the built-in model, forced alignment
        (pocketsphinx) for English with other models, or `self.aligner` when set."""
        aligner = self.aligner or default_aligner(self.frontend.tokenizer, language)
        return WordTimer(aligner, self.frontend.segment_texts(text, language, text_frontend))

    def stream_timed(self, text: str, **options: Unpack[Options]) -> Iterator[tuple[AudioChunk, list[WordTime]]]:
        """`stream`, each chunk with the words whose sentence it ended (times from the start of the audio)."""
        timer = self.word_timer(text, options.get("language", "auto"), options.get("text_frontend", True))
        for chunk in self.stream(text, **options):
            yield chunk, timer.push(chunk)

    def synthesize_timed(self, text: str, **options: Unpack[Options]) -> tuple[np.ndarray, list[WordTime]]:
        """`synthesize` and every word's start and end in it."""
        timer = self.word_timer(text, options.get("language", "auto"), options.get("text_frontend", True))
        chunks = list(self.run(self.request(text, **options), stream=False))
        for chunk in chunks:
            timer.push(chunk)
        return np.concatenate([c.samples for c in chunks]), timer.words

    # ---- async -------------------------------------------------------------------------------------------
    async def astream(self, text: Text, **options: Unpack[Options]) -> AsyncIterator[AudioChunk]:
        """`stream` for async callers: `async for chunk in tts.astream(...)`. `text` may be an async iterable."""
        handle = self.engine.submit(self.request(text, **options), stream=True)
        try:
            async for chunk in handle:
                yield chunk
        finally:
            handle.abort()

    async def asynthesize(self, text: str, **options: Unpack[Options]) -> np.ndarray:
        """`synthesize` for async callers."""
        handle = self.engine.submit(self.request(text, **options), stream=False)
        return np.concatenate([c.samples async for c in handle])
