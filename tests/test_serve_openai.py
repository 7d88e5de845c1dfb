"""The official `openai` Python client, unchanged, against a real server on 127.0.0.1."""

from __future__ import annotations

import numpy as np
import pytest
from serve_support import aac_supported, decode_audio, quick_tts, serve

openai = pytest.importorskip("openai", reason="the openai client is part of the dev extra")



@pytest.fixture(scope="module")
def tts(tmp_path_factory):
    return quick_tts(tmp_path_factory)

@pytest.fixture(scope="module")
def server(tts):
    with serve(tts, api_key="sk-local") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="sk-local", timeout=120, max_retries=0)


def test_speech_create(client) -> None:
    audio = client.audio.speech.create(model="tts-1", voice="alloy", input="Hello from the OpenAI client.",
                                       response_format="wav", extra_body={"seed": 4})
    wav = decode_audio("wav", audio.content)
    assert len(wav) > 2400 and np.abs(wav).max() > 0
    same = client.audio.speech.create(model="gpt-4o-mini-tts", voice="echo", input="Hello from the OpenAI client.",
                                      response_format="pcm", speed=1.0, instructions="", extra_body={"seed": 4})
    np.testing.assert_allclose(decode_audio("pcm", same.content), wav, atol=1e-4)  # both map onto `default`


def test_streaming_response(client) -> None:
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="nova", input="Stream me.",
                                                            response_format="pcm") as response:
        assert response.headers["content-type"] == "audio/pcm"
        parts = list(response.iter_bytes())
    assert sum(len(p) for p in parts) > 0 and sum(len(p) for p in parts) % 2 == 0


def test_default_format_is_mp3(client) -> None:
    audio = client.audio.speech.create(model="tts-1", voice="shimmer", input="Hi.")
    assert len(decode_audio("mp3", audio.content)) > 0


def test_errors_surface_as_openai_exceptions(client, server) -> None:
    with pytest.raises(openai.BadRequestError, match="unknown voice"):
        client.audio.speech.create(model="tts-1", voice="nobody", input="Hi.")
    if aac_supported():  # the aac extra is installed: OpenAI's aac works
        aac = client.audio.speech.create(model="tts-1", voice="alloy", input="Hi.", response_format="aac")
        assert len(decode_audio("aac", aac.content)) > 0
    else:
        with pytest.raises(openai.BadRequestError, match="not supported"):
            client.audio.speech.create(model="tts-1", voice="alloy", input="Hi.", response_format="aac")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).audio.speech.create(
            model="tts-1", voice="alloy", input="Hi.")
