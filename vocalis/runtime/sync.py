"""The blocking face of the async engine, for callers without an event loop (`TTS.stream`, the CLI, batch jobs).

A small event loop runs in a daemon thread; each blocking call submits there and waits for the next chunk. The
engine's own loop thread does the work, so several blocking callers (threads) batch together exactly as async
ones do. A consumer that stops iterating (break, exception, garbage collection) aborts its request, which frees
its KV blocks and stream state at once.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

from vocalis.frontend.request import AudioChunk, SynthesisRequest
from vocalis.runtime.async_engine import AsyncEngine
from vocalis.runtime.handle import StreamHandle

_END = object()


class BlockingEngine:
    """Runs an `AsyncEngine` (started here) behind blocking iterators."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine.start()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vocalis-sync", daemon=True)
        self._thread.start()

    def stream(self, request: SynthesisRequest, *, stream: bool = True) -> Iterator[AudioChunk]:
        """The request's chunks as they are made (the last has final=True); input errors raise from here."""

        async def submit() -> StreamHandle:
            return self.engine.submit(request, stream=stream)

        handle = asyncio.run_coroutine_threadsafe(submit(), self._loop).result()
        return self._chunks(handle)

    def _chunks(self, handle: StreamHandle) -> Iterator[AudioChunk]:
        async def next_chunk() -> object:
            try:
                return await handle.__anext__()
            except StopAsyncIteration:
                return _END

        try:
            while True:
                item = asyncio.run_coroutine_threadsafe(next_chunk(), self._loop).result()
                if item is _END:
                    return
                assert isinstance(item, AudioChunk)
                yield item
        finally:
            if not handle.done:  # the consumer stopped early: free what the request holds
                self._loop.call_soon_threadsafe(handle.abort)

    def close(self) -> None:
        """Stop the engine (unfinished requests end with `EngineClosed`) and this face's loop."""
        self.engine.close()
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
        if not self._loop.is_running():
            self._loop.close()
