"""The reference server backend: ONE worker thread runs one job at a time on the reference path, fed by a
bounded queue. The baseline the engine backend is measured against (`benchmarks/serve_bench.py`) and an oracle in
tests; the server itself runs `vocalis.serve.engine_backend.EngineBackend`.

Threads: handles are created and consumed on the event loop; the worker only calls `JobHandle._put`, which
hops back onto the loop with `call_soon_threadsafe`. Cancellation is a `threading.Event` the worker checks
between chunks (and the text feed checks while waiting), so an abort frees the worker at the next chunk.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vocalis.errors import VocalisError
from vocalis.frontend.request import AudioChunk, SynthesisRequest
from vocalis.frontend.voice import Voice
from vocalis.model_dir import LoadedModel
from vocalis.reference.synthesizer import Synthesizer
from vocalis.serve.backend import END, ModelFacts, SpeechJob, TextFeed
from vocalis.serve.errors import Aborted, JobTimeout, Overloaded
from vocalis.tts import TTS

if TYPE_CHECKING:
    from vocalis.backends.choice import Runtime

log = logging.getLogger(__name__)


class ReferenceTTS(TTS):
    """`TTS` whose requests run on the reference `Synthesizer`, one at a time in the caller's thread."""

    def __init__(self, model: LoadedModel, runtime: Runtime | None = None) -> None:
        super().__init__(model, runtime=runtime)
        self.synth = Synthesizer(model, runtime=runtime)

    def run(self, request: SynthesisRequest, *, stream: bool = True) -> Iterator[AudioChunk]:
        return self.synth.run(request, stream=stream)


class JobHandle:
    """The caller's side of one submitted job (a `serve.backend.JobHandle`): `async for item in handle`, `abort()`.

    Timing (monotonic seconds): `submitted`, `started` (worker picked it up), `finished`.
    """

    def __init__(self, job_id: str, loop: asyncio.AbstractEventLoop, feed: TextFeed | None = None) -> None:
        self.id = job_id
        self.warnings: list[str] = []  # the reference path notes nothing for the client
        self._loop = loop
        self._out: asyncio.Queue[object] = asyncio.Queue()
        self._cancel = threading.Event()
        self._feed = feed
        self.submitted = time.monotonic()
        self.started: float | None = None
        self.finished: float | None = None
        self.done = False

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def abort(self) -> None:
        """Stop the job at its next chunk (or before it starts). Idempotent; a finished job is left alone."""
        if self.done or self._cancel.is_set():
            return
        self._cancel.set()
        if self._feed is not None:
            self._feed.cancel()

    def _put(self, item: object) -> None:  # worker thread
        try:
            self._loop.call_soon_threadsafe(self._out.put_nowait, item)
        except RuntimeError:  # the loop is gone (server shutting down): nobody is listening any more
            pass

    def __aiter__(self) -> JobHandle:
        return self

    async def __anext__(self) -> Any:
        if self.done:
            raise StopAsyncIteration
        item = await self._out.get()
        if item is END:
            self.done = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.done = True
            raise item
        return item


@dataclass
class _Work:
    handle: JobHandle
    run: Callable[[], Iterable[object]]
    timeout_s: float


