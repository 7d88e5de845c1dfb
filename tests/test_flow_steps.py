"""The flow's Euler step count as a speed/quality setting (`Token2WavConfig.flow_steps`, tiny preset, random weights):
the default is the model's 10 steps exactly; fewer steps give a different mel whose error against 10 steps shrinks
as the count grows, on the streaming (cached, chunked) path and the whole-utterance path alike; `TTS.load` and the
`--flow-steps` flags of `vocalis speak` / `vocalis serve` set it."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from cv3_support import cv3_reference
from tiny_assets import make_tiny_model_dir

from vocalis.cli import main
from vocalis.config import PRESETS
from vocalis.models.flow.flow import CausalMaskedDiffWithXvec
from vocalis.models.hift.generator import HiFTGenerator
from vocalis.reference.token2wav import FlowPrompt
from vocalis.token2wav.config import Token2WavConfig
from vocalis.token2wav.cv2.engine import Token2WavEngine
from vocalis.token2wav.cv3.engine import CV3Token2WavEngine
from vocalis.tts import TTS

P, N = 35, 60  # prompt tokens, generated tokens: a first chunk of 40, then the final 20


@pytest.fixture(scope="module")
def modules() -> tuple[CausalMaskedDiffWithXvec, HiFTGenerator]:
    cfg = PRESETS["tiny"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return CausalMaskedDiffWithXvec(cfg.flow).eval(), HiFTGenerator(cfg.hift).eval()


def _run(modules, flow_steps: int | None, streaming: bool) -> tuple[torch.Tensor, np.ndarray, int]:
    """One request through the engine -> its mel (80, frames) over all chunks, its audio, and the estimator frames
    x Euler steps of every solve (the voice prefix's included)."""
    g = torch.Generator().manual_seed(3)
    prompt = FlowPrompt(torch.randint(0, 6561, (1, P), generator=g, dtype=torch.int32),
                        torch.randn(1, 2 * P, 80, generator=g), torch.randn(1, 192, generator=g))
    engine = Token2WavEngine(*modules, Token2WavConfig(cache_dtype=None, flow_steps=flow_steps))
    mels: list[torch.Tensor] = []
    vocode = engine._vocode

    def capture(items, chunk_mels):
        mels.extend(m.clone() for m in chunk_mels)
        return vocode(items, chunk_mels)

    engine._vocode = capture  # type: ignore[method-assign]
    state = engine.new_stream("r", prompt, streaming=streaming, generator=torch.Generator().manual_seed(1))
    state.add_tokens(torch.randint(0, 6561, (N,), generator=torch.Generator().manual_seed(4)).tolist())
    state.end_input()
    audio = []
    while not state.finished:
        audio += [c.samples for c in engine.step([state])]
    return torch.cat(mels, dim=1), np.concatenate(audio), engine.stats.estimator_frames


def test_flow_steps_must_be_positive() -> None:
    for bad in (0, -2):
        with pytest.raises(ValueError, match="flow_steps must be >= 1"):
            Token2WavConfig(flow_steps=bad)
    assert Token2WavConfig().flow_steps is None and Token2WavConfig(flow_steps=1).flow_steps == 1


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "whole"])
def test_ten_steps_is_the_default_and_fewer_approach_it(modules, streaming: bool) -> None:
    assert modules[0].config.cfm.n_timesteps == 10
    mel_default, audio_default, frames_default = _run(modules, None, streaming)
    mel_10, audio_10, frames_10 = _run(modules, 10, streaming)
    assert torch.equal(mel_default, mel_10) and np.array_equal(audio_default, audio_10)
    assert frames_default == frames_10
    errors = {}
    for k in (2, 5):
        mel_k, audio_k, frames_k = _run(modules, k, streaming)
        assert mel_k.shape == mel_10.shape and audio_k.shape == audio_10.shape
        assert frames_k * 10 == frames_10 * k  # every solve (voice prefix, chunks, final) ran k steps
        errors[k] = float((mel_k - mel_10).norm() / mel_10.norm())
    assert all(math.isfinite(e) for e in errors.values())
    assert errors[2] > errors[5] > 0, errors


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("m") / "tiny")


def test_tts_load_sets_the_steps_of_its_token2wav_config(model_dir: Path) -> None:
    with TTS.load(model_dir, flow_steps=3) as tts:
        assert tts.token2wav_config.flow_steps == 3 and tts.token2wav_config.final_attention == "full"  # TTS's own
        wav = tts.synthesize("Hi there.", seed=0)
        assert len(wav) > 0 and np.isfinite(wav).all()
        assert tts.engine.token2wav.n_timesteps == 3
    given = Token2WavConfig(final_attention="causal", flow_steps=4)
    assert TTS.load(model_dir, token2wav=given).token2wav_config is given
    assert TTS.load(model_dir, token2wav=given, flow_steps=6).token2wav_config.flow_steps == 6
    assert TTS.load(model_dir).token2wav_config.flow_steps is None
    with pytest.raises(ValueError, match="flow_steps must be >= 1"):
        TTS.load(model_dir, flow_steps=0)


