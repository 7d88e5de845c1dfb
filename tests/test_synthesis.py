"""End to end on a tiny random model with the real ONNX frontend path: every mode, streaming, bi-streaming."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tiny_assets import make_tiny_model_dir, write_voice_like_wav
from vocalis.errors import InputError
from vocalis.tts import TTS

TEXT = "Hi there."  # few text tokens: the random LLM runs to 20 x text length


@pytest.fixture(scope="module")
def tts(tmp_path_factory: pytest.TempPathFactory) -> TTS:
    return TTS.load(make_tiny_model_dir(tmp_path_factory.mktemp("m") / "tiny"))


@pytest.fixture(scope="module")
def prompt_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_voice_like_wav(tmp_path_factory.mktemp("w") / "prompt.wav", seconds=2.0, sr=22050)


def _audio_ok(wav: np.ndarray, tts: TTS) -> None:
    assert wav.dtype == np.float32 and wav.ndim == 1
    assert len(wav) > 0 and len(wav) % (tts.sample_rate // 50) == 0  # whole mel frames
    assert np.isfinite(wav).all() and np.abs(wav).max() <= 0.99 + 1e-6


def test_sft_seeded_is_reproducible(tts: TTS) -> None:
    a = tts.synthesize(TEXT, voice="default", seed=3)
    b = tts.synthesize(TEXT, voice="default", seed=3)
    c = tts.synthesize(TEXT, voice="default", seed=4)
    _audio_ok(a, tts)
    assert np.array_equal(a, b)
    assert len(a) != len(c) or not np.array_equal(a, c)


def test_zero_shot_saved_voice_equals_one_off_prompt(tts: TTS, prompt_wav: Path) -> None:
    one_off = tts.synthesize(TEXT, prompt_wav=prompt_wav, prompt_text="A short prompt.", seed=1)
    voice = tts.add_voice("me", prompt_wav, "A short prompt.")
    assert voice.prompt_text_ids and len(voice.prompt_mel) == 2 * len(voice.prompt_speech_ids)
    saved = tts.synthesize(TEXT, voice="me", seed=1)
    _audio_ok(saved, tts)
    assert np.array_equal(one_off, saved)


def test_streaming_has_same_tokens_and_length_as_whole(tts: TTS, prompt_wav: Path) -> None:
    # seed 3: this tiny random model runs to the 80-token limit, long enough for a chunk before the last
    whole = tts.synthesize(TEXT, prompt_wav=prompt_wav, prompt_text="A short prompt.", seed=3)
    chunks = list(tts.stream(TEXT, prompt_wav=prompt_wav, prompt_text="A short prompt.", seed=3))
    assert len(chunks) >= 2 and chunks[-1].final and not any(c.final for c in chunks[:-1])
    streamed = np.concatenate([c.samples for c in chunks])
    assert len(streamed) == len(whole)  # same seed -> same speech tokens -> same duration
    _audio_ok(streamed, tts)


def test_stream_sends_a_chunk_as_soon_as_it_is_computed(tts: TTS, prompt_wav: Path) -> None:
    """The first chunk is vocoded when the LLM has written only the tokens it needs (25 + 3 look-ahead + prompt
    padding), not those of the chunk after it."""
    t2w = tts.engine.token2wav
    step, written = t2w.step, []

    def counting(states, **kw):
        written.append(max(len(s.tokens) for s in states))
        return step(states, **kw)

    t2w.step = counting
    try:
        chunks = list(tts.stream(TEXT, prompt_wav=prompt_wav, prompt_text="A short prompt.", seed=3))
    finally:
        del t2w.step
    assert len(chunks) > 1 and chunks[-1].final and not chunks[0].final
    assert written[0] <= 25 + 3 + 25 < written[-1]


def test_cross_lingual_instruct_and_modes_differ(tts: TTS, prompt_wav: Path) -> None:
    cross = tts.synthesize(TEXT, prompt_wav=prompt_wav, seed=5)
    instruct = tts.synthesize(TEXT, prompt_wav=prompt_wav, instruct="Speak slowly.", seed=5)
    for wav in (cross, instruct):
        _audio_ok(wav, tts)
    assert len(cross) != len(instruct) or not np.array_equal(cross, instruct)


def test_voice_conversion_keeps_source_duration(tts: TTS, prompt_wav: Path, tmp_path: Path) -> None:
    source = write_voice_like_wav(tmp_path / "src.wav", seconds=1.6, sr=16000, seed=3)
    wav = np.concatenate([c.samples for c in tts.convert_voice(source, prompt_wav=prompt_wav, seed=0)])
    # 16 kHz -> 100 Hz whisper frames -> 25 Hz tokens -> 2 mel frames each -> 480 samples per frame
    assert len(wav) == (int(1.6 * 100) // 4) * 2 * 480


def test_bistream_text_pieces(tts: TTS) -> None:
    pieces = ["Hello ", "there, ", "in pieces."]
    chunks = list(tts.stream(iter(pieces), voice="default", seed=0))
    assert chunks and chunks[-1].final
    _audio_ok(np.concatenate([c.samples for c in chunks]), tts)


def test_speed_changes_duration(tts: TTS) -> None:
    normal = tts.synthesize(TEXT, voice="default", seed=7)
    fast = tts.synthesize(TEXT, voice="default", seed=7, speed=2.0)
    assert abs(len(fast) - len(normal) / 2) <= 480


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"text": ""}, "empty"),
        ({"text": "?!..."}, "nothing to say|punctuation"),
        ({"text": "x" * 20001}, "limit"),
        ({"text": TEXT, "speed": 9.0}, "speed"),
        ({"text": TEXT, "voice": "nobody"}, "unknown voice"),
    ],
)
def test_bad_requests_are_input_errors(tts: TTS, kwargs: dict, message: str) -> None:
    with pytest.raises(InputError, match=message):
        tts.synthesize(**kwargs)
