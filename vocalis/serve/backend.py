"""The seam between the HTTP layer and synthesis: what a job is (`SpeechJob`, `TextFeed`), what runs it
(`Backend`) and what the server reads of a running one (`JobHandle`).

The server runs `engine_backend.EngineBackend` (the batching engine), whose handles are the engine's own
`StreamHandle`s; the reference path's one-job-at-a-time `ThreadedBackend` (`vocalis.reference.threaded_backend`)
is the baseline it is measured against. Routes turn a request body into one `SpeechJob`; the backend turns that
into the engine's `SynthesisRequest` (`SpeechJob.request`) in the same worker-thread hop that prepares the rest.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from vocalis.config import CAMPPLUS_ONNX
from vocalis.errors import InputError
from vocalis.frontend.request import AudioChunk
from vocalis.frontend.voice import Voice
from vocalis.serve.errors import Aborted, JobTimeout

if TYPE_CHECKING:
    from vocalis.frontend.request import SynthesisRequest
    from vocalis.frontend.word_times import WordTimer
    from vocalis.tts import TTS

END = object()  # marks the end of a stream of items (a text feed, a job's output)


class TextFeed:
    """Text pieces arriving over time (WebSocket bi-streaming). The event loop `put`s; a consumer reads them.

    Made and fed on the event loop. Read with `pieces()` (async: the engine backend; waiting costs nothing) or
    by iterating from a worker thread (the threaded backend). Reading ends at `end()`, raises `Aborted` after
    `cancel()` and `JobTimeout` when no piece arrives for `idle_timeout_s`.
    """

    def __init__(self, idle_timeout_s: float = 30.0) -> None:
        self.idle_timeout_s = idle_timeout_s
        self._loop = asyncio.get_running_loop()
        self._q: asyncio.Queue[object] = asyncio.Queue()
        self.chars = 0

    def put(self, piece: str) -> None:
        self.chars += len(piece)
        self._q.put_nowait(piece)

    def end(self) -> None:
        self._q.put_nowait(END)

    def cancel(self) -> None:
        self._q.put_nowait(Aborted("aborted"))

    async def _next(self) -> object:
        try:
            item = await asyncio.wait_for(self._q.get(), self.idle_timeout_s)
        except TimeoutError:
            raise JobTimeout(f"no text arrived for {self.idle_timeout_s:g} s") from None
        if isinstance(item, Exception):
            raise item
        return item

    async def pieces(self) -> AsyncIterator[str]:
        while (item := await self._next()) is not END:
            assert isinstance(item, str)
            yield item

    def __iter__(self) -> Iterator[str]:  # a worker thread, never the loop's
        while (item := asyncio.run_coroutine_threadsafe(self._next(), self._loop).result()) is not END:
            assert isinstance(item, str)
            yield item


@dataclass(frozen=True)
class SpeechJob:
    """One synthesis, as the HTTP layer describes it (voices already resolved to `Voice` objects).

    text: the whole text, or a `TextFeed` of pieces (bi-streaming).
    prompt_wav: encoded audio bytes of a one-off reference clip (instead of `voice`); prompt_text its transcript.
    source_wav: encoded audio bytes to re-voice (voice conversion; `text` unused).
    stream: chunked synthesis (low first-chunk latency) rather than one chunk per sentence.
    """

    text: str | TextFeed = ""
    voice: Voice | None = None
    prompt_wav: bytes | None = None
    prompt_text: str = ""
    instruct: str = ""
    source_wav: bytes | None = None
    speed: float = 1.0
    seed: int | None = None
    language: str = "auto"
    stream: bool = True
    adapter: str | None = None  # a LoRA adapter the TTS loaded (None: the base model)

    def request(self, tts: TTS, async_text: bool = True) -> SynthesisRequest:
        """The engine's request for this job (uploaded clips decoded, the voice made): CPU work, not for the event
        loop. A text feed is read asynchronously (`TextFeed.pieces`), or with async_text=False by blocking
        iteration (a worker thread's)."""
        prompt = io.BytesIO(self.prompt_wav) if self.prompt_wav is not None else None
        if self.source_wav is not None:
            return tts.vc_request(io.BytesIO(self.source_wav), voice=self.voice, prompt_wav=prompt, speed=self.speed,
                                  seed=self.seed)
        if isinstance(self.text, str) and not self.text.strip():
            raise InputError("input text is empty")
        text = self.text.pieces() if async_text and isinstance(self.text, TextFeed) else self.text
        return tts.request(text, voice=self.voice, prompt_wav=prompt, prompt_text=self.prompt_text or None,
                           instruct=self.instruct or None, speed=self.speed, seed=self.seed, language=self.language,
                           adapter=self.adapter)


class JobHandle(Protocol):
    """A submitted job as the server reads it: `async for chunk in handle` gives its `AudioChunk`s (the last has
    final=True); `abort()` stops it at once and frees what it holds (a later read raises `Aborted`); its input
    errors are raised from the iteration.

    Timing (monotonic seconds): `submitted`; `started`, when its synthesis began (None while queued or waiting
    for text); `finished`, when it ended (`done`). `warnings`: what reading its text noted for the client,
    complete when the first chunk arrives.
    """

    @property
    def id(self) -> str: ...

    @property
    def submitted(self) -> float: ...

    @property
    def started(self) -> float | None: ...

    @property
    def finished(self) -> float | None: ...

    @property
    def done(self) -> bool: ...

    @property
    def warnings(self) -> list[str]: ...

    def abort(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[AudioChunk]: ...

    async def __anext__(self) -> AudioChunk: ...


class Backend(Protocol):
    """What the server runs jobs on. Submitting raises `Overloaded` at once when the backend is full or not
    running; `close()` ends unfinished jobs with `Overloaded` (shutting down). Deadlines are the server's
    (`serve.deadlines`), applied through the handles."""

    @property
    def sample_rate(self) -> int: ...

    @property
    def queue_depth(self) -> int:
        """Jobs admitted that have not started."""
        ...

    @property
    def active(self) -> int:
        """Jobs running now."""
        ...

    @property
    def builtin_voices(self) -> dict[str, Voice]: ...

    def check_adapter(self, name: str | None) -> None: ...

    @property
    def can_clone(self) -> bool: ...

    @property
    def clone_blocker(self) -> str:
        """Why voices cannot be made from audio, when `can_clone` is false."""
        ...

    @property
    def describe(self) -> str: ...

    @property
    def model_path(self) -> Path | None:
        """Where the model lives (answers never show it)."""
        ...

    def start(self) -> None: ...

    def close(self) -> None: ...

    def submit(self, job: SpeechJob) -> JobHandle: ...

    async def make_voice(self, name: str, wav: bytes, text: str, language: str = "auto") -> Voice: ...

    def count_tokens(self, text: str) -> int:
        """Text tokens of `text` as the LLM reads them (the server bounds prompts with it)."""
        ...

    def kv_usage(self) -> float:
        """Fraction of the LLM's KV-cache blocks in use (0 without a KV-cache pool)."""
        ...

    def stats(self) -> dict[str, float]:
        """Live counters for /metrics."""
        ...

    def word_timer(self, text: str, language: str = "auto") -> WordTimer:
        """What times the words of a synthesis of `text` (`frontend.word_times`); InputError where no aligner
        reads the model or language. CPU work (text normalisation): not for the event loop."""
        ...




class ModelFacts:
    """The `Backend` surface that reads a backend's model (for backends holding a `tts`)."""

    tts: TTS

    @property
    def model_path(self) -> Path | None:
        return self.tts.model.path

    def count_tokens(self, text: str) -> int:
        """The LLM's text tokens, or UTF-8 bytes without a tokenizer (a byte-level BPE token is at least one byte,
        so the bound is never too low)."""
        tokenizer = self.tts.model.tokenizer
        return tokenizer.count(text) if tokenizer is not None else len(text.encode())

    @property
    def builtin_voices(self) -> dict[str, Voice]:
        return dict(self.tts.model.voices)

    def check_adapter(self, name: str | None) -> None:
        """InputError (a 400) unless `name` is None or one of the LoRA adapters the TTS loaded."""
        self.tts.check_adapter(name)

    def word_timer(self, text: str, language: str = "auto") -> WordTimer:
        return self.tts.word_timer(text, language)

    def _clone_parts(self) -> list[tuple[str, object]]:
        """What making a voice from audio reads: the speech tokenizer, and the speaker encoder unless the flow was
        trained without speaker embeddings (the built-in model's: its voices need no encoder, as in `Frontend`)."""
        model = self.tts.model
        parts: list[tuple[str, object]] = [("speech tokenizer", model.speech_tokenizer)]
        if model.config.speaker_embedding != "zeros":
            parts.append(("speaker encoder", model.speaker_encoder))
        return parts

    @property
    def can_clone(self) -> bool:
        return all(part is not None for _, part in self._clone_parts())

    @property
    def clone_blocker(self) -> str:
        """Why voices cannot be made from audio (when `can_clone` is false), for the 400 answer."""
        missing = [what for what, part in self._clone_parts() if part is None]
        return f"no {' or '.join(missing)} in the model directory ({self.tts.frontend.speech_tokenizer_file}, " \
               f"{CAMPPLUS_ONNX})"

    @property
    def describe(self) -> str:
        return self.tts.model.describe()