class ThreadedBackend(ModelFacts):
    """Runs `TTS` jobs one at a time in a worker thread (the reference path); a `serve.backend.Backend`."""

    def __init__(self, tts: TTS, *, max_queue: int = 64, queue_timeout_s: float = 120.0,
                 job_timeout_s: float = 300.0) -> None:
        self.tts = tts
        self.sample_rate: int = tts.sample_rate
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.job_timeout_s = job_timeout_s
        self._queue: queue.Queue[_Work | None] = queue.Queue(maxsize=max_queue)
        self._ids = itertools.count(1)
        self._running: JobHandle | None = None
        self._thread: threading.Thread | None = None
        self.completed = 0
        self.aborted = 0
        self.failed = 0

    # ---- what the app reads ----------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        """Jobs waiting to start."""
        return self._queue.qsize()

    @property
    def active(self) -> int:
        """Jobs running now (0 or 1 here)."""
        return 0 if self._running is None else 1

    def kv_usage(self) -> float:
        return 0.0  # the reference path has no KV-cache pool

    def stats(self) -> dict[str, float]:
        return {"completed": self.completed, "aborted": self.aborted, "failed": self.failed}

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._worker, name="vocalis-tts-worker", daemon=True)
            self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Abort queued and running jobs and stop the worker."""
        while True:
            try:
                work = self._queue.get_nowait()
            except queue.Empty:
                break
            if work is not None:
                work.handle.abort()
                work.handle._put(Overloaded("the server is shutting down"))
        if self._running is not None:
            self._running.abort()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)
            self._thread = None

    # ---- submitting ------------------------------------------------------------------------------
    def submit(self, job: SpeechJob) -> JobHandle:
        """Queue a synthesis; raises `Overloaded` at once when the queue is full."""
        feed = job.text if isinstance(job.text, TextFeed) else None
        return self._enqueue(lambda: self._synthesize(job), feed)

    async def make_voice(self, name: str, wav: bytes, text: str, language: str = "auto") -> Voice:
        """Reference clip (+ transcript) -> `Voice`, computed in the worker like any job."""
        handle = self._enqueue(lambda: [self.tts.frontend.make_voice(io.BytesIO(wav), text, name, language)], None)
        try:
            async for voice in handle:
                return voice
        finally:
            handle.abort()
        raise VocalisError("voice creation produced nothing")

    def _enqueue(self, run: Callable[[], Iterable[object]], feed: TextFeed | None) -> JobHandle:
        if self._thread is None:
            raise Overloaded("the synthesis worker is not running")
        handle = JobHandle(f"job-{next(self._ids)}", asyncio.get_running_loop(), feed)
        try:
            self._queue.put_nowait(_Work(handle, run, self.job_timeout_s))
        except queue.Full:
            raise Overloaded(f"the server is busy ({self.max_queue} requests queued); retry shortly") from None
        return handle

    def _synthesize(self, job: SpeechJob) -> Iterator[AudioChunk]:
        # the worker thread reads a text feed by blocking iteration
        return self.tts.run(job.request(self.tts, async_text=False),
                            stream=job.stream or isinstance(job.text, TextFeed))

    # ---- the worker ------------------------------------------------------------------------------
    def _worker(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            handle = work.handle
            if handle.cancelled:
                self.aborted += 1  # counters first: the caller may look as soon as it hears back
                handle._put(Aborted("aborted before it started"))
                continue
            waited = time.monotonic() - handle.submitted
            if waited > self.queue_timeout_s:
                self.failed += 1
                handle._put(Overloaded(f"the request waited {waited:.0f} s in the queue; retry shortly"))
                continue
            self._running = handle
            try:
                self._run(work)
            finally:
                self._running = None

    def _run(self, work: _Work) -> None:
        handle = work.handle
        handle.started = time.monotonic()
        deadline = handle.started + work.timeout_s
        items: Iterator[object] | None = None
        try:
            items = iter(work.run())
            for item in items:
                if handle.cancelled:
                    raise Aborted("aborted")
                if time.monotonic() > deadline:
                    raise JobTimeout(f"synthesis took longer than {work.timeout_s:g} s")
                handle._put(item)
            handle.finished = time.monotonic()
            self.completed += 1
            handle._put(END)
        except Aborted as exc:
            self.aborted += 1
            log.info("job %s aborted after %.2f s", handle.id, time.monotonic() - handle.started)
            handle._put(exc)
        except VocalisError as exc:
            self.failed += 1
            handle._put(exc)
        except Exception as exc:  # a bug, not bad input: log it with its traceback, answer 500
            self.failed += 1
            log.exception("job %s failed", handle.id)
            handle._put(exc)
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()
