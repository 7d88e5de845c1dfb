"""One synthesis job as an HTTP response.

The response starts only once the first audio chunk exists: errors found before any audio (bad prompt audio,
unknown mode, queue timeout) still become a 4xx/5xx JSON answer, not a 200 with an empty body. While waiting,
the client's connection is watched, and a client that leaves aborts the job. After the first byte, a failure
ends the body abruptly (raw audio) or with an `error` event (SSE), so a client never mistakes a cut-off stream
for a complete one; a disconnect cancels the body generator, whose `finally` aborts the job.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Send

from vocalis.audio_trim import TailTrimmer, TrimConfig
from vocalis.errors import VocalisError
from vocalis.frontend.request import AudioChunk
from vocalis.frontend.word_times import WordTime, WordTimer
from vocalis.serve.audio_encoding import MEDIA_TYPES, AudioEncoder, encode_whole
from vocalis.serve.backend import SpeechJob
from vocalis.serve.deadlines import JobWatch, retrieve
from vocalis.serve.errors import Aborted
from vocalis.serve.ssml_job import SsmlHandle

if TYPE_CHECKING:
    from vocalis.frontend.ssml import SsmlPart
    from vocalis.serve.context import ServerContext

log = logging.getLogger(__name__)


class ClientGone(Aborted):
    """The client disconnected before the first chunk."""


async def first_item(watch: JobWatch, request: Request | None, poll_s: float = 0.2) -> AudioChunk:
    """The job's first chunk; aborts the job and raises `ClientGone` if the client leaves meanwhile, or the
    deadline's error (503 queue timeout, 504 run timeout) as soon as one fires."""
    task = asyncio.ensure_future(watch.next())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                try:
                    return task.result()
                except StopAsyncIteration:
                    raise VocalisError("the synthesis produced no audio") from None
            if request is not None and await request.is_disconnected():
                raise ClientGone("the client disconnected before the first chunk")
    except BaseException:
        task.cancel()
        task.add_done_callback(retrieve)
        watch.close()
        raise


@dataclass(frozen=True)
class StartedJob:
    """A job whose first chunk exists: what a response sends."""

    watch: JobWatch
    first: AudioChunk
    trim: TrimConfig | None = None  # trailing silence trimmed with these settings (None: kept)
    timer: WordTimer | None = None  # word timestamps asked for: their timer

    @property
    def sample_rate(self) -> int:
        return self.first.sample_rate

    async def chunks(self) -> AsyncIterator[AudioChunk]:
        """Every chunk, first included, trimmed (and timed) as set. A failure after the first byte is counted here
        (the client only sees a cut body); the job is aborted unless it ran to its end."""
        watch = self.watch
        trimmer = TailTrimmer(self.sample_rate, self.trim) if self.trim is not None else None
        try:
            async for chunk in self._raw():
                if self.timer is not None:
                    if chunk.speech_ids or chunk.final:  # a sentence's end: align it off the loop
                        await asyncio.get_running_loop().run_in_executor(None, self.timer.push, chunk)
                    else:
                        self.timer.push(chunk)
                if trimmer is not None:
                    samples = trimmer.push(chunk.samples)
                    if chunk.final:
                        samples = np.concatenate([samples, trimmer.finish()])
                    chunk = replace(chunk, samples=samples)
                yield chunk
        except VocalisError as exc:
            if not isinstance(exc, Aborted) and watch.metrics is not None:
                watch.metrics.errors.labels(watch.route, type(exc).__name__).inc()
            raise
        finally:
            watch.close()

    async def _raw(self) -> AsyncIterator[AudioChunk]:
        yield self.first
        async for chunk in self.watch:
            yield chunk


def _clipped(words: list[WordTime], seconds: float) -> list[dict[str, object]]:
    """Words as JSON, their ends within the audio sent (its trimmed length)."""
    return [replace(w, end=min(w.end, seconds)).as_dict() for w in words if w.start < seconds]


async def start_job(ctx: ServerContext, job: SpeechJob, request: Request | None, route: str,
                    t0: float, ssml: tuple[SsmlPart, ...] | None = None, timer: WordTimer | None = None
                    ) -> StartedJob:
    """Submit `job` under the server's deadlines and wait for its first chunk; with `ssml`, the job's settings
    say those parts in turn (`ssml_job`), their pauses kept whole; `timer`: time its words."""
    ctx.shutdown.check_open()
    handle = ctx.backend.submit(job) if ssml is None else SsmlHandle(ctx.backend, job, ssml)
    watch = JobWatch(handle, queue_timeout_s=ctx.config.queue_timeout_s,
                     run_timeout_s=ctx.config.request_timeout_s, shutdown=ctx.shutdown, metrics=ctx.metrics,
                     route=route, t0=t0)
    trim = TrimConfig() if ctx.config.trim_silence and ssml is None else None  # an SSML <break> at the end stays
    return StartedJob(watch, await first_item(watch, request), trim, timer)


