#!/usr/bin/env python3
"""Recipe of the built-in model: corpus -> speech tokenizer -> prepare -> LLM, flow, HiFT -> export.

Every stage is resumable: finished stages leave a `.done-<stage>` marker in the run folder, training stages
resume from their newest checkpoint (`--resume auto`) and stop at their step budget, so rerunning the same
command continues where it stopped (raise a budget with e.g. `--llm-steps 20000` to train on). Run it niced
and in the background on a shared machine:

    nohup nice -n 19 python scripts/train_builtin.py /work/runs/builtin > /work/runs/builtin/recipe.log 2>&1 &

Stages (each one a `vocalis` command, printed before it runs):
  corpus     vocalis corpus RUN/corpus --hours H                         (festival + espeak-ng teachers)
  corpus_b   vocalis corpus RUN/corpus_b --hours HB --seed 1             (new sentences and voice variants: with
             one 5 h corpus the LLM learned its sentences instead of how text sounds; docs/builtin-model.md)
  base       a random `builtin`-preset model directory with speaker_encoder.json (resemblyzer): the frontend
             source of every later stage
  prep_tok   vocalis prepare ... --no-speech-tokens --no-speaker-embeddings  (mel, F0, audio; tokenizer + HiFT data)
  prep_tok_b the same for corpus_b
  tokenizer  vocalis train tokenizer three times (preset `builtin`: FSQ 3^6 = 729 ids, CTC on `latin` characters):
             RUN/tok_warm with the FSQ unrounded and RUN/tokenizer from it with rounding (both on prep_tok), then
             RUN/tokenizer2 continued on prep_tok + prep_tok_b (greedy CER 23.9 % -> 7.1 %) -> exported into base
  prep       vocalis prepare ... --speech-tokenizer base/speech_tokenizer.safetensors (speech ids, resemblyzer x-vectors)
  prep_b     the same for corpus_b
  llm, flow  vocalis train llm|flow --data RUN/prep RUN/prep_b --set model.preset=builtin   (concurrently, one
             thread each; learning rate held, then annealed as 1/sqrt(steps past the hold): `noam_hold`)
  hift       vocalis train hift on prep_tok (+ prep_tok_b), RUN/hift_warm: mel + F0 losses, no critic (concurrently
             with the rest)
  export     vocalis export (newest checkpoints) --base RUN/base, plus a default voice from a festival SLT clip
  install    (only with --install) copy the export to vocalis/assets/model
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ASSET_MODEL = REPO / "vocalis" / "assets" / "model"
DEFAULT_VOICE_UTT = "en-000002"  # a festival cmu_us_slt_arctic_hts clip of the corpus (female US English)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def vocalis(*args: str, background: bool = False) -> subprocess.Popen | None:
    cmd = [sys.executable, "-m", "vocalis", *args]
    log("$ vocalis " + " ".join(args))
    if background:
        return subprocess.Popen(cmd)
    subprocess.run(cmd, check=True)
    return None


def stage(run: Path, name: str) -> bool:
    """True when `name` still has to run."""
    if (run / f".done-{name}").exists():
        log(f"stage {name}: done before, skipped")
        return False
    log(f"stage {name}")
    return True


def mark(run: Path, name: str) -> None:
    (run / f".done-{name}").write_text(time.strftime("%Y-%m-%d %H:%M:%S") + "\n")


DEVICE = "cpu"  # --device


def common_train_args(run_dir: Path, steps: int, threads: int, extra: list[str]) -> list[str]:
    sets = ["trainer.max_epochs=0", "trainer.save_every=100", "trainer.keep_checkpoints=3", "trainer.log_every=10",
            f"trainer.num_threads={threads}", "data.num_workers=0", "trainer.tensorboard=false", *extra]
    out = ["--out", str(run_dir), "--max-steps", str(steps), "--resume", "auto", "--device", DEVICE]
    for s in sets:
        out += ["--set", s]
    return out


def newest_checkpoint(run_dir: Path) -> Path | None:
    found = sorted((run_dir / "checkpoints").glob("step_*.pt"))
    return found[-1] if found else None


def export_tokenizer(run_dir: Path) -> Path:
    """Export a tokenizer run's newest checkpoint to RUN_DIR/export (speech_tokenizer.safetensors + .json)."""
    out = run_dir / "export"
    shutil.rmtree(out, ignore_errors=True)
    vocalis("export", str(newest_checkpoint(run_dir)), "--out", str(out))
    return out


