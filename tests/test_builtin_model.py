"""The built-in model's pieces: the `builtin` preset's size, the resemblyzer speaker encoder in a model
directory (and in `vocalis prepare`'s featurizer), and the shipped model when it is there."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from system_deps import need_program

from vocalis.config import PRESETS
from vocalis.model_dir import BUILTIN_MODEL, load_model, random_model, save_vocalis

MAX_SHIPPED_BYTES = 60 * 1024 * 1024


def test_builtin_preset_fits_the_size_budget():
    from vocalis.models.speech_tokenizer import SupervisedSpeechTokenizer, preset_config

    config = PRESETS["builtin"]
    model = random_model("builtin")
    tokenizer = SupervisedSpeechTokenizer(preset_config("builtin", 300))
    assert tokenizer.codebook_size == config.llm.speech_token_size == config.flow.vocab_size
    assert config.spk_embed_dim == config.flow.spk_embed_dim == 256  # resemblyzer d-vectors
    nbytes = sum(t.numel() * 4 for m in (model.llm, model.flow, model.hift, tokenizer) for t in m.state_dict().values())
    assert nbytes < MAX_SHIPPED_BYTES


def _speech_wav(path: Path) -> Path:
    espeak = need_program("espeak-ng", "espeak-ng")
    subprocess.run([espeak, "-w", str(path), "This is a short test of the speaker encoder."], check=True)
    return path


def test_resemblyzer_speaker_encoder_from_model_dir(tmp_path: Path):
    pytest.importorskip("resemblyzer")
    from vocalis.frontend.audio import load_wav
    from vocalis.frontend.speaker_resemblyzer import ResemblyzerSpeakerEncoder, write_speaker_encoder_json
    from vocalis.train.features import FeatureConfig, Featurizer
    from vocalis.train.manifest import Utterance

    model = random_model("tiny")
    save_vocalis(model, tmp_path / "m", tokenizer_src=Path(__file__).parents[1] / "vocalis" / "assets" / "tokenizer")
    write_speaker_encoder_json(tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    enc = loaded.speaker_encoder
    assert isinstance(enc, ResemblyzerSpeakerEncoder)
    assert enc._encoder is None  # loads on first use, not with the model
    wav_path = _speech_wav(tmp_path / "a.wav")
    e = enc.embed(load_wav(wav_path, 16000))
    assert e.shape == (256,) and abs(float(np.linalg.norm(e)) - 1.0) < 1e-3
    # prepare's featurizer picks the same encoder from the directory
    feat = Featurizer(tmp_path / "m", FeatureConfig(speech_tokens=False))
    row = feat(Utterance("a", str(wav_path), "This is a short test.", "spk"))
    assert row["embedding"].shape == (256,)
    assert np.allclose(row["embedding"], e, atol=1e-2)


def test_unknown_speaker_encoder_kind_is_a_clear_error(tmp_path: Path):
    from vocalis.errors import ModelLoadError

    model = random_model("tiny")
    save_vocalis(model, tmp_path / "m", tokenizer_src=Path(__file__).parents[1] / "vocalis" / "assets" / "tokenizer")
    (tmp_path / "m" / "speaker_encoder.json").write_text('{"kind": "nope"}')
    with pytest.raises(ModelLoadError, match="unknown speaker encoder kind"):
        load_model(tmp_path / "m")


@pytest.mark.skipif(not (BUILTIN_MODEL / "vocalis.json").is_file(), reason="no built-in model shipped yet")
def test_shipped_builtin_model_loads_and_speaks(tmp_path: Path):
    total = sum(p.stat().st_size for p in BUILTIN_MODEL.rglob("*") if p.is_file())
    assert total <= MAX_SHIPPED_BYTES
    from vocalis.tts import TTS

    tts = TTS.load()
    assert tts.model.kind != "random" and "default" in tts.model.voices
    wav = tts.synthesize("Hello.", seed=0)
    assert wav.ndim == 1 and wav.size > 0 and np.isfinite(wav).all()
    sf.write(str(tmp_path / "o.wav"), wav, tts.sample_rate)
