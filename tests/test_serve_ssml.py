"""SSML on the server (`input_format: "ssml"` on POST /v1/audio/speech), real loopback server on the tiny model:
the audio is `render_ssml`'s joining of the parts as the same server says them one by one, streamed or whole;
bad markup is one 400 with one clear message."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from serve_support import quick_tts, serve

from vocalis.frontend.ssml import parse_ssml, render_ssml

SSML = ('<speak><s>Hello there.</s><break time="300ms"/><prosody rate="slow">Say <say-as interpret-as="cardinal">'
        '42</say-as> slowly.</prosody><p>A last <sub alias="World Wide Web">WWW</sub> paragraph.</p></speak>')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(quick_tts(tmp_path_factory)) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        yield srv, c


def _pcm(client: httpx.Client, **body: object) -> np.ndarray:
    r = client.post("/v1/audio/speech", json={"model": "vocalis", "response_format": "pcm", "seed": 1, **body})
    assert r.status_code == 200, r.text
    return np.frombuffer(r.content, dtype=np.int16)


def test_ssml_is_its_parts_said_in_turn_with_their_pauses(server) -> None:
    srv, client = server
    parts = parse_ssml(SSML)
    assert [p.rate for p in parts if p.text] == [1.0, 0.75, 1.0] and sum(p.pause_s for p in parts) > 0.7

    for stream in (False, True):  # whole files, and chunked synthesis sent as it is made

        def speak(text: str, rate: float, stream: bool = stream) -> np.ndarray:  # the same server, plain text
            return _pcm(client, input=text, speed=rate, stream=stream).astype(np.float32)

        want = render_ssml(parts, speak, srv.backend.sample_rate).astype(np.int16)
        got = _pcm(client, input=SSML, input_format="ssml", stream=stream)
        assert len(got) == len(want) > 24000
        np.testing.assert_allclose(got / 32768.0, want / 32768.0, atol=1e-4, rtol=0)


def test_speed_scales_every_part(server) -> None:
    _, client = server
    ssml = '<speak>One.<break time="200ms"/><prosody rate="x-fast">Two.</prosody></speak>'
    got = _pcm(client, input=ssml, input_format="ssml", speed=0.5, stream=False)
    one = _pcm(client, input="One.", speed=0.5, stream=False)
    two = _pcm(client, input="Two.", speed=0.75, stream=False)
    assert np.array_equal(got, np.concatenate([one, np.zeros(round(0.2 * 24000), np.int16), two]))


@pytest.mark.parametrize(("ssml", "message"), [
    ("<speak>Hello <b>there</speak>", "SSML is not well-formed XML"),
    ("<voice>Hello</voice>", "SSML must have <speak> as its root element"),
    ('<speak>Wait <break time="5 parsecs"/> now.</speak>', "SSML break time '5 parsecs'"),
    ('<speak><say-as interpret-as="cardinal">many</say-as></speak>', "SSML say-as cardinal needs digits"),
    ('<speak><prosody rate="150%">Fast.</prosody></speak>', "gives 4.5; it must be between"),  # at speed 3
    ("<speak><break time='1s'/></speak>", "the SSML has no text to say"),
])
def test_bad_markup_is_one_400(server, ssml: str, message: str) -> None:
    _, client = server
    r = client.post("/v1/audio/speech", json={"model": "vocalis", "input": ssml, "input_format": "ssml",
                                              "speed": 3.0, "response_format": "wav"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]["message"]
    assert message in error and "\n" not in error and "Traceback" not in error


def test_unknown_input_format_is_a_400_and_text_stays_text(server) -> None:
    _, client = server
    r = client.post("/v1/audio/speech", json={"model": "vocalis", "input": "Hi.", "input_format": "markdown"})
    assert r.status_code == 400 and "input_format" in r.json()["error"]["message"]
    plain = client.post("/v1/audio/speech", json={"model": "vocalis", "input": "<speak>Hi.</speak>",
                                                  "response_format": "wav", "stream": False})
    assert plain.status_code == 200  # without input_format the markup is ordinary text
