"""Text given in pieces (bi-streaming): read on the caller's event loop and posted, tokenised, to the engine loop.

An async iterable is awaited on the caller's loop. A blocking iterable is waited on in a small reader pool, the one
place a thread waits per request: only a thread can wait on a blocking iterator.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vocalis.runtime.handle import END


class TextPump:
    """Posts ("text", (job_id, ids)) per piece, then ("text_end", job_id), or ("fail", (job_id, exc)) when the
    caller's text source raises."""

    def __init__(self, encode: Callable[[str], list[int]], post: Callable[[tuple[str, Any]], None],
                 max_readers: int = 64) -> None:
        self._encode = encode
        self._post = post
        self._max_readers = max_readers
        self._lock = threading.Lock()
        self._readers: ThreadPoolExecutor | None = None  # made on the first blocking iterable

    async def pump(self, job_id: str, pieces: Any, loop: asyncio.AbstractEventLoop) -> None:
        try:
            if hasattr(pieces, "__aiter__"):
                async for piece in pieces:
                    self._piece(job_id, piece)
            else:
                it = iter(pieces)
                while (piece := await loop.run_in_executor(self._pool(), next, it, END)) is not END:
                    self._piece(job_id, piece)
            self._post(("text_end", job_id))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 -- any failure of the caller's text source fails its request
            self._post(("fail", (job_id, exc)))

    def _piece(self, job_id: str, piece: str) -> None:
        if piece:
            self._post(("text", (job_id, self._encode(piece))))

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(max_workers=self._max_readers, thread_name_prefix="vocalis-text")
            return self._readers

    def close(self) -> None:
        """Stop waiting on blocking iterables (their pumps' next reads are cancelled)."""
        with self._lock:
            readers, self._readers = self._readers, None
        if readers is not None:
            readers.shutdown(wait=False, cancel_futures=True)