def make_base(run: Path) -> Path:
    from vocalis.frontend.speaker_resemblyzer import write_speaker_encoder_json
    from vocalis.model_dir import BUNDLED_TOKENIZER, random_model, save_vocalis

    base = run / "base"
    if not (base / "vocalis.json").is_file():
        model = random_model("builtin")
        model.voices = {}  # the random embedding-only voice is replaced at export
        save_vocalis(model, base, tokenizer_src=BUNDLED_TOKENIZER)
    write_speaker_encoder_json(base)
    return base


def add_default_voice(model_dir: Path, corpus: Path) -> None:
    """A `default` voice (prompt tokens, mel and x-vector) from one corpus clip, so `vocalis speak` needs no prompt."""
    from vocalis.tts import TTS

    rows = [json.loads(line) for line in (corpus / "manifest.jsonl").read_text(encoding="utf-8").splitlines()]
    row = next(r for r in rows if r["utt"] == DEFAULT_VOICE_UTT)
    tts = TTS.load(model_dir)
    voice = tts.add_voice("default", corpus / row["wav"], row["text"], language="en")
    (model_dir / "voices").mkdir(exist_ok=True)
    voice.save(model_dir / "voices" / "default.safetensors")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="run folder (outside the repository), e.g. /work/runs/builtin")
    ap.add_argument("--hours", type=float, default=5.0, help="corpus size")
    ap.add_argument("--hours-b", type=float, default=12.0, help="second corpus size (0: none)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tokenizer-warm-steps", type=int, default=1200)
    ap.add_argument("--tokenizer-steps", type=int, default=300)
    ap.add_argument("--tokenizer2-steps", type=int, default=3200, help="the continued run on both corpora (0: none)")
    ap.add_argument("--llm-steps", type=int, default=4000)
    ap.add_argument("--flow-steps", type=int, default=4000)
    ap.add_argument("--hift-warm-steps", type=int, default=4000)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (every trainer)")
    ap.add_argument("--only", nargs="*", help="run only these stages (others must be done already)")
    ap.add_argument("--install", action="store_true", help="copy the export to vocalis/assets/model")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    run: Path = args.run.resolve()
    run.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    want = (lambda s: args.only is None or s in args.only)
    corpus, manifest = run / "corpus", run / "corpus" / "manifest.jsonl"
    second = args.hours_b > 0

    if want("corpus") and stage(run, "corpus"):
        vocalis("corpus", str(corpus), "--hours", str(args.hours), "--workers", str(args.workers))
        mark(run, "corpus")
    if second and want("corpus_b") and stage(run, "corpus_b"):
        # another seed: other sentences and espeak-ng voice variants (the measurement's held-out ones stay out)
        vocalis("corpus", str(run / "corpus_b"), "--hours", str(args.hours_b), "--workers", str(args.workers),
                "--seed", "1")
        mark(run, "corpus_b")
    base = make_base(run)
    if want("prep_tok") and stage(run, "prep_tok"):
        vocalis("prepare", str(manifest), str(run / "prep_tok"), "--model", str(base), "--workers", str(args.workers),
                "--utts-per-shard", "200", "--no-speech-tokens", "--no-speaker-embeddings")
        mark(run, "prep_tok")
    audio = [str(run / "prep_tok")]
    if second:
        if want("prep_tok_b") and stage(run, "prep_tok_b"):
            vocalis("prepare", str(run / "corpus_b" / "manifest.jsonl"), str(run / "prep_tok_b"), "--model", str(base),
                    "--workers", str(args.workers), "--utts-per-shard", "200", "--no-speech-tokens",
                    "--no-speaker-embeddings")
            mark(run, "prep_tok_b")
        audio.append(str(run / "prep_tok_b"))

    hift_proc = None
    if want("hift"):
        hift_proc = vocalis("train", "hift", "--data", *audio, *common_train_args(
            run / "hift_warm", args.hift_warm_steps, 1,
            # warm-up without a critic (mel + F0 losses): intelligible audio in far fewer, cheaper steps than the GAN
            # plus log-mel L1 at 512/1024-sample windows: the official 1920 one alone leaves 10-30 ms detail loose
            ["model.preset=builtin", "hift.adversarial=none", "hift.extra_mel_ffts=[512, 1024]", "optim.lr=1e-3",
             "optim.betas=[0.8, 0.99]", "scheduler.name=noam_hold", "scheduler.warmup_steps=200",
             "scheduler.hold_steps=4600", "scheduler.decay_rate=1.0", "data.max_frames_in_batch=816",
             "data.segment_frames=51"]), background=True)

    if want("tokenizer") and stage(run, "tokenizer"):
        # 1. CTC with the FSQ values unrounded: a cold start through the rounding collapsed to one constant code
        #    (tanh saturated) before CTC left its blank plateau, at lr 1e-3 and 3e-4 alike. Targets: characters with
        #    Hanzi as numbered-tone pinyin (`latin`), ~60 symbols shared by the five languages.
        vocalis("train", "tokenizer", "--data", str(run / "prep_tok"), *common_train_args(
            run / "tok_warm", args.tokenizer_warm_steps, 1,
            ["tokenizer.preset=builtin", "tokenizer.unit=latin", "tokenizer.quantize=false", "optim.lr=1e-3",
             "scheduler.name=constant", "scheduler.warmup_steps=300", "data.max_frames_in_batch=6000"]))
        warm_export = export_tokenizer(run / "tok_warm")
        # 2. the same network with the bottleneck discrete (straight-through rounding), fine-tuned from 1
        vocalis("train", "tokenizer", "--data", str(run / "prep_tok"), *common_train_args(
            run / "tokenizer", args.tokenizer_steps, 1,
            ["tokenizer.preset=builtin", "tokenizer.unit=latin", f"tokenizer.init_from={warm_export}",
             "optim.lr=3e-4", "scheduler.name=constant", "scheduler.warmup_steps=50",
             "data.max_frames_in_batch=6000"]))
        tok_export = export_tokenizer(run / "tokenizer")
        if args.tokenizer2_steps > 0:
            # 3. the same, continued on every audio folder: 1.7 h gave a greedy CER of 23.9 %, and every later stage
            #    inherits the tokenizer's confusions (docs/builtin-model.md, sixth session)
            vocalis("train", "tokenizer", "--data", *audio, *common_train_args(
                run / "tokenizer2", args.tokenizer2_steps, 1,
                ["tokenizer.preset=builtin", "tokenizer.unit=latin",
                 f"tokenizer.init_from={tok_export}", "optim.lr=3e-4",
                 "scheduler.name=constant", "scheduler.warmup_steps=50", "data.max_frames_in_batch=6000"]))
            tok_export = export_tokenizer(run / "tokenizer2")
        for f in ("speech_tokenizer.safetensors", "speech_tokenizer.json"):
            shutil.copy2(tok_export / f, base / f)
        mark(run, "tokenizer")

    token_data = [("prep", manifest)] + ([("prep_b", run / "corpus_b" / "manifest.jsonl")] if second else [])
    for name, source in token_data:
        if want(name) and stage(run, name):
            vocalis("prepare", str(source), str(run / name), "--model", str(base), "--workers", str(args.workers),
                    "--utts-per-shard", "500", "--speech-tokenizer", str(base / "speech_tokenizer.safetensors"),
                    "--no-audio")
            mark(run, name)
    data = [str(run / name) for name, _ in token_data]

    procs = []
    if want("llm"):
        procs.append(vocalis("train", "llm", "--data", *data, *common_train_args(
            run / "llm", args.llm_steps, 1,
            ["model.preset=builtin", "optim.lr=1e-3", "scheduler.name=noam_hold", "scheduler.warmup_steps=200",
             "scheduler.hold_steps=2000", "scheduler.decay_rate=1.0", "data.max_frames_in_batch=3000",
             "llm.bistream_prob=0.0"]), background=True))
    if want("flow"):
        procs.append(vocalis("train", "flow", "--data", *data, *common_train_args(
            run / "flow", args.flow_steps, 1,
            ["model.preset=builtin", "optim.lr=5e-4", "scheduler.name=noam_hold", "scheduler.warmup_steps=200",
             "scheduler.hold_steps=4400", "scheduler.decay_rate=1.0", "data.max_frames_in_batch=3000"]),
            background=True))
    for p in [*procs, hift_proc]:
        if p is not None and p.wait() != 0:
            log(f"a training process exited with {p.returncode}")
            return 1

    if want("export"):
        export = run / "export"
        shutil.rmtree(export, ignore_errors=True)
        ckpts = [c for c in (newest_checkpoint(run / n) for n in ("llm", "flow", "hift_warm")) if c is not None]
        vocalis("export", *map(str, ckpts), "--out", str(export), "--base", str(base))
        add_default_voice(export, corpus)
        log(f"exported {export} from {', '.join(map(str, ckpts))}")
        if args.install:
            shutil.rmtree(ASSET_MODEL, ignore_errors=True)
            shutil.copytree(export, ASSET_MODEL)
            log(f"installed into {ASSET_MODEL}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
