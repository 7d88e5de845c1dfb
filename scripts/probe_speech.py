"""`probe_server.py`'s rows about what the server says and when (issue 55): word timestamps, the built-in model's
dropped and run-on sentences, the trimmed and faded end, markdown in pieces. A row: (case, expected, got, seconds).
"""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Callable

import httpx
import numpy as np
import soundfile as sf

DROPPED = "Client eighteen is here today."  # the built-in model used to pause after "Client" to its length bound
RUN_ON = ("Client 18 request 0: the weather today is mild, with light winds and a little sun in the afternoon.")


def _seconds(r: httpx.Response) -> float:
    return len(np.frombuffer(r.content, "<i2")) / int(r.headers.get("X-Sample-Rate", 24000))


def speech_rows(c: httpx.Client, ws_probe: Callable[..., tuple[str, float]], url: str
                ) -> list[tuple[str, str, str, float]]:
    rows: list[tuple[str, str, str, float]] = []

    def row(name: str, expect: str, call: Callable[[], str]) -> None:
        t0 = time.monotonic()
        try:
            got = call()
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            got = type(exc).__name__
        rows.append((name, expect, got, time.monotonic() - t0))

    def timed_json() -> str:
        r = c.post("/v1/audio/speech", json={"input": DROPPED, "seed": 1, "timestamps": True, "stream": False,
                                             "response_format": "wav"})
        if r.status_code != 200:
            return str(r.status_code)
        body = r.json()
        wav, _ = sf.read(io.BytesIO(base64.b64decode(body["audio"])), dtype="float32")
        return f"{' '.join(w['word'].lower() for w in body['words'])}; last sample {abs(wav[-1]):.0g}"

    def timed_sse() -> str:
        r = c.post("/v1/audio/speech", json={"input": DROPPED, "seed": 1, "timestamps": True,
                                             "stream_format": "sse", "response_format": "pcm"})
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        return f"{sum(e['type'] == 'speech.word' for e in events)} speech.word events"

    row("timestamps: JSON form, seed 1 (+ trimmed end)", "client eighteen is here today; last sample 0", timed_json)
    row("timestamps: SSE", "5 speech.word events", timed_sse)
    row("timestamps with input_format ssml", "400", lambda: str(c.post("/v1/audio/speech", json={
        "input": "<speak>Hi.</speak>", "input_format": "ssml", "timestamps": True}).status_code))
    def length(text: str) -> str:
        r = c.post("/v1/audio/speech", json={"input": text, "seed": 1, "response_format": "pcm"})
        return f"{_seconds(r):.2f} s" if r.status_code == 200 else str(r.status_code)

    for text, bound in ((DROPPED, 3.0), (RUN_ON, 9.0)):
        row(f"built-in seed 1: {text[:30]!r}...", f"< {bound:g} s", lambda t=text: length(t))
    rows.append(("WebSocket markdown + numbers in pieces", "close 1000", *ws_probe(url, [
        {"type": "start"}, *({"type": "text", "text": t} for t in ("## What", " changed\n\n- **Fast",
                                                                    "er** start for $3", ".50 each. Done.")),
        {"type": "end"}])))
    return rows
