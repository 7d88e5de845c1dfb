"""LoRA on the speech LM (peft): only the adapters train and the base stays bit-identical, the adapter folder
merges into the same outputs, `vocalis train merge-adapter` writes a loadable model, bad settings are one error
line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_corpus import prepared_corpus

from vocalis.adapters.lora_file import ADAPTER_JSON, ADAPTER_WEIGHTS, load_adapter, merge_adapter
from vocalis.model_dir import load_model, random_model, save_vocalis
from vocalis.train.checkpointing import checkpoint_path, load_checkpoint
from vocalis.train.config import load_config
from vocalis.train.data import ShardDataset, resolve_shards
from vocalis.train.distributed import init_distributed
from vocalis.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
BASE = ["trainer.max_epochs=0", "trainer.log_every=1", "trainer.save_every=1000", "trainer.num_threads=1",
        "scheduler.name=constant", "scheduler.warmup_steps=0", "data.shuffle_buffer=4", "data.max_frames_in_batch=300",
        "trainer.tensorboard=false"]
LORA = ["lora.enabled=true", "lora.rank=4", "lora.alpha=8", "lora.target_modules=[q_proj,v_proj,down_proj]"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepared_corpus(tmp_path_factory.mktemp("lora-corpus"), n=8)


@pytest.fixture(scope="module")
def trained(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Trainer:
    out = tmp_path_factory.mktemp("lora-run") / "run"
    model = corpus.parent / "model"
    config = load_config(None, [f"data.train=[{corpus}]", f"trainer.out_dir={out}", f"model.init_from={model}",
                                "trainer.max_steps=4", "optim.lr=1e-2", *BASE, *LORA], task="llm")
    trainer = Trainer(config, init_distributed("cpu"))
    trainer.run()
    return trainer


@pytest.fixture(scope="module")
def run(trained: Trainer) -> Path:
    return trained.out_dir


def _logits(llm: torch.nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, llm.config.qwen.hidden_size, generator=g)
    with torch.no_grad():
        return llm.eval()(x)


def test_only_adapters_train_and_the_base_stays(trained: Trainer, run: Path, corpus: Path) -> None:
    state = load_checkpoint(checkpoint_path(run, 4))
    assert list(state["models"]) == ["lora"]  # the checkpoint holds the adapters, not the LLM
    keys = list(state["models"]["lora"])
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys)
    assert {k.split("/")[-1].split(".")[0] for k in keys} == {"q_proj", "v_proj", "down_proj"}
    assert any(v.abs().sum() > 0 for k, v in state["models"]["lora"].items() if "lora_B" in k)  # it trained
    adapter = load_adapter(run / "adapter")
    assert (run / "adapter" / ADAPTER_WEIGHTS).stat().st_size < 0.2 * (corpus.parent / "model" / "llm.safetensors").stat().st_size
    assert adapter.config.rank == 4 and adapter.config.target_modules == ("q_proj", "v_proj", "down_proj")
    assert (run / "adapter" / ADAPTER_JSON).is_file()

    # after training, the base weights inside the run are bit-identical to the model directory's, and a backward
    # pass reaches the adapters only
    task = trained.task
    base = load_model(corpus.parent / "model").llm.state_dict()
    batch = next(iter(ShardDataset(resolve_shards(trained.config.data.train), trained.config.data, "llm")))
    loss, _ = task.objective(batch, __import__("random").Random(0))
    loss.backward()
    adapters = {id(p) for p in task.modules["lora"].parameters()}
    assert adapters
    for name, p in task.llm.named_parameters():  # type: ignore[attr-defined]
        assert (p.grad is not None) == (id(p) in adapters), name
        if id(p) not in adapters:
            key = name.replace(".base_layer", "")
            assert torch.equal(p, base[key]), name
    opt_params = sum(p.numel() for p in task.groups()["main"])
    assert opt_params == sum(p.numel() for p in task.modules["lora"].parameters())


def test_merged_equals_unmerged_and_merge_adapter_cli(run: Path, corpus: Path, tmp_path: Path) -> None:
    from vocalis.checkpoint import load_strict
    from vocalis.cli import main
    from vocalis.train.lora import LoraConfig, attach_lora

    model_dir = corpus.parent / "model"
    wrapped = load_model(model_dir).llm
    weights, _ = attach_lora(wrapped, LoraConfig(True, 4, 8.0, ("q_proj", "v_proj", "down_proj")))
    load_strict(weights, load_checkpoint(checkpoint_path(run, 4))["models"]["lora"], "lora")
    merged = load_model(model_dir).llm
    merge_adapter(merged, load_adapter(run / "adapter"))
    plain = load_model(model_dir).llm
    assert not torch.allclose(_logits(plain), _logits(merged), atol=1e-4)  # the adapter changes the outputs
    torch.testing.assert_close(_logits(merged), _logits(wrapped), atol=2e-5, rtol=1e-5)

    out = tmp_path / "merged"
    assert main(["train", "merge-adapter", str(run / "adapter"), "--out", str(out)]) == 0
    exported = load_model(out).llm
    assert all(torch.equal(v, merged.state_dict()[k]) for k, v in exported.state_dict().items())


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "vocalis", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env, check=False)


def test_bad_settings_are_one_error_line(run: Path, corpus: Path, tmp_path: Path) -> None:
    common = ["train", "llm", "--lora", "--data", str(corpus), "--out", str(tmp_path / "bad"), "--max-steps", "1"]
    for setting, words in (("lora.rank=0", "lora.rank must be >= 1"),
                           ("lora.target_modules=[q_proj,qkv]", "unknown lora.target_modules ['qkv']")):
        done = _cli(*common, "--set", setting, cwd=tmp_path)
        assert done.returncode == 2, done.stderr[-2000:]
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("vocalis: error:") and words in lines[0], done.stderr
    other = tmp_path / "other"
    save_vocalis(random_model(seed=1), other, tokenizer_src=corpus.parent / "model" / "tokenizer")
    done = _cli("train", "merge-adapter", str(run / "adapter"), "--base", str(other), "--out", str(tmp_path / "m"),
                cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "trained on another base model" in lines[0], done.stderr
    assert not (tmp_path / "m").exists()
