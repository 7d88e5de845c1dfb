"""CosyVoice-style mode endpoints and the WebSocket bi-streaming endpoint, on a real loopback server."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import numpy as np
import pytest
from serve_support import check_aac, decode_audio, quick_tts, serve
from tiny_assets import write_voice_like_wav

websockets = pytest.importorskip("websockets", reason="websockets is part of the dev extra")
import websockets.sync.client as websockets_sync


@pytest.fixture(scope="module")
def tts(tmp_path_factory):
    return quick_tts(tmp_path_factory)


@pytest.fixture(scope="module")
def server(tts):
    with serve(tts, api_key="k") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": "Bearer k"}) as c:
        yield c


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> bytes:
    return write_voice_like_wav(tmp_path_factory.mktemp("clip") / "v.wav", 2.0).read_bytes()


def pcm(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "audio/pcm" and r.headers["x-sample-rate"] == "24000"
    audio = decode_audio("pcm", r.content)
    assert len(audio) > 0 and np.abs(audio).max() > 0
    return audio


def test_every_mode(client: httpx.Client, clip: bytes) -> None:
    wav = {"prompt_wav": ("p.wav", clip, "audio/wav")}
    sft = pcm(client.post("/inference_sft", data={"tts_text": "Hi there.", "spk_id": "default", "seed": "1"}))
    openai_route = client.post("/v1/audio/speech", json={"input": "Hi there.", "voice": "default", "seed": 1,
                                                         "response_format": "pcm"})
    np.testing.assert_allclose(sft, decode_audio("pcm", openai_route.content), atol=1e-4)
    pcm(client.post("/inference_zero_shot", data={"tts_text": "Hi.", "prompt_text": "hello there"}, files=wav))
    pcm(client.post("/inference_cross_lingual", data={"tts_text": "Hi."}, files=wav))
    pcm(client.post("/inference_instruct", data={"tts_text": "Hi.", "spk_id": "alloy",
                                                 "instruct_text": "Speak slowly."}))
    pcm(client.post("/inference_instruct2", data={"tts_text": "Hi.", "instruct_text": "Speak slowly."}, files=wav))
    vc = pcm(client.post("/inference_vc", files={"source_wav": ("s.wav", clip), **wav}))
    assert abs(len(vc) / 24000 - 2.0) < 0.3  # conversion keeps the source's length
    flac = client.post("/inference_sft", data={"tts_text": "Hi.", "spk_id": "default", "response_format": "flac"})
    assert flac.status_code == 200 and flac.content[:4] == b"fLaC"


def test_mode_errors(client: httpx.Client, clip: bytes) -> None:
    cases = [
        ("/inference_sft", {"tts_text": "Hi."}, {}, 400, "spk_id"),
        ("/inference_sft", {"tts_text": "", "spk_id": "default"}, {}, 400, "tts_text"),
        ("/inference_sft", {"tts_text": "Hi.", "spk_id": "nobody"}, {}, 400, "unknown voice"),
        ("/inference_sft", {"tts_text": "Hi.", "spk_id": "default", "speed": "7"}, {}, 400, "speed"),
        ("/inference_zero_shot", {"tts_text": "Hi."}, {"prompt_wav": ("p.wav", clip)}, 400, "prompt_text"),
        ("/inference_zero_shot", {"tts_text": "Hi.", "prompt_text": "x"}, {"prompt_wav": ("p.wav", b"junk")}, 415,
         "not audio"),
        ("/inference_vc", {}, {"source_wav": ("s.wav", clip)}, 400, "prompt_wav or spk_id"),
        ("/inference_vc", {"spk_id": "default"}, {"source_wav": ("s.wav", clip)}, 400, "needs a voice made from"),
    ]
    for path, data, files, status, needle in cases:
        r = client.post(path, data=data, files=files or None)
        assert r.status_code == status, (path, data, r.text)
        assert needle in r.json()["error"]["message"], (path, r.json())
    check_aac(client.post("/inference_sft", data={"tts_text": "Hi.", "spk_id": "default", "response_format": "aac"}))


def ws_url(server, key: str | None = "k") -> str:
    return server.url.replace("http://", "ws://") + "/v1/audio/speech/ws" + (f"?api_key={key}" if key else "")


def test_websocket_bistream(server, client: httpx.Client) -> None:
    pieces = ["Sure, ", "here is ", "the answer ", "to your question. ", "It takes ", "a few words ", "to explain, ",
              "so bear with me ", "while I write them ", "one piece at a time."]
    with websockets_sync.connect(ws_url(server)) as ws:
        ws.send(json.dumps({"type": "start", "voice": "alloy", "response_format": "pcm", "seed": 3}))
        ready = json.loads(ws.recv(timeout=30))
        assert ready == {"type": "ready", "sample_rate": 24000, "format": "pcm"}
        for piece in pieces:
            ws.send(json.dumps({"type": "text", "text": piece}))
            time.sleep(0.05)  # text trickles in, as from a chat LLM
        audio = ws.recv(timeout=120)  # audio starts before the end of the text is known
        assert isinstance(audio, bytes) and len(audio) > 0
        ws.send(json.dumps({"type": "end"}))
        while True:
            msg = ws.recv(timeout=120)
            if isinstance(msg, bytes):
                audio += msg
                continue
            done = json.loads(msg)
            break
    assert done["type"] == "done" and done["audio_seconds"] == pytest.approx(len(audio) / 2 / 24000, abs=1e-3)
    assert done["first_chunk_latency"] > 0 and done["rtf"] > 0
    assert len(audio) > 0 and len(audio) % 2 == 0
    metrics = client.get("/metrics").text
    assert 'vocalis_requests_total{route="/v1/audio/speech/ws",status="200"} 1.0' in metrics


def test_websocket_errors(server) -> None:
    def first_reply(url: str, *messages: dict | str) -> tuple[dict, int | None]:
        ws = websockets_sync.connect(url)
        try:
            for m in messages:
                with contextlib.suppress(websockets.exceptions.ConnectionClosed):  # the server may close first
                    ws.send(m if isinstance(m, str) else json.dumps(m))
            reply = json.loads(ws.recv(timeout=30))
            while reply["type"] == "ready":
                reply = json.loads(ws.recv(timeout=30))
            with contextlib.suppress(websockets.exceptions.ConnectionClosed):
                ws.recv(timeout=10)  # the server closes: read its close code
            return reply, ws.close_code
        finally:
            with contextlib.suppress(websockets.exceptions.ConnectionClosed):
                ws.close()

    reply, code = first_reply(ws_url(server, None), {"type": "start"})
    assert reply["status"] == 401 and code == 4401
    reply, code = first_reply(ws_url(server), {"type": "text", "text": "no start"})
    assert reply["status"] == 400 and code == 4400
    reply, code = first_reply(ws_url(server), "not json")
    assert reply["status"] == 400 and "JSON" in reply["message"]
    reply, code = first_reply(ws_url(server), {"type": "start", "voice": "nobody"})
    assert reply["status"] == 400 and "unknown voice" in reply["message"]
    reply, code = first_reply(ws_url(server), {"type": "start"}, {"type": "end"})
    assert reply["status"] == 400 and "no text" in reply["message"]
    reply, code = first_reply(ws_url(server), {"type": "start"}, {"type": "text", "text": "x" * 5000})
    assert reply["status"] == 413 and code == 4413
    reply, code = first_reply(ws_url(server), {"type": "start"}, {"type": "dance"})
    assert reply["status"] == 400 and "unknown message type" in reply["message"]
    assert server.backend.queue_depth == 0


def test_websocket_disconnect_aborts(server) -> None:
    backend = server.backend
    before = backend.aborted
    ws = websockets_sync.connect(ws_url(server))
    ws.send(json.dumps({"type": "start", "response_format": "pcm"}))
    ws.recv(timeout=30)
    # a complete sentence (read at once; text in pieces is read a sentence at a time), then one that never ends
    ws.send(json.dumps({"type": "text", "text": "Some text. And more that will never be finished "}))
    deadline = time.monotonic() + 30
    while backend.active == 0:  # the worker is now waiting for more text
        assert time.monotonic() < deadline
        time.sleep(0.02)
    ws.close()
    while backend.aborted == before or backend.active:
        assert time.monotonic() < deadline, "the bistream job was not aborted"
        time.sleep(0.05)


def test_websocket_idle_timeout(tts) -> None:
    with serve(tts, ws_idle_timeout_s=0.5) as srv:
        ws = websockets_sync.connect(ws_url(srv, None))
        ws.send(json.dumps({"type": "start"}))
        assert json.loads(ws.recv(timeout=30))["type"] == "ready"
        reply = json.loads(ws.recv(timeout=30))
        with contextlib.suppress(websockets.exceptions.ConnectionClosed):
            ws.recv(timeout=10)
        assert reply["status"] == 408 and "no message came for 0.5 s" in reply["message"]
        assert ws.close_code == 4408


def test_concurrent_websockets_are_queued(server) -> None:
    results: list[int] = []

    def session(i: int) -> None:
        with websockets_sync.connect(ws_url(server)) as ws:
            ws.send(json.dumps({"type": "start", "seed": i}))
            ws.recv(timeout=60)
            ws.send(json.dumps({"type": "text", "text": f"Session number {i}."}))
            ws.send(json.dumps({"type": "end"}))
            n = 0
            while True:
                msg = ws.recv(timeout=120)
                if isinstance(msg, bytes):
                    n += len(msg)
                elif json.loads(msg)["type"] == "done":
                    results.append(n)
                    return

    threads = [threading.Thread(target=session, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 3 and all(n > 0 for n in results)
