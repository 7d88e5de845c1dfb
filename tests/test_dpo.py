"""DPO on fixed preference pairs with a tiny model: the loss falls and the chosen-minus-rejected margin rises,
the reference stays frozen, a bad pairs file is one error line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from vocalis.train.checkpointing import checkpoint_path, load_checkpoint
from vocalis.train.config import load_config
from vocalis.train.run import train

REPO = Path(__file__).resolve().parents[1]
COMMON = ["trainer.log_every=1", "trainer.num_threads=1", "trainer.tensorboard=false", "scheduler.name=constant",
          "scheduler.warmup_steps=0", "optim.lr=2e-3", "policy.global_batch=4", "policy.micro_batch=2",
          "dpo.beta=0.5"]


def write_pairs(path: Path, n: int = 8) -> Path:
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        text = torch.randint(0, 1000, (5,), generator=g).tolist()
        chosen = torch.randint(0, 6561, (12,), generator=g).tolist()
        rejected = torch.randint(0, 6561, (14,), generator=g).tolist()
        rows.append({"text_token": text, "chosen": chosen, "rejected": rejected,
                     "prompt_speech_token": torch.randint(0, 6561, (3,), generator=g).tolist()})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_dpo_loss_falls_and_margin_rises(tmp_path: Path) -> None:
    pairs = write_pairs(tmp_path / "pairs.jsonl")
    out = tmp_path / "dpo"
    summary = train(load_config(None, [f"policy.data={pairs}", f"trainer.out_dir={out}", "trainer.max_steps=10",
                                       *COMMON], task="dpo"))
    assert summary["step"] == 10
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    loss = [r["loss"] for r in records]
    margin = [r["margin"] for r in records]
    assert abs(loss[0] - 0.6931) < 1e-3 and abs(margin[0]) < 1e-6  # policy == reference at the first step
    assert sum(loss[-3:]) / 3 < 0.5 * loss[0], loss
    assert sum(margin[-3:]) / 3 > 1.0, margin
    assert records[-1]["accuracy"] == 1.0
    state = load_checkpoint(checkpoint_path(out, 10))
    assert list(state["models"]) == ["llm"] and state["task"] == "dpo"
    # a full DPO run's checkpoint exports like an llm run's
    from vocalis.cli import main
    from vocalis.model_dir import load_model

    assert main(["export", str(checkpoint_path(out, 10)), "--out", str(tmp_path / "model")]) == 0
    exported = load_model(tmp_path / "model").llm.state_dict()
    assert all(torch.equal(exported[k], v) for k, v in state["models"]["llm"].items())


def test_bad_pairs_file_is_one_error_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text_token": [1, 2], "chosen": [1, 99999], "rejected": [3]}) + "\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "vocalis", "train", "dpo", "--data", str(bad), "--out",
                           str(tmp_path / "o"), "--max-steps", "1"], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("vocalis: error:") and "out of range" in lines[0]


def test_shuffled_positions_are_epochs_of_one_seeded_shuffle() -> None:
    """DPO's pairs and GRPO's prompts: every epoch a permutation, the same stream however it is cut into steps."""
    from vocalis.train.policy_data import shuffled_positions

    stream = shuffled_positions(5, 3, 0, 15)
    assert all(sorted(stream[e * 5:(e + 1) * 5]) == list(range(5)) for e in range(3))
    assert stream[:5] != stream[5:10]  # each epoch its own order
    assert shuffled_positions(5, 3, 3, 8) == stream[3:11]
    assert shuffled_positions(5, 4, 0, 5) != stream[:5]


def test_policy_runs_learn_from_their_first_step(tmp_path: Path) -> None:
    """dpo and grpo fine-tune for tens of steps: their learning rate is the configured one from step 1, not the
    pretraining schedule's 2500-step warmup; a config that sets the scheduler keeps it."""
    pairs = write_pairs(tmp_path / "pairs.jsonl")
    out = tmp_path / "dpo"
    common = [s for s in COMMON if not s.startswith("scheduler.")]  # the task's default schedule
    train(load_config(None, [f"policy.data={pairs}", f"trainer.out_dir={out}", "trainer.max_steps=2", *common],
                      task="dpo"))
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in records] == [2e-3, 2e-3]
    for task in ("dpo", "grpo"):
        assert load_config(None, ["scheduler.warmup_steps=5"], task=task).scheduler.warmup_steps == 5
    assert load_config(None, [], task="llm").scheduler.warmup_steps == 2500
