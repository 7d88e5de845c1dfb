#!/usr/bin/env python3
"""GRPO of the built-in model's speech LM on one voice with the pocketsphinx WER reward, then the model directory
that `measure_builtin.py --rows L5 --model DIR` measures.

    python recipes/builtin/grpo_builtin.py RUN [--voice slt] [--steps 36] [--group 4] [--global-batch 16] [--lr 5e-5]
    python recipes/builtin/grpo_builtin.py RUN --assemble DIR      # the newest checkpoint -> a model directory

The prompts are the training recipe's sentences (`vocalis.corpus.sentences.recipe`), which never hold the 50
held-out WordNet sentences the measurement reads. Rerunning the same command resumes from the newest checkpoint
(`--resume auto`), so the run survives being stopped.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

BUILTIN = Path(__file__).resolve().parents[2] / "vocalis" / "assets" / "model"


def write_prompts(path: Path, voice: str, n: int) -> None:
    from vocalis.corpus.sentences import recipe

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": text, "voice": voice}) + "\n" for text in recipe(n))


def train(args: argparse.Namespace) -> None:
    prompts = args.run / "prompts.jsonl"
    if not prompts.exists():
        write_prompts(prompts, args.voice, args.prompts)
    sets = {
        "grpo.rewards": "[wer]", "grpo.group_size": args.group, "grpo.kl_coef": args.kl,
        "policy.global_batch": args.global_batch, "policy.micro_batch": args.group,
        "optim.lr": args.lr, "scheduler.name": "constant", "scheduler.warmup_steps": args.warmup,
        "trainer.save_every": args.save_every,
        "trainer.keep_checkpoints": 2, "trainer.num_threads": args.threads, "trainer.seed": args.seed,
    }
    cmd = [sys.executable, "-m", "vocalis", "train", "grpo", "--init-from", str(args.model), "--data", str(prompts),
           "--out", str(args.run), "--max-steps", str(args.steps), "--resume", "auto"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    print(" ".join(cmd), flush=True)
    sys.exit(subprocess.call(cmd))


def assemble(args: argparse.Namespace) -> None:
    from vocalis.train.export import export, last_checkpoints

    newest = last_checkpoints(args.run, 1)
    if not newest:
        sys.exit(f"grpo_builtin: no checkpoint under {args.run}")
    export(newest, args.assemble, base=str(args.model))
    print(f"{newest[0]} -> {args.assemble}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="run folder (prompts, checkpoints, logs)")
    ap.add_argument("--model", type=Path, default=BUILTIN, help="the model to fine-tune (default: the built-in one)")
    ap.add_argument("--voice", default="slt")
    ap.add_argument("--prompts", type=int, default=400, help="training sentences to draw prompts from")
    ap.add_argument("--steps", type=int, default=36, help="optimizer steps (one rollout round each)")
    ap.add_argument("--group", type=int, default=4, help="samples per prompt (G)")
    ap.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--warmup", type=int, default=2, help="optimizer steps of linear learning-rate warmup")
    ap.add_argument("--kl", type=float, default=0.04, help="KL coefficient to the frozen reference")
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--assemble", type=Path, help="write the newest checkpoint's model directory here and stop")
    args = ap.parse_args()
    assemble(args) if args.assemble else train(args)


if __name__ == "__main__":
    main()
