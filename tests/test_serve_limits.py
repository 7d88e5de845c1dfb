"""Issue 25, items 1, 10 and 12 on a real loopback server: every text field of every route has the one length
cap, the LLM prompt is bounded before it is queued, odd bodies are quiet 4xx answers, and slow clients are cut
off by the head and body time limits."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time

import httpx
import pytest
from serve_support import quick_tts, serve
from tiny_assets import write_voice_like_wav

websockets = pytest.importorskip("websockets", reason="websockets is part of the dev extra")
import websockets.sync.client as websockets_sync

LIMIT = 300  # a small cap, so the tests send small bodies


@pytest.fixture(scope="module")
def tts(tmp_path_factory):
    return quick_tts(tmp_path_factory)


@pytest.fixture(scope="module")
def server(tts):
    with serve(tts, max_input_chars=LIMIT, max_prompt_tokens=120, header_timeout_s=1.0, body_timeout_s=1.0) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> bytes:
    return write_voice_like_wav(tmp_path_factory.mktemp("clip") / "v.wav", 2.0).read_bytes()


def _idle(backend) -> None:
    deadline = time.monotonic() + 30
    while backend.active or backend.queue_depth:
        assert time.monotonic() < deadline, "the backend did not become idle"
        time.sleep(0.05)


LONG = "x" * (LIMIT + 1)


@pytest.mark.parametrize(("path", "fields", "with_wav", "field"), [
    ("/inference_instruct2", {"tts_text": "Hi.", "instruct_text": LONG}, True, "instruct_text"),  # the case
    ("/inference_instruct", {"tts_text": "Hi.", "spk_id": "default", "instruct_text": LONG}, False, "instruct_text"),
    ("/inference_zero_shot", {"tts_text": "Hi.", "prompt_text": LONG}, True, "prompt_text"),
    ("/inference_sft", {"tts_text": LONG, "spk_id": "default"}, False, "tts_text"),
    ("/inference_cross_lingual", {"tts_text": LONG}, True, "tts_text"),
    ("/v1/audio/speech", {"input": "Hi.", "instructions": LONG}, False, "instructions"),
    ("/v1/audio/speech", {"input": "Hi.", "ref_text": LONG}, True, "ref_text"),
    ("/v1/audio/speech", {"input": LONG}, False, "input"),
    ("/v1/audio/voices", {"name": "long", "text": LONG}, True, "text"),
])
def test_every_text_field_is_capped(server, client: httpx.Client, clip: bytes, path: str, fields: dict,
                                    with_wav: bool, field: str) -> None:
    audio_field = {"/v1/audio/speech": "ref_audio", "/v1/audio/voices": "audio"}.get(path, "prompt_wav")
    files = {audio_field: ("c.wav", clip, "audio/wav")} if with_wav else None
    t0 = time.monotonic()
    r = client.post(path, data=fields, files=files)
    assert r.status_code == 400, r.text
    assert f"{field} is {LIMIT + 1} characters; the limit is {LIMIT}" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 10  # refused up front, not after a synthesis
    _idle(server.backend)


def test_json_fields_share_the_cap(client: httpx.Client) -> None:
    r = client.post("/v1/audio/speech", json={"input": "Hi.", "instructions": LONG})
    assert r.status_code == 400 and "instructions is" in r.json()["error"]["message"]


def test_llm_prompt_is_bounded_before_queueing(server, client: httpx.Client, clip: bytes) -> None:
    words = "ab cd " * 45  # within the character cap, over the 120-token prompt bound
    r = client.post("/v1/audio/speech", json={"input": words})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "the LLM prompt would be" in msg and "the limit is 120" in msg
    r = client.post("/inference_instruct", data={"tts_text": "Hi.", "spk_id": "default", "instruct_text": words})
    assert r.status_code == 400 and "instruction" in r.json()["error"]["message"]
    # a zero-shot prompt: the transcript and the clip's speech tokens (2 s = 50) count too
    r = client.post("/inference_zero_shot", data={"tts_text": "ab cd " * 10, "prompt_text": "ab cd " * 10},
                    files={"prompt_wav": ("c.wav", clip, "audio/wav")})
    assert r.status_code == 400 and "prompt speech" in r.json()["error"]["message"], r.text
    assert client.post("/v1/audio/speech", json={"input": "Hi.", "response_format": "pcm"}).status_code == 200
    _idle(server.backend)


def ws_url(server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/audio/speech/ws"


def _ws_error(server, *messages: object) -> tuple[dict, int | None]:
    ws = websockets_sync.connect(ws_url(server))
    try:
        for m in messages:
            with contextlib.suppress(websockets.exceptions.ConnectionClosed):
                ws.send(m if isinstance(m, (str, bytes)) else json.dumps(m))
        reply = json.loads(ws.recv(timeout=30))
        while reply["type"] == "ready":
            reply = json.loads(ws.recv(timeout=30))
        with contextlib.suppress(websockets.exceptions.ConnectionClosed):
            ws.recv(timeout=10)
        return reply, ws.close_code
    finally:
        ws.close()


def test_websocket_text_limits(server) -> None:
    reply, code = _ws_error(server, {"type": "start", "instructions": LONG})
    assert reply["status"] == 400 and code == 4400 and "instructions is" in reply["message"]
    pieces = [{"type": "text", "text": "ab cd " * 10} for _ in range(5)]  # 60 chars each, together > 120 tokens
    reply, code = _ws_error(server, {"type": "start"}, *pieces)
    assert reply["status"] == 400 and code == 4400 and "the LLM prompt would be" in reply["message"]
    _idle(server.backend)  # (the pieces' character cap, 4413: test_serve_modes.test_websocket_errors)


def test_websocket_binary_frame_and_deep_json(server) -> None:
    reply, code = _ws_error(server, b"\x00\x01binary")
    assert reply["status"] == 400 and code == 4400 and "binary frames" in reply["message"]
    reply, code = _ws_error(server, {"type": "start"}, b"RIFF....")
    assert reply["status"] == 400 and code == 4400
    reply, code = _ws_error(server, "[" * 100_000 + "]" * 100_000)
    assert reply["status"] == 400 and code == 4400 and "nested too deeply" in reply["message"]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def server_log():
    handler = _Records()
    loggers = [logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.error", "vocalis")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield handler.records
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


def test_deep_json_and_client_leaving_mid_body_are_quiet(server, client: httpx.Client, server_log) -> None:
    r = client.post("/v1/audio/speech", content=b"[" * 100_000 + b"]" * 100_000,
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    r = client.post("/v1/audio/speech", content=b'{"input": ' * 50_000, headers={"content-type": "application/json"})
    assert r.status_code == 400
    for path, ctype in (("/v1/audio/speech", "application/json"), ("/v1/audio/voices", "application/json"),
                        ("/inference_sft", "multipart/form-data; boundary=xyz")):
        for _ in range(5):  # the client says 1000 bytes, sends 20 and leaves
            with socket.create_connection(("127.0.0.1", server.port)) as s:
                s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {ctype}\r\n"
                          "Content-Length: 1000\r\n\r\n".encode() + b'{"input": "Hello, th')
                time.sleep(0.05)
    time.sleep(0.5)
    assert client.get("/health").status_code == 200
    noisy = [r for r in server_log if r.levelno >= logging.ERROR or r.exc_info]
    assert not noisy, [(r.name, r.getMessage()) for r in noisy]


def _raw_exchange(port: int, data: bytes, wait_s: float) -> tuple[bytes, float]:
    """Send `data`, then read until the server closes (or `wait_s` passes): (what came back, when it ended)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(data)
        s.settimeout(wait_s)
        got = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := s.recv(65536):
                got += chunk
    return got, time.monotonic() - t0


def test_slow_head_and_slow_body_get_408(server) -> None:
    got, took = _raw_exchange(server.port, b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ", 10)
    assert got.startswith(b"HTTP/1.1 408") and took < 4, (got, took)
    # a byte every 0.4 s keeps the head coming, but not within the limit
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        s.settimeout(0.4)
        got = b""
        for _ in range(25):
            try:
                s.sendall(b"X")
                got += s.recv(65536)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            if got:
                break
    assert got.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 4, got
    body_start = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"inp")
    got, took = _raw_exchange(server.port, body_start, 10)
    assert b" 408 " in got.split(b"\r\n", 1)[0] and b"did not arrive within 1 s" in got and took < 4, (got, took)
    # a keep-alive connection gets the same limit for its next request's head
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        s.settimeout(5)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /health HTTP/1.1\r\n")
        t0 = time.monotonic()
        rest = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := s.recv(65536):
                rest += chunk
        assert time.monotonic() - t0 < 8
        assert rest == b"" or rest.startswith(b"HTTP/1.1 408"), rest  # uvicorn's keep-alive limit may close first
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
