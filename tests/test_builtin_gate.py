"""Ladder gates of the built-in model: a rung's newest checkpoint -> fp16 weights without optimizer state, which
load back into the built-in HiFT (scripts/train_builtin.py --gate, scripts/measure_builtin.py --hift)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from safetensors.torch import load_file

from vocalis.config import PRESETS
from vocalis.models.hift.generator import HiFTGenerator
from vocalis.train.checkpointing import checkpoint_path, save_atomic

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gate_weights_are_fp16_newest_and_load_into_the_builtin_hift(tmp_path: Path) -> None:
    torch.manual_seed(0)
    hift = HiFTGenerator(PRESETS["builtin"].hift)
    run = tmp_path / "hift"
    for step in (100, 200):
        state = {k: v + step * 1e-4 for k, v in hift.state_dict().items()}  # tell the two checkpoints apart
        save_atomic({"models": {"hift": state}, "optimizers": {"generator": {"state": {0: torch.ones(9)}}},
                     "step": step}, checkpoint_path(run, step))
    path = _script("train_builtin").save_gate(run, tmp_path / "gates" / "L1")
    weights = load_file(str(path))
    assert set(weights) == set(hift.state_dict()) and all(v.dtype == torch.float16 for v in weights.values())
    name = next(iter(weights))
    assert torch.allclose(weights[name].float(), hift.state_dict()[name] + 0.02, atol=2e-3)  # the newest checkpoint
    loaded = _script("measure_builtin").load_hift(path)
    mel = torch.randn(1, 80, 12)
    out, _ = loaded.inference(mel, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 12 * 480) and torch.isfinite(out).all()


def test_a_new_machine_starts_from_the_committed_rung(tmp_path: Path, monkeypatch) -> None:
    from vocalis.train.checkpointing import load_checkpoint

    recipe = _script("train_builtin")
    hift = HiFTGenerator(PRESETS["builtin"].hift)
    save_atomic({"models": {"hift": hift.state_dict()}, "step": 300}, checkpoint_path(tmp_path / "old" / "hift", 300))
    monkeypatch.setattr(recipe, "LADDER", tmp_path / "ladder")
    run = tmp_path / "run"
    run.mkdir()
    assert recipe.start_from_ladder(run, "L1", "hift") == []  # nothing committed yet
    recipe.save_gate(tmp_path / "old" / "hift", tmp_path / "ladder" / "L1")
    (sets,) = recipe.start_from_ladder(run, "L1", "hift")
    state = load_checkpoint(sets.removeprefix("model.checkpoint="))["models"]["hift"]
    assert all(v.dtype == torch.float32 for v in state.values()) and set(state) == set(hift.state_dict())
    save_atomic({"models": {"hift": state}, "step": 100}, checkpoint_path(run / "hift", 100))
    assert recipe.start_from_ladder(run, "L1", "hift") == []  # a run with checkpoints resumes instead
