"""Argument parsers of `vocalis prepare | train | average | export`. Importing this module is cheap: the
training code loads only when a command runs."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("vocalis")

TASK_HELP = {
    "llm": "the speech LM (next speech token); --lora for adapters",
    "flow": "the flow-matching decoder",
    "hift": "the HiFT vocoder (GAN)",
    "tokenizer": "a supervised speech tokenizer",
    "labeller": "the phone model's prompt tokenizer",
    "dpo": "the speech LM on preference pairs (DPO; a frozen reference)",
    "grpo": "the speech LM by GRPO: engine rollouts scored by reward functions",
}


def _prepare(args: argparse.Namespace) -> int:
    from vocalis.train.features import FeatureConfig
    from vocalis.train.prepare import PrepareConfig, format_summary, prepare

    features = FeatureConfig(min_seconds=args.min_seconds, max_seconds=args.max_seconds,
                             speech_tokens=not args.no_speech_tokens, speaker_embeddings=not args.no_speaker_embeddings,
                             keep_audio=not args.no_audio)
    summary = prepare(PrepareConfig(args.manifest, args.out, args.model, args.utts_per_shard, args.workers,
                                    args.speech_tokenizer, features))
    print(format_summary(summary))
    return 0


def _train(args: argparse.Namespace) -> int:
    from vocalis.train.config import load_config
    from vocalis.train.run import train

    overrides = []
    if args.data and args.task in ("dpo", "grpo"):
        overrides.append("policy.data=" + json.dumps(args.data[0]))
    elif args.data:
        overrides.append("data.train=" + json.dumps(args.data))
    for flag, key in (("out", "trainer.out_dir"), ("init_from", "model.init_from"), ("resume", "trainer.resume"),
                      ("max_steps", "trainer.max_steps"), ("precision", "trainer.precision"),
                      ("engine", "trainer.engine"), ("device", "trainer.device")):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={json.dumps(value)}")
    if args.lora:
        overrides.append("lora.enabled=true")
    config = load_config(args.config, overrides + list(args.set), task=args.task)
    summary = train(config)
    if summary.get("step") is not None:
        log.info("finished at step %d; last checkpoint %s", summary["step"], summary.get("last_checkpoint"))
    if summary.get("world_size", 1) > 1:
        # A torchrun worker whose work is saved and whose group is left: end here, not in interpreter teardown,
        # where torch's distributed threads once aborted a finished rank (SIGABRT, "terminate called without an
        # active exception"), which torchrun reports as a failed run.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _merge_adapter(args: argparse.Namespace) -> int:
    from vocalis.train.export import merge_adapter_into

    merge_adapter_into(Path(args.adapter), Path(args.out), args.base)
    return 0


def _average(args: argparse.Namespace) -> int:
    from vocalis.errors import InputError
    from vocalis.train.export import average, last_checkpoints

    paths = [Path(p) for p in args.checkpoints]
    if args.run:
        paths += last_checkpoints(Path(args.run), args.last)
    if not paths:
        raise InputError("give checkpoints to average, or --run DIR [--last N]")
    average(paths, Path(args.output))
    return 0


def _export(args: argparse.Namespace) -> int:
    from vocalis.train.export import export

    export([Path(p) for p in args.checkpoints], Path(args.out), args.base)
    return 0


def add_training_commands(sub: argparse._SubParsersAction) -> None:
    pp = sub.add_parser("prepare", help="manifest -> sharded Parquet training features (resumable)")
    pp.add_argument("manifest", help="jsonl (wav, text, speaker, language) or a Kaldi dir (wav.scp, text, utt2spk)")
    pp.add_argument("out", help="output folder (shards/, data.list, summary.json)")
    pp.add_argument("--model", required=True, help="model directory: its text tokenizer and ONNX frontend models")
    pp.add_argument("--utts-per-shard", type=int, default=1000)
    pp.add_argument("--workers", type=int, default=1, help="parallel processes")
    pp.add_argument("--min-seconds", type=float, default=0.5)
    pp.add_argument("--max-seconds", type=float, default=30.0)
    pp.add_argument("--speech-tokenizer", help="our own speech tokenizer (dir or .safetensors) instead of the ONNX")
    pp.add_argument("--no-speech-tokens", action="store_true", help="skip speech tokens (to train a tokenizer first)")
    pp.add_argument("--no-speaker-embeddings", action="store_true", help="zero x-vectors (no campplus.onnx)")
    pp.add_argument("--no-audio", action="store_true", help="do not store the 24 kHz waveform (no vocoder training)")
    pp.set_defaults(func=_prepare)

    tp = sub.add_parser("train", help="train llm, flow, hift, tokenizer or labeller; LoRA, DPO, GRPO on the llm "
                        "(torchrun for several processes)")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", help="toml, json or yaml with [trainer], [data], [optim], [scheduler], [model] ...")
    common.add_argument("--data", nargs="+", help="prepared folders, data.list files or .parquet shards; dpo: the "
                        "pairs file, grpo: the prompts file (JSON lines)")
    common.add_argument("--out", help="run folder (checkpoints, logs)")
    common.add_argument("--init-from", help="model directory to fine-tune (official CosyVoice2 or Vocalis)")
    common.add_argument("--resume", help="'auto' (newest checkpoint of --out) or a checkpoint path")
    common.add_argument("--max-steps", type=int)
    common.add_argument("--precision", choices=("fp32", "bf16", "fp16"))
    common.add_argument("--engine", choices=("ddp", "deepspeed"))
    common.add_argument("--device", choices=("auto", "cpu", "cuda"))
    common.add_argument("--lora", action="store_true", help="train LoRA adapters on the llm, its weights frozen "
                        "(settings: [lora] rank, alpha, target_modules, dropout)")
    common.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set optim.lr=2e-4 (repeatable)")
    tasks = tp.add_subparsers(dest="task", required=True, metavar="TASK")
    for task, text in TASK_HELP.items():
        tasks.add_parser(task, parents=[common], help=text).set_defaults(func=_train)
    mp = tasks.add_parser("merge-adapter", help="a LoRA adapter folded into its base model -> a model directory")
    mp.add_argument("adapter", help="adapter folder (adapter.safetensors + adapter.json)")
    mp.add_argument("--out", required=True, help="new model directory")
    mp.add_argument("--base", help="the base model directory (default: the one the adapter records)")
    mp.set_defaults(func=_merge_adapter)

    ap = sub.add_parser("average", help="average the weights of several checkpoints")
    ap.add_argument("checkpoints", nargs="*")
    ap.add_argument("-o", "--output", required=True, help="averaged checkpoint (.pt)")
    ap.add_argument("--run", help="a run folder: average its newest checkpoints")
    ap.add_argument("--last", type=int, default=5, help="with --run: how many")
    ap.set_defaults(func=_average)

    ep = sub.add_parser("export", help="training checkpoints -> a Vocalis model directory")
    ep.add_argument("checkpoints", nargs="+", help="checkpoints (one per trained part: llm, flow, hift, tokenizer)")
    ep.add_argument("--out", required=True, help="new model directory")
    ep.add_argument("--base", help="model directory for the untrained parts (default: the run's init_from)")
    ep.set_defaults(func=_export)
