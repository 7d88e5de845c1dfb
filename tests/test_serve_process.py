"""`vocalis serve` as a real process on 127.0.0.1: starts, answers, saves voices where told, stops on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
from serve_support import free_port, make_quick_tiny_model_dir, wait_healthy


def test_serve_command(tmp_path: Path) -> None:
    model = make_quick_tiny_model_dir(tmp_path / "model")
    port = free_port()
    cmd = [sys.executable, "-m", "vocalis", "serve", "--model", str(model), "--port", str(port), "--threads", "1",
           "--voices-dir", str(tmp_path / "voices"), "--api-key", "k", "--voice-alias", "alloy=default"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 60, "the server")
        r = httpx.post(url + "/v1/audio/speech", json={"input": "Hi.", "voice": "alloy", "response_format": "wav"},
                       headers={"Authorization": "Bearer k"}, timeout=60)
        assert r.status_code == 200 and r.content[:4] == b"RIFF"
        assert httpx.get(url + "/", timeout=10).status_code == 200  # the web page needs no key
        assert (tmp_path / "voices").is_dir()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    # uvicorn shuts down gracefully, then re-raises the signal it caught (exit status -15)
    assert proc.returncode in (0, -signal.SIGTERM) and "Finished server process" in out, out
    assert "Traceback" not in out, out


def test_aac_without_its_encoder_is_a_400(tmp_path: Path) -> None:
    """aac needs PyAV (the aac extra): a server without it answers aac with a 400 and the formats it has."""
    model = make_quick_tiny_model_dir(tmp_path / "model")
    port = free_port()
    without_av = "import sys; sys.modules['av'] = None; from vocalis.cli import main; sys.exit(main())"
    cmd = [sys.executable, "-c", without_av, "serve", "--model", str(model), "--port", str(port), "--threads", "1",
           "--voices-dir", str(tmp_path / "voices")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 60, "the server")
        assert "aac" not in httpx.get(url + "/health", timeout=10).json()["formats"]
        r = httpx.post(url + "/v1/audio/speech", json={"input": "Hi.", "response_format": "aac"}, timeout=60)
        assert r.status_code == 400 and "'aac' is not supported" in r.json()["error"]["message"], r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def test_serve_bad_argument_exits_2() -> None:
    r = subprocess.run([sys.executable, "-m", "vocalis", "serve", "--port", str(free_port()), "--voice-alias", "alloy"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and "NAME=VOICE" in r.stderr, r.stderr


def test_load_script_is_loopback_only() -> None:
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "load_test.py"
    r = subprocess.run([sys.executable, str(script), "--url", "http://10.1.2.3:8000"], capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode != 0 and "only loopback" in r.stderr
