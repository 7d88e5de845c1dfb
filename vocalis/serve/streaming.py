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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Send

from vocalis.errors import VocalisError
from vocalis.frontend.request import AudioChunk
from vocalis.serve.audio_encoding import MEDIA_TYPES, AudioEncoder, encode_whole
from vocalis.serve.backend import SpeechJob
from vocalis.serve.deadlines import JobWatch, retrieve
from vocalis.serve.errors import Aborted
from vocalis.serve.metrics import ServeMetrics

if TYPE_CHECKING:
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
        watch.handle.abort()
        watch.close()
        raise


@dataclass
class JobStream:
    """A started job: its first chunk, the rest to come, and the bookkeeping for metrics."""

    watch: JobWatch
    first: AudioChunk
    metrics: ServeMetrics
    route: str
    t0: float  # request arrival (perf_counter)
    audio_samples: int = 0
    sample_rate: int = field(init=False)
    handle: Any = field(init=False)

    def __post_init__(self) -> None:
        self.handle = self.watch.handle
        self.sample_rate = self.first.sample_rate
        self.metrics.first_chunk.labels(self.route).observe(time.perf_counter() - self.t0)

    async def chunks(self) -> AsyncIterator[AudioChunk]:
        """Every chunk, first included; aborts the job unless it ran to the end."""
        finished = failed = False
        self.metrics.active_streams.inc()
        try:
            self.audio_samples += len(self.first.samples)
            yield self.first
            async for chunk in self.watch:
                self.audio_samples += len(chunk.samples)
                yield chunk
            finished = True
            self._record()
        except VocalisError as exc:
            if not isinstance(exc, Aborted):
                failed = True
                self.metrics.errors.labels(self.route, type(exc).__name__).inc()
                log.warning("stream %d failed after %d samples: %s", self.handle.id, self.audio_samples, exc)
            raise
        finally:
            self.watch.close()
            self.metrics.active_streams.dec()
            if not finished:
                self.handle.abort()
                if not failed:
                    self.metrics.aborted.inc()
                    log.info("stream %d ended early (client gone); job aborted", self.handle.id)

    def _record(self) -> None:
        seconds = self.audio_samples / self.sample_rate
        self.metrics.audio_seconds.inc(seconds)
        h = self.handle
        if seconds > 0 and h.started is not None and h.finished is not None:
            self.metrics.rtf.labels(self.route).observe((h.finished - h.started) / seconds)

    @property
    def stats(self) -> dict[str, float]:
        h = self.handle
        seconds = self.audio_samples / self.sample_rate
        busy = (h.finished or time.monotonic()) - (h.started or h.submitted)
        return {"audio_seconds": round(seconds, 3), "rtf": round(busy / seconds, 4) if seconds else 0.0}


async def start_job(ctx: ServerContext, job: SpeechJob, request: Request | None, route: str,
                    t0: float) -> JobStream:
    """Submit `job` under the server's deadlines and wait for its first chunk."""
    ctx.shutdown.check_open()
    handle = ctx.backend.submit(job)
    watch = JobWatch(handle, queue_timeout_s=ctx.config.queue_timeout_s, run_timeout_s=ctx.config.request_timeout_s,
                     shutdown=ctx.shutdown)
    first = await first_item(watch, request)
    return JobStream(watch, first, ctx.metrics, route, t0)


def _timing_headers(stream: JobStream, fmt: str) -> dict[str, str]:
    return {
        "X-Sample-Rate": str(stream.sample_rate),
        "X-First-Chunk-Latency": f"{time.perf_counter() - stream.t0:.4f}",
        "X-Audio-Format": fmt,
        "Cache-Control": "no-store",
    }


class CutOnErrorResponse(StreamingResponse):
    """A streaming response that a failure after the first byte cuts: no end-of-body marker is sent and the
    connection closes, so the client sees an incomplete body, and the server logs one line, not a traceback
    (`JobStream.chunks` already logged and counted the failure)."""

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except VocalisError:
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def audio_response(stream: JobStream, fmt: str) -> StreamingResponse:
    """Raw audio bytes in `fmt`, sent as chunks are made."""
    encoder = AudioEncoder(fmt, stream.sample_rate)

    async def body() -> AsyncIterator[bytes]:
        async with aclosing(stream.chunks()) as chunks:
            async for chunk in chunks:
                data = encoder.push(chunk.samples)
                if data:
                    yield data
        tail = encoder.finish()
        if tail:
            yield tail

    return CutOnErrorResponse(body(), media_type=encoder.media_type, headers=_timing_headers(stream, fmt))


def sse_response(stream: JobStream, fmt: str, input_chars: int) -> StreamingResponse:
    """OpenAI's `stream_format=sse`: `speech.audio.delta` events with base64 audio, then `speech.audio.done`."""
    encoder = AudioEncoder(fmt, stream.sample_rate)

    def event(payload: dict[str, object]) -> bytes:
        return f"data: {json.dumps(payload)}\n\n".encode()

    async def body() -> AsyncIterator[bytes]:
        try:
            async with aclosing(stream.chunks()) as chunks:
                async for chunk in chunks:
                    data = encoder.push(chunk.samples)
                    if data:
                        yield event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
        except VocalisError as exc:
            if not isinstance(exc, Aborted):
                yield event({"type": "error", "error": {"message": str(exc), "type": type(exc).__name__}})
            return
        tail = encoder.finish()
        if tail:
            yield event({"type": "speech.audio.delta", "audio": base64.b64encode(tail).decode()})
        usage = {"input_tokens": input_chars, "output_tokens": stream.audio_samples, "total_tokens": 0}
        usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
        yield event({"type": "speech.audio.done", "usage": usage, **stream.stats})

    headers = _timing_headers(stream, fmt)
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)


async def whole_response(stream: JobStream, fmt: str) -> Response:
    """Everything first, then one file with exact headers (for `stream: false`)."""
    async with aclosing(stream.chunks()) as chunks:
        parts = [chunk.samples async for chunk in chunks]
    data = encode_whole(fmt, np.concatenate(parts), stream.sample_rate)
    headers = {**_timing_headers(stream, fmt), "X-RTF": str(stream.stats["rtf"])}
    return Response(data, media_type=MEDIA_TYPES[fmt], headers=headers)
