"""Text given in pieces (bi-streaming): read on the caller's event loop and posted, tokenised, to the engine loop.

The pieces are read a sentence at a time, normalised as a whole text is (`frontend.pieces.PieceReader`, in the
default executor: normalisation is CPU work, not for the caller's loop).

An async iterable is awaited on the caller's loop. A blocking iterable is waited on in a small reader pool, the one
place a thread waits per request: only a thread can wait on a blocking iterator.

A bi-stream's LLM request waits for a full block of text ids before it says the last words it has, so a complete
sentence followed by a pause of the text's writer (an LLM thinking) would stay unsaid until more text came. When
the text so far ends a sentence (or a long clause) and no piece follows within `cut_after_s`, the pump posts a cut:
the engine ends that LLM request there (its speech completes now) and the text after the cut starts the job's next
one, as a whole text is spoken sentence by sentence. Pieces that keep coming are never cut, so text written
without pauses is one bi-stream, as the official schedule lays it out.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from vocalis.errors import InputError
from vocalis.frontend.text import ends_sentence
from vocalis.runtime.handle import END

if TYPE_CHECKING:
    from vocalis.frontend.pieces import PieceReader
    from vocalis.runtime.async_engine import AsyncEngine
    from vocalis.runtime.handle import Job

CUT_AFTER_S = 0.2  # a pause after a sentence's end that long ends the sentence's LLM request
CUT = "cut"  # in a job's `early_text`: the text before it is a complete sentence


class TextPump:
    """Posts ("text", (job_id, ids)) per piece, ("text_cut", job_id) where a sentence ends before a pause, then
    ("text_end", job_id), or ("fail", (job_id, exc)) when the caller's text source raises."""

    def __init__(self, post: Callable[[tuple[str, Any]], None], max_readers: int = 64,
                 cut_after_s: float = CUT_AFTER_S) -> None:
        self._post = post
        self._max_readers = max_readers
        self.cut_after_s = cut_after_s
        self._lock = threading.Lock()
        self._readers: ThreadPoolExecutor | None = None  # made on the first blocking iterable

    async def pump(self, job_id: str, pieces: Any, loop: asyncio.AbstractEventLoop, reader: PieceReader) -> None:
        """Read `pieces` into the job `job_id`: `reader` makes token ids of them a sentence at a time."""
        if hasattr(pieces, "__aiter__"):
            source = pieces.__aiter__()

            def next_piece() -> asyncio.Future[Any]:
                return asyncio.ensure_future(anext(source, END))
        else:
            it = iter(pieces)

            def next_piece() -> asyncio.Future[Any]:
                return loop.run_in_executor(self._pool(), next, it, END)
        waiting: asyncio.Future[Any] | None = None
        try:
            since_cut = ""  # the text after the last cut
            while True:
                waiting = next_piece()
                if since_cut and ends_sentence(since_cut):
                    done, _ = await asyncio.wait({waiting}, timeout=self.cut_after_s)
                    if not done:  # [latency] the writer paused after a sentence: say it now
                        self._send(job_id, await _off_loop(loop, reader.flush))
                        self._post(("text_cut", job_id))
                        since_cut = ""
                piece = await waiting
                waiting = None
                if piece is END:
                    break
                if piece:
                    self._send(job_id, await _off_loop(loop, reader.feed, piece))
                    since_cut += piece
            self._send(job_id, await _off_loop(loop, reader.flush))
            self._post(("text_end", job_id))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 -- any failure of the caller's text source fails its request
            self._post(("fail", (job_id, exc)))
        finally:
            if waiting is not None:
                waiting.cancel()

    def _send(self, job_id: str, ids: list[int]) -> None:
        if ids:
            self._post(("text", (job_id, ids)))

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


def _off_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., list[int]], *args: str) -> asyncio.Future[list[int]]:
    """`fn(*args)` in the default executor, in this task's context (its notices reach the request's caller)."""
    return loop.run_in_executor(None, contextvars.copy_context().run, fn, *args)


# ---- the engine loop's side (loop thread) -------------------------------------------------------------------
def route_text(engine: AsyncEngine, kind: str, payload: Any) -> None:
    """A bi-stream's "text" / "text_cut" / "text_end" message: to its running LLM request, or kept for the next
    one (a job still queued, or text after a cut); dropped if the job is gone."""
    job_id = payload[0] if kind == "text" else payload
    item = payload[1] if kind == "text" else (CUT if kind == "text_cut" else None)
    queued = engine.queued_job(job_id)
    if queued is not None:  # replayed when it starts
        queued.early_text.append(item)
        return
    job = engine.running_job(job_id)
    if job is None:
        return
    if job.cut:  # after a cut: the next sentence's request takes it
        if item is CUT and not job.early_text:
            return  # nothing since the last cut
        if item is None and not job.early_text:
            job.text_closed = True  # the last request was the last sentence
            if job.emitting >= len(job.states):
                finish(engine, job)
            return
        job.early_text.append(item)
        if job.llm_request is None:  # the cut sentence is said: start the next one now
            start_segment(engine, job)
        return
    if job.llm_request is None:
        return  # it ended on its own (its length bound): nothing more is said
    rid = job.llm_request.request_id
    if item is None:
        engine.llm.end_text(rid)
        job.text_closed = True
    elif item is CUT:
        engine.llm.end_text(rid)
        job.cut = True
    else:
        engine.llm.add_text(rid, item)


def start_segment(engine: AsyncEngine, job: Job) -> None:
    """Start the job's next bi-stream LLM request (its first, or the one after a cut) and feed it the text kept for
    it, up to the next cut or the end."""
    while job.early_text and job.early_text[0] is CUT:
        job.early_text.pop(0)  # a cut with no text before it
    if job.next_segment and (not job.early_text or job.early_text[0] is None):  # no text after the last cut
        job.early_text = []
        job.text_closed = True
        if job.emitting >= len(job.states):
            finish(engine, job)
        return
    i = job.next_segment
    job.next_segment += 1
    if i >= len(job.states):
        assert job.new_state is not None
        job.states.append(job.new_state(i))
    sink = job.token_sink(job.states[i])
    try:  # the vllm backend's engine cannot take text in pieces: it says so here
        req = engine.llm.make_bistream_request(*job.llm_prompt, engine.llm_params([]), request_id=f"{job.job_id}/{i}",
                                               sink=sink, generator=job.llm_gen, adapter=job.adapter)
    except InputError as exc:
        engine.fail(job.job_id, exc)
        return
    job.llm_request = req
    job.cut = False
    engine.llm.add_request(req)
    pending, job.early_text = job.early_text, []
    for k, item in enumerate(pending):
        if item is None:
            engine.llm.end_text(req.request_id)
            job.text_closed = True
            break
        if item is CUT:
            engine.llm.end_text(req.request_id)
            job.cut = True
            job.early_text = pending[k + 1:]
            break
        engine.llm.add_text(req.request_id, item)


def finish(engine: AsyncEngine, job: Job) -> None:
    """End a bi-stream whose text ended after its last sentence's audio went out: a final empty chunk, then END."""
    engine.end_job(job, final_chunk=True)
