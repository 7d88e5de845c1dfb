"""The server's backend on the batching engine: every HTTP / WebSocket job is one request of one `AsyncEngine`.

Concurrent jobs batch together: the engine interleaves LLM steps and token2wav steps across all of them. A job's
handle is the engine's own `StreamHandle`; the job becomes the engine's request in the engine's one preparation
hop (`SpeechJob.request`, then text and prompts, in a worker thread). Admission is bounded by `max_jobs` jobs in
flight (then `Overloaded`, 503 + Retry-After). An abort (client gone, deadline) frees the job's place at once,
and its KV blocks and token2wav state at the engine loop's next iteration. A WebSocket job waiting for text holds
no compute: its text arrives through an async feed, and the engine loop sleeps while nothing is ready.
"""

from __future__ import annotations

import asyncio
import io
import logging
from functools import partial
from typing import TYPE_CHECKING

from vocalis.frontend.voice import Voice
from vocalis.runtime.handle import StreamHandle
from vocalis.serve.backend import ModelFacts, SpeechJob, TextFeed
from vocalis.serve.errors import Aborted, Overloaded

if TYPE_CHECKING:
    from vocalis.tts import TTS

log = logging.getLogger(__name__)


class EngineBackend(ModelFacts):
    """Serves `TTS`'s engine to the HTTP layer (a `serve.backend.Backend`). `max_queue` bounds the jobs in flight
    (waiting or running); the app's deadlines (`serve.deadlines`) time them out through `abort()`. A server holds
    its KV budget from the start (`TTS.hold_kv_budget`), so that its RSS stays flat from the first requests on."""

    def __init__(self, tts: TTS, *, max_queue: int = 64) -> None:
        tts.hold_kv_budget()
        self.tts = tts
        self.sample_rate: int = tts.sample_rate
        self.max_jobs = max_queue
        self._live: dict[str, StreamHandle] = {}  # submitted, not ended (an aborted one until the engine freed it)
        self._started = False
        self.completed = 0
        self.failed = 0
        self._aborted_ended = 0

    # ---- what the app reads ----------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        """Jobs admitted that have not started (no LLM step yet); an aborted job is over at once."""
        return sum(1 for h in self._live.values() if h.started is None and not h.aborted)

    @property
    def active(self) -> int:
        """Jobs running now (started, not finished, not aborted)."""
        return sum(1 for h in self._live.values() if h.started is not None and not h.aborted)

    @property
    def aborted(self) -> int:
        """Jobs aborted (counted from the abort, not from when the engine has freed them)."""
        return self._aborted_ended + sum(1 for h in self._live.values() if h.aborted)

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

    def close(self) -> None:
        """Stop the engine: unfinished jobs end with `EngineClosed` (the server's 503, shutting down)."""
        self.tts.close()
        self._started = False

    # ---- submitting ------------------------------------------------------------------------------
    def submit(self, job: SpeechJob) -> StreamHandle:
        """Admit a synthesis; raises `Overloaded` at once when `max_jobs` are in flight."""
        if not self._started:
            raise Overloaded("the synthesis engine is not running")
        if self.queue_depth + self.active >= self.max_jobs:  # an aborted job's place is free at once
            raise Overloaded(f"the server is busy ({self.max_jobs} requests in flight); retry shortly")
        stream = job.stream or isinstance(job.text, TextFeed)
        handle = self.tts.engine.submit(partial(job.request, self.tts), stream=stream)
        handle.abort_error = Aborted("aborted")
        self._live[handle.id] = handle
        handle.on_end(self._ended)
        return handle

    def _ended(self, handle: StreamHandle) -> None:
        if self._live.pop(handle.id, None) is None:
            return
        if handle.aborted:
            self._aborted_ended += 1
        elif handle.error is None:
            self.completed += 1
        else:
            self.failed += 1

    async def make_voice(self, name: str, wav: bytes, text: str, language: str = "auto") -> Voice:
        """Reference clip (+ transcript) -> `Voice` (speech tokens and speaker embedding off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(None, self.tts.frontend.make_voice, io.BytesIO(wav),
                                                                text, name, language)
