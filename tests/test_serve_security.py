"""Issue 25, items 5, 7, 8, 9 and 13 on a real loopback server: Host and Origin allow-lists (with and without an
API key, HTTP and WebSocket), the key checked before the body is read and kept out of the access log, whole-name
voice checks, and answers that name the model without saying where it lives."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from serve_support import LogLines, make_quick_tiny_model_dir, quick_tts, serve, serve_backend
from tiny_assets import write_voice_like_wav

websockets = pytest.importorskip("websockets", reason="websockets is part of the dev extra")
import websockets.sync.client as websockets_sync


@pytest.fixture(scope="module")
def tts(tmp_path_factory):
    return quick_tts(tmp_path_factory)


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> bytes:
    return write_voice_like_wav(tmp_path_factory.mktemp("clip") / "v.wav", 2.0).read_bytes()


@pytest.fixture(scope="module")
def open_server(tts, tmp_path_factory):
    """The default: no API key."""
    voices = tmp_path_factory.mktemp("voices")
    with serve(tts, voices_dir=voices) as srv:
        srv.voices_dir = voices
        yield srv


def ws_connect(srv, origin: str | None = None, host: str | None = None, query: str = ""):
    headers = {k: v for k, v in (("Origin", origin), ("Host", host)) if v}
    url = srv.url.replace("http://", "ws://") + "/v1/audio/speech/ws" + query
    return websockets_sync.connect(url, additional_headers=headers, open_timeout=30)


# ---- item 5 ------------------------------------------------------------------------------------------------
def test_foreign_host_is_refused_without_an_api_key(open_server, clip: bytes) -> None:
    url = open_server.url
    rebinding = {"Host": f"evil.example:{open_server.port}"}
    for method, path, kw in (("GET", "/health", {}), ("GET", "/v1/audio/voices", {}),
                             ("POST", "/v1/audio/speech", {"json": {"input": "Hi."}})):
        r = httpx.request(method, url + path, headers=rebinding, timeout=30, **kw)
        assert r.status_code == 403 and "host 'evil.example" in r.json()["error"]["message"], (path, r.text)
    for host in (f"127.0.0.1:{open_server.port}", f"localhost:{open_server.port}", "localhost", "[::1]:80"):
        assert httpx.get(url + "/health", headers={"Host": host}, timeout=30).status_code == 200, host
    with pytest.raises(websockets.exceptions.InvalidStatus) as err:
        ws_connect(open_server, host="evil.example")
    assert err.value.response.status_code == 403


def test_cross_site_requests_are_refused(open_server, clip: bytes) -> None:
    url = open_server.url
    evil = {"Origin": "https://evil.example"}
    r = httpx.post(url + "/v1/audio/voices", data={"name": "planted"}, files={"audio": ("v.wav", clip)},
                   headers=evil, timeout=60)
    assert r.status_code == 403 and "origin 'https://evil.example'" in r.json()["error"]["message"]
    r = httpx.post(url + "/inference_sft", data={"tts_text": "Hi.", "spk_id": "default"}, headers=evil, timeout=60)
    assert r.status_code == 403
    assert httpx.post(url + "/v1/audio/speech", json={"input": "Hi."}, headers={"Origin": "null"},
                      timeout=30).status_code == 403
    assert not list(Path(open_server.voices_dir).iterdir())  # nothing was planted
    with pytest.raises(websockets.exceptions.InvalidStatus) as err:
        ws_connect(open_server, origin="https://evil.example")
    assert err.value.response.status_code == 403
    # the server's own page, and pages on this machine, may call it
    own = {"Origin": url}
    r = httpx.post(url + "/v1/audio/speech", json={"input": "Hi.", "response_format": "pcm"}, headers=own, timeout=60)
    assert r.status_code == 200
    assert httpx.get(url + "/v1/audio/voices", headers={"Origin": "http://localhost:3000"},
                     timeout=30).status_code == 200
    with ws_connect(open_server, origin=url) as ws:
        ws.send(json.dumps({"type": "start"}))
        assert json.loads(ws.recv(timeout=30))["type"] == "ready"


def test_allow_lists_widen(tts) -> None:
    with serve(tts, allowed_hosts=("tts.internal",), allowed_origins=("https://app.example",)) as srv:
        r = httpx.get(srv.url + "/v1/audio/voices", headers={"Host": "tts.internal:8000",
                                                            "Origin": "https://app.example"}, timeout=30)
        assert r.status_code == 200
        assert httpx.get(srv.url + "/health", headers={"Host": "other.internal"}, timeout=30).status_code == 403
    with serve(tts, bind_host="0.0.0.0") as srv:  # bound to all interfaces: a typed IP cannot be rebound
        assert httpx.get(srv.url + "/health", headers={"Host": "192.168.1.20:8000"}, timeout=30).status_code == 200
        assert httpx.get(srv.url + "/health", headers={"Host": "evil.example"}, timeout=30).status_code == 403
        assert httpx.get(srv.url + "/health", headers={"Origin": "http://6.6.6.6"}, timeout=30).status_code == 403


def test_host_check_holds_with_an_api_key(tts) -> None:
    with serve(tts, api_key="k") as srv:
        r = httpx.get(srv.url + "/v1/audio/voices", headers={"Host": "evil.example", "Authorization": "Bearer k"},
                      timeout=30)
        assert r.status_code == 403


# ---- item 7 ------------------------------------------------------------------------------------------------
def test_api_key_is_checked_before_the_body_is_read(tts) -> None:
    with serve(tts, api_key="k") as srv:
        for path in ("/inference_zero_shot", "/v1/audio/speech", "/v1/audio/voices"):
            with socket.create_connection(("127.0.0.1", srv.port)) as s:
                # a 15 MB body is announced and 1 KB of it sent: the answer must not wait for the rest
                s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; "
                          f"boundary=b\r\nContent-Length: {15 * 1024 * 1024}\r\n\r\n".encode() + b"x" * 1024)
                s.settimeout(5)
                t0 = time.monotonic()
                head = s.recv(65536)
                assert head.startswith(b"HTTP/1.1 401") and time.monotonic() - t0 < 3, (path, head)
                assert b"www-authenticate: Bearer" in head.lower().replace(b"bearer", b"Bearer")


# ---- item 8 ------------------------------------------------------------------------------------------------
def test_api_key_never_reaches_the_access_log(tts) -> None:
    from serve_support import reference_backend

    handler = LogLines()
    loggers = [logging.getLogger(n) for n in ("uvicorn.access", "uvicorn.error", "vocalis")]
    backend = reference_backend(tts)
    with serve_backend(backend, log_level="info", api_key="s3cret-key") as srv:
        for lg in loggers:
            lg.addHandler(handler)
        try:
            httpx.get(srv.url + "/v1/audio/voices?api_key=s3cret-key&x=1", timeout=30)
            httpx.get(srv.url + "/v1/audio/voices?api_key=wrong-key-abc", timeout=30)
            with ws_connect(srv, query="?api_key=s3cret-key") as ws:
                ws.send(json.dumps({"type": "start"}))
                assert json.loads(ws.recv(timeout=30))["type"] == "ready"
            with contextlib.suppress(Exception), ws_connect(srv, host="evil.example", query="?api_key=s3cret-key"):
                pass
            time.sleep(0.3)
        finally:
            for lg in loggers:
                lg.removeHandler(handler)
    text = "\n".join(handler.lines)
    assert "/v1/audio/voices" in text and "REDACTED" in text, text
    assert "s3cret-key" not in text and "wrong-key-abc" not in text, text


# ---- item 9 ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["nl\n", "con", "NUL", "nul.v2", "com1", "LPT9.x", "trailing.", "a\r", "tab\t"])
def test_whole_name_is_checked(open_server, clip: bytes, name: str) -> None:
    r = httpx.post(open_server.url + "/v1/audio/voices", data={"name": name}, files={"audio": ("v.wav", clip)},
                   timeout=60)
    assert r.status_code == 400 and "invalid voice name" in r.json()["error"]["message"], r.text
    assert not list(Path(open_server.voices_dir).iterdir())
    assert httpx.delete(open_server.url + "/v1/audio/voices/" + quote(name, safe=""),
                        timeout=30).status_code in (400, 404)


# ---- item 13 -----------------------------------------------------------------------------------------------
def test_answers_name_the_model_not_its_path(tmp_path: Path, clip: bytes) -> None:
    from vocalis.tts import TTS

    model_dir = make_quick_tiny_model_dir(tmp_path / "secret-place" / "tiny")
    for onnx in model_dir.glob("*.onnx"):  # no speech tokenizer / speaker encoder: cloning errors
        onnx.unlink()
    backend_tts = TTS.load(model_dir)
    with serve(backend_tts, model_name="tiny-test") as srv:
        health = httpx.get(srv.url + "/health", timeout=30).json()
        assert health["model"] == "tiny-test" and "pid" not in health
        models = httpx.get(srv.url + "/v1/models", timeout=30).json()
        answers = [json.dumps(health), json.dumps(models)]
        answers.append(httpx.post(srv.url + "/v1/audio/speech", data={"input": "Hi."},
                                  files={"ref_audio": ("v.wav", clip)}, timeout=60).text)
        answers.append(httpx.post(srv.url + "/inference_vc", data={"spk_id": "default"},
                                  files={"source_wav": ("v.wav", clip)}, timeout=60).text)
        answers.append(httpx.post(srv.url + "/v1/audio/voices", data={"name": "v"},
                                  files={"audio": ("v.wav", clip)}, timeout=60).text)
    assert "tiny-test" in answers[1] and "cannot" in answers[2], answers
    for answer in answers:
        assert "secret-place" not in answer and str(os.getpid()) not in answer.split('"sample_rate"')[0], answer
    shutil.rmtree(tmp_path / "secret-place")
