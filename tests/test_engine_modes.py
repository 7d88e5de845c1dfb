"""What users hear stays the reference path's: for every mode, `TTS` (the engine) against the reference
`Synthesizer` on the same model and seed, streaming and not. Same seed -> same speech tokens, so the same length;
audio within 1e-4 (fp32 summation order; the engine's final chunk is the reference's full-attention pass)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tiny_assets import make_tiny_model_dir, write_voice_like_wav
from vocalis.reference.threaded_backend import ReferenceTTS
from vocalis.tts import TTS

TEXT = "Hi there."
ATOL = 1e-4


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    engine = TTS.load(make_tiny_model_dir(tmp_path_factory.mktemp("m") / "tiny"))
    yield engine, ReferenceTTS(engine.model)
    engine.close()


@pytest.fixture(scope="module")
def prompt_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_voice_like_wav(tmp_path_factory.mktemp("w") / "prompt.wav", seconds=2.0, sr=22050)


def _modes(prompt_wav: Path) -> dict[str, dict]:
    return {
        "sft": {"voice": "default"},
        "zero_shot": {"prompt_wav": prompt_wav, "prompt_text": "A short prompt."},
        "cross_lingual": {"prompt_wav": prompt_wav},
        "instruct": {"prompt_wav": prompt_wav, "instruct": "Speak slowly."},
    }


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("mode", ["sft", "zero_shot", "cross_lingual", "instruct"])
def test_engine_equals_reference(pair, prompt_wav: Path, mode: str, stream: bool) -> None:
    engine, reference = pair
    options = _modes(prompt_wav)[mode]
    got = list(engine.run(engine.request(TEXT, seed=3, **options), stream=stream))
    want = list(reference.run(reference.request(TEXT, seed=3, **options), stream=stream))
    assert got[-1].final and not any(c.final for c in got[:-1])
    a, b = (np.concatenate([c.samples for c in chunks]) for chunks in (got, want))
    assert a.shape == b.shape  # same speech tokens
    np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_voice_conversion_equals_reference(pair, prompt_wav: Path, tmp_path: Path, stream: bool) -> None:
    engine, reference = pair
    source = write_voice_like_wav(tmp_path / "src.wav", seconds=1.6, sr=16000, seed=3)
    a = np.concatenate([c.samples for c in engine.convert_voice(source, prompt_wav=prompt_wav, seed=0,
                                                                stream=stream)])
    b = np.concatenate([c.samples for c in reference.convert_voice(source, prompt_wav=prompt_wav, seed=0,
                                                                   stream=stream)])
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)
