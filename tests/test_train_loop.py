"""Trainers on a tiny prepared corpus: the loss goes down for each task, accumulation k=2 equals a batch twice
as large, a run killed mid-way resumes bit-identically, two torchrun ranks stay identical, export works."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from train_corpus import prepared_corpus

from vocalis.errors import InputError
from vocalis.train.checkpointing import checkpoint_path, load_checkpoint
from vocalis.train.config import TrainConfig, load_config
from vocalis.train.run import train

REPO = Path(__file__).resolve().parents[1]
BASE = ["trainer.max_epochs=0", "trainer.log_every=1", "trainer.save_every=1000", "trainer.num_threads=1",
        "scheduler.name=constant", "scheduler.warmup_steps=0", "data.shuffle_buffer=4", "data.max_frames_in_batch=300"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepared_corpus(tmp_path_factory.mktemp("corpus"), n=8)


@pytest.fixture(scope="module")
def equal_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepared_corpus(tmp_path_factory.mktemp("equal"), n=8, equal=True)


def _config(task: str, data: Path, out: Path, *overrides: str) -> TrainConfig:
    return load_config(None, [f"data.train=[{data}]", f"trainer.out_dir={out}", *BASE, *overrides], task=task)


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines()]


def _weights(path: Path, name: str) -> dict[str, torch.Tensor]:
    return load_checkpoint(path)["models"][name]


# small discriminators and 10-frame segments keep the GAN step cheap
HIFT = ("data.segment_frames=10", "data.max_frames_in_batch=40", "hift.periods=[2,3]", "hift.period_channels=[4,8,16]",
        "hift.spec_channels=4")


@pytest.mark.parametrize("task, steps, extra", [("llm", 12, ()), ("flow", 12, ()), ("tokenizer", 12, ()),
                                                ("hift", 8, HIFT)])
def test_loss_goes_down(task: str, steps: int, extra: tuple[str, ...], corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / task
    summary = train(_config(task, corpus, out, f"trainer.max_steps={steps}", "optim.lr=3e-3", *extra))
    losses = _losses(out)  # hift: the mel L1 of the generator
    assert summary["step"] == steps and len(losses) == steps
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.85 * first, losses
    assert checkpoint_path(out, steps).is_file()
    if task == "hift":  # two optimizer groups, both stepped and logged
        record = json.loads((out / "train_log.jsonl").read_text().splitlines()[-1])
        assert record["lr_generator"] == record["lr_discriminator"] == 3e-3
        assert record["grad_norm_generator"] > 0 and record["grad_norm_discriminator"] > 0
        assert sorted(load_checkpoint(checkpoint_path(out, steps))["models"]) == ["discriminator", "hift"]
    if task == "llm":
        assert summary["metrics_backend"] == "tensorboard+jsonl"
        assert list((out / "tensorboard").glob("events.out.tfevents.*"))
        record = json.loads((out / "train_log.jsonl").read_text().splitlines()[-1])
        assert {"grad_norm", "lr", "samples_per_s", "frames_per_s", "acc"} <= set(record)


def test_hift_warmup_without_critic(corpus: Path, tmp_path: Path) -> None:
    """hift.adversarial=none: the generator learns from mel + F0 alone, and no discriminator is built or saved."""
    out = tmp_path / "hift-warm"
    train(_config("hift", corpus, out, "trainer.max_steps=8", "optim.lr=3e-3", "hift.adversarial=none", *HIFT))
    losses = _losses(out)
    assert sum(losses[-3:]) / 3 < 0.85 * sum(losses[:3]) / 3, losses
    record = json.loads((out / "train_log.jsonl").read_text().splitlines()[-1])
    assert record["grad_norm_generator"] > 0 and "grad_norm_discriminator" not in record
    assert not any(k.startswith("d_") for k in record)
    state = load_checkpoint(checkpoint_path(out, 8))
    assert list(state["models"]) == ["hift"] and list(state["optimizers"]) == ["generator"]


def test_hift_multi_period_critic_alone(corpus: Path, tmp_path: Path) -> None:
    """hift.spec_resolutions=[]: a GAN run with the multi-period critic only (the CPU recipe's critic) learns, and
    its checkpoint holds no spectrogram critic."""
    out = tmp_path / "hift-mpd"
    train(_config("hift", corpus, out, "trainer.max_steps=8", "optim.lr=3e-3", "hift.spec_resolutions=[]", *HIFT))
    losses = _losses(out)
    assert sum(losses[-3:]) / 3 < 0.85 * sum(losses[:3]) / 3, losses
    record = json.loads((out / "train_log.jsonl").read_text().splitlines()[-1])
    assert record["grad_norm_discriminator"] > 0 and record["g_fm"] > 0
    critic = load_checkpoint(checkpoint_path(out, 8))["models"]["discriminator"]
    assert critic and all(k.startswith("period.") for k in critic), sorted(critic)


def test_hift_critic_free_resume(corpus: Path, tmp_path: Path) -> None:
    """A critic-free run resumes bit-identically, also from a checkpoint that still holds an idle critic (as
    written before critic-free runs dropped it); a GAN run may resume from a critic-free checkpoint (fresh critic)."""
    from vocalis.train.discriminators import DiscriminatorConfig, HiFTDiscriminator

    warm = ["optim.lr=3e-3", "hift.adversarial=none", "trainer.save_every=3", *HIFT]
    train(_config("hift", corpus, tmp_path / "whole", "trainer.max_steps=6", *warm))
    train(_config("hift", corpus, tmp_path / "split", "trainer.max_steps=3", *warm))
    legacy = tmp_path / "legacy"
    (legacy / "checkpoints").mkdir(parents=True)
    state = load_checkpoint(checkpoint_path(tmp_path / "split", 3))
    critic = HiFTDiscriminator(DiscriminatorConfig(periods=(2, 3), period_channels=(4, 8, 16), spec_channels=4))
    state["models"]["discriminator"] = critic.state_dict()
    for part in ("optimizers", "schedulers", "scalers"):
        state[part] = {"discriminator": state[part]["generator"], **state[part]}
    torch.save(state, checkpoint_path(legacy, 3))
    for run in ("split", "legacy"):
        train(_config("hift", corpus, tmp_path / run, "trainer.max_steps=6", "trainer.resume=auto", *warm))
    whole = _weights(checkpoint_path(tmp_path / "whole", 6), "hift")
    for run in ("split", "legacy"):
        resumed = _weights(checkpoint_path(tmp_path / run, 6), "hift")
        assert all(torch.equal(whole[k], resumed[k]) for k in whole), run
    assert _losses(tmp_path / "split")[-3:] == _losses(tmp_path / "whole")[-3:]

    gan = tmp_path / "gan"
    (gan / "checkpoints").mkdir(parents=True)
    torch.save(load_checkpoint(checkpoint_path(tmp_path / "whole", 6)), checkpoint_path(gan, 6))
    summary = train(_config("hift", corpus, gan, "trainer.max_steps=7", "trainer.resume=auto", "optim.lr=3e-3", *HIFT))
    assert summary["step"] == 7
    assert sorted(load_checkpoint(checkpoint_path(gan, 7))["models"]) == ["discriminator", "hift"]


def test_accumulation_of_two_equals_a_batch_twice_as_large(equal_corpus: Path, tmp_path: Path) -> None:
    # Equal-length utterances and no shuffling: batches of 2 (k=2) cover exactly the batches of 4 (k=1). The
    # LM loss is deterministic with bistream_prob=0. Adam with a large eps is near-linear in the gradient, so
    # the tolerance checks the gradients rather than Adam's sign-like first steps.
    from vocalis.config import PRESETS
    from vocalis.models.speech_lm import Qwen2LM
    from vocalis.train.data import ShardDataset, resolve_shards

    probe = ShardDataset(resolve_shards([str(equal_corpus)]), _config("llm", equal_corpus, tmp_path).data, "llm")
    length = next(iter(probe.examples())).length
    common = ["data.shuffle_buffer=0", "data.sort_buffer=0", "llm.bistream_prob=0", "trainer.max_steps=2",
              "optim.lr=0.5", "optim.eps=1.0"]
    small = train(_config("llm", equal_corpus, tmp_path / "k2", *common, "trainer.accum_grad=2",
                          f"data.max_frames_in_batch={2 * length}"))
    large = train(_config("llm", equal_corpus, tmp_path / "k1", *common, "trainer.accum_grad=1",
                          f"data.max_frames_in_batch={4 * length}"))
    assert small["step"] == large["step"] == 2
    a = _weights(checkpoint_path(tmp_path / "k2", 2), "llm")
    b = _weights(checkpoint_path(tmp_path / "k1", 2), "llm")
    torch.manual_seed(0)  # the trainer seeds trainer.seed (0) before building: the same initial weights
    init = Qwen2LM(PRESETS["tiny"].llm).state_dict()
    moved = max(float((b[k] - init[k]).abs().max()) for k in b)
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert moved > 1e-3 and worst < 1e-4 * moved, (moved, worst)


def test_killed_run_resumes_bit_identically(corpus: Path, tmp_path: Path) -> None:
    common = ["trainer.save_every=2", "optim.lr=2e-3", "scheduler.name=noam_hold", "scheduler.warmup_steps=2",
              "scheduler.hold_steps=1", "data.num_workers=0"]
    # a separate process, killed (SIGKILL) once its step-4 checkpoint exists; meanwhile the reference run
    # (6 steps in one go) trains here
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "vocalis", "train", "flow", "--data", str(corpus), "--out", str(killed),
           "--max-steps", "1000", *[a for o in BASE + common for a in ("--set", o)]]
    log = tmp_path / "killed.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
        try:
            train(_config("flow", corpus, tmp_path / "ref", *common, "trainer.max_steps=6"))
            deadline = time.monotonic() + 120
            while not checkpoint_path(killed, 4).is_file():
                assert proc.poll() is None, log.read_text()[-2000:]
                assert time.monotonic() < deadline, "no step-4 checkpoint in time: " + log.read_text()[-2000:]
                time.sleep(0.05)
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
    # the step-4 checkpoint of the killed process matches the reference run's weights at step 4
    resumed_from = checkpoint_path(killed, 4)
    ref4 = _weights(checkpoint_path(tmp_path / "ref", 4), "flow")
    assert all(torch.equal(v, ref4[k]) for k, v in _weights(resumed_from, "flow").items())
    # resume it to step 6 (a fresh run folder, so nothing of the killed run's later steps is reused)
    summary = train(_config("flow", corpus, tmp_path / "resumed", *common, "trainer.max_steps=6",
                            f"trainer.resume={resumed_from}"))
    assert summary["step"] == 6
    ref, res = _weights(checkpoint_path(tmp_path / "ref", 6), "flow"), _weights(checkpoint_path(tmp_path / "resumed", 6), "flow")
    assert all(torch.equal(ref[k], res[k]) for k in ref)
    ref_state, res_state = load_checkpoint(checkpoint_path(tmp_path / "ref", 6)), load_checkpoint(checkpoint_path(tmp_path / "resumed", 6))
    assert (ref_state["epoch"], ref_state["batches_in_epoch"]) == (res_state["epoch"], res_state["batches_in_epoch"])
    assert ref_state["schedulers"] == res_state["schedulers"]


def test_two_torchrun_ranks_on_gloo_end_identical(corpus: Path, tmp_path: Path) -> None:
    # The GAN task: two DDP modules (generator, discriminator), two optimizers, no_sync on the accumulation step.
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "vocalis", "train", "hift", "--data", str(corpus), "--out", str(out), "--max-steps", "2",
           "--device", "cpu", *[a for o in BASE + list(HIFT) + ["optim.lr=3e-3", "trainer.accum_grad=2", "trainer.tensorboard=false",
                                                                 "data.max_frames_in_batch=20"] for a in ("--set", o)]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["step"] == 2
    assert summary["replicas_identical"] and len(set(summary["param_digests"])) == 1
    state = load_checkpoint(checkpoint_path(out, 2))
    assert len(state["rng"]) == 2  # one RNG record per rank
    # the weights moved: rank-identical is not the trivial "nothing trained"
    torch.manual_seed(0)
    from vocalis.config import PRESETS
    from vocalis.models.hift.generator import HiFTGenerator

    init = HiFTGenerator(PRESETS["tiny"].hift).state_dict()
    assert any(not torch.equal(init[k], v) for k, v in state["models"]["hift"].items())


def test_average_and_export_to_a_loadable_model_dir(corpus: Path, tmp_path: Path) -> None:
    from vocalis.cli import main
    from vocalis.model_dir import load_model

    out = tmp_path / "run"
    train(_config("flow", corpus, out, "trainer.max_steps=3", "trainer.save_every=1"))
    avg = tmp_path / "avg.pt"
    assert main(["average", "--run", str(out), "--last", "2", "-o", str(avg)]) == 0
    a, b = (_weights(checkpoint_path(out, s), "flow") for s in (2, 3))
    mean = _weights(avg, "flow")
    key = next(k for k in mean if mean[k].is_floating_point() and not torch.equal(a[k], b[k]))
    assert torch.allclose(mean[key], (a[key] + b[key]) / 2, atol=1e-7)
    # a trained speech tokenizer goes in beside the TTS parts and is what the loaded model tokenizes with
    tok_run = tmp_path / "tok"
    train(_config("tokenizer", corpus, tok_run, "trainer.max_steps=1"))
    model_dir = tmp_path / "exported"
    assert main(["export", str(avg), str(checkpoint_path(tok_run, 1)), "--out", str(model_dir)]) == 0
    loaded = load_model(model_dir)
    assert all(torch.equal(loaded.flow.state_dict()[k], v) for k, v in mean.items())
    from vocalis.frontend.speech_tokenizer import TorchSpeechTokenizer

    assert isinstance(loaded.speech_tokenizer, TorchSpeechTokenizer)
    tok_weights = _weights(checkpoint_path(tok_run, 1), "tokenizer")
    assert all(torch.equal(loaded.speech_tokenizer.model.state_dict()[k], v) for k, v in tok_weights.items())
    assert len(loaded.speech_tokenizer.tokenize(torch.randn(16000).numpy() * 0.1)) == 25
    assert main(["export", str(avg), "--out", str(model_dir)]) == 2  # refuses to overwrite


def test_precisions_and_gradient_checkpointing(corpus: Path, tmp_path: Path) -> None:
    for precision in ("bf16", "fp16"):  # autocast on CPU; fp16 also through the GradScaler
        out = tmp_path / precision
        train(_config("flow", corpus, out, "trainer.max_steps=2", f"trainer.precision={precision}"))
        assert all(math.isfinite(x) for x in _losses(out))
        scaler = load_checkpoint(checkpoint_path(out, 2))["scalers"]["main"]
        assert (scaler["scale"] > 0) if precision == "fp16" else scaler == {}
    # checkpointing recomputes activations in backward, and changes nothing else: bitwise equal weights
    weights = {}
    for flag in ("false", "true"):
        out = tmp_path / f"gc-{flag}"
        train(_config("llm", corpus, out, "trainer.max_steps=2", f"trainer.gradient_checkpointing={flag}"))
        weights[flag] = _weights(checkpoint_path(out, 2), "llm")
    assert all(torch.equal(weights["true"][k], weights["false"][k]) for k in weights["true"])

    from vocalis.train.data import ShardDataset, resolve_shards
    from vocalis.train.task import enable_gradient_checkpointing
    from vocalis.train.tasks import build_task

    config = _config("llm", corpus, tmp_path / "count")
    shards = resolve_shards(config.data.train)
    batch = next(iter(ShardDataset(shards, config.data, "llm")))
    calls = []
    for checkpointing in (False, True):
        task = build_task(config, shards)
        layers = list(task.checkpointed_layers())
        if checkpointing:
            assert enable_gradient_checkpointing(layers) == len(layers) == 2
        count = [0]
        for layer in layers:  # count MLP runs (module hooks do not fire during a checkpoint's recomputation)
            inner = layer.mlp.forward

            def counted(*args: object, _inner=inner, _count=count) -> torch.Tensor:
                _count[0] += 1
                return _inner(*args)

            layer.mlp.forward = counted
        loss, _ = task.objective(batch, __import__("random").Random(0))
        loss.backward()
        calls.append(count[0])
    assert calls == [2, 4]  # each layer's MLP runs again during backward


def test_deepspeed_zero2_trains_and_resumes_exactly(corpus: Path, tmp_path: Path) -> None:
    pytest.importorskip("deepspeed", reason="the optional `deepspeed` extra is not installed")
    common = ["trainer.engine=deepspeed", "trainer.save_every=2", "trainer.accum_grad=2", "trainer.tensorboard=false"]
    summary = train(_config("llm", corpus, tmp_path / "ds", *common, "trainer.max_steps=4"))
    assert summary["step"] == 4 and (tmp_path / "ds" / "deepspeed" / "step_00000002").is_dir()
    train(_config("llm", corpus, tmp_path / "ds-resumed", *common, "trainer.max_steps=4",
                  f"trainer.resume={checkpoint_path(tmp_path / 'ds', 2)}"))
    a, b = (_weights(checkpoint_path(tmp_path / d, 4), "llm") for d in ("ds", "ds-resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(InputError, match="one optimizer"):
        train(_config("hift", corpus, tmp_path / "ds-gan", *common, *HIFT, "trainer.max_steps=1"))


def test_fine_tune_an_official_directory_and_export(compat_dir: Path, tmp_path: Path) -> None:
    """`model.init_from` = an unchanged official-layout directory (the tiny compatibility fixture: 300 text ids,
    100 speech ids); the export keeps its untouched parts and carries the fine-tuned LLM."""
    import numpy as np

    from vocalis.cli import main
    from vocalis.model_dir import load_model
    from vocalis.train.prepare import write_shard

    rng = np.random.default_rng(0)
    rows = []
    for i in range(6):
        n_tok = int(rng.integers(20, 40))
        rows.append({"utt": f"c{i}", "wav": "", "text": "x", "speaker": "s", "language": "en", "duration": n_tok / 25,
                     "text_token": rng.integers(0, 300, 6).astype(np.int32),
                     "speech_token": rng.integers(0, 100, n_tok).astype(np.int32),
                     "embedding": rng.standard_normal(192).astype(np.float32), "num_frames": 2 * n_tok,
                     "mel": rng.standard_normal(2 * n_tok * 80).astype(np.float32),
                     "f0": np.zeros(2 * n_tok, np.float32), "audio": b""})
    (tmp_path / "data").mkdir()
    write_shard(rows, tmp_path / "data" / "shard-000000.parquet")
    shard = str(tmp_path / "data" / "shard-000000.parquet")
    out = tmp_path / "run"
    train(load_config(None, [f"data.train=[{shard}]", f"trainer.out_dir={out}", *BASE, "trainer.max_steps=2",
                             f"model.init_from={compat_dir}"], task="llm"))
    official = load_model(compat_dir)
    trained = _weights(checkpoint_path(out, 2), "llm")
    assert any(not torch.equal(trained[k], v) for k, v in official.llm.state_dict().items())
    assert main(["export", str(checkpoint_path(out, 2)), "--out", str(tmp_path / "exported")]) == 0
    exported = load_model(tmp_path / "exported")
    assert all(torch.equal(exported.llm.state_dict()[k], v) for k, v in trained.items())
    assert all(torch.equal(exported.flow.state_dict()[k], v) for k, v in official.flow.state_dict().items())
