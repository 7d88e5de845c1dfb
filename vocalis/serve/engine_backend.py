"""The server's backend on the batching engine: every HTTP / WebSocket job is one request of one `AsyncEngine`.

Same surface as `ThreadedBackend` (`submit(SpeechJob) -> handle`, async iteration of `AudioChunk`s, `abort()`,
`make_voice`, `queue_depth`, `active`), but concurrent jobs batch together: the engine interleaves LLM steps
and token2wav steps across all of them. Admission is bounded by `max_jobs` jobs in flight (then `Overloaded`,
503 + Retry-After). An abort (client gone, deadline) reaches the engine loop at once and frees the job's KV
blocks and token2wav state at its next iteration. A WebSocket job waiting for text holds no compute: its text
arrives through an async feed, and the engine loop sleeps while nothing is ready.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from vocalis.frontend.request import AudioChunk
from vocalis.frontend.voice import Voice
from vocalis.runtime.handle import EngineClosed, StreamHandle
from vocalis.serve.backend import ModelFacts, SpeechJob, TextFeed, job_request
from vocalis.serve.errors import Aborted, Overloaded

if TYPE_CHECKING:
    from vocalis.tts import TTS

log = logging.getLogger(__name__)


class EngineJobHandle:
    """One submitted job on the engine: `async for chunk in handle`, `abort()`.

    Timing (monotonic seconds): `submitted`, `started` (its first LLM step ran, or its tokens were given),
    `finished`.
    """

    def __init__(self, job_id: int, backend: EngineBackend) -> None:
        self.id = job_id
        self._backend = backend
        self._stream: StreamHandle | None = None
        self._pending: asyncio.Task[StreamHandle] | None = None  # request preparation (text, voice, prompt)
        self.submitted = time.monotonic()
        self.finished: float | None = None
        self.done = False
        self._aborted = False

    @property
    def started(self) -> float | None:
        return None if self._stream is None else self._stream.started

    @property
    def cancelled(self) -> bool:
        return self._aborted

    def abort(self) -> None:
        """Stop the job now: the engine frees its KV blocks and stream state, and the backend forgets the job
        whether or not anyone reads the handle again (a later read raises `Aborted`). Idempotent."""
        if self.done or self._aborted:
            return
        self._aborted = True
        if self._stream is not None:
            self._stream.abort()
        elif self._pending is not None:
            self._pending.cancel()
        self._end()

    def _prepared(self, task: asyncio.Task[StreamHandle]) -> None:
        """The request is in the engine: keep its stream handle (and abort it if the job was aborted meanwhile)."""
        if task.cancelled() or task.exception() is not None:
            return  # the error is raised to whoever reads the handle
        self._stream = task.result()
        if self._aborted:
            self._stream.abort()

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self

    async def __anext__(self) -> AudioChunk:
        if self.done:
            if self._aborted:
                raise Aborted("aborted")
            raise StopAsyncIteration
        try:
            if self._stream is None:
                assert self._pending is not None
                self._stream = await self._pending
                if self._aborted:
                    self._stream.abort()
            chunk = await self._stream.__anext__()
        except StopAsyncIteration:
            self._end()
            if self._aborted:
                raise Aborted("aborted") from None
            raise
        except asyncio.CancelledError:
            if self._aborted:
                self._end()
                raise Aborted("aborted") from None
            raise
        except EngineClosed as exc:
            self._end()
            raise Overloaded(f"the server is shutting down ({exc}); retry shortly") from None
        except BaseException:
            self._end()
            raise
        if chunk.final:
            self._end()
        return chunk

    def _end(self) -> None:
        if not self.done:
            self.done = True
            self.finished = time.monotonic()
            self._backend._ended(self)


class EngineBackend(ModelFacts):
    """Serves `TTS`'s engine to the HTTP layer. `max_queue` bounds the jobs in flight (waiting or running); the
    app's deadlines (`serve.deadlines`) time them out through `abort()`. A server holds its KV budget from the
    start (`TTS.hold_kv_budget`), so that its RSS stays flat from the first requests on."""

    def __init__(self, tts: TTS, *, max_queue: int = 64) -> None:
        tts.hold_kv_budget()
        self.tts = tts
        self.sample_rate: int = tts.sample_rate
        self.max_jobs = max_queue
        self._ids = itertools.count(1)
        self._live: dict[int, EngineJobHandle] = {}
        self._started = False
        self.completed = 0
        self.aborted = 0
        self.failed = 0

    # ---- what the app reads ----------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        """Jobs admitted that have not started (no LLM step yet)."""
        return sum(1 for h in self._live.values() if h.started is None)

    @property
    def active(self) -> int:
        """Jobs running now (started, not finished)."""
        return sum(1 for h in self._live.values() if h.started is not None)

    def count_tokens(self, text: str) -> int:
        """Text tokens of `text` as the LLM reads them (the server bounds prompts with it)."""
        tokenizer = self.tts.model.tokenizer
        return tokenizer.count(text) if tokenizer is not None else len(text.encode())

    def kv_usage(self) -> float:
        """Fraction of the LLM's KV-cache blocks in use."""
        return float(self.tts.engine.stats()["kv_usage"]) if self._started else 0.0

    def stats(self) -> dict[str, float]:
        """The engine's live counters (jobs, LLM requests, KV usage, steps, tokens) plus this backend's."""
        stats = dict(self.tts.engine.stats()) if self._started else {}
        stats.update(live_jobs=len(self._live), completed=self.completed, aborted=self.aborted, failed=self.failed)
        return stats

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self.tts.engine  # noqa: B018 - builds and starts the engine now, not on the first request
        self._started = True

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the engine: unfinished jobs end with `Overloaded` (shutting down)."""
        for handle in list(self._live.values()):
            handle.abort()
        self.tts.close()
        self._started = False

    # ---- submitting ------------------------------------------------------------------------------
    def submit(self, job: SpeechJob) -> EngineJobHandle:
        """Admit a synthesis; raises `Overloaded` at once when `max_jobs` are in flight."""
        if not self._started:
            raise Overloaded("the synthesis engine is not running")
        if len(self._live) >= self.max_jobs:
            raise Overloaded(f"the server is busy ({self.max_jobs} requests in flight); retry shortly")
        handle = EngineJobHandle(next(self._ids), self)
        self._live[handle.id] = handle
        loop = asyncio.get_running_loop()
        handle._pending = loop.create_task(self._start(job))
        handle._pending.add_done_callback(handle._prepared)
        return handle

    async def _start(self, job: SpeechJob) -> StreamHandle:
        # voice and speech tokens from uploaded clips are CPU work: off the event loop
        request = await asyncio.get_running_loop().run_in_executor(None, job_request, self.tts, job)
        stream = job.stream or isinstance(job.text, TextFeed)
        return self.tts.engine.submit(request, stream=stream)

    def _ended(self, handle: EngineJobHandle) -> None:
        if self._live.pop(handle.id, None) is None:
            return
        if handle.cancelled:
            self.aborted += 1
        elif handle.finished is not None and handle.started is not None:
            self.completed += 1
        else:
            self.failed += 1

    async def make_voice(self, name: str, wav: bytes, text: str, language: str = "auto") -> Voice:
        """Reference clip (+ transcript) -> `Voice` (speech tokens and speaker embedding off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(None, self.tts.frontend.make_voice, io.BytesIO(wav),
                                                                text, name, language)
