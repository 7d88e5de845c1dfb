"""WebSocket bi-streaming: text pieces in (as a chat LLM writes them), audio chunks out.

`/v1/audio/speech/ws` (API key: `Authorization: Bearer` header or `?api_key=`). Client messages are JSON text:

    {"type": "start", "voice": "alloy", "response_format": "pcm", "speed": 1.0, "seed": 7, "instructions": ...}
    {"type": "text", "text": "Sure, here is "}        ... any number of pieces
    {"type": "end"}                                   end of input: finish the audio, then the server closes
    {"type": "cancel"}                                stop now

Server messages: `{"type": "ready", "sample_rate": 24000, "format": "pcm"}` after start; binary frames of audio
in the chosen format as it is made; `{"type": "warning", "message": ...}` for what reading the text noted (a word
spelled out or skipped); `{"type": "done", "audio_seconds", "first_chunk_latency", "rtf", "warnings"}` and a
normal close (1000) at the end; on a problem `{"type": "error", "status": 400, "message": ...}` and close code
4000 + status (e.g. 4400, 4401, 4503). A client that disconnects aborts its synthesis.

Time limits: a session that sends no message for `ws_idle_timeout_s` (until its "end") is closed with 4408, and
one that lasts longer than `ws_max_duration_s` in all with 4504; a session not started within the queue timeout
gets 4503. A binary frame from the client is a 4400 (messages are JSON text). The text pieces together have the
server's one length cap (4413 over it), and the LLM prompt they make is bounded as for HTTP (4400).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from vocalis.errors import InputError, VocalisError
from vocalis.frontend.voice import Voice
from vocalis.serve.audio_encoding import AudioEncoder, check_format
from vocalis.serve.backend import SpeechJob, TextFeed
from vocalis.serve.context import ServerContext, ctx_of
from vocalis.serve.deadlines import JobWatch, retrieve
from vocalis.serve.errors import Aborted, close_reason, error_status
from vocalis.serve.limits import check_text_fields
from vocalis.serve.schemas import PayloadTooLarge, WsCancel, WsEnd, WsStart, WsText, validation_message

log = logging.getLogger(__name__)
ROUTE = "/v1/audio/speech/ws"
# The backend's text feed gives up on its own a little after the session's idle limit, so the session's timer
# (which tells the client why) always fires first.
FEED_SLACK_S = 10.0


class _Closed(Exception):
    """The session is over (the error, if any, was already sent)."""


class SessionIdle(VocalisError):
    """No message came for the idle limit (close 4408)."""


async def _fail(ws: WebSocket, ctx: ServerContext, status: int, message: str, kind: str) -> None:
    ctx.metrics.errors.labels(ROUTE, kind).inc()
    ctx.metrics.requests.labels(ROUTE, str(status)).inc()
    message = ctx.public(message)
    with contextlib.suppress(Exception):
        await ws.send_json({"type": "error", "status": status, "message": message})
        await ws.close(code=4000 + status, reason=close_reason(message))


async def _receive_json(ws: WebSocket, idle_s: float) -> dict[str, object]:
    try:
        message = await asyncio.wait_for(ws.receive(), idle_s)
    except TimeoutError:
        raise SessionIdle(f"no message came for {idle_s:g} s; the session is closed") from None
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    raw = message.get("text")
    if raw is None:
        raise InputError("binary frames are not accepted: messages are JSON text")
    try:
        msg = json.loads(raw)
    except RecursionError:
        raise InputError("the message is nested too deeply") from None
    except ValueError:
        raise InputError("messages must be JSON text") from None
    if not isinstance(msg, dict) or "type" not in msg:
        raise InputError('messages must be JSON objects with a "type"')
    return msg


def websocket_router() -> APIRouter:
    router = APIRouter()

    @router.websocket(ROUTE)
    async def speech_ws(ws: WebSocket) -> None:
        ctx = ctx_of(ws)
        cfg = ctx.config
        await ws.accept()
        if not ctx.api_key.websocket_ok(ws):
            await _fail(ws, ctx, 401, "missing or wrong API key (Authorization: Bearer, or ?api_key=)", "Unauthorized")
            return
        watch: JobWatch | None = None
        try:
            async with asyncio.timeout(cfg.ws_max_duration_s):
                ctx.shutdown.check_open()
                start = WsStart.model_validate(await _receive_json(ws, cfg.ws_idle_timeout_s))
                check_text_fields(cfg, instructions=start.instructions)
                fmt = check_format(start.response_format)
                voice = ctx.voices.resolve(start.voice)
                ctx.budget.check(voice=voice, instruct=start.instructions or "")
                feed = TextFeed(cfg.ws_idle_timeout_s + FEED_SLACK_S)
                job = SpeechJob(text=feed, voice=voice, instruct=start.instructions or "", speed=start.speed,
                                seed=start.seed, language=start.language,
                                adapter=ctx.adapter_for(start.adapter, voice))
                # A session's length is the client's writing time, so the session cap, not the request
                # timeout, bounds it; the queue timeout still applies.
                watch = JobWatch(ctx.backend.submit(job), queue_timeout_s=cfg.queue_timeout_s,
                                 run_timeout_s=math.inf, shutdown=ctx.shutdown, wait_for_input=True,
                                 metrics=ctx.metrics, route=ROUTE)
                await ws.send_json({"type": "ready", "sample_rate": ctx.backend.sample_rate, "format": fmt})
                await _session(ws, ctx, watch, feed, fmt, voice, start.instructions or "")
        except ValidationError as exc:
            await _fail(ws, ctx, 400, validation_message(exc), "ValidationError")
        except WebSocketDisconnect:
            if watch is not None and not watch.handle.done and watch.audio_samples == 0:
                ctx.metrics.aborted.inc()  # once audio went out, the watch counts it
            ctx.metrics.requests.labels(ROUTE, "499").inc()
        except _Closed:
            pass
        except SessionIdle as exc:
            await _fail(ws, ctx, 408, str(exc), "SessionIdle")
        except TimeoutError:  # the session cap (asyncio.timeout above)
            await _fail(ws, ctx, 504, f"the session lasted longer than its {cfg.ws_max_duration_s:g} s limit",
                        "SessionTimeout")
        except VocalisError as exc:
            status = error_status(exc)
            await _fail(ws, ctx, status, str(exc), type(exc).__name__)
        except Exception as exc:  # a bug: log it, tell the client, close
            log.exception("websocket session failed")
            await _fail(ws, ctx, 500, f"internal error ({type(exc).__name__})", type(exc).__name__)
        finally:
            if watch is not None:
                watch.close()

    return router


async def _session(ws: WebSocket, ctx: ServerContext, watch: JobWatch, feed: TextFeed, fmt: str,
                   voice: Voice | None, instruct: str) -> None:
    """Run the reader (client text -> feed) and the writer (audio -> client) until the audio is complete."""
    limit = ctx.config.max_input_chars
    handle = watch.handle
    text_tokens = 0

    async def reader() -> None:
        nonlocal text_tokens
        while True:
            msg = await _receive_json(ws, ctx.config.ws_idle_timeout_s)
            kind = msg.get("type")
            if kind == "text":
                piece = WsText.model_validate(msg).text
                if feed.chars + len(piece) > limit:
                    raise PayloadTooLarge(f"the text is longer than the {limit}-character limit")
                # The pieces are one LLM sequence (bi-streaming): their tokens add up.
                text_tokens += ctx.budget.count(piece)
                ctx.budget.check(voice=voice, instruct=instruct, extra_text_tokens=text_tokens)
                if watch.t0 is None:  # the first chunk's latency counts from the first text
                    watch.t0 = time.perf_counter()
                if piece.strip():  # blank pieces give the backend nothing to start on
                    watch.input_arrived()
                feed.put(piece)
            elif kind == "end":
                WsEnd.model_validate(msg)
                if feed.chars == 0:
                    raise InputError("no text was sent before end")
                feed.end()
                return
            elif kind == "cancel":
                WsCancel.model_validate(msg)
                handle.abort()
                raise Aborted("cancelled by the client")
            else:
                raise InputError(f"unknown message type {kind!r}; expected text, end or cancel")

    async def writer() -> None:
        encoder = AudioEncoder(fmt, ctx.backend.sample_rate)
        told = 0  # warnings sent so far (reading text pieces may add more as they come)
        try:
            async for chunk in watch:
                for warning in handle.warnings[told:]:
                    await ws.send_json({"type": "warning", "message": warning})
                told = len(handle.warnings)
                data = encoder.push(chunk.samples)
                if data:
                    await ws.send_bytes(data)
            tail = encoder.finish()
            if tail:
                await ws.send_bytes(tail)
        finally:  # the client left or the session failed: the encoder's memory goes now
            encoder.close()

    read_task = asyncio.create_task(reader())
    write_task = asyncio.create_task(writer())
    try:
        # The reader finishing first is normal (end of input); its failing is not. The writer may also finish
        # first (the model reached its length limit), and then the session is over.
        done, _ = await asyncio.wait({read_task, write_task}, return_when=asyncio.FIRST_COMPLETED)
        if read_task in done and read_task.exception() is not None:
            raise read_task.exception()  # type: ignore[misc]
        await write_task
    finally:
        for task in (read_task, write_task):
            task.cancel()
            task.add_done_callback(retrieve)  # the loser's error (e.g. the client left) is no one's to log
        watch.close()
    ctx.metrics.requests.labels(ROUTE, "200").inc()
    stats = {**watch.stats, "first_chunk_latency": round(watch.first_chunk_latency, 4)}
    await ws.send_json({"type": "done", **stats, "warnings": handle.warnings})
    await ws.close(code=1000)