def warnings_header(warnings: list[str]) -> dict[str, str]:
    """`X-Vocalis-Warnings`: a JSON list of what reading the text noted (ASCII, as a header must be)."""
    return {"X-Vocalis-Warnings": json.dumps(warnings)} if warnings else {}


def _timing_headers(job: StartedJob, fmt: str) -> dict[str, str]:
    return {
        "X-Sample-Rate": str(job.sample_rate),
        "X-First-Chunk-Latency": f"{time.perf_counter() - (job.watch.t0 or time.perf_counter()):.4f}",
        "X-Audio-Format": fmt,
        "Cache-Control": "no-store",
        **warnings_header(job.watch.handle.warnings),
    }


class CutOnErrorResponse(StreamingResponse):
    """A streaming response that a failure after the first byte cuts: no end-of-body marker is sent and the
    connection closes, so the client sees an incomplete body, and the server logs one line, not a traceback
    (`StartedJob.chunks` already counted the failure)."""

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except VocalisError:
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def audio_response(job: StartedJob, fmt: str) -> StreamingResponse:
    """Raw audio bytes in `fmt`, sent as chunks are made."""
    encoder = AudioEncoder(fmt, job.sample_rate)

    async def body() -> AsyncIterator[bytes]:
        try:
            async with aclosing(job.chunks()) as chunks:
                async for chunk in chunks:
                    data = encoder.push(chunk.samples)
                    if data:
                        yield data
            tail = encoder.finish()
            if tail:
                yield tail
        finally:  # a client that left (the generator is closed) or a failure: the encoder's memory goes now
            encoder.close()

    return CutOnErrorResponse(body(), media_type=encoder.media_type, headers=_timing_headers(job, fmt))


def sse_response(job: StartedJob, fmt: str, input_chars: int) -> StreamingResponse:
    """OpenAI's `stream_format=sse`: `speech.audio.delta` events with base64 audio, then `speech.audio.done`;
    first a `speech.warning` event for each thing reading the text noted, and with timestamps a `speech.word`
    event ({word, start, end} in seconds) for each word once its sentence's audio is sent (Vocalis extensions)."""
    encoder = AudioEncoder(fmt, job.sample_rate)

    def event(payload: dict[str, object]) -> bytes:
        return f"data: {json.dumps(payload)}\n\n".encode()

    async def body() -> AsyncIterator[bytes]:
        try:
            async with aclosing(events()) as stream:
                async for event_bytes in stream:
                    yield event_bytes
        finally:  # a client that left (the generator is closed) or a failure: the encoder's memory goes now
            encoder.close()

    async def events() -> AsyncIterator[bytes]:
        for warning in job.watch.handle.warnings:
            yield event({"type": "speech.warning", "message": warning})
        try:
            sent_words = samples = 0
            async with aclosing(job.chunks()) as chunks:
                async for chunk in chunks:
                    samples += len(chunk.samples)
                    data = encoder.push(chunk.samples)
                    if data:
                        yield event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
                    if job.timer is not None:  # the words begun in the audio sent (the trimmer may hold some)
                        sent_s = samples / job.sample_rate
                        for word in job.timer.words[sent_words:]:
                            if word.start >= sent_s:
                                break
                            yield event({"type": "speech.word", **word.as_dict()})
                            sent_words += 1
            if job.timer is not None:  # the rest, their ends within the (trimmed) audio
                for word in _clipped(job.timer.words[sent_words:], samples / job.sample_rate):
                    yield event({"type": "speech.word", **word})
        except VocalisError as exc:
            if not isinstance(exc, Aborted):
                yield event({"type": "error", "error": {"message": str(exc), "type": type(exc).__name__}})
            return
        tail = encoder.finish()
        if tail:
            yield event({"type": "speech.audio.delta", "audio": base64.b64encode(tail).decode()})
        usage = {"input_tokens": input_chars, "output_tokens": job.watch.audio_samples, "total_tokens": 0}
        usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
        yield event({"type": "speech.audio.done", "usage": usage, **job.watch.stats})

    headers = _timing_headers(job, fmt)
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)


async def whole_response(job: StartedJob, fmt: str) -> Response:
    """Everything first, then one file with exact headers (for `stream: false`); with timestamps one JSON body:
    {audio (base64 of the file), response_format, sample_rate, words: [{word, start, end}]}."""
    async with aclosing(job.chunks()) as chunks:
        parts = [chunk.samples async for chunk in chunks]
    wav = np.concatenate(parts)
    data = encode_whole(fmt, wav, job.sample_rate)
    headers = {**_timing_headers(job, fmt), "X-RTF": str(job.watch.stats["rtf"])}
    if job.timer is not None:
        body = {"audio": base64.b64encode(data).decode(), "response_format": fmt, "sample_rate": job.sample_rate,
                "words": _clipped(job.timer.words, len(wav) / job.sample_rate)}
        return Response(json.dumps(body), media_type="application/json", headers=headers)
    return Response(data, media_type=MEDIA_TYPES[fmt], headers=headers)
