"""GRPO on a tiny model: engine rollouts with a plugged-in reward that no untrained model meets (share of even
speech ids -> 1), the mean reward rises over fixed steps from fixed seeds, KL to the reference is 0 at the first
step, two gloo ranks make the same update as one rank with the whole group, a resumed run continues bit for bit,
rewards and KL reach TensorBoard; the pocketsphinx WER reward scores real speech."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vocalis.train.checkpointing import checkpoint_path, load_checkpoint
from vocalis.train.config import load_config
from vocalis.train.run import train

REPO = Path(__file__).resolve().parents[1]
COMMON = ["trainer.log_every=1", "trainer.num_threads=1", "scheduler.name=constant", "scheduler.warmup_steps=0",
          "optim.lr=1e-2", "policy.global_batch=8", "policy.micro_batch=2", "grpo.group_size=4", "grpo.max_len=24",
          "grpo.rewards=[grpo_rewards:even_ids]", "trainer.device=cpu"]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("grpo") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"text_token": [10 + i, 20 + i, 30 + i, 40 + i]}) + "\n" for i in range(4)))
    return path


@pytest.fixture(autouse=True)
def _plugin_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def _run(prompts: Path, out: Path, *extra: str) -> dict:
    return train(load_config(None, [f"policy.data={prompts}", f"trainer.out_dir={out}", *COMMON, *extra],
                             task="grpo"))


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def _weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    return load_checkpoint(checkpoint_path(out, step))["models"]["llm"]


def test_reward_rises_and_kl_starts_at_zero(prompts: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    summary = _run(prompts, out, "trainer.max_steps=12")
    records = _log(out)
    assert summary["step"] == 12 and len(records) == 12
    reward = [r["reward"] for r in records]
    assert records[0]["kl"] == 0.0  # the policy is the reference at the first step
    assert records[-1]["kl"] > 0
    assert sum(reward[-3:]) / 3 > sum(reward[:3]) / 3 + 0.1, reward
    assert all(abs(r["reward"] - 0.5) < 0.1 for r in records[:1])  # an untrained model: about half even
    assert {"reward_even_ids", "reward_group_std", "length", "clip_fraction", "grad_norm", "lr"} <= set(records[-1])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert {"train/reward", "train/kl", "train/loss"} <= set(events.Tags()["scalars"])
    pairs = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert pairs and all(p["reward_chosen"] > p["reward_rejected"] for p in pairs)  # DPO pairs from rollouts


def test_two_gloo_ranks_make_the_same_update_as_one(prompts: Path, tmp_path: Path) -> None:
    # Adam's eps well above float noise: the key biases' gradient is 0 in exact arithmetic (softmax ignores a
    # constant score shift), so at the default 1e-8 their updates are normalised rounding noise of either run
    extra = ["trainer.tensorboard=false", "trainer.save_every=1", "optim.eps=1e-6"]
    _run(prompts, tmp_path / "one", "trainer.max_steps=2", *extra)
    out = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "vocalis",
           "train", "grpo", "--data", str(prompts), "--out", str(out), "--max-steps", "2",
           *[a for o in COMMON + extra for a in ("--set", o)]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{Path(__file__).parent}"}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["replicas_identical"]
    one, two = _log(tmp_path / "one"), _log(out)
    assert [r["reward"] for r in one] == [r["reward"] for r in two]  # the same rollouts, spread over the ranks
    for step in (1, 2):
        a, b = _weights(tmp_path / "one", step), _weights(out, step)
        for k in a:  # within a thousandth of an Adam step (lr 1e-2): float summation order differs, nothing else
            torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-5)
    before = _weights(tmp_path / "one", 1)
    assert any(not torch.equal(a[k], before[k]) for k in a)  # the update is not the trivial "nothing moved"


def test_resume_continues_bit_for_bit(prompts: Path, tmp_path: Path) -> None:
    # two updates per rollout round, so a resume from step 3 starts inside a round (its rollouts come back from
    # the checkpoint)
    common = ["trainer.save_every=1", "grpo.updates_per_rollout=2", "trainer.tensorboard=false"]
    _run(prompts, tmp_path / "whole", "trainer.max_steps=5", *common)
    _run(prompts, tmp_path / "resumed", "trainer.max_steps=5", *common,
         f"trainer.resume={checkpoint_path(tmp_path / 'whole', 3)}")
    whole, resumed = (load_checkpoint(checkpoint_path(tmp_path / d, 5)) for d in ("whole", "resumed"))
    assert all(torch.equal(v, resumed["models"]["llm"][k]) for k, v in whole["models"]["llm"].items())
    assert whole["optimizers"]["main"]["state"].keys() == resumed["optimizers"]["main"]["state"].keys()
    for k, s in whole["optimizers"]["main"]["state"].items():
        assert all(torch.equal(v, resumed["optimizers"]["main"]["state"][k][n]) for n, v in s.items())
    assert [r["reward"] for r in _log(tmp_path / "whole")][3:] == [r["reward"] for r in _log(tmp_path / "resumed")]


def test_wer_reward_scores_real_speech(tmp_path: Path) -> None:
    """The pocketsphinx reward on speech from festival: the right transcript beats a wrong one."""
    pytest.importorskip("pocketsphinx")
    import numpy as np
    import soundfile as sf
    import soxr

    from vocalis.train.policy_config import GRPOConfig
    from vocalis.train.policy_data import SpeechSequence
    from vocalis.train.rewards import AUDIO_RATE, Rollout, build_scorers

    wav = tmp_path / "s.wav"
    text = "the quick brown fox jumps over the lazy dog"
    subprocess.run(["text2wave", "-o", str(wav)], input=text, text=True, check=True, capture_output=True)
    audio, sr = sf.read(wav, dtype="float32")
    audio = soxr.resample(audio, sr, AUDIO_RATE).astype(np.float32)
    (scorer,) = build_scorers(GRPOConfig(rewards=("wer",)), None)
    seq = SpeechSequence((1,), (2, 3))
    right, wrong = scorer([Rollout(text, seq, audio), Rollout("a completely different sentence", seq, audio)])
    assert right > -0.5 and wrong == -1.0 and right > wrong


def test_audio_rewards_run_through_token2wav(tmp_path: Path) -> None:
    """Text prompts with voices of a model directory: the frontend reads them, token2wav makes each rollout's audio
    (the engine's voice conversion for a cloned voice, the reference path for an embedding-only one), and the
    similarity (the model's speaker encoder against the voice) and WER rewards score it."""
    pytest.importorskip("pocketsphinx")
    from tiny_assets import make_tiny_model_dir, write_voice_like_wav

    from vocalis.frontend.family import frontend_for
    from vocalis.model_dir import load_model

    model = make_tiny_model_dir(tmp_path / "model")
    clip = write_voice_like_wav(tmp_path / "clip.wav", seconds=1.5)
    frontend_for(load_model(model)).make_voice(str(clip), name="clone").save(model / "voices" / "clone.safetensors")
    prompts = tmp_path / "text.jsonl"
    prompts.write_text("".join(json.dumps({"text": t, "voice": v}) + "\n"
                               for t, v in (("Hello there.", "default"), ("Bye.", "clone"))))
    out = tmp_path / "audio"
    _run(prompts, out, "trainer.max_steps=1", f"model.init_from={model}", "grpo.rewards=[similarity,wer,repetition]",
         "grpo.reward_weights=[1.0,1.0,0.5]", "grpo.max_len=8", "trainer.tensorboard=false")
    (record,) = _log(out)
    assert -1.0 <= record["reward_similarity"] <= 1.0 and record["reward_similarity"] != 0.0
    assert -1.0 <= record["reward_wer"] <= 0.0
    expected = record["reward_similarity"] + record["reward_wer"] + 0.5 * record["reward_repetition"]
    assert abs(record["reward"] - expected) < 1e-9
