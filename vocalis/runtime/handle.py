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
    from vocalis.runtime.async_engine import AsyncEngine
    from vocalis.token2wav.protocol import Token2WavStream

END = object()  # the end of a request's output
_job_ids = itertools.count(1)


def new_job_id() -> str:
    return f"job-{next(_job_ids)}"


class EngineClosed(VocalisError):
    """The engine stopped before the request finished."""


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
    llm_request: Request | None = None
    next_segment: int = 0  # next sentence whose LLM request has not started
    emitting: int = 0  # sentence whose audio is being emitted
    submitted: float = field(default_factory=time.monotonic)
    first_chunk_at: float | None = None
    ready_since: tuple[int, float] | None = None  # (LLM step count, monotonic time) its chunk became ready
    early_text: list[str | None] = field(default_factory=list)  # a queued bi-stream's pieces (None: the end)

    @property
    def seq(self) -> int:
        """Its submission number: the admission queue's order."""
        return self.handle.seq

    def token_sink(self, state: Token2WavStream) -> Callable[[Request, int | None, bool], None]:
        """Where the LLM engine puts one sentence's speech ids: its token2wav stream (and the job's start time)."""

        def sink(req: Request, token: int | None, finished: bool) -> None:
            if self.handle.started is None:
                self.handle.started = time.monotonic()
            if token is not None:
                state.add_tokens((token,))
            if finished:
                state.end_input()

        return sink


class StreamHandle:
    """The caller's side of one request: `async for chunk in handle`; `abort()`; `await handle.aclose()`.

    A handle aborted by its owner simply ends; an engine error or shutdown is raised from the iteration.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, loop: asyncio.AbstractEventLoop, seq: int = 0) -> None:
        self.engine = engine
        self.request_id = request_id
        self.seq = seq  # submission number (AsyncEngine.submit)
        self._loop = loop
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._aborted = False
        self._done = False
        self.submitted = time.monotonic()
        self.started: float | None = None  # when its first LLM step ran (voice conversion: when it was added)
        self.first_chunk_latency: float | None = None
        self._pump: asyncio.Task[None] | None = None  # reads a bi-stream's text pieces

    def _put(self, item: object) -> None:  # any thread
        if item is END or isinstance(item, BaseException):
            self.engine._forget(self.request_id)
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody listens any more
            pass

    def abort(self) -> None:
        """Stop the request; its KV blocks and stream state are freed by the engine loop."""
        if not self._done and not self._aborted:
            self._aborted = True
            self.engine._post(("abort", self.request_id))
            if self._pump is not None:
                self._loop.call_soon_threadsafe(self._pump.cancel)

    async def aclose(self) -> None:
        """Abort (if still running) and wait until the engine has released everything the request held."""
        self.abort()
        while not self._done:
            await self._next_item()

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self

    async def __anext__(self) -> AudioChunk:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._next_item()
        except asyncio.CancelledError:
            self.abort()  # [cancel] a consumer that went away must not keep its KV blocks
            raise
        if item is END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        assert isinstance(item, AudioChunk)
        if self.first_chunk_latency is None:
            self.first_chunk_latency = time.monotonic() - self.submitted
        return item

    @property
    def done(self) -> bool:
        """Whether the request has ended (its last chunk, an error, or its abort was delivered)."""
        return self._done

    async def _next_item(self) -> object:
        item = await self._queue.get()
        if item is END or isinstance(item, BaseException):
            self._done = True
        return item
