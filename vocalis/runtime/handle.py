"""The caller's side of one engine request (`StreamHandle`) and the engine loop's record of it (`Job`).

A handle lives on the caller's event loop: the engine thread only puts chunks (or the end, or an error) into it
with `call_soon_threadsafe`. A job is loop-thread data: the request's sentences, LLM requests and token2wav
states, and its timing.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vocalis.errors import VocalisError
from vocalis.frontend.request import AudioChunk

if TYPE_CHECKING:
    from vocalis.engine.request import Request
    from vocalis.frontend.pieces import PieceReader
    from vocalis.runtime.async_engine import AsyncEngine
    from vocalis.token2wav.protocol import Token2WavStream

END = object()  # the end of a request's output
_job_ids = itertools.count(1)


def new_job_id() -> str:
    return f"job-{next(_job_ids)}"


def message_job_id(kind: str, payload: Any) -> str:
    """The request a loop message is about ("add": a Job; "fail" and "text": (job id, ...); else the id)."""
    if kind == "add":
        return payload.job_id
    return payload[0] if isinstance(payload, tuple) else payload


class EngineClosed(VocalisError):
    """The engine stopped before the request finished."""


class TokenGate:
    """Whether the LLM's ids go into their token2wav streams at once (open) or wait in their job (closed: a
    token2wav step owns the streams on the worker thread, `runtime.overlap`). One per engine, shared by its jobs."""

    def __init__(self) -> None:
        self.closed = False


_OPEN = TokenGate()  # a job not started by an overlapping engine: ids go straight in


@dataclass(eq=False)
class Job:
    """One submitted synthesis: its sentences, LLM requests and token2wav states (loop-thread data)."""

    job_id: str
    handle: StreamHandle
    segments: list[list[int]]  # text ids per sentence; [] for voice conversion and bi-streams
    llm_prompt: tuple[list[int], list[int]]  # (prompt text ids, prompt speech ids)
    states: list[Token2WavStream]  # one per sentence, created as its LLM request starts
    llm_gen: torch.Generator
    text: Any = None  # a bi-stream's pieces (an iterable or async iterable of str), read by `_pump`
    reader: PieceReader | None = None  # a bi-stream's: reads its pieces sentence by sentence (`frontend.pieces`)
    llm_request: Request | None = None
    next_segment: int = 0  # next sentence whose LLM request has not started
    emitting: int = 0  # sentence whose audio is being emitted
    submitted: float = field(default_factory=time.monotonic)
    first_chunk_at: float | None = None
    ready_since: tuple[int, float] | None = None  # (LLM step count, monotonic time) its chunk became ready
    # a bi-stream's text ids not yet fed (queued, or after a cut), with `text_pump.CUT` marks; None: the end
    early_text: list[Any] = field(default_factory=list)
    cut: bool = False  # a bi-stream's running LLM request had its text ended at a sentence (text_pump)
    text_closed: bool = False  # a bi-stream's text ended after a cut: the cut sentence was its last
    new_state: Callable[[int], Token2WavStream] | None = None  # a bi-stream's token2wav stream for its sentence i
    gate: TokenGate = _OPEN
    held: list[tuple[Token2WavStream, int | None, bool]] = field(default_factory=list)  # ids the gate held back
    audio_s: float = 0.0  # seconds of audio handed out (its next chunk is due when they have played)
    adapter: str | None = None  # the LoRA adapter its LLM requests run with (None: the base model)

    @property
    def seq(self) -> int:
        """Its submission number: the admission queue's order."""
        return self.handle.seq

    def token_sink(self, state: Token2WavStream) -> Callable[[Request, int | None, bool], None]:
        """Where the LLM engine puts one sentence's speech ids: its token2wav stream (and the job's start time)."""

        def sink(req: Request, token: int | None, finished: bool) -> None:
            if self.handle.started is None:
                self.handle.started = time.monotonic()
            if self.gate.closed:
                self.held.append((state, token, finished))
            else:
                _feed(state, token, finished)

        return sink

    def release_held(self) -> None:
        """Put the ids the gate held back into their streams, in order (the gate is open again)."""
        held, self.held = self.held, []
        for state, token, finished in held:
            _feed(state, token, finished)

    def due(self) -> float:
        """When its next chunk is due (monotonic): once the audio handed out has played from its first chunk;
        before that, from its submission."""
        return self.submitted if self.first_chunk_at is None else self.first_chunk_at + self.audio_s


