"""`vocalis serve` with a CosyVoice 3 model, on a real server on 127.0.0.1: the compat_cv3 folder made servable
(`cv3_support.make_cv3_model_dir`: a tokenizer, an sft and a zero-shot speaker, tiny v3 speech tokenizer and CAM++
ONNX files). The OpenAI speech route, whole and streamed, equals the batch-1 reference path for the same seed (sft,
zero-shot, instruct, a saved voice made from speech ids, voices made from audio), also with requests batched
together, and so does the WebSocket route with text in pieces (bi-streaming); bad input is a clean 400, never a
traceback."""

from __future__ import annotations

import base64
import io
import json
import logging
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from cv3_support import cv3_reference, make_cv3_model_dir, reference_audio
from serve_support import check_aac, decode_audio, free_port, serve, wait_healthy
from tiny_assets import write_voice_like_wav

from vocalis.frontend.audio import load_wav, mel_spectrogram
from vocalis.frontend.voice import Voice
from vocalis.model_dir import read_official_yaml
from vocalis.tts import TTS

PCM_ATOL = 1e-4  # int16 on the wire: 1.5e-5 of rounding on top of the engine == reference margin


@pytest.fixture(scope="module")
def model_dir(cv3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("onnx")  # the tiny frontend ONNX files are exported through it
    return make_cv3_model_dir(tmp_path_factory.mktemp("cv3") / "Fun-CosyVoice3-tiny", cv3_dir, clone=True)


@pytest.fixture(scope="module")
def tts(model_dir: Path):
    t = TTS.load(model_dir)
    yield t
    t.close()


@pytest.fixture(scope="module")
def voices_dir(cv3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A voices folder holding one saved voice made from speech ids."""
    folder = tmp_path_factory.mktemp("voices")
    ref = cv3_reference(cv3_dir, "ref_flow")
    Voice("mine", "Hello world.", (9906, 1879, 13), tuple(ref["prompt_token"][0].tolist()), ref["prompt_feat"][0],
          ref["embedding"][0]).save(folder / "mine.safetensors")
    return folder


@pytest.fixture(scope="module")
def server(tts: TTS, voices_dir: Path):
    with serve(tts, api_key="k", voices_dir=voices_dir) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=300, headers={"Authorization": "Bearer k"}) as c:
        yield c


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return write_voice_like_wav(tmp_path_factory.mktemp("clip") / "v.wav", 1.0).read_bytes()


def _speech(client: httpx.Client, **body: object) -> np.ndarray:
    fmt = str(body.setdefault("response_format", "pcm"))
    r = client.post("/v1/audio/speech", json=body)
    assert r.status_code == 200, r.text
    return decode_audio(fmt, r.content)


def _reference(tts: TTS, text: str, voice: str | Voice, seed: int, stream: bool, instruct: str | None = None,
               ) -> list[np.ndarray]:
    """The reference path's chunks for what the server is asked (int16 on the wire clips to [-1, 1])."""
    v = tts.model.voices[voice] if isinstance(voice, str) else voice
    request = tts.request(text, voice=v, seed=seed, instruct=instruct)
    return [np.clip(c, -1.0, 1.0) for c in reference_audio(tts, request, stream)]


def _close(got: np.ndarray, chunks: list[np.ndarray], what: str) -> None:
    want = np.concatenate(chunks)
    assert len(got) == len(want), f"{what}: {len(got)} samples != {len(want)}"
    diff = float(np.abs(got - want).max())
    print(f"[cv3 serve] {what}: {len(got)} samples, max abs diff {diff:.2e}")
    assert diff <= PCM_ATOL, what


@pytest.mark.parametrize(("voice", "instruct"), [("default", None), ("zs", None), ("default", "Speak slowly.")],
                         ids=["sft", "zero_shot", "instruct"])
def test_speech_equals_the_reference_whole_and_streamed(client, tts: TTS, voice: str, instruct: str | None) -> None:
    extra = {"instructions": instruct} if instruct else {}
    streamed = _speech(client, input="Hi there.", voice=voice, seed=1, **extra)
    whole = _speech(client, input="Hi there.", voice=voice, seed=1, stream=False, response_format="wav", **extra)
    chunks = _reference(tts, "Hi there.", voice, 1, True, instruct)
    assert len(chunks) >= 2  # the seed makes an utterance long enough for a chunk before the final one
    _close(streamed, chunks, f"{voice} streamed")
    _close(whole, _reference(tts, "Hi there.", voice, 1, False, instruct), f"{voice} whole")


def test_saved_voice_from_ids_and_openai_names(client, tts: TTS, voices_dir: Path) -> None:
    listed = client.get("/v1/audio/voices").json()
    kinds = {v["name"]: (v["kind"], v["modes"]) for v in listed["data"]}
    assert kinds == {"default": ("builtin", ["sft"]), "mine": ("saved", ["zero_shot", "cross_lingual", "instruct", "vc"]),
                     "zs": ("builtin", ["zero_shot", "cross_lingual", "instruct", "vc"])}
    got = _speech(client, input="Hello.", voice="mine", seed=5)
    _close(got, _reference(tts, "Hello.", Voice.load(voices_dir / "mine.safetensors"), 5, True), "saved voice")
    # an unchanged OpenAI client names OpenAI's voices: they map onto the built-in ones
    alloy = listed["aliases"]["alloy"]
    np.testing.assert_array_equal(_speech(client, input="Hello.", voice="alloy", seed=5),
                                  _speech(client, input="Hello.", voice=alloy, seed=5))


def test_batched_requests_equal_each_alone(client, tts: TTS) -> None:
    texts = ["Hi there.", "Good day.", "Hello."]
    steps0 = tts.engine.num_llm_steps
    with ThreadPoolExecutor(len(texts)) as pool:
        got = list(pool.map(lambda i: _speech(client, input=texts[i], voice="default", seed=10 + i), range(3)))
    steps = tts.engine.num_llm_steps - steps0
    for i, (text, audio) in enumerate(zip(texts, got)):
        _close(audio, _reference(tts, text, "default", 10 + i, True), f"batched {i}")
    # one LLM step serves every running request: fewer steps than one request after another would take
    assert steps < 0.8 * sum(len(a) // 960 for a in got), steps


PIECES = ["Hello there, ", "how are ", "you?"]


@pytest.mark.parametrize("voice", ["zs", "default"])
def test_websocket_text_in_pieces_equals_the_reference(server, tts: TTS, voice: str) -> None:
    ws_sync = pytest.importorskip("websockets.sync.client", reason="websockets is part of the dev extra")
    url = server.url.replace("http://", "ws://") + "/v1/audio/speech/ws"
    audio, messages = b"", []
    with ws_sync.connect(url, additional_headers={"Authorization": "Bearer k"}, open_timeout=30) as ws:
        ws.send(json.dumps({"type": "start", "voice": voice, "response_format": "pcm", "seed": 2}))
        messages.append(json.loads(ws.recv(timeout=60)))
        for piece in PIECES:
            ws.send(json.dumps({"type": "text", "text": piece}))
        ws.send(json.dumps({"type": "end"}))
        while True:
            m = ws.recv(timeout=300)
            if isinstance(m, bytes):
                audio += m
                continue
            messages.append(json.loads(m))
            if messages[-1]["type"] in ("done", "error"):
                break
    assert [m["type"] for m in messages] == ["ready", "done"], messages
    request = tts.request(iter(PIECES), voice=tts.model.voices[voice], seed=2)
    chunks = [np.clip(c, -1.0, 1.0) for c in reference_audio(tts, request, True, PIECES)]
    assert len(chunks) >= 2
    _close(decode_audio("pcm", audio), chunks, f"websocket {voice}")


def test_cosyvoice_routes_and_formats(client) -> None:
    sft = client.post("/inference_sft", data={"tts_text": "Hi there.", "spk_id": "default", "seed": "3"})
    assert sft.status_code == 200 and sft.headers["x-sample-rate"] == "24000"
    np.testing.assert_array_equal(decode_audio("pcm", sft.content),
                                  _speech(client, input="Hi there.", voice="default", seed=3))
    mp3 = client.post("/v1/audio/speech", json={"input": "Hi.", "voice": "default"})
    assert mp3.status_code == 200 and len(decode_audio("mp3", mp3.content)) > 0


def test_voices_from_audio_equal_the_reference(client, tts: TTS, clip: bytes, cv3_dir: Path) -> None:
    """The v3 speech tokenizer and CAM++ make a voice from a clip in every route that takes one; its audio is the
    reference path's for the voice the frontend makes of the same clip."""
    voice = tts.frontend.make_voice(io.BytesIO(clip), "hello")
    frames = 2 * len(voice.prompt_speech_ids)
    assert frames and voice.prompt_mel.shape == (frames, 80)
    # the prompt mel is the official feature extractor's, as the yaml gives it (CosyVoice 3: fmax null)
    fe = read_official_yaml(cv3_dir / "cosyvoice3.yaml")["feat_extractor"]
    wav24k = load_wav(io.BytesIO(clip), fe["sampling_rate"])
    mel = mel_spectrogram(wav24k, fe["sampling_rate"], fe["n_fft"], fe["hop_size"], fe["num_mels"], fe["fmin"],
                          fe["fmax"], fe["win_size"])
    torch.testing.assert_close(voice.prompt_mel, mel.T[:frames], rtol=0, atol=0)
    want = _reference(tts, "Hi.", voice, 4, True)
    b64 = base64.b64encode(clip).decode()
    _close(_speech(client, input="Hi.", ref_audio=b64, ref_text="hello", seed=4), want, "ref_audio")
    r = client.post("/v1/audio/voices", data={"name": "new", "text": "hello"}, files={"audio": ("p.wav", clip)})
    assert r.status_code == 201, r.text
    try:
        _close(_speech(client, input="Hi.", voice="new", seed=4), want, "voice made from audio")
    finally:
        assert client.delete("/v1/audio/voices/new").json()["deleted"] is True
    zs = client.post("/inference_zero_shot", data={"tts_text": "Hi.", "prompt_text": "hello", "seed": "4"},
                     files={"prompt_wav": ("p.wav", clip)})
    assert zs.status_code == 200, zs.text
    _close(decode_audio("pcm", zs.content), want, "inference_zero_shot")
    for path, data, files in [("/inference_cross_lingual", {"tts_text": "Hi."}, {"prompt_wav": ("p.wav", clip)}),
                              ("/inference_vc", {"spk_id": "zs"}, {"source_wav": ("s.wav", clip)})]:
        r = client.post(path, data=data, files=files)
        assert r.status_code == 200 and len(decode_audio("pcm", r.content)) > 0, (path, r.text)


def test_bad_input_is_a_clean_400(client, caplog: pytest.LogCaptureFixture) -> None:
    for body, needle in [({"input": "Hi.", "voice": "nobody"}, "unknown voice"),
                         ({"input": "", "voice": "default"}, "input"),
                         ({"input": "Hi.", "ref_audio": base64.b64encode(b"junk").decode()}, "audio")]:
        r = client.post("/v1/audio/speech", json=body)
        assert r.status_code in (400, 415) and needle in r.json()["error"]["message"], r.text
    check_aac(client.post("/v1/audio/speech", json={"input": "Hi.", "voice": "default", "response_format": "aac"}))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_vocalis_serve_command_with_a_cv3_model(model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "vocalis", "serve", "--model", str(model_dir), "--port", str(port), "--threads", "1",
           "--voices-dir", str(tmp_path / "voices")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 120, "the CosyVoice 3 server")
        r = httpx.post(url + "/v1/audio/speech", json={"input": "Hi.", "voice": "default", "response_format": "wav",
                                                        "stream": False}, timeout=300)
        assert r.status_code == 200 and r.content[:4] == b"RIFF"
        assert "cosyvoice3" in httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["description"]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode in (0, -signal.SIGTERM) and "Finished server process" in out, out
    assert "Traceback" not in out, out


def test_the_helper_dir_is_the_fixture(model_dir: Path, cv3_dir: Path) -> None:
    """Only the speech head's stop rows differ from the fixture's weights."""
    ours = torch.load(model_dir / "llm.pt", weights_only=True)
    theirs = torch.load(cv3_dir / "llm.pt", weights_only=True)
    assert ours.keys() == theirs.keys()
    changed = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert changed == ["llm_decoder.weight"]
    v = ours["speech_embedding.weight"].shape[0] - 200
    assert torch.equal(ours[changed[0]][:v], theirs[changed[0]][:v]) and not ours[changed[0]][v:].any()
