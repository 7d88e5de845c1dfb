#!/usr/bin/env python
"""Probe `vocalis serve` as its users and an attacker would, on this machine only, and print what it answered.

Starts its own server (`python -m vocalis serve` on 127.0.0.1, a free port, an API key, short time limits so
the probe is quick) and runs:

1. a table of bad inputs -> statuses (text caps, the LLM prompt bound, speakable-but-awkward text, Host/Origin,
   CORS for an allowed origin, API key before the body and out of the log whatever its spelling, voice names,
   deep JSON, a client leaving mid-body, WebSocket binary frames, a multi-byte error reason, idle and session
   caps, slow heads and bodies, deadlines, cloning on every route, aac, what /health says);
2. a short load run with aborts (C clients x R requests; errors, first-chunk p50/p95, the server's RSS);
3. kill -9 during voice creation (K times) and during streams, then a restart that must load every saved voice;
4. SIGTERM during streams: how long until the process is gone, and what the clients got.

    python scripts/probe_server.py --model DIR [--clients 8 --requests 4 --abort-fraction 0.2 --kills 5]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from probe_speech import speech_rows

KEY = "probe-key-7f3a"
APP_ORIGIN = "https://app.example"  # started with --allowed-origins: a web app that may call the API
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = ["--queue-timeout", "2", "--request-timeout", "5", "--ws-idle-timeout", "3", "--ws-max-duration", "8",
          "--header-timeout", "3", "--body-timeout", "3", "--shutdown-grace", "2"]
LONG_TEXT = " ".join(["This is a fairly long sentence that keeps the synthesis busy for a while."] * 12)


# ---- the server --------------------------------------------------------------------------------------------
class Server:
    """`vocalis serve` as a child process; its output is kept (to look for tracebacks and the key)."""

    count = 0

    def __init__(self, args: argparse.Namespace, voices_dir: Path, extra: list[str] | None = None) -> None:
        Server.count += 1
        self.log_file = Path(args.keep_logs) / f"server{Server.count}.log" if args.keep_logs else None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "vocalis", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--voices-dir", str(voices_dir), "--api-key", KEY, "--allowed-origins", APP_ORIGIN, *LIMITS,
               *(extra or [])]
        if args.model:
            cmd += ["--model", args.model]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        self.log: list[str] = []
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                time.sleep(0.2)
                sys.exit("probe: the server exited:\n" + "".join(self.log[-30:]))
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.3)
        self.proc.kill()
        sys.exit("probe: the server did not start within 180 s")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            self.log_file.write_text("".join(self.log))

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> float:
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return time.monotonic() - t0


# ---- 1. the table ------------------------------------------------------------------------------------------
def raw(port: int, data: bytes, wait_s: float, trickle: bytes = b"") -> tuple[str, float]:
    """Send `data` (then `trickle` a byte every 0.5 s); the status line the server answers and when."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(data)
        s.settimeout(0.5)
        got = b""
        for i in range(int(wait_s / 0.5)):
            with contextlib.suppress(TimeoutError):
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
                break
            if trickle:
                with contextlib.suppress(OSError):
                    s.sendall(trickle[i % len(trickle): i % len(trickle) + 1])
    line = got.split(b"\r\n", 1)[0].decode(errors="replace")
    return (line.split(" ")[1] if line.startswith("HTTP/") else "closed"), time.monotonic() - t0


def ws_probe(url: str, messages: list[object], headers: dict[str, str] | None = None,
             every_s: float = 0.0, for_s: float = 0.0) -> tuple[str, float]:
    """A WebSocket session: its close code (or the refused handshake's status) and when it ended."""
    import websockets.sync.client as wsc
    from websockets.exceptions import ConnectionClosed, InvalidStatus

    t0 = time.monotonic()
    try:
        ws = wsc.connect(url.replace("http://", "ws://") + f"/v1/audio/speech/ws?api_key={KEY}",
                         additional_headers=headers or {}, open_timeout=30)
    except InvalidStatus as exc:
        return f"handshake {exc.response.status_code}", time.monotonic() - t0
    with ws, contextlib.suppress(ConnectionClosed):
        for m in messages:
            ws.send(m if isinstance(m, (str, bytes)) else json.dumps(m))
        while time.monotonic() - t0 < 60:
            if every_s and time.monotonic() - t0 < for_s:
                ws.send(json.dumps({"type": "text", "text": " "}))
            with contextlib.suppress(TimeoutError):
                ws.recv(timeout=every_s or 30)
    return f"close {ws.close_code}", time.monotonic() - t0


