"""Loading model directories: the official layout unchanged, our layout, conversion, clear errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from vocalis.errors import ModelLoadError
from vocalis.model_dir import load_model, load_official, random_model, save_vocalis


def test_official_compat_folder_loads_strictly(compat_dir: Path) -> None:
    model = load_official(compat_dir)
    assert model.kind == "official"
    assert model.config.llm.speech_token_size == 100
    assert model.config.llm.qwen.hidden_size == 64
    assert model.config.flow.estimator.channels == (32,)
    assert model.config.hift.base_channels == 16
    # every tensor of the files is in the modules (the tied lm_head duplicate is dropped on purpose)
    flow_sd = torch.load(compat_dir / "flow.pt", weights_only=True)
    for key, value in flow_sd.items():
        assert torch.equal(model.flow.state_dict()[key], value), key
    assert model.speech_tokenizer is None and model.speaker_encoder is None and model.voices == {}


def test_convert_roundtrip_is_exact(compat_dir: Path, tmp_path: Path) -> None:
    model = load_official(compat_dir)
    out = tmp_path / "converted"
    save_vocalis(model, out, tokenizer_src=compat_dir / "CosyVoice-BlankEN")
    again = load_model(out)
    assert again.config == model.config
    for a, b in ((model.llm, again.llm), (model.flow, again.flow), (model.hift, again.hift)):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    with pytest.raises(ModelLoadError, match="already exists"):
        save_vocalis(model, out, tokenizer_src=compat_dir / "CosyVoice-BlankEN")


def _copy_official(compat_dir: Path, dst: Path) -> Path:
    shutil.copytree(compat_dir, dst, ignore=shutil.ignore_patterns("reference"))
    for p in dst.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    dst.chmod(0o755)
    return dst


def test_missing_file_is_named(compat_dir: Path, tmp_path: Path) -> None:
    d = _copy_official(compat_dir, tmp_path / "m")
    (d / "hift.pt").unlink()
    with pytest.raises(ModelLoadError, match="missing checkpoint file: .*hift.pt"):
        load_model(d)


def test_wrong_shape_names_key_and_both_shapes(compat_dir: Path, tmp_path: Path) -> None:
    d = _copy_official(compat_dir, tmp_path / "m")
    sd = torch.load(d / "flow.pt", weights_only=True)
    sd["encoder_proj.weight"] = torch.zeros(80, 7)
    torch.save(sd, d / "flow.pt")
    with pytest.raises(ModelLoadError, match=r"encoder_proj.weight: checkpoint \(80, 7\) vs model \(80, 512\)"):
        load_model(d)


def test_missing_key_and_corrupt_file(compat_dir: Path, tmp_path: Path) -> None:
    d = _copy_official(compat_dir, tmp_path / "m")
    sd = torch.load(d / "llm.pt", weights_only=True)
    del sd["llm_decoder.bias"]
    torch.save(sd, d / "llm.pt")
    with pytest.raises(ModelLoadError, match="missing: llm_decoder.bias"):
        load_model(d)
    (d / "llm.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ModelLoadError, match="cannot read checkpoint"):
        load_model(d)


def test_not_a_model_dir(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="neither"):
        load_model(tmp_path)


def test_random_model_is_deterministic_and_leaves_global_rng() -> None:
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b = random_model(), random_model()
    assert torch.equal(torch.random.get_rng_state(), before)
    assert all(torch.equal(x, y) for x, y in zip(a.flow.state_dict().values(), b.flow.state_dict().values()))
    assert a.tokenizer is not None and a.voices["default"].embedding.shape == (192,)


def test_a_voice_saves_to_the_same_bytes_and_reads_back(tmp_path: Path) -> None:
    from vocalis.frontend.voice import Voice

    g = torch.Generator().manual_seed(0)
    voice = Voice("narrator", 'a "quoted" prompt, ünïcode\n', (5, 6), (1, 2, 3), torch.randn(6, 80, generator=g),
                  torch.randn(192, generator=g))
    files = []
    for i in range(6):  # safetensors writes the metadata in a hash map's order, which changes from save to save
        voice.save(tmp_path / f"v{i}.safetensors")
        files.append((tmp_path / f"v{i}.safetensors").read_bytes())
    assert len(set(files)) == 1
    again = Voice.load(tmp_path / "v0.safetensors")
    assert (again.name, again.prompt_text, again.prompt_text_ids, again.prompt_speech_ids) == \
        (voice.name, voice.prompt_text, voice.prompt_text_ids, voice.prompt_speech_ids)
    assert torch.equal(again.prompt_mel, voice.prompt_mel) and torch.equal(again.embedding, voice.embedding)
