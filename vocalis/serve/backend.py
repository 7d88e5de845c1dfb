"""The seam between the HTTP layer and synthesis: what a job is (`SpeechJob`, `TextFeed`) and how it can fail.

A backend takes `submit(SpeechJob) -> handle` (async iteration of `AudioChunk`s, `abort()`), `make_voice`,
`queue_depth`, `active`. The server runs `engine_backend.EngineBackend` (the batching engine); the reference
path's one-job-at-a-time `ThreadedBackend` (`vocalis.reference.threaded_backend`) is the baseline it is measured
against.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vocalis.config import CAMPPLUS_ONNX
from vocalis.errors import InputError
from vocalis.frontend.voice import Voice
from vocalis.serve.errors import Aborted, JobTimeout

if TYPE_CHECKING:
    from vocalis.frontend.request import SynthesisRequest
    from vocalis.tts import TTS


_END = object()  # marks the end of a job's output


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
        self._q.put_nowait(_END)

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
        while (item := await self._next()) is not _END:
            assert isinstance(item, str)
            yield item

    def __iter__(self) -> Iterator[str]:  # a worker thread, never the loop's
        while (item := asyncio.run_coroutine_threadsafe(self._next(), self._loop).result()) is not _END:
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

    @property
    def text_chars(self) -> int:
        return self.text.chars if isinstance(self.text, TextFeed) else len(self.text)


def job_request(tts: TTS, job: SpeechJob, async_text: bool = True) -> SynthesisRequest:
    """The typed request a job asks for (uploaded clips decoded, the voice made): CPU work, not for the event loop.
    A text feed is read asynchronously (`TextFeed.pieces`), or with async_text=False by blocking iteration."""
    prompt = io.BytesIO(job.prompt_wav) if job.prompt_wav is not None else None
    if job.source_wav is not None:
        return tts.vc_request(io.BytesIO(job.source_wav), voice=job.voice, prompt_wav=prompt, speed=job.speed,
                              seed=job.seed)
    if isinstance(job.text, str) and not job.text.strip():
        raise InputError("input text is empty")
    text: Any = job.text.pieces() if async_text and isinstance(job.text, TextFeed) else job.text
    return tts.request(text, voice=job.voice, prompt_wav=prompt, prompt_text=job.prompt_text or None,
                       instruct=job.instruct or None, speed=job.speed, seed=job.seed, language=job.language)


class ModelFacts:
    """What the app reads of a backend's model (for backends holding a `tts`)."""

    tts: TTS

    @property
    def builtin_voices(self) -> dict[str, Voice]:
        return dict(self.tts.model.voices)

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
