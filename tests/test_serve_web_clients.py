"""Issue 55's server items for web apps, on a real loopback server: CORS for allowed origins (preflight without the
key, headers on the answer), the API key out of the log whatever its spelling, and a WebSocket error whose reason
holds multi-byte text still closing with its 44xx code."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest
from serve_support import LogLines, quick_tts, serve

websockets = pytest.importorskip("websockets", reason="websockets is part of the dev extra")
import websockets.sync.client as websockets_sync

APP = "https://app.example"


@pytest.fixture(scope="module")
def tts(tmp_path_factory):
    return quick_tts(tmp_path_factory)


@pytest.fixture(scope="module")
def keyed(tts, tmp_path_factory):
    with serve(tts, api_key="k", allowed_origins=(APP,), voices_dir=tmp_path_factory.mktemp("voices")) as srv:
        yield srv


def preflight(srv, origin: str, path: str = "/v1/audio/speech", method: str = "POST") -> httpx.Response:
    return httpx.options(srv.url + path, timeout=30, headers={
        "Origin": origin, "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": "authorization,content-type"})


# ---- CORS for allowed origins ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("origin", [APP, "http://localhost:5173", "http://127.0.0.1:8080"])
def test_allowed_origin_preflight_needs_no_key_and_gets_cors_headers(keyed, origin: str) -> None:
    r = preflight(keyed, origin)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == origin
    assert "POST" in r.headers["access-control-allow-methods"]
    assert {"authorization", "content-type"} <= {h.strip().lower()
                                                 for h in r.headers["access-control-allow-headers"].split(",")}
    body = {"input": "Hi.", "response_format": "pcm", "seed": 1}
    r = httpx.post(keyed.url + "/v1/audio/speech", json=body, timeout=120,
                   headers={"Origin": origin, "Authorization": "Bearer k"})
    assert r.status_code == 200 and len(r.content) > 0
    assert r.headers["access-control-allow-origin"] == origin
    exposed = {h.strip().lower() for h in r.headers["access-control-expose-headers"].split(",")}
    assert {"x-sample-rate", "x-vocalis-warnings"} <= exposed
    # a wrong key is still refused, and the page can read why
    r = httpx.get(keyed.url + "/v1/audio/voices", headers={"Origin": origin}, timeout=30)
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == origin


def test_other_origins_keep_the_refusal(keyed) -> None:
    for origin in ("https://evil.example", "null", "http://6.6.6.6"):
        r = preflight(keyed, origin)
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers, (origin, r.headers)
        r = httpx.post(keyed.url + "/v1/audio/speech", json={"input": "Hi."}, timeout=30,
                       headers={"Origin": origin, "Authorization": "Bearer k"})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    # an OPTIONS that is no preflight is an ordinary request: it needs the key
    assert httpx.options(keyed.url + "/v1/audio/speech", timeout=30).status_code == 401


def test_any_origin_when_allowed(tts) -> None:
    with serve(tts, allowed_origins=("*",)) as srv:
        r = preflight(srv, "https://anywhere.example", "/v1/audio/voices", "GET")
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


# ---- the key out of the log, whatever its spelling ------------------------------------------------
def test_key_spellings_are_redacted_in_the_access_log(tts) -> None:
    from serve_support import ServerThread

    from vocalis.serve.app import create_app
    from vocalis.serve.config import ServeConfig
    from vocalis.serve.engine_backend import EngineBackend

    handler = LogLines()
    loggers = [logging.getLogger(n) for n in ("uvicorn.access", "uvicorn.error", "vocalis")]
    app = create_app(EngineBackend(tts), ServeConfig(api_key="s3cret-key"))
    with ServerThread(app, log_level="info") as srv:
        for lg in loggers:
            lg.addHandler(handler)
        try:
            for query in ("API_KEY=s3cret-key", "api%5Fkey=s3cret-key", "Api_Key=s3cret-key&x=1",
                          "api%5fKEY=wrong-key-abc", "%61pi_key=wrong-key-def"):
                r = httpx.get(srv.url + "/v1/audio/voices?" + query, timeout=30)
                assert r.status_code == 401  # HTTP takes the key from the header only
            url = srv.url.replace("http://", "ws://") + "/v1/audio/speech/ws?API%5FKEY=s3cret-key"
            with websockets_sync.connect(url, open_timeout=30) as ws:  # browsers' WebSockets may use the query
                ws.send(json.dumps({"type": "start"}))
                assert json.loads(ws.recv(timeout=30))["type"] == "ready"
            time.sleep(0.3)
        finally:
            for lg in loggers:
                lg.removeHandler(handler)
    text = "\n".join(handler.lines)
    assert "/v1/audio/voices" in text and text.count("REDACTED") >= 5, text
    assert "s3cret" not in text and "wrong-key" not in text, text


# ---- the close frame -------------------------------------------------------------------------------
def test_a_multibyte_error_reason_still_closes_with_its_code(tts) -> None:
    with serve(tts) as srv:
        url = srv.url.replace("http://", "ws://") + "/v1/audio/speech/ws"
        name = "голос" * 30  # an unknown voice: the 400's message holds 300 characters of 2-byte text
        with websockets_sync.connect(url, open_timeout=30) as ws:
            ws.send(json.dumps({"type": "start", "voice": name}))
            error = json.loads(ws.recv(timeout=30))
            with pytest.raises(websockets.exceptions.ConnectionClosed):
                ws.recv(timeout=30)
        assert error["status"] == 400 and name in error["message"]  # the whole message in the error event
        assert ws.close_code == 4400, (ws.close_code, ws.close_reason)
        reason = ws.close_reason
        assert 0 < len(reason.encode()) <= 123 and error["message"].startswith(reason)
