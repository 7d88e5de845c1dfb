"""Loading a CosyVoice 3 folder: `load_model` recognises `cosyvoice3.yaml`, builds the CV3 modules and loads them
strictly; the yaml maps onto our dataclasses (the released shapes give the `cosyvoice3-0.5b` preset)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from vocalis.config import QwenConfig
from vocalis.config.cv3 import CV3_PRESETS, CosyVoice3Config
from vocalis.errors import ModelLoadError
from vocalis.model_dir import cosyvoice3_config_from_official, load_model, read_official_yaml
from vocalis.models.cv3.flow import CausalMaskedDiffWithDiT
from vocalis.models.cv3.hift import CausalHiFTGenerator
from vocalis.models.cv3.speech_lm import CosyVoice3LM

# The fixture's yaml is the released one with these values made tiny (its README): put the released ones back.
_RELEASED = {
    r"llm_input_size: 32": "llm_input_size: 896",
    r"llm_output_size: 32": "llm_output_size: 896",
    r"speech_token_size: 300": "speech_token_size: 6561",
    r"vocab_size: 300": "vocab_size: 6561",
    r"channels: 64\n": "channels: 1024\n",
    r"dim: 64\n": "dim: 1024\n",
    r"depth: 3\n": "depth: 22\n",
    r"heads: 4\n": "heads: 16\n",
    r"dim_head: 16\n": "dim_head: 64\n",
    r"base_channels: 16\n": "base_channels: 512\n",
    r"cond_channels: 16\n": "cond_channels: 512\n",
}


def test_load_model_builds_the_cv3_modules(cv3_model, cv3_dir: Path) -> None:
    assert cv3_model.kind == "cosyvoice3" and cv3_model.path == cv3_dir
    assert isinstance(cv3_model.config, CosyVoice3Config)
    assert isinstance(cv3_model.llm, CosyVoice3LM)
    assert isinstance(cv3_model.flow, CausalMaskedDiffWithDiT)
    assert isinstance(cv3_model.hift, CausalHiFTGenerator)
    assert cv3_model.tokenizer is None  # the fixture ships no tokenizer files
    assert not any(m.training for m in (cv3_model.llm, cv3_model.flow, cv3_model.hift))
    official = torch.load(cv3_dir / "flow.pt", weights_only=True)
    assert torch.equal(cv3_model.flow.state_dict()["decoder.estimator.rotary_embed.inv_freq"],
                       official["decoder.estimator.rotary_embed.inv_freq"])


def test_released_yaml_gives_the_preset(cv3_dir: Path, tmp_path: Path) -> None:
    text = (cv3_dir / "cosyvoice3.yaml").read_text(encoding="utf-8")
    for tiny, released in _RELEASED.items():
        text, count = re.subn(tiny, released, text)
        assert count >= 1, tiny
    path = tmp_path / "cosyvoice3.yaml"
    path.write_text(text, encoding="utf-8")
    assert cosyvoice3_config_from_official(read_official_yaml(path), QwenConfig()) == CV3_PRESETS["cosyvoice3-0.5b"]


def test_a_wrong_checkpoint_is_named(cv3_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "cv3"
    shutil.copytree(cv3_dir, folder, ignore=shutil.ignore_patterns("reference"))
    state = torch.load(folder / "flow.pt", weights_only=True)
    del state["pre_lookahead_layer.conv2.bias"]
    torch.save(state, folder / "flow.pt")
    with pytest.raises(ModelLoadError, match=r"flow\.pt.*pre_lookahead_layer\.conv2\.bias"):
        load_model(folder)


def test_released_preset_builds_on_the_meta_device() -> None:
    """The `cosyvoice3-0.5b` preset at the released shapes (built on meta: no memory), as `bench` will need it."""
    from vocalis.model_dir import build_cv3_modules

    config = CV3_PRESETS["cosyvoice3-0.5b"]
    with torch.device("meta"):
        llm, flow, hift = build_cv3_modules(config)
    shapes = {**{f"llm.{k}": tuple(v.shape) for k, v in llm.state_dict().items()},
              **{f"flow.{k}": tuple(v.shape) for k, v in flow.state_dict().items()},
              **{f"hift.{k}": tuple(v.shape) for k, v in hift.state_dict().items()}}
    assert shapes["llm.speech_embedding.weight"] == (6761, 896) and shapes["llm.llm_decoder.weight"] == (6761, 896)
    assert "llm.llm_decoder.bias" not in shapes
    assert shapes["flow.pre_lookahead_layer.conv1.weight"] == (1024, 80, 4)
    assert shapes["flow.decoder.estimator.input_embed.proj.weight"] == (1024, 320)
    assert shapes["flow.decoder.estimator.transformer_blocks.21.attn.to_q.weight"] == (1024, 1024)
    assert "flow.decoder.estimator.transformer_blocks.22.attn.to_q.weight" not in shapes
    assert shapes["flow.decoder.estimator.rotary_embed.inv_freq"] == (32,)
    assert shapes["hift.conv_pre.parametrizations.weight.original1"] == (512, 80, 5)
    assert shapes["hift.f0_predictor.condnet.0.parametrizations.weight.original1"] == (512, 80, 4)
    # buffers the checkpoints lack stay real on the meta device
    assert flow.decoder.rand_noise.device.type == "cpu"
    assert flow.estimator.rotary_embed.inv_freq.device.type == "cpu"