def _feed(state: Token2WavStream, token: int | None, finished: bool) -> None:
    if token is not None:
        state.add_tokens((token,))
    if finished:
        state.end_input()


class StreamHandle:
    """The caller's side of one request: `async for chunk in handle`; `abort()`; `await handle.aclose()`.

    It exists because the engine loop runs in its own thread: that thread only `_put`s chunks, the end or an error,
    and they reach this handle on the caller's event loop. An engine error or shutdown is raised from the
    iteration. A handle aborted by its owner ends: its iteration stops, or raises `abort_error` when the owner set
    one (a server reads an aborted job as a failure, `serve.errors.Aborted`). `warnings` holds what preparing the
    request noted for the caller (e.g. a word the text frontend spelled out or skipped); it is complete before
    the first chunk arrives.

    Timing (monotonic seconds): `submitted`; `started`, its first LLM step (voice conversion: when it was added);
    `finished`, when the engine let go of it (`ended`: its end, error or abort was delivered).
    """

    def __init__(self, engine: AsyncEngine, request_id: str, loop: asyncio.AbstractEventLoop, seq: int = 0) -> None:
        self.engine = engine
        self.request_id = request_id
        self.seq = seq  # submission number (AsyncEngine.submit)
        self._loop = loop
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._aborted = False
        self._drained = False  # the consumer has read the end (or the error)
        self.submitted = time.monotonic()
        self.started: float | None = None
        self.finished: float | None = None
        self.ended = False
        self.error: BaseException | None = None  # what ended it, when not its end or an abort
        self.abort_error: BaseException | None = None
        self.warnings: list[str] = []
        self.first_chunk_latency: float | None = None
        self._pump: asyncio.Task[None] | None = None  # reads a bi-stream's text pieces
        self._on_end: list[Callable[[StreamHandle], None]] = []

    @property
    def id(self) -> str:
        return self.request_id

    @property
    def aborted(self) -> bool:
        return self._aborted

    @property
    def done(self) -> bool:
        """Whether the request has ended (its last chunk, an error, or its abort was delivered)."""
        return self.ended

    def on_end(self, callback: Callable[[StreamHandle], None]) -> None:
        """Call `callback(handle)` on the caller's loop once the engine has let go of the request."""
        if self.ended:
            callback(self)
        else:
            self._on_end.append(callback)

    def _put(self, item: object) -> None:  # any thread
        if item is END or isinstance(item, BaseException):
            self.engine._forget(self.request_id)
        try:
            self._loop.call_soon_threadsafe(self._receive, item)
        except RuntimeError:  # the caller's loop is closed: nobody listens any more
            pass

    def _receive(self, item: object) -> None:  # the caller's loop
        self._queue.put_nowait(item)
        if (item is END or isinstance(item, BaseException)) and not self.ended:
            self.ended = True
            self.finished = time.monotonic()
            self.error = item if isinstance(item, BaseException) else None
            if self._pump is not None:  # an ended request reads no more of its caller's text
                self._pump.cancel()
            for callback in self._on_end:
                callback(self)
            self._on_end.clear()

    def abort(self) -> None:
        """Stop the request; its KV blocks and stream state are freed by the engine loop."""
        if not self.ended and not self._aborted:
            self._aborted = True
            self.engine._post(("abort", self.request_id))
            if self._pump is not None:
                self._loop.call_soon_threadsafe(self._pump.cancel)

    async def aclose(self) -> None:
        """Abort (if still running) and wait until the engine has released everything the request held."""
        self.abort()
        while not self._drained:
            await self._next_item()

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self

    async def __anext__(self) -> AudioChunk:
        if not self._drained:
            try:
                item = await self._next_item()
            except asyncio.CancelledError:
                self.abort()  # [cancel] a consumer that went away must not keep its KV blocks
                raise
            if isinstance(item, BaseException):
                raise item
            if item is not END:
                assert isinstance(item, AudioChunk)
                if self.first_chunk_latency is None:
                    self.first_chunk_latency = time.monotonic() - self.submitted
                return item
        if self._aborted and self.abort_error is not None:
            raise self.abort_error
        raise StopAsyncIteration

    async def _next_item(self) -> object:
        item = await self._queue.get()
        if item is END or isinstance(item, BaseException):
            self._drained = True
        return item
