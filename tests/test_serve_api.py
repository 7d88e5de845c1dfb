"""POST /v1/audio/speech on a real uvicorn server (127.0.0.1): formats, streaming, concurrency, errors, aborts."""

from __future__ import annotations

import base64
import json
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from serve_support import aac_supported, decode_audio, quick_tts, serve
from tiny_assets import write_voice_like_wav

AAC = aac_supported()  # with PyAV installed (the aac extra); else aac is a 400

LONG_TEXT = " ".join(["This is a fairly long sentence that keeps the synthesis busy for a while."] * 12)



@pytest.fixture(scope="module")
def tts(tmp_path_factory):
    return quick_tts(tmp_path_factory)

@pytest.fixture(scope="module")
def server(tts, tmp_path_factory):
    voices = tmp_path_factory.mktemp("voices")
    with serve(tts, voices_dir=voices) as srv:
        srv.voices_dir = voices
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> bytes:
    return write_voice_like_wav(tmp_path_factory.mktemp("clip") / "v.wav", 2.0).read_bytes()


def speech(client: httpx.Client, **body: object) -> httpx.Response:
    return client.post("/v1/audio/speech", json={"input": "Hello there.", "voice": "alloy", **body})


def wait_idle(backend: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while backend.active or backend.queue_depth:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the backend did not become idle"
        time.sleep(0.05)


def test_health_needs_nothing(client: httpx.Client) -> None:
    body = client.get("/health").json()
    assert body["status"] == "ok" and body["sample_rate"] == 24000
    assert {"wav", "pcm", "flac"} <= set(body["formats"])


@pytest.mark.parametrize("fmt", ["wav", "pcm", "flac", "mp3", "opus", *(["aac"] if AAC else [])])
def test_formats_streamed_and_whole_agree(client: httpx.Client, fmt: str) -> None:
    whole = speech(client, response_format=fmt, seed=3, stream=False)
    assert whole.status_code == 200, whole.text
    ref = decode_audio("wav", speech(client, response_format="wav", seed=3, stream=False).content)
    assert len(ref) > 0 and np.abs(ref).max() > 0
    streamed = speech(client, response_format=fmt, seed=3)
    assert streamed.status_code == 200, streamed.text
    assert streamed.headers["content-type"].startswith({"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac",
                                                         "mp3": "audio/mpeg", "opus": "audio/ogg",
                                                         "aac": "audio/aac"}[fmt])
    got = decode_audio(fmt, streamed.content, frames=len(ref))
    got_whole = decode_audio(fmt, whole.content)
    if fmt in ("wav", "pcm", "flac"):  # lossless: the same seed gives the same samples, streamed or not
        np.testing.assert_allclose(got, ref, atol=1e-4)
        np.testing.assert_allclose(got_whole, ref, atol=1e-4)
    else:  # lossy (and the tiny model makes noise, which codecs do not keep): length and audibility only
        assert abs(len(got_whole) - len(ref)) < 2400 and abs(len(got) - len(ref)) < 2400
        rms = np.sqrt(np.mean(ref**2))
        assert np.sqrt(np.mean(got**2)) > 0.25 * rms and np.sqrt(np.mean(got_whole**2)) > 0.25 * rms


def test_streaming_sends_audio_before_synthesis_ends(server, client: httpx.Client) -> None:
    text = " ".join(["This sentence makes one segment long enough for several streamed chunks."] * 4)
    with client.stream("POST", "/v1/audio/speech", json={"input": text, "response_format": "pcm", "seed": 1}) as r:
        assert r.status_code == 200
        reads = [(time.perf_counter(), data) for data in r.iter_raw()]
    body = b"".join(data for _, data in reads)
    assert len(body) % 2 == 0 and len(reads) >= 2
    # the first bytes came while later chunks were still being synthesised, not all at once at the end
    assert reads[-1][0] - reads[0][0] > 0.05
    wait_idle(server.backend)


def test_concurrent_streams_each_get_their_complete_audio(server, client: httpx.Client) -> None:
    texts = ["Hello there.", "How are you today?", "Fine, thanks.", "Speech from text, streamed."]
    alone = [decode_audio("wav", speech(client, input=t, seed=i, response_format="wav").content)
             for i, t in enumerate(texts)]
    results: dict[int, bytes] = {}

    def one(i: int) -> None:
        with httpx.Client(base_url=server.url, timeout=120) as c, c.stream("POST", "/v1/audio/speech",
                      json={"input": texts[i], "voice": "nova", "seed": i, "response_format": "wav"}) as r:
            assert r.status_code == 200
            results[i] = b"".join(r.iter_bytes())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == list(range(len(texts)))
    for i, ref in enumerate(alone):
        np.testing.assert_allclose(decode_audio("wav", results[i]), ref, atol=1e-4)


def test_sse_events(client: httpx.Client) -> None:
    r = speech(client, response_format="pcm", stream_format="sse", seed=2)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["input_tokens"] == len("Hello there.")
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert all(e["type"] == "speech.audio.delta" for e in events[:-1])
    ref = decode_audio("pcm", speech(client, response_format="pcm", seed=2).content)
    np.testing.assert_allclose(decode_audio("pcm", audio), ref, atol=1e-4)


def test_one_off_cloning_json_and_multipart(client: httpx.Client, clip: bytes) -> None:
    b64 = base64.b64encode(clip).decode()
    r = speech(client, input="Hi.", ref_audio=b64, ref_text="hello there", response_format="wav", seed=5)
    assert r.status_code == 200, r.text
    r2 = client.post("/v1/audio/speech", data={"input": "Hi.", "voice": "alloy", "ref_text": "hello there",
                                               "response_format": "wav", "seed": "5"},
                     files={"ref_audio": ("me.wav", clip, "audio/wav")})
    assert r2.status_code == 200, r2.text
    np.testing.assert_allclose(decode_audio("wav", r.content), decode_audio("wav", r2.content), atol=1e-4)
    r3 = speech(client, input="Hi.", ref_audio=f"data:audio/wav;base64,{b64}", response_format="wav", seed=5,
                instructions="speak slowly", speed=1.5, language="en")
    assert r3.status_code == 200, r3.text


@pytest.mark.parametrize(("body", "status", "needle"), [
    *([] if AAC else [({"response_format": "aac"}, 400, "not supported")]),  # else it works (formats below)
    ({"input": ""}, 400, "input"),
    ({"input": "x" * 4097}, 400, "limit is 4096"),
    ({"speed": 4.5}, 400, "speed"),
    ({"speed": 0.1}, 400, "speed"),
    ({"response_format": "ogg"}, 400, "response_format"),
    ({"stream_format": "chunks"}, 400, "stream_format"),
    ({"voice": "nobody"}, 400, "unknown voice"),
    ({"voice": "../../etc/passwd"}, 400, "unknown voice"),
    ({"sed": 1}, 400, "unknown field"),
    ({"seed": -1}, 400, "seed"),
    ({"language": "xx"}, 400, "language"),
    ({"ref_audio": "%%%notbase64"}, 400, "base64"),
    ({"ref_audio": base64.b64encode(b"not audio at all").decode()}, 415, "not audio"),
    ({"ref_text": "hello"}, 400, "ref_text needs ref_audio"),
    ({"input": "!!!"}, 400, "punctuation"),
])
def test_bad_requests_get_4xx_json(server, client: httpx.Client, body: dict, status: int, needle: str) -> None:
    r = speech(client, **body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    wait_idle(server.backend)


def test_bad_bodies(server, client: httpx.Client, clip: bytes) -> None:
    r = client.post("/v1/audio/speech", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = client.post("/v1/audio/speech", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = client.post("/v1/audio/speech", content=b"input=hi", headers={"content-type": "text/plain"})
    assert r.status_code == 415
    big = b"0" * (17 * 1024 * 1024)
    r = client.post("/v1/audio/speech", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(17):
            yield b"0" * (1024 * 1024)

    r = client.post("/v1/audio/speech", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    r = client.post("/v1/audio/speech", data={"input": "Hi."},
                    files={"ref_audio": ("big.wav", b"RIFF" + b"0" * (11 * 1024 * 1024), "audio/wav")})
    assert r.status_code == 413
    r = client.post("/v1/audio/speech", data={"input": "Hi."}, files={"other": ("x.wav", clip, "audio/wav")})
    assert r.status_code == 400 and "unexpected file field" in r.json()["error"]["message"]
    silent = write_silence()
    r = client.post("/v1/audio/speech", data={"input": "Hi.", "ref_text": "x"}, files={"ref_audio": ("s.wav", silent)})
    assert r.status_code == 400 and "silent" in r.json()["error"]["message"]
    assert client.get("/nope").status_code == 404 and "error" in client.get("/nope").json()
    wait_idle(server.backend)


def write_silence() -> bytes:
    import io

    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, np.zeros(24000, dtype=np.float32), 24000, format="WAV")
    return buf.getvalue()


def test_client_disconnect_aborts_the_job(server) -> None:
    backend = server.backend
    aborted = backend.aborted
    with httpx.Client(base_url=server.url, timeout=120) as c, \
            c.stream("POST", "/v1/audio/speech", json={"input": LONG_TEXT * 3, "response_format": "pcm"}) as r:
        assert r.status_code == 200
        raw = r.iter_raw()  # keep the iterator: dropping it closes the connection
        next(raw)
        time.sleep(0.3)
        assert backend.active == 1 and backend.aborted == aborted  # still streaming while we hold on
    # leaving the block closed the connection mid-stream
    deadline = time.monotonic() + 30
    while backend.aborted == aborted:
        assert time.monotonic() < deadline, "the job was not aborted after the client left"
        time.sleep(0.05)
    wait_idle(backend)
    metrics = httpx.get(server.url + "/metrics").text
    assert "vocalis_active_streams 0.0" in metrics
    assert "vocalis_aborted_total 1.0" in metrics or "vocalis_aborted_total 2.0" in metrics


def test_metrics_exposed(client: httpx.Client) -> None:
    speech(client, input="Hi.", response_format="pcm")
    text = client.get("/metrics").text
    for name in ("vocalis_requests_total", "vocalis_errors_total", "vocalis_queue_depth", "vocalis_active_streams",
                 "vocalis_first_chunk_seconds_bucket", "vocalis_rtf_bucket", "vocalis_running_jobs"):
        assert name in text, name
    assert 'vocalis_requests_total{route="/v1/audio/speech",status="200"}' in text
    assert 'vocalis_first_chunk_seconds_count{route="/v1/audio/speech"}' in text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}
    if sys.platform.startswith("linux"):  # the process's memory: resident now, and a peak at least that
        assert values["process_resident_memory_bytes"] > 50e6
        assert values["vocalis_process_peak_resident_memory_bytes"] >= values["process_resident_memory_bytes"]


def test_api_key_everywhere_but_health(tts) -> None:
    with serve(tts, api_key="s3cret") as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.get("/health").status_code == 200
        for method, path in (("POST", "/v1/audio/speech"), ("GET", "/v1/audio/voices"), ("GET", "/metrics"),
                             ("POST", "/inference_sft"), ("DELETE", "/v1/audio/voices/x"), ("GET", "/v1/models")):
            r = c.request(method, path, json={"input": "Hi."})
            assert r.status_code == 401, (path, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
        assert speech(c, input="Hi.", response_format="pcm").status_code == 401
        wrong = c.post("/v1/audio/speech", json={"input": "Hi."}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = c.post("/v1/audio/speech", json={"input": "Hi.", "response_format": "pcm"},
                    headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and len(ok.content) > 0


def test_full_engine_answers_503_with_retry_after(tts) -> None:
    """Admission is bounded by the jobs in flight: with room for two, a third request is refused at once with 503 +
    Retry-After; the two in flight end (done, or aborted when their clients leave) and nothing stays behind."""
    with serve(tts, backend_opts={"max_queue": 2}) as srv:
        backend = srv.backend
        completed, aborted = backend.completed, backend.aborted
        body = {"input": LONG_TEXT * 3, "response_format": "pcm"}
        with httpx.Client(base_url=srv.url, timeout=120) as c1, c1.stream("POST", "/v1/audio/speech", json=body) as r1, \
                httpx.Client(base_url=srv.url, timeout=120) as c2, c2.stream("POST", "/v1/audio/speech", json=body) as r2:
            raw1, raw2 = r1.iter_raw(), r2.iter_raw()  # keep the iterators: dropping one closes its connection
            next(raw1), next(raw2)  # both jobs run
            r3 = httpx.post(srv.url + "/v1/audio/speech", json={"input": "Hi."}, timeout=30)
            assert r3.status_code == 503 and r3.headers["retry-after"] == "2"
            assert "busy" in r3.json()["error"]["message"]
        wait_idle(backend, timeout=600)
        ended = (backend.aborted - aborted) + (backend.completed - completed)
        assert ended == 2, (backend.aborted, backend.completed)


def test_request_timeout_is_504(tts) -> None:
    with serve(tts, request_timeout_s=0.01) as srv:  # a long text: "Hi." was done within 10 ms once
        r = httpx.post(srv.url + "/v1/audio/speech", json={"input": LONG_TEXT, "stream": False}, timeout=60)
        assert r.status_code == 504 and "longer than" in r.json()["error"]["message"]


def test_voice_dir_untouched_by_speech_errors(server) -> None:
    assert sorted(Path(server.voices_dir).iterdir()) == []


@pytest.mark.parametrize("fmt", ["wav", "pcm", "flac", "mp3", "opus", *(["aac"] if AAC else [])])
def test_encoder_takes_empty_chunks_and_closes_unfinished(fmt: str) -> None:
    """Empty chunks (a trimmed stream's held-back silence, a bi-stream's empty end) change nothing in the file, and
    an encoder whose client left is closed without finishing (twice is harmless)."""
    from vocalis.serve.audio_encoding import AudioEncoder

    x, empty = np.sin(np.arange(12000, dtype=np.float32) / 9) * 0.3, np.zeros(0, np.float32)
    plain = AudioEncoder(fmt, 24000)
    want = plain.push(x) + plain.finish()
    gaps = AudioEncoder(fmt, 24000)
    got = gaps.push(empty) + gaps.push(x) + gaps.push(empty) + gaps.finish()
    if fmt == "opus":  # an Ogg stream's serial number is random: the same audio, other bytes
        np.testing.assert_array_equal(decode_audio(fmt, got), decode_audio(fmt, want))
    else:
        assert got == want
    left = AudioEncoder(fmt, 24000)
    left.push(x)
    left.close()
    left.close()