def test_cli_flags(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o.wav"
    assert main(["speak", "Hi there.", "-o", str(out), "--model", str(model_dir), "--flow-steps", "2"]) == 0
    wav, sr = sf.read(out)
    assert sr == 24000 and len(wav) > 0 and np.isfinite(wav).all()
    # every entry point that loads a model takes the same flags, with the same usage errors before anything loads
    commands = {"speak": ["speak", "Hi.", "-o", str(tmp_path / "x.wav")], "serve": ["serve"],
                "serve --ray": ["serve", "--ray"],
                "infer": ["infer", "--manifest", str(tmp_path / "m.jsonl"), "--out", str(tmp_path / "out")],
                "export-triton": ["export-triton", str(tmp_path / "repo")]}
    for name, argv in commands.items():
        for flags, message in ((["--flow-steps", "0"], "--flow-steps: must be at least 1"),
                               (["--token2wav-cache-mib", "-1"], "--token2wav-cache-mib: must be at least 0"),
                               (["--final-chunk", "half"], "--final-chunk: invalid choice"),
                               (["--max-streams", "-1"], "--max-streams: must be at least 0")):
            with pytest.raises(SystemExit) as exit_info:
                main(argv + flags)
            assert exit_info.value.code == 2 and message in capsys.readouterr().err, (name, flags)
        assert main(argv + ["--precision", "int4"]) == 2
        assert "--precision must be one of auto, fp32" in capsys.readouterr().err, name
    for name in ("speak", "serve", "serve --ray", "infer"):  # the machine it runs on is checked before loading
        assert main(commands[name] + ["--precision", "fp16"]) == 2
        assert "fp16 needs a CUDA GPU" in capsys.readouterr().err, name
    assert not (tmp_path / "out").exists() and not (tmp_path / "repo").exists()


def test_server_model_options(model_dir: Path) -> None:
    """What `vocalis serve` (and each Ray replica) loads: the flags reach the engine that serves."""
    from vocalis.model_options import ModelOptions

    tts = ModelOptions(precision="int8", flow_steps=3, token2wav_cache_mib=7, final_chunk="causal",
                       max_streams=2).load(model_dir)
    with tts:
        assert len(tts.synthesize("Hi there.", seed=0)) > 0
        t2w = tts.engine.token2wav
        assert (t2w.n_timesteps, t2w.config.final_attention, t2w.config.max_cache_mib) == (3, "causal", 7)
        assert t2w.config.max_streams == 2
        assert tts.runtime.precision == "int8"
    default = ModelOptions().load(model_dir).token2wav_config
    assert default.final_attention == "full"  # the reference's last chunk
    assert default.max_streams == 16  # on a CPU: requests in flight, over several token2wav steps
    assert ModelOptions(max_streams=0).load(model_dir).token2wav_config.max_streams is None  # 0: no cap


def test_builtin_model_streams_end_block_causal() -> None:
    """The built-in model has no reference to match: its streams end block-causal unless asked for the full pass;
    a CosyVoice model's end on the reference's full-attention pass (above)."""
    from vocalis.model_options import ModelOptions

    assert TTS.load().token2wav_config.final_attention == "causal"
    assert ModelOptions().load(None).token2wav_config.final_attention == "causal"
    assert ModelOptions(final_chunk="full").load(None).token2wav_config.final_attention == "full"


def test_cv3_engine_takes_the_steps(cv3_model, cv3_dir: Path) -> None:
    """CosyVoice 3's engine solves with the setting too (the compat_cv3 fixture's recorded prompt and tokens)."""
    ref = cv3_reference(cv3_dir, "ref_stream")
    prompt = FlowPrompt(ref["prompt_token"], ref["prompt_feat"], ref["embedding"])
    tokens = ref["token"][0, :30].tolist()
    out = {}
    for steps in (None, 10, 2):
        engine = CV3Token2WavEngine(cv3_model.flow, cv3_model.hift, Token2WavConfig(flow_steps=steps))
        state = engine.new_stream("r", prompt, streaming=False)
        state.add_source_tokens(tokens)
        state.end_input()
        audio = np.concatenate([c.samples for c in engine.step([state])])
        out[steps] = (audio, state.estimator_frames)
    assert cv3_model.flow.config.cfm.n_timesteps == 10
    assert np.array_equal(out[None][0], out[10][0]) and out[None][1] == out[10][1] == 5 * out[2][1]
    assert out[2][0].shape == out[10][0].shape and not np.array_equal(out[2][0], out[10][0])
