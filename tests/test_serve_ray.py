"""`vocalis serve --ray --replicas 2` as a real process: Ray Serve on 127.0.0.1 with two model replicas, for a
CosyVoice 2 layout (the tiny preset) and a CosyVoice 3 one (the compat_cv3 fixture, with tiny v3 speech tokenizer
and CAM++ files so that voices can be made from audio).

Needs `ray[serve]` (dev extra); skipped without it outside CI.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from serve_support import free_port, make_quick_tiny_model_dir, wait_healthy
from tiny_assets import write_voice_like_wav

try:
    import ray  # noqa: F401
    from ray import serve  # noqa: F401
except ImportError:
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("Ray Serve is not installed (pip install 'ray[serve]')", allow_module_level=True)


@pytest.fixture(params=["cosyvoice2", "cosyvoice3"])
def model(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    if request.param == "cosyvoice2":
        return make_quick_tiny_model_dir(tmp_path / "model")
    from cv3_support import make_cv3_model_dir

    return make_cv3_model_dir(tmp_path / "model", request.getfixturevalue("cv3_dir"), clone=True)


@pytest.mark.slow
def test_ray_serve_two_replicas(model: Path, tmp_path: Path) -> None:
    clip = write_voice_like_wav(tmp_path / "me.wav", 2.0).read_bytes()
    port = free_port()
    ray_tmp = tempfile.mkdtemp(prefix="vray", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": ray_tmp}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "vocalis", "serve", "--ray", "--replicas", "2", "--model", str(model),
           "--port", str(port), "--threads", "1", "--voices-dir", str(tmp_path / "voices")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 150, "Ray Serve")
        # both replicas answer (the second may still be loading when the first passes the health check)
        replicas: set[str] = set()
        deadline = time.monotonic() + 90
        while len(replicas) < 2 and time.monotonic() < deadline:
            replicas.add(httpx.get(url + "/health", timeout=10).json()["replica"])
            time.sleep(0.05)
        assert len(replicas) == 2, replicas
        r = httpx.post(url + "/v1/audio/voices", data={"name": "me", "text": "hello there"},
                       files={"audio": ("me.wav", clip)}, timeout=60)
        assert r.status_code == 201, r.text
        for _ in range(4):  # whichever replica answers knows the voice saved through the other
            r = httpx.post(url + "/v1/audio/speech", json={"input": "Hi.", "voice": "me", "response_format": "pcm"},
                           timeout=60)
            assert r.status_code == 200 and len(r.content) > 0, r.text
        with httpx.stream("POST", url + "/v1/audio/speech", timeout=60,
                          json={"input": "Hello there. How are you?", "response_format": "wav"}) as r:
            body = b"".join(r.iter_raw())
        assert r.status_code == 200 and body[:4] == b"RIFF" and len(body) > 44
        bad = httpx.post(url + "/v1/audio/speech", json={"input": ""}, timeout=30)
        assert bad.status_code == 400 and "error" in bad.json()

        import websockets.sync.client as ws_client

        with ws_client.connect(url.replace("http", "ws") + "/v1/audio/speech/ws") as ws:
            ws.send(json.dumps({"type": "start"}))
            assert json.loads(ws.recv(timeout=60))["type"] == "ready"
            ws.send(json.dumps({"type": "text", "text": "Hello from Ray."}))
            ws.send(json.dumps({"type": "end"}))
            audio = b""
            while isinstance(msg := ws.recv(timeout=60), bytes):
                audio += msg
            assert json.loads(msg)["type"] == "done" and len(audio) > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session holds only this command's Ray processes
            out, _ = proc.communicate()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, out
    leftovers = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True, check=False).stdout
    assert leftovers.strip() == "", f"Ray processes left behind: {leftovers}"
