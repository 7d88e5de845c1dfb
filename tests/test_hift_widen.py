"""A wider HiFT vocoder started from a narrower one: same audio at the start, copies that train apart, and the
recipe / measurement / trainer paths that carry the width."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from vocalis.config import PRESETS
from vocalis.models.hift.generator import HiFTGenerator, hift_config_for
from vocalis.train.widen import widen_hift

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _narrow() -> HiFTGenerator:
    torch.manual_seed(0)
    hift = HiFTGenerator(PRESETS["builtin"].hift)
    with torch.no_grad():  # trained-looking weights: Snake alphas and biases away from their initial values
        for name, p in hift.named_parameters():
            if name.endswith((".alpha", ".bias")):
                p.add_(0.3 * torch.randn_like(p))
    return hift.eval()


@pytest.mark.parametrize("factor", [2, 4])
def test_widened_hift_decodes_the_same_audio(factor: int) -> None:
    narrow = _narrow()
    config = narrow.config
    state, wide_config = widen_hift(narrow.state_dict(), config, config.base_channels * factor)
    wide = HiFTGenerator(wide_config).eval()
    wide.load_state_dict(state, strict=True)
    assert hift_config_for(state, config) == wide_config
    assert sum(p.numel() for p in wide.parameters()) > 2 * sum(p.numel() for p in narrow.parameters())
    mel = torch.randn(2, 80, 30)
    with torch.no_grad():
        s = narrow.source(mel, torch.Generator().manual_seed(1))  # (2, 1, N)
        a, b = narrow.decode(mel, s), wide.decode(mel, s)
    assert a.abs().max() > 0.05
    torch.testing.assert_close(b, a, atol=1e-4, rtol=0)


def test_widened_copies_get_different_gradients() -> None:
    """Copied channels whose outgoing weights were split alike would train as one forever; the random shares
    break that symmetry."""
    narrow = _narrow()
    state, wide_config = widen_hift(narrow.state_dict(), narrow.config, 128)
    wide = HiFTGenerator(wide_config)
    wide.load_state_dict(state)
    mel = torch.randn(1, 80, 20)
    s = narrow.source(mel, torch.Generator().manual_seed(2)).detach()
    wide.decode(mel, s).pow(2).mean().backward()
    grad = wide.conv_pre.parametrizations.weight.original1.grad  # (128, 80, 7): channel c and its copy c + 64
    assert not torch.allclose(grad[:64], grad[64:], atol=1e-7)


def test_widening_needs_a_whole_multiple() -> None:
    narrow = _narrow()
    with pytest.raises(ValueError, match="multiple of 64"):
        widen_hift(narrow.state_dict(), narrow.config, 96)


def test_recipe_starts_a_wider_vocoder_from_the_committed_one(tmp_path: Path, monkeypatch) -> None:
    """--hift-channels: the committed L1 weights widened into the trainer's start, the trainer's module built at
    that width from them, and its gate weights measured at that width."""
    from vocalis.train.checkpointing import checkpoint_path, save_atomic
    from vocalis.train.config import load_config
    from vocalis.train.task import build_part

    recipe = _script("train_builtin")
    monkeypatch.setattr(recipe, "LADDER", tmp_path / "ladder")
    narrow = _narrow()
    save_atomic({"models": {"hift": narrow.state_dict()}, "step": 300}, checkpoint_path(tmp_path / "old", 300))
    recipe.save_gate(tmp_path / "old", tmp_path / "ladder" / "L1")
    run = tmp_path / "run"
    run.mkdir()
    (init,) = recipe.start_from_ladder(run, "L1", "hift", recipe.hift_dir(run, 128), 128)

    config = load_config(None, [init, "model.preset=builtin", "model.hift_channels=128"], task="hift")
    wide, model_config = build_part(config, "hift")
    assert model_config.hift.base_channels == 128 and wide.conv_pre.out_channels == 128
    mel = torch.randn(1, 80, 16)
    with torch.no_grad():
        s = narrow.source(mel, torch.Generator().manual_seed(3))
        torch.testing.assert_close(wide.eval().decode(mel, s), narrow.decode(mel, s), atol=2e-3, rtol=0)  # fp16 gate

    save_atomic({"models": {"hift": wide.state_dict()}, "step": 100}, checkpoint_path(recipe.hift_dir(run, 128), 100))
    assert recipe.start_from_ladder(run, "L1", "hift", recipe.hift_dir(run, 128), 128) == []  # resumes instead
    gate = recipe.save_gate(recipe.hift_dir(run, 128), run / "gates" / "L1")
    measured = _script("measure_builtin").load_hift(gate)
    assert measured.config.base_channels == 128
