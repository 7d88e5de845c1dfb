#!/usr/bin/env python3
"""Does a part of the built-in model generalise? Its training loss on utterances it trained on vs unseen ones.

llm:  teacher-forced next-speech-token loss and accuracy (eval mode, uni-stream) on the first N utterances of a
      prepared training folder vs the held-out sentences' teacher clips that `scripts/measure_builtin.py` left in
      its --out folder (named by its --json rows), tokenised by the model's own speech tokenizer. A wide gap means
      the LLM learned its training sentences rather than how text sounds.
flow: flow-matching loss (eval mode, the same noise and times for every checkpoint) on N utterances of a prepared
      folder it trained on vs N of one it did not.

    python scripts/check_generalization.py llm --model DIR --train PREP --measure OUT --rows OUT.json [--checkpoint C ...]
    python scripts/check_generalization.py flow --seen PREP --unseen PREP2 --checkpoint C [C ...]

Checkpoints are trainer checkpoints (`RUN/llm/checkpoints/step_*.pt`); without --checkpoint the llm check uses the
model directory's own weights.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr
import torch

from vocalis.config import PRESETS
from vocalis.model_dir import build_modules, load_model
from vocalis.models.flow.flow_train import flow_matching_loss
from vocalis.models.speech_lm_train import lm_training_forward
from vocalis.train.data import DataConfig, Example, ShardDataset, collate, resolve_shards


def first_examples(source: Path, task: str, n: int) -> list[Example]:
    out: list[Example] = []
    for ex in ShardDataset(resolve_shards([str(source)]), DataConfig(), task).examples():
        out.append(ex)
        if len(out) >= n:
            break
    return out


def padded(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.tensor([len(s) for s in seqs])
    out = torch.zeros(len(seqs), int(lens.max()), dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s)
    return out, lens


def load_part(module: torch.nn.Module, checkpoint: str, part: str) -> None:
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    module.load_state_dict(state["models"][part])


def check_llm(args: argparse.Namespace) -> None:
    model = load_model(args.model)
    if model.speech_tokenizer is None or model.tokenizer is None:
        sys.exit(f"{args.model}: needs a text tokenizer and a speech tokenizer")
    rows = json.loads(args.rows.read_text("utf-8"))["rows"]
    held: list[tuple[list[int], list[int]]] = []
    for i, row in enumerate(rows):
        wav, rate = sf.read(args.measure / f"teacher-{row['voice']}-{i:03d}.wav", dtype="float32")
        wav16 = soxr.resample(wav, rate, 16000).astype(np.float32)
        held.append((model.tokenizer.encode(row["text"]), list(model.speech_tokenizer.tokenize(wav16))))
    train = [(list(e.text_token), list(e.speech_token)) for e in first_examples(args.train, "llm", args.n)]
    for checkpoint in args.checkpoint or [None]:
        if checkpoint:
            load_part(model.llm, checkpoint, "llm")
        model.llm.eval()
        figures = {}
        with torch.no_grad():
            for name, pairs in (("train", train), ("held-out", held)):
                text, text_len = padded([t for t, _ in pairs])
                speech, speech_len = padded([s for _, s in pairs])
                out = lm_training_forward(model.llm, text, text_len, speech, speech_len, rng=random.Random(0),
                                          bistream_prob=0.0)
                figures[name] = f"loss {float(out.loss):.3f} acc {float(out.acc):.3f} ({len(pairs)} utts)"
        print(f"{checkpoint or args.model}: " + " | ".join(f"{k} {v}" for k, v in figures.items()), flush=True)


def check_flow(args: argparse.Namespace) -> None:
    _, flow, _ = build_modules(PRESETS[args.preset])
    sets = {"seen": first_examples(args.seen, "flow", args.n), "unseen": first_examples(args.unseen, "flow", args.n)}
    for checkpoint in args.checkpoint:
        load_part(flow, checkpoint, "flow")
        flow.eval()
        figures = {}
        with torch.no_grad():
            for name, examples in sets.items():
                losses = []
                for i in range(0, len(examples), 8):
                    b = collate(examples[i : i + 8], "flow")
                    g = torch.Generator().manual_seed(i)  # same noise and times for every checkpoint and set
                    losses.append(float(flow_matching_loss(flow, b.speech_token, b.speech_token_len, b.mel, b.mel_len,
                                                           b.embedding, generator=g)))
                figures[name] = f"{np.mean(losses):.4f}"
        print(f"{checkpoint}: flow-matching loss " + " | ".join(f"{k} {v}" for k, v in figures.items()), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="part", required=True)
    llm = sub.add_parser("llm")
    llm.add_argument("--model", type=Path, required=True, help="exported model directory (tokenizers, LLM)")
    llm.add_argument("--train", type=Path, required=True, help="prepared folder the LLM trained on")
    llm.add_argument("--measure", type=Path, required=True, help="measure_builtin.py --out folder (teacher wavs)")
    llm.add_argument("--rows", type=Path, required=True, help="measure_builtin.py --json file (held-out rows)")
    llm.add_argument("--checkpoint", nargs="*", default=[])
    llm.add_argument("-n", type=int, default=40, help="training utterances")
    flow = sub.add_parser("flow")
    flow.add_argument("--seen", type=Path, required=True)
    flow.add_argument("--unseen", type=Path, required=True)
    flow.add_argument("--checkpoint", nargs="+", required=True)
    flow.add_argument("--preset", default="builtin", choices=sorted(PRESETS))
    flow.add_argument("-n", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(1)
    (check_llm if args.part == "llm" else check_flow)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
