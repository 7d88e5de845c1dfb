"""Ladder gates of the built-in model: a rung's newest checkpoint -> fp16 weights without optimizer state, which
load back into the built-in HiFT (recipes/builtin/train_builtin.py --gate, measure_builtin.py --hift)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from system_deps import need_festival

from vocalis.config import PRESETS
from vocalis.models.hift.generator import HiFTGenerator
from vocalis.train.checkpointing import checkpoint_path, save_atomic

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "builtin"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, RECIPE / f"{name}.py")
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


def test_a_rung_without_its_weights_names_the_flag_it_needs() -> None:
    """measure_builtin's rows that need a part's weights stop with the flag to give, not a traceback."""
    measure = _script("measure_builtin")
    for load, flag, rows in ((measure.load_flow, "--flow", "L2"), (measure.load_llm, "--llm", "L4"),
                             (measure.load_labeller, "--labeller", "L3")):
        with pytest.raises(SystemExit, match=f"--rows {rows}: give the weights with {flag}$"):
            load(None)


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


def test_l2_gate_flow_weights_decode_true_labels(tmp_path: Path, monkeypatch) -> None:
    """L2: the flow's newest checkpoint -> fp16 gate weights -> measure_builtin's labels -> flow -> HiFT path; the
    recipe trains the flow only once the committed L1 figures pass."""
    import json

    from vocalis.frontend.phones import NUM_LABELS
    from vocalis.models.flow.flow import CausalMaskedDiffWithXvec

    recipe, measure = _script("train_builtin"), _script("measure_builtin")
    torch.manual_seed(0)
    flow = CausalMaskedDiffWithXvec(PRESETS["builtin-phones"].flow)
    save_atomic({"models": {"flow": flow.state_dict()}, "step": 100}, checkpoint_path(tmp_path / "flow", 100))
    path = recipe.save_gate(tmp_path / "flow", tmp_path / "gates" / "L2", "flow")
    hift_path = recipe.save_gate(_hift_run(tmp_path / "hift"), tmp_path / "gates" / "L1")
    labels = torch.randint(0, NUM_LABELS, (20,)).tolist()
    wav = measure.labels_to_wav(measure.load_flow(path), measure.load_hift(hift_path), labels, seed=0)
    assert wav.shape == (2 * 20 * 480,) and torch.isfinite(wav).all()

    monkeypatch.setattr(recipe, "LADDER", tmp_path / "ladder")
    assert not recipe.passes("L1")
    (tmp_path / "ladder" / "L1").mkdir(parents=True)
    for ratio, ok in ((4.0, False), (1.1, True)):
        figures = {"figures": {"L1": {"wer": 0.3, "ratio": ratio, "gate": 1.15}}}
        (tmp_path / "ladder" / "L1" / "figures.json").write_text(json.dumps(figures))
        assert recipe.passes("L1") is ok


def _hift_run(run: Path) -> Path:
    save_atomic({"models": {"hift": HiFTGenerator(PRESETS["builtin"].hift).state_dict()}, "step": 100},
                checkpoint_path(run, 100))
    return run


def test_l4_gate_llm_weights_decode_phones_to_labels(tmp_path: Path) -> None:
    """L4: the LLM's newest checkpoint -> fp16 gate weights -> measure_builtin's phones -> labels decode: label ids
    only (no stop id), at least one per text id and at most the phone model's bound of four."""
    from vocalis.frontend.phones import NUM_LABELS, text_ids
    from vocalis.models.speech_lm import Qwen2LM

    recipe, measure = _script("train_builtin"), _script("measure_builtin")
    torch.manual_seed(0)
    llm = Qwen2LM(PRESETS["builtin-phones"].llm)
    save_atomic({"models": {"llm": llm.state_dict()}, "step": 100}, checkpoint_path(tmp_path / "llm", 100))
    path = recipe.save_gate(tmp_path / "llm", tmp_path / "gates" / "L4", "llm")
    assert all(v.dtype == torch.float16 for v in load_file(str(path)).values())
    text = "A dealer in stolen goods."
    labels = measure.llm_labels(measure.load_llm(path), text, seed=0)
    n = len(text_ids(text))
    assert n <= len(labels) <= 4 * n and all(0 <= t < NUM_LABELS for t in labels)
    assert labels == measure.llm_labels(measure.load_llm(path), text, seed=0)  # seeded: the same labels again


def test_l3_gate_labeller_weights_label_a_clip(tmp_path: Path) -> None:
    """L3: the labeller's newest checkpoint -> fp16 gate weights -> measure_builtin's clip -> 25 Hz labels path."""
    import numpy as np
    import soundfile as sf

    from vocalis.config import PHONE_LABELS
    from vocalis.models.speech_tokenizer.labeller import FrameLabeller, labeller_config

    recipe, measure = _script("train_builtin"), _script("measure_builtin")
    torch.manual_seed(0)
    model = FrameLabeller(labeller_config("builtin", PHONE_LABELS))
    save_atomic({"models": {"labeller": model.state_dict()}, "step": 100},
                checkpoint_path(tmp_path / "labeller", 100))
    path = recipe.save_gate(tmp_path / "labeller", tmp_path / "gates" / "L3", "labeller")
    wav = tmp_path / "clip.wav"
    sf.write(str(wav), 0.1 * np.sin(np.arange(48000) / 24000 * 2 * np.pi * 300).astype(np.float32), 24000)
    labels = measure.audio_labels(measure.load_labeller(path), wav)
    assert abs(len(labels) - 50) <= 1 and all(0 <= t < PHONE_LABELS for t in labels)  # 2 s at 25 Hz


