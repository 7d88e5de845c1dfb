"""Issue 25, items 2, 3 and 14 on a real loopback server: deadlines fire when they expire (queue timeout 503,
request timeout 504) instead of at the next chunk, WebSocket sessions have idle and total caps, and SIGTERM
drains within a bounded grace period, then answers 503 to what has not started."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from serve_support import (
    free_port,
    make_quick_tiny_model_dir,
    quick_tts,
    reference_backend,
    serve,
    serve_backend,
    wait_healthy,
)

websockets = pytest.importorskip("websockets", reason="websockets is part of the dev extra")
import websockets.sync.client as websockets_sync

from vocalis.frontend.request import AudioChunk
from vocalis.serve.deadlines import JobWatch
from vocalis.serve.errors import JobTimeout

LONG_TEXT = " ".join(["This is a fairly long sentence that keeps the synthesis busy for a while."] * 36)
# ~10 s of synthesis on the tiny model, its first chunk in well under a second on an idle machine
MEDIUM_TEXT = " ".join(["This is a fairly long sentence that keeps the synthesis busy for a while."] * 8)


@pytest.fixture(scope="module")
def tts(tmp_path_factory):
    return quick_tts(tmp_path_factory)


def ws_url(srv) -> str:
    return srv.url.replace("http://", "ws://") + "/v1/audio/speech/ws"


def _wait(cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _hold_worker(srv):
    """A WebSocket session waiting for more text: on the reference backend it holds the one worker."""
    ws = websockets_sync.connect(ws_url(srv))
    ws.send(json.dumps({"type": "start"}))
    assert json.loads(ws.recv(timeout=30))["type"] == "ready"
    ws.send(json.dumps({"type": "text", "text": "Waiting for the rest "}))
    _wait(lambda: srv.backend.active == 1)
    return ws


def _close_code(ws) -> int | None:
    with contextlib.suppress(websockets.exceptions.ConnectionClosed):
        while True:
            ws.recv(timeout=30)
    return ws.close_code


def test_queue_timeout_fires_when_it_expires(tts) -> None:
    # the backend's own check (at dequeue) would come only when the worker is free again
    with serve_backend(reference_backend(tts), queue_timeout_s=1.0, ws_idle_timeout_s=60) as srv:
        ws = _hold_worker(srv)
        try:
            t0 = time.monotonic()
            r = httpx.post(srv.url + "/v1/audio/speech", json={"input": "Hi."}, timeout=30)
            took = time.monotonic() - t0
        finally:
            ws.close()
        assert r.status_code == 503 and "waited 1 s in the queue" in r.json()["error"]["message"], r.text
        assert r.headers["retry-after"] == "2"
        assert 0.9 <= took < 3.0, took


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def asyncio_errors():
    """What asyncio logs at error level (e.g. a task's exception never retrieved) while the test runs."""
    handler = _Errors()
    logging.getLogger("asyncio").addHandler(handler)
    try:
        yield handler.messages
    finally:
        gc.collect()
        logging.getLogger("asyncio").removeHandler(handler)


@pytest.mark.parametrize("which", ["reference", "default"])
def test_request_timeout_fires_when_it_expires(tts, which: str, asyncio_errors: list[str]) -> None:
    limit = 4.0
    backend = reference_backend(tts) if which == "reference" else None
    server = serve_backend(backend, request_timeout_s=limit) if backend else serve(tts, request_timeout_s=limit)
    # texts that keep each backend busy well past the limit on fast CPUs too (MEDIUM_TEXT alone can stream through
    # the reference backend within it, and a one-chunk job of three times it can finish within it); the one-chunk
    # job stays under the server's 4096-character input limit
    streamed, whole = (LONG_TEXT, LONG_TEXT + " " + MEDIUM_TEXT * 2) if backend else (LONG_TEXT, LONG_TEXT)
    with server as srv:
        # a stream under way is cut when its deadline passes: the client sees an incomplete body
        t0 = time.monotonic()
        with pytest.raises(httpx.RemoteProtocolError), httpx.stream(
                "POST", srv.url + "/v1/audio/speech", json={"input": streamed, "response_format": "pcm"},
                timeout=60) as stream:
            assert stream.status_code == 200
            for _ in stream.iter_raw():
                pass
        assert time.monotonic() - t0 < limit + 2.5
        _wait(lambda: srv.backend.active == 0 and srv.backend.queue_depth == 0, 120)
        t0 = time.monotonic()  # the whole utterance in one chunk: no chunk boundary until the end
        r = httpx.post(srv.url + "/v1/audio/speech", json={"input": whole, "stream": False}, timeout=60)
        took = time.monotonic() - t0
        assert r.status_code == 504 and f"longer than {limit:g} s" in r.json()["error"]["message"], r.text
        assert took < limit + 4.0, took  # counted from the start: text preparation comes first
        # the reference backend finishes a one-chunk job before it sees the abort: let it, before the server stops
        _wait(lambda: srv.backend.active == 0 and srv.backend.queue_depth == 0, 180)
    gc.collect()
    assert not asyncio_errors, asyncio_errors


CHUNK = AudioChunk(np.zeros(480, dtype=np.float32), 24000, 0, False)


class _OneChunkHandle:
    """A job handle as `JobWatch` reads it (a `serve.backend.JobHandle`) whose chunk is ready at once."""

    def __init__(self) -> None:
        self.id = "job-1"
        self.submitted = time.monotonic()
        self.started: float | None = None
        self.finished: float | None = None
        self.done = False
        self.warnings: list[str] = []
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True

    def __aiter__(self) -> _OneChunkHandle:
        return self

    async def __anext__(self) -> AudioChunk:
        return CHUNK


@pytest.mark.parametrize("running_s", [0.0, 2.0])
def test_a_chunk_after_the_run_deadline_is_not_handed_over(running_s: float) -> None:
    """The deadline holds by the clock, not by when its timer gets to run: a chunk that comes once the job has run
    past its limit ends the job with JobTimeout even before the watch's timer fired (a busy event loop runs timers
    late), and one that comes in time is handed over."""
    async def read() -> AudioChunk:
        handle = _OneChunkHandle()
        watch = JobWatch(handle, queue_timeout_s=30.0, run_timeout_s=1.0)
        handle.started = time.monotonic() - running_s  # the watch's timer has not looked since it was made
        try:
            return await watch.next()
        finally:
            assert handle.aborted == (running_s > 1.0)
            watch.close()

    if running_s > 1.0:
        with pytest.raises(JobTimeout, match="longer than 1 s"):
            asyncio.run(read())
    else:
        assert asyncio.run(read()) is CHUNK


def test_idle_websocket_is_closed_and_frees_the_worker(tts) -> None:
    with serve_backend(reference_backend(tts), ws_idle_timeout_s=1.0) as srv:
        ws = websockets_sync.connect(ws_url(srv))
        ws.send(json.dumps({"type": "start"}))  # ...and nothing more, as in the issue
        assert json.loads(ws.recv(timeout=30))["type"] == "ready"
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/v1/audio/speech", json={"input": "Hi.", "response_format": "pcm"}, timeout=60)
        assert r.status_code == 200 and time.monotonic() - t0 < 20
        assert _close_code(ws) == 4408


def test_websocket_session_cap(tts) -> None:
    with serve_backend(reference_backend(tts), ws_idle_timeout_s=30, ws_max_duration_s=1.5) as srv:
        ws = websockets_sync.connect(ws_url(srv))
        ws.send(json.dumps({"type": "start"}))
        assert json.loads(ws.recv(timeout=30))["type"] == "ready"
        t0 = time.monotonic()
        reply = None
        with contextlib.suppress(websockets.exceptions.ConnectionClosed):
            while time.monotonic() - t0 < 10:  # a space now and then keeps it from being idle
                ws.send(json.dumps({"type": "text", "text": " "}))
                with contextlib.suppress(TimeoutError):
                    msg = ws.recv(timeout=0.3)
                    if isinstance(msg, str):
                        reply = json.loads(msg)
        assert ws.close_code == 4504 and time.monotonic() - t0 < 4
        assert reply is not None and reply["status"] == 504 and "1.5 s limit" in reply["message"]
        _wait(lambda: srv.backend.active == 0, 30)


def test_drain_answers_503_to_what_has_not_started(tts) -> None:
    with serve_backend(reference_backend(tts), shutdown_grace_s=1.0) as srv:
        results: list[tuple[int, str, float]] = []
        streaming = threading.Event()

        def running() -> None:  # holds the one worker: a long stream under way
            try:
                with httpx.stream("POST", srv.url + "/v1/audio/speech",
                                  json={"input": LONG_TEXT, "response_format": "pcm"}, timeout=60) as r:
                    streaming.set()
                    for _ in r.iter_raw():
                        pass
                status = r.status_code
            except httpx.RemoteProtocolError:
                status = -1  # cut, as a stream past the grace is
            results.append((status, "", time.monotonic()))

        def queued() -> None:
            r = httpx.post(srv.url + "/v1/audio/speech", json={"input": "Hi."}, timeout=60)
            results.append((r.status_code, r.text, time.monotonic()))

        first = threading.Thread(target=running)
        first.start()
        assert streaming.wait(60)
        threads = [threading.Thread(target=queued) for _ in range(3)]
        for t in threads:
            t.start()
        _wait(lambda: srv.backend.queue_depth == 3)
        t0 = time.monotonic()
        srv.server.should_exit = True  # what SIGTERM does
        for t in (first, *threads):
            t.join(30)
        assert len(results) == 4
        assert sorted(status for status, _, _ in results) == [-1, 503, 503, 503], results
        for status, text, at in results:
            assert status == -1 or "shutting down" in text, text
            assert 0.8 <= at - t0 < 3.0, at - t0
        srv.thread.join(15)
        assert not srv.thread.is_alive()


def test_sigterm_is_bounded(tmp_path: Path) -> None:
    model = make_quick_tiny_model_dir(tmp_path / "model")
    port = free_port()
    cmd = [sys.executable, "-m", "vocalis", "serve", "--model", str(model), "--port", str(port), "--threads", "1",
           "--voices-dir", str(tmp_path / "voices"), "--shutdown-grace", "1.5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    ended: list[tuple[int, float]] = []
    started = threading.Event()

    def client() -> None:
        status = 0
        try:
            with httpx.stream("POST", url + "/v1/audio/speech", json={"input": LONG_TEXT, "response_format": "pcm"},
                              timeout=120) as r:
                status = r.status_code
                if status == 200:
                    started.set()
                with contextlib.suppress(httpx.HTTPError):
                    for _ in r.iter_raw():
                        pass
        except httpx.HTTPError:
            status = -1
        ended.append((status, time.monotonic()))

    try:
        wait_healthy(proc, url, 90)
        threads = [threading.Thread(target=client) for _ in range(6)]
        for t in threads:
            t.start()
        assert started.wait(60)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        exited = time.monotonic() - t0
        for t in threads:
            t.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert exited < 1.5 + 6, (exited, out)  # the grace, uvicorn's margin, the lifespan's close
    assert len(ended) == 6 and all(at - t0 < 1.5 + 4 for _, at in ended), ended
    assert {s for s, _ in ended} <= {200, 503}, ended
    assert "Traceback" not in out, out


def test_websocket_waiting_for_its_first_text_is_not_queued(tts) -> None:
    """A session's job cannot start before its first text arrives: that wait is the client's, not the queue's."""
    with serve(tts, queue_timeout_s=1.0, ws_idle_timeout_s=30) as srv:
        with websockets_sync.connect(ws_url(srv)) as ws:
            ws.send(json.dumps({"type": "start"}))
            assert json.loads(ws.recv(timeout=30))["type"] == "ready"
            time.sleep(2.0)  # twice the queue timeout, thinking
            ws.send(json.dumps({"type": "text", "text": "Here it comes."}))
            ws.send(json.dumps({"type": "end"}))
            audio = 0
            while True:
                msg = ws.recv(timeout=60)
                if isinstance(msg, bytes):
                    audio += len(msg)
                    continue
                assert json.loads(msg)["type"] == "done", msg
                break
        assert audio > 0