def probe_table(srv: Server, clip: bytes) -> list[tuple[str, str, str, float]]:
    url = srv.url
    rows: list[tuple[str, str, str, float]] = []
    c = httpx.Client(base_url=url, timeout=120, headers=AUTH)
    wav = {"prompt_wav": ("c.wav", clip, "audio/wav")}

    def http(name: str, expect: str, call: Callable[[], httpx.Response]) -> None:
        t0 = time.monotonic()
        try:
            got = str(call().status_code)
        except httpx.HTTPError as exc:
            got = type(exc).__name__
        rows.append((name, expect, got, time.monotonic() - t0))

    def other(name: str, expect: str, call: Callable[[], tuple[str, float]]) -> None:
        got, took = call()
        rows.append((name, expect, got, took))

    big = "x" * 100_000
    http("form instruct_text 100k chars (instruct2)", "400", lambda: c.post(
        "/inference_instruct2", data={"tts_text": "Hi.", "instruct_text": big}, files=wav))
    http("form prompt_text 100k chars (zero_shot)", "400", lambda: c.post(
        "/inference_zero_shot", data={"tts_text": "Hi.", "prompt_text": big}, files=wav))
    http("form tts_text 5000 chars (sft)", "400", lambda: c.post(
        "/inference_sft", data={"tts_text": "x" * 5000, "spk_id": "default"}))
    http("JSON instructions 100k chars", "400", lambda: c.post("/v1/audio/speech", json={"input": "Hi.",
                                                                                       "instructions": big}))
    http("JSON ref_text 5000 chars", "400", lambda: c.post("/v1/audio/speech", json={"input": "Hi.",
                                                                                   "ref_text": "x" * 5000}))
    http("LLM prompt over --max-prompt-tokens", "400", lambda: c.post("/v1/audio/speech", json={
        "input": "7 " * 2040, "instructions": "7 " * 2040}))
    for text in ("See [1] for details.", "[31m", "[5kg"):
        http(f"speakable text {text!r}", "200", lambda t=text: c.post("/v1/audio/speech", json={
            "input": t, "response_format": "pcm"}))
    http("Host: evil.example (DNS rebinding)", "403", lambda: c.get("/v1/audio/voices",
                                                                   headers={"Host": "evil.example"}))
    http("cross-site POST (Origin: evil)", "403", lambda: c.post("/v1/audio/voices", data={"name": "x"},
                                                                files={"audio": ("v.wav", clip)},
                                                                headers={"Origin": "https://evil.example"}))
    other("cross-site WebSocket", "handshake 403", lambda: ws_probe(url, [], {"Origin": "https://evil.example"}))
    other("15 MB body, no key: answered before the body", "401", lambda: raw(
        srv.port, b"POST /inference_zero_shot HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; "
                  b"boundary=b\r\nContent-Length: 15728640\r\n\r\n" + b"x" * 4096, 10))
    http("GET ?api_key= (then: is the key in the log?)", "200", lambda: httpx.get(
        url + f"/v1/audio/voices?api_key={KEY}", headers=AUTH, timeout=30))
    for spelling in ("API_KEY", "api%5Fkey", "Api_Key"):
        http(f"GET ?{spelling}= (then: is the key in the log?)", "200", lambda q=spelling: httpx.get(
            url + f"/v1/audio/voices?{q}={KEY}", headers=AUTH, timeout=30))
    preflight = {"Origin": APP_ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    other("CORS preflight, allowed origin, no key", "200 + allow-origin", lambda: cors(url, "OPTIONS", preflight))
    other("CORS POST, allowed origin", "200 + allow-origin", lambda: cors(url, "POST", {
        "Origin": APP_ORIGIN, **AUTH}, {"input": "Hi.", "response_format": "pcm"}))
    other("CORS preflight, loopback page", "200 + allow-origin", lambda: cors(url, "OPTIONS", {
        **preflight, "Origin": "http://localhost:5173"}))
    other("CORS preflight, evil origin", "403", lambda: cors(url, "OPTIONS", {
        **preflight, "Origin": "https://evil.example"}))
    for name in ("nl\n", "con", "NUL.x", "trailing."):
        http(f"voice name {name!r}", "400", lambda n=name: c.post("/v1/audio/voices", data={"name": n},
                                                                   files={"audio": ("v.wav", clip)}))
    http("JSON nested 100,000 deep", "400", lambda: c.post(
        "/v1/audio/speech", content=b"[" * 100_000 + b"]" * 100_000, headers={"content-type": "application/json"}))
    before = sum("Traceback" in line for line in srv.log)

    def leave_mid_body() -> tuple[str, float]:
        t0 = time.monotonic()
        for _ in range(200):
            with socket.create_connection(("127.0.0.1", srv.port)) as s:
                s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " +
                          KEY.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n{\"in")
        time.sleep(1)
        return f"{sum('Traceback' in line for line in srv.log) - before} tracebacks", time.monotonic() - t0

    other("200 clients leave mid-body", "0 tracebacks", leave_mid_body)
    other("WebSocket binary frame", "close 4400", lambda: ws_probe(url, [b"\x00\x01"]))
    other("WebSocket error with a 300-char Cyrillic reason", "close 4400", lambda: ws_probe(
        url, [{"type": "start", "voice": "голос" * 60}]))
    other("WebSocket text with 改善 and привет", "close 1000", lambda: ws_probe(url, [
        {"type": "start"}, {"type": "text", "text": "We saw a real 改善 in the results, привет to all."},
        {"type": "end"}]))
    cloned = {"tts_text": "Hi there.", "prompt_text": "hello"}
    for route, data in (("/inference_zero_shot", cloned), ("/inference_cross_lingual", {"tts_text": "Hi there."}),
                        ("/inference_vc", {})):
        files = {**wav, "source_wav": ("s.wav", clip, "audio/wav")} if route == "/inference_vc" else wav
        http(f"clone: {route}", "200", lambda r=route, d=data, f=files: c.post(r, data=d, files=f))
    http("clone: POST /v1/audio/voices", "201", lambda: c.post("/v1/audio/voices", data={"name": "probe-clone",
                                                                                        "text": "hello"},
                                                                files={"audio": ("v.wav", clip)}))
    http("clone: ref_audio on /v1/audio/speech", "200", lambda: c.post("/v1/audio/speech", data={
        "input": "Hi there.", "response_format": "pcm"}, files={"ref_audio": ("r.wav", clip)}))
    aac_expected = "200" if "aac" in httpx.get(url + "/health", timeout=30).json()["formats"] else "400"
    http(f"response_format aac ({'encoder installed' if aac_expected == '200' else 'no encoder'})", aac_expected,
         lambda: c.post("/v1/audio/speech", json={"input": "Hi.", "response_format": "aac"}))
    other("WebSocket start, then nothing (--ws-idle-timeout 3)", "close 4408", lambda: ws_probe(
        url, [{"type": "start"}]))
    other("WebSocket a space every 1 s (--ws-max-duration 8)", "close 4504", lambda: ws_probe(
        url, [{"type": "start"}], every_s=1.0, for_s=30))
    other("head a byte every 0.5 s (--header-timeout 3)", "408", lambda: raw(
        srv.port, b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\n", 15, trickle=b"X-Slow: abcdefgh"))
    other("body a byte every 0.5 s (--body-timeout 3)", "408", lambda: raw(
        srv.port, b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() +
        b"\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n", 15, trickle=b'{"input": "hello'))
    http("whole long utterance (--request-timeout 5)", "504", lambda: c.post(
        "/v1/audio/speech", json={"input": LONG_TEXT * 3, "stream": False}))
    rows += speech_rows(c, ws_probe, url)  # what it says and when (probe_speech.py)
    health = httpx.get(url + "/health", timeout=30).json()
    leaks = [k for k in ("pid",) if k in health] + (["path"] if "/" in str(health.get("model")) else [])
    rows.append(("/health: no pid, no path", "model name only",
                 f"LEAKS {leaks}" if leaks else f"model name only ({health.get('model')!r})", 0.0))
    rows.append(("API key in the server's log", "no", "yes" if any(KEY in line for line in srv.log) else "no", 0.0))
    c.close()
    return rows


def cors(url: str, method: str, headers: dict[str, str], body: dict[str, object] | None = None
         ) -> tuple[str, float]:
    """A browser's CORS request: its status, and whether the answer lets the page read it."""
    t0 = time.monotonic()
    r = httpx.request(method, url + "/v1/audio/speech", headers=headers, json=body, timeout=120)
    allowed = r.headers.get("access-control-allow-origin") in (headers["Origin"], "*")
    return f"{r.status_code}{' + allow-origin' if allowed else ''}", time.monotonic() - t0


# ---- 2. load with aborts -----------------------------------------------------------------------------------
def load_run(srv: Server, clients: int, requests: int, abort_fraction: float, seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    texts = ["Hello there.", "How are you today?", "The weather is nice.", "Thanks for calling.", "One moment."]
    firsts: list[float] = []
    errors: dict[str, int] = {}
    aborted = 0
    lock = threading.Lock()
    rss0 = srv.rss_mb()

    def client(i: int) -> None:
        nonlocal aborted
        with httpx.Client(base_url=srv.url, timeout=120, headers=AUTH) as c:
            for _ in range(requests):
                abort = rng.random() < abort_fraction
                t0 = time.monotonic()
                try:
                    with c.stream("POST", "/v1/audio/speech", json={"input": rng.choice(texts),
                                                                     "response_format": "pcm"}) as r:
                        if r.status_code != 200:
                            with lock:
                                errors[str(r.status_code)] = errors.get(str(r.status_code), 0) + 1
                            continue
                        for n, _ in enumerate(r.iter_raw()):
                            if n == 0:
                                with lock:
                                    firsts.append(time.monotonic() - t0)
                            if abort:
                                with lock:
                                    aborted += 1
                                break
                except httpx.HTTPError as exc:
                    with lock:
                        errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    firsts.sort()

    def pct(q: float) -> float:
        return firsts[min(len(firsts) - 1, int(q * len(firsts)))] if firsts else float("nan")

    return {"requests": clients * requests, "errors": errors or 0, "aborted by the client": aborted,
            "first chunk p50 s": round(pct(0.5), 3), "first chunk p95 s": round(pct(0.95), 3),
            "wall s": round(time.monotonic() - t0, 1), "RSS MB before/after": (round(rss0), round(srv.rss_mb()))}


# ---- 3. kill -9 --------------------------------------------------------------------------------------------
def check_voices(args: argparse.Namespace, voices: Path) -> str:
    from vocalis.frontend.voice import Voice

    files = sorted(voices.glob("*.safetensors"))
    bad = []
    for f in files:
        try:
            Voice.load(f)
        except Exception:  # noqa: BLE001  a corrupt file is what this looks for
            bad.append(f.name)
    srv = Server(args, voices)
    listed = httpx.get(srv.url + "/v1/audio/voices", headers=AUTH, timeout=60).json()["data"]
    srv.stop()
    saved = [v for v in listed if v["kind"] == "saved"]
    return (f"{len(files)} files, {len(bad)} unreadable, {len(saved)} listed after restart, "
            f"{len(list(voices.glob('*.tmp')))} partial .tmp left")


def kill_during_voice_creation(args: argparse.Namespace, voices: Path, clip: bytes) -> str:
    rng = random.Random(args.seed)
    for k in range(args.kills):
        srv = Server(args, voices)
        for j in range(3):  # a few complete ones, so there is something to corrupt
            httpx.post(srv.url + "/v1/audio/voices", data={"name": f"ok{k}_{j}"}, files={"audio": ("v.wav", clip)},
                       headers=AUTH, timeout=60)
        threads = [threading.Thread(target=_quiet_post, args=(srv.url, f"kill{k}_{n}", clip)) for n in range(4)]
        for t in threads:
            t.start()
        time.sleep(rng.uniform(0.05, 0.6))
        srv.proc.kill()
        srv.proc.wait()
        for t in threads:
            t.join(30)
    return check_voices(args, voices)


def _quiet_post(url: str, name: str, clip: bytes) -> None:
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(url + "/v1/audio/voices", data={"name": name}, files={"audio": ("v.wav", clip)}, headers=AUTH,
                   timeout=60)


def streams_then(srv: Server, n: int, action: Callable[[], float]) -> tuple[float, dict[str, int]]:
    """Start n long streams, wait for the first bytes, run `action` (a signal); what the clients got."""
    results: dict[str, int] = {}
    started = threading.Event()
    lock = threading.Lock()

    def client() -> None:
        outcome = "?"
        try:
            with httpx.stream("POST", srv.url + "/v1/audio/speech", json={"input": LONG_TEXT,
                              "response_format": "pcm"}, headers=AUTH, timeout=60) as r:
                outcome = str(r.status_code)
                if r.status_code == 200:
                    started.set()
                for _ in r.iter_raw():
                    pass
                outcome += " complete"
        except httpx.HTTPError as exc:
            outcome += f" {type(exc).__name__}"
        with lock:
            results[outcome] = results.get(outcome, 0) + 1

    threads = [threading.Thread(target=client) for _ in range(n)]
    for t in threads:
        t.start()
    started.wait(120)
    took = action()
    for t in threads:
        t.join(60)
    return took, results


# ---- main --------------------------------------------------------------------------------------------------
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the built-in model)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--abort-fraction", type=float, default=0.2)
    p.add_argument("--kills", type=int, default=5, help="kill -9 rounds during voice creation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-logs", metavar="DIR", help="write each server's output to DIR/serverN.log")
    args = p.parse_args()
    import numpy as np
    import soundfile as sf

    with tempfile.TemporaryDirectory() as tmp:
        voices = Path(tmp) / "voices"
        t = np.arange(48000) / 24000
        wav = 0.3 * np.sin(2 * np.pi * 140 * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t) ** 2)
        sf.write(Path(tmp) / "clip.wav", (wav + 0.01 * np.random.default_rng(0).standard_normal(len(t))
                                          ).astype(np.float32), 24000)
        clip = (Path(tmp) / "clip.wav").read_bytes()

        srv = Server(args, voices)
        rows = probe_table(srv, clip)
        print("\n## Bad inputs -> statuses\n\n| probe | expected | got | s |\n|---|---|---|---|")
        for name, expect, got, took in rows:
            mark = "" if got == expect or got.startswith(expect) else " **differs**"
            print(f"| {name} | {expect} | {got}{mark} | {took:.1f} |")
        print(f"\n## Load with aborts ({args.clients} clients x {args.requests} requests)\n")
        for k, v in load_run(srv, args.clients, args.requests, args.abort_fraction, args.seed).items():
            print(f"- {k}: {v}")
        took, got = streams_then(srv, 4, lambda: srv.stop(signal.SIGTERM))
        print(f"\n## SIGTERM during 4 streams (--shutdown-grace 2)\n\n- exited after {took:.1f} s; clients: {got}")
        print("- tracebacks in the server log:", sum("Traceback" in line for line in srv.log))

        print(f"\n## kill -9\n\n- during voice creation, {args.kills} rounds: "
              f"{kill_during_voice_creation(args, voices, clip)}")
        srv = Server(args, voices, ["--queue-timeout", "120"])  # the streams must be running when it dies
        httpx.post(srv.url + "/v1/audio/speech", json={"input": "Warm up."}, headers=AUTH, timeout=120)
        took, got = streams_then(srv, 4, lambda: srv.stop(signal.SIGKILL))
        print(f"- during 4 streams: clients: {got}; then {check_voices(args, voices)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