def _gated_parts(recipe, run: Path, rungs: dict[str, str], shift: float = 0.0) -> tuple[dict[str, Path], dict]:
    """Random builtin-phones parts (every weight + `shift`, to tell two sets apart), each checkpointed in
    RUN/<part> and gated to RUN/gates/<its rung>."""
    from vocalis.config import PHONE_LABELS
    from vocalis.model_dir import random_model
    from vocalis.models.speech_tokenizer.labeller import FrameLabeller, labeller_config

    torch.manual_seed(0)
    parts = random_model("builtin-phones")
    modules = {"llm": parts.llm, "flow": parts.flow, "hift": parts.hift,
               "labeller": FrameLabeller(labeller_config("builtin", PHONE_LABELS))}
    with torch.no_grad():
        for module in modules.values():
            for p in module.parameters():
                p.add_(shift)
    weights = {}
    for part, rung in rungs.items():
        save_atomic({"models": {part: modules[part].state_dict()}, "step": 100}, checkpoint_path(run / part, 100))
        weights[part] = recipe.save_gate(run / part, run / "gates" / rung, part)
    return weights, {p: m.state_dict() for p, m in modules.items()}


def test_assemble_builds_a_phone_model_that_speaks_with_its_default_voice(tmp_path: Path, monkeypatch) -> None:
    """--assemble: gate weights of every part + festival SLT's prompt with its true labels -> a model directory that
    `TTS` loads (its weights, its labeller as the speech tokenizer) and speaks with on the engine."""
    need_festival("slt")
    from vocalis.config import PHONE_LABELS
    from vocalis.frontend.speech_tokenizer import LabellerSpeechTokenizer
    from vocalis.tts import TTS

    recipe = _script("train_builtin")
    monkeypatch.setattr(recipe, "LADDER", tmp_path / "ladder")  # nothing committed: the run's gates
    run = tmp_path / "run"
    weights, states = _gated_parts(recipe, run, {"llm": "L4", "flow": "L2", "hift": "L1", "labeller": "L3"})
    out = recipe.assemble(run, tmp_path / "model", weights)

    with TTS.load(out) as tts:
        assert set(tts.model.voices) == {"default"}
        voice = tts.model.voices["default"]
        assert voice.prompt_text_ids == ()  # cross-lingual: the flow is prompted, the LLM is not
        assert len(voice.prompt_speech_ids) > 50 and max(voice.prompt_speech_ids) < PHONE_LABELS  # festival's labels
        assert not voice.embedding.any()  # the flow trains with zero x-vectors
        assert isinstance(tts.model.speech_tokenizer, LabellerSpeechTokenizer)
        name = "input_embedding.weight"
        assert torch.allclose(tts.model.flow.state_dict()[name], states["flow"][name].half().float())
        wav = tts.synthesize("A quiet room.", voice="default", seed=0)
        assert wav.ndim == 1 and wav.size > 0


def test_assemble_takes_the_three_voice_parts_and_names_every_voice(tmp_path: Path, monkeypatch) -> None:
    """With L6's three-voice flow gated beside the one-voice L2 flow, --assemble of a one-voice run takes L2's and of a
    three-voice run L6's, saving a voice per festival teacher (SLT also as `default`); --ship refuses weights not
    installed in the ladder."""
    import sys

    import pytest

    need_festival("slt", "kal", "ked")
    from vocalis.model_dir import load_model

    recipe = _script("train_builtin")
    monkeypatch.setattr(recipe, "LADDER", tmp_path / "ladder")
    run = tmp_path / "run"
    _gated_parts(recipe, run, {"llm": "L4", "flow": "L2", "hift": "L1"})
    (run / "flow").rename(run / "flow-one-voice")
    _, states = _gated_parts(recipe, run, {"flow": "L6"}, shift=0.5)
    name = "input_embedding.weight"
    argv = ["train_builtin.py", str(run), "--assemble", str(tmp_path / "one")]
    monkeypatch.setattr(sys, "argv", argv)
    assert recipe.main() == 0
    one = load_model(tmp_path / "one")  # a one-voice run: the one-voice parts
    assert set(one.voices) == {"default"}
    assert not torch.allclose(one.flow.state_dict()[name], states["flow"][name].half().float())

    monkeypatch.setattr(sys, "argv", argv[:2] + ["--voices", "slt", "kal", "ked", "--assemble", str(tmp_path / "model")])
    assert recipe.main() == 0
    model = load_model(tmp_path / "model")
    assert set(model.voices) == {"default", "slt", "kal", "ked"}
    assert torch.equal(model.voices["default"].prompt_mel, model.voices["slt"].prompt_mel)
    assert not torch.equal(model.voices["kal"].prompt_mel[:50], model.voices["slt"].prompt_mel[:50])
    assert torch.allclose(model.flow.state_dict()[name], states["flow"][name].half().float())

    monkeypatch.setattr(sys, "argv", argv[:2] + ["--voices", "slt", "kal", "ked", "--assemble", str(tmp_path / "m2"),
                                                 "--ship"])
    with pytest.raises(SystemExit, match="not installed in the ladder"):
        recipe.main()


def test_recipe_starts_a_wider_vocoder_from_the_committed_one(tmp_path: Path, monkeypatch) -> None:
    """--hift-channels: the committed L1 weights widened into the trainer's start, the trainer's module built at
    that width from them, and its gate weights measured at that width."""
    from vocalis.train.checkpointing import checkpoint_path, save_atomic
    from vocalis.train.config import load_config
    from vocalis.train.task import build_part

    recipe = _script("train_builtin")
    monkeypatch.setattr(recipe, "LADDER", tmp_path / "ladder")
    torch.manual_seed(0)
    narrow = HiFTGenerator(PRESETS["builtin"].hift).eval()
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
