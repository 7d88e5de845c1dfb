"""Helpers for the server tests: a short-spoken tiny model and a real uvicorn server on 127.0.0.1.

The tiny model's random LLM rarely samples eos, so every utterance would run to the length limit (12 s of
noise, tens of seconds of CPU). `make_quick_tiny_model_dir` raises the eos bias of the speech head, so
utterances end at the minimum length (2 speech tokens per text token): the whole pipeline still runs, fast.
"""

from __future__ import annotations

import io
import logging
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from safetensors.torch import load_file, save_file
from tiny_assets import make_tiny_model_dir


def make_quick_tiny_model_dir(directory: Path, eos_boost: float = 30.0) -> Path:
    """`make_tiny_model_dir` with the speech head's eos logit raised by `eos_boost`."""
    from vocalis.config import PRESETS

    make_tiny_model_dir(directory)
    eos = PRESETS["tiny"].llm.eos_token
    weights = load_file(str(directory / "llm.safetensors"))
    weights["llm_decoder.bias"][eos] += eos_boost
    save_file(weights, str(directory / "llm.safetensors"))
    return directory


_QUICK: dict[str, object] = {}


def aac_supported() -> bool:
    """Whether this environment writes aac (PyAV installed: the aac extra); else aac is a 400."""
    from vocalis.serve.audio_encoding import supported_formats

    return "aac" in supported_formats()


def check_aac(r: httpx.Response) -> None:
    """An aac answer: audio where the encoder is installed, else the 400 naming the format."""
    if aac_supported():
        assert r.status_code == 200 and r.headers["content-type"] == "audio/aac", r.text
        assert len(decode_audio("aac", r.content)) > 0
    else:
        assert r.status_code == 400 and "aac" in r.json()["error"]["message"], r.text


def free_port() -> int:
    """A port free on 127.0.0.1 right now (for servers started as separate processes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, what: str = "the server") -> None:
    """Poll `url`/health until it answers 200; fail with the process output if it exits or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{what} did not come up"
        time.sleep(0.3)


def quick_tts(tmp_path_factory: pytest.TempPathFactory):
    """One quick tiny model directory and `TTS` per test session, shared by the server test modules."""
    if "tts" not in _QUICK:
        from vocalis.tts import TTS

        _QUICK["dir"] = make_quick_tiny_model_dir(tmp_path_factory.mktemp("model") / "tiny")
        _QUICK["tts"] = TTS.load(_QUICK["dir"])
    return _QUICK["tts"]


def serve(tts: object, backend_opts: dict | None = None, **config: object) -> ServerThread:
    """A `ServerThread` around a fresh app and backend over `tts` (use it as a context manager)."""
    from vocalis.serve.app import create_app
    from vocalis.serve.config import ServeConfig
    from vocalis.serve.engine_backend import EngineBackend

    backend = EngineBackend(tts, **(backend_opts or {}))
    app = create_app(backend, ServeConfig(**config))  # type: ignore[arg-type]
    return ServerThread(app, backend)


def reference_backend(tts: object, **backend_opts: object) -> object:
    """The one-job-at-a-time reference backend over `tts`'s model (its queue is what queue-timeout tests need)."""
    from vocalis.reference.threaded_backend import ReferenceTTS, ThreadedBackend

    return ThreadedBackend(ReferenceTTS(tts.model), **backend_opts)  # type: ignore[attr-defined]


def serve_backend(backend: object, log_level: str = "warning", **config: object) -> ServerThread:
    """A `ServerThread` around a fresh app over `backend`."""
    from vocalis.serve.app import create_app
    from vocalis.serve.config import ServeConfig

    return ServerThread(create_app(backend, ServeConfig(**config)), backend, log_level)  # type: ignore[arg-type]


class ServerThread:
    """`vocalis serve`'s server (uvicorn with the head timeout and drain) on 127.0.0.1 at a free port, in a
    background thread."""

    def __init__(self, app: object, backend: object = None, log_level: str = "warning") -> None:
        from vocalis.serve.server import make_server

        self.app = app
        self.backend = backend

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(app, log_level=log_level, timeout_graceful_shutdown=5, ws_ping_interval=None)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:  # noqa: PYI034
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


def decode_audio(fmt: str, data: bytes, sample_rate: int = 24000, frames: int | None = None) -> np.ndarray:
    """Response bytes -> (N,) float32.

    A streamed FLAC's STREAMINFO says "length unknown" (valid FLAC, but libsndfile's reader cannot handle it), so
    its sample count must be given as `frames` (e.g. from the same request made with `stream: false`).
    """
    if fmt == "pcm":
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0
    if fmt == "aac":  # libsndfile reads no AAC: PyAV (FFmpeg) decodes it
        import av

        with av.open(io.BytesIO(data)) as container:
            assert container.streams.audio[0].rate == sample_rate
            return np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)])
    if fmt == "flac" and int.from_bytes(data[21:26], "big") & 0xFFFFFFFFF == 0:
        assert frames is not None, "a streamed FLAC needs its sample count"
        b = bytearray(data)
        b[21:26] = ((int.from_bytes(b[21:26], "big") & ~0xFFFFFFFFF) | frames).to_bytes(5, "big")
        data = bytes(b)
    with sf.SoundFile(io.BytesIO(data)) as f:
        assert f.samplerate == sample_rate, f.samplerate
        return f.read(dtype="float32")


class LogLines(logging.Handler):
    """Every log message it receives, formatted, in order."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
