#!/usr/bin/env python3
"""Recipe of the built-in model, rung by rung (docs/builtin-model.md, "The ladder"). Resumable.

Finished stages leave `RUN/.done-<stage>`; trainers resume from their newest checkpoint (`--resume auto`, a
checkpoint every 100 steps) and stop at their step budget, so the same command continues where it stopped.
Run it niced, one thread, in the background, with the trainer's pid in a file (to pause it: kill -STOP / -CONT):

    OMP_NUM_THREADS=1 nohup nice -n 19 python recipes/builtin/train_builtin.py RUN --pid-file RUN/../train.pid \\
        > RUN/recipe.log 2>&1 &

Stages (each a `vocalis` command, printed before it runs):
  corpus  vocalis corpus RUN/corpus --voice slt --utterances N   (WordNet + fortunes + templates spoken by
          festival's cmu_us_slt_arctic_hts, with 25 Hz phone-state labels from its alignment; --voices slt kal ked:
          the same sentences by the kal and ked diphones too)
  base    a random `builtin`-preset model directory: the frontend `vocalis prepare` reads
  prep    vocalis prepare ... --no-speech-tokens --no-speaker-embeddings   (mel, F0, 24 kHz audio)
  labels  python -m vocalis.train.phone_labels: prep with text ids = phones, speech ids = the 25 Hz labels
          (RUN/prep_labels: the flow's and LLM's data from L2 on)
  hift    L1: vocalis train hift on prep: mel (4 windows) + multi-resolution STFT + F0 losses, no critic
  flow    L2: vocalis train flow on prep_labels (speech ids = the true labels) at the builtin-phones preset; only
          once the committed L1 figures pass their gate (or with --only flow: beside L1, on the other core)
  hift-flow (--only hift-flow) L2's vocoder: the committed flow's mel of every utterance's true labels
          (RUN/prep_flow_mels, `python -m vocalis.train.flow_mels`) -> the teacher's audio; the committed vocoder
          (L2's, else L1's) tuned on them in RUN/hift-flow with the L1 losses at learning rate 1e-4. Gate it with
          --gate L2-hift (-> RUN/gates/L2/hift.safetensors) and measure the L2 row with it; installed, it is the
          vocoder that --assemble and the rows above L2 use. In a multi-voice run: L6's vocoder, tuned on the
          committed L6 flow's mels, each utterance continuing its own voice's prompt (--tune-shards N: N shards of
          each voice), gated with --gate L6-hift (-> RUN/gates/L6/hift.safetensors)
  labeller L3: vocalis train labeller on prep_labels_audio (prep_labels with the audio; the prompt tokenizer: the 16 kHz Whisper log-mel of the
          stored audio -> one label per 25 Hz frame, cross-entropy); only once the committed L2 figures pass (or
          with --only labeller: it learns from the corpus alone)
  llm     L4: vocalis train llm on prep_labels (phones in, the 25 Hz labels out: a duration and prosody model);
          only once the committed L3 figures pass (or with --only llm: it learns from the corpus alone)
  L6      (a corpus of more than one voice: --voices slt kal ked, in a RUN of its own) the hift, flow and labeller
          stages continue from the committed one-voice parts (L6's own once installed) on every voice: the flow
          learns a voice from its in-context prompt (zero x-vectors, no speaker encoder), the vocoder is tuned on
          the teachers' mels at L2's rate; --gate L6 writes each part's newest checkpoint to RUN/gates/L6
  assemble (--assemble OUT) a phone-model directory from every part's committed weights (else RUN/gates'; with
          --voices slt kal ked, L6's three-voice parts before the one-voice rungs') and a `default` voice (SLT
          speaking a fixed prompt, its true labels), with L6's flow also one voice per --voices name: what the L5,
          L6 and L7 rows measure
  gate    (--gate L1 | L2 | L3 | L4) the newest HiFT | flow | labeller | LLM checkpoint -> fp16 weights in RUN/gates/<rung>;
          measure them with recipes/builtin/measure_builtin.py --voices slt --rows L1 --hift RUN/gates/L1/hift.safetensors
          --json RUN/gates/L1/figures.json (L2: --rows L2 --hift <the L1 weights> --flow
          RUN/gates/L2/flow.safetensors; L3: --rows L3 --labeller RUN/gates/L3/labeller.safetensors and the L1/L2
          weights; L4: --rows L4 --llm RUN/gates/L4/llm.safetensors and the L1/L2 weights);
          when the figure improves, --gate <rung> --install copies the folder to recipes/builtin/ladder/<rung>
          (commit it). On a new machine the hift, flow, labeller and llm stages start from those weights.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads lazily: --help and the stages that only run commands need none of it
    import torch

REPO = Path(__file__).resolve().parents[2]
LADDER = REPO / "recipes" / "builtin" / "ladder"  # committed fp16 weights + figures of each rung


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def vocalis(*args: str, pid_file: Path | None = None) -> None:
    """Run one `vocalis` command to completion; with `pid_file`, its pid is written there while it runs."""
    log("$ vocalis " + " ".join(args))
    proc = subprocess.Popen([sys.executable, "-m", "vocalis", *args])
    if pid_file is not None:
        pid_file.write_text(f"{proc.pid}\n")
    try:
        if proc.wait() != 0:
            raise SystemExit(f"vocalis {args[0]} exited with {proc.returncode}")
    finally:
        if pid_file is not None:
            pid_file.unlink(missing_ok=True)


def stage(run: Path, name: str, only: list[str] | None) -> bool:
    """True when `name` still has to run (and is selected)."""
    if only is not None and name not in only:
        return False
    if (run / f".done-{name}").exists():
        log(f"stage {name}: done before, skipped")
        return False
    log(f"stage {name}")
    return True


def mark(run: Path, name: str) -> None:
    (run / f".done-{name}").write_text(time.strftime("%Y-%m-%d %H:%M:%S") + "\n")


def train_args(run_dir: Path, steps: int, device: str, save_every: int, sets: list[str]) -> list[str]:
    common = ["trainer.max_epochs=0", f"trainer.save_every={save_every}", "trainer.keep_checkpoints=3",
              "trainer.log_every=10",
              "trainer.num_threads=1", "data.num_workers=0", "trainer.tensorboard=false"]
    out = ["--out", str(run_dir), "--max-steps", str(steps), "--resume", "auto", "--device", device]
    for s in common + sets:
        out += ["--set", s]
    return out


# L1: the vocoder alone. Mel L1 at the official 80 ms window plus 21/43 ms windows, Parallel WaveGAN's three STFT
# resolutions (spectral convergence + log magnitude) and the F0 term; no critic (a CPU cannot afford one, see
# docs/builtin-model.md). Held learning rate, annealed past hold_steps.
HIFT_L1 = ["model.preset=builtin", "hift.adversarial=none", "hift.extra_mel_ffts=[512, 1024]", "hift.stft_weight=15",
           "optim.lr=1e-3", "optim.betas=[0.8, 0.99]", "scheduler.name=noam_hold", "scheduler.warmup_steps=200",
           "scheduler.hold_steps=30000", "scheduler.decay_rate=1.0", "data.max_frames_in_batch=816",
           "data.segment_frames=51"]


# L2: the flow as a decoder with given durations: true 25 Hz labels in, the teacher's mel out (one voice, zero
# x-vectors). The first attempt's flow settings, at the phone vocabulary.
FLOW_L2 = ["model.preset=builtin-phones", "optim.lr=5e-4", "scheduler.name=noam_hold", "scheduler.warmup_steps=200",
           "scheduler.hold_steps=30000", "scheduler.decay_rate=1.0", "data.max_frames_in_batch=3000"]
# L4: the LLM as a duration/prosody model over phones (unistream: bi-streaming's 5:15 text:speech interleaving
# assumes BPE pacing, ~3 speech ids per text id, where a phone lasts ~1.9 labels). Half the utterances are read
# after another one (data.pair_prob): the corpus's single short sentences alone did not teach it to continue
# after a prompt utterance (its labels for a prompted text lost far more words than unprompted).
LLM_L4 = ["model.preset=builtin-phones", "llm.bistream_prob=0", "data.pair_prob=0.5", "optim.lr=1e-3",
          "scheduler.name=noam_hold", "scheduler.warmup_steps=200", "scheduler.hold_steps=30000",
          "scheduler.decay_rate=1.0"]
# L3: the prompt tokenizer, a frame classifier over the labels (`FrameLabeller`, ~1.9 M parameters).
LABELLER_L3 = ["labeller.preset=builtin", "optim.lr=1e-3", "scheduler.name=noam_hold", "scheduler.warmup_steps=200",
               "scheduler.hold_steps=30000", "scheduler.decay_rate=1.0", "data.max_frames_in_batch=3000"]
# Tuning a committed vocoder: L2's (the L1 vocoder on the committed flow's own mels, `vocalis.train.flow_mels`: the
# flow's mel of each utterance's true labels -> the teacher's audio) and L6's (on every voice's teacher mels), the
# L1 losses at a tenth of the learning rate.
HIFT_TUNE = ["optim.lr=1e-4", "scheduler.warmup_steps=100"]
PARTS = {"L1": "hift", "L2": "flow", "L3": "labeller", "L4": "llm", "L2-hift": "hift", "L6-hift": "hift"}
GATE_FOLDERS = {"L2-hift": "L2", "L6-hift": "L6"}  # a flow-tuned vocoder gates (and installs) beside its flow
# Where each part's weights come from, first found first: L6's three-voice parts, then the one-voice rungs.
PART_RUNGS = {"hift": ("L6", "L2", "L1"), "flow": ("L6", "L2"), "labeller": ("L6", "L3"), "llm": ("L4",)}


def passes(rung: str) -> bool:
    """The committed figures of `rung` pass its gate (the rung above may train)."""
    import json

    path = LADDER / rung / "figures.json"
    if not path.is_file():
        return False
    r = json.loads(path.read_text(encoding="utf-8"))["figures"].get(rung, {})
    if "passes" in r:
        return bool(r["passes"])
    return r.get("ratio") is not None and r["ratio"] <= r["gate"]


def labels_stage(run: Path, keep_audio: bool = False) -> Path:
    """RUN/prep_labels with zero x-vectors of the flow's size (prep's are CAM++-sized zeros: no speaker encoder);
    keep_audio: RUN/prep_labels_audio, the same with the 24 kHz audio the labeller reads. -> the folder."""
    import json

    from vocalis.config import PRESETS
    from vocalis.train.phone_labels import attach_labels

    dim = PRESETS["builtin-phones"].flow.spk_embed_dim
    out = run / ("prep_labels_audio" if keep_audio else "prep_labels")
    summary = out / "summary.json"
    if summary.is_file() and json.loads(summary.read_text(encoding="utf-8")).get("embedding_dim") == dim:
        return out
    labels = run / "corpus" / "labels.jsonl"
    log(f"labels: {attach_labels(run / 'prep', labels, out, keep_audio=keep_audio, embedding_dim=dim)}")
    return out


def make_base(run: Path) -> Path:
    from vocalis.model_dir import BUNDLED_TOKENIZER, random_model, save_vocalis

    base = run / "base"
    if not (base / "vocalis.json").is_file():
        model = random_model("builtin")
        model.voices = {}
        save_vocalis(model, base, tokenizer_src=BUNDLED_TOKENIZER)
    return base


def save_gate(run_dir: Path, out: Path, part: str = "hift") -> Path:
    """The newest checkpoint's `part` weights as fp16 safetensors (no optimizer state): out/<part>.safetensors."""
    import torch
    from safetensors.torch import save_file

    from vocalis.train import checkpointing as ckpt

    newest = ckpt.list_checkpoints(run_dir)[-1]
    state = ckpt.load_checkpoint(newest)
    weights = {k: v.detach().to(torch.float16).contiguous() for k, v in state["models"][part].items()}
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{part}.safetensors"
    save_file(weights, str(path), metadata={"step": str(state.get("step")), "source": newest.name})
    log(f"{part} step {state.get('step')} -> {path} ({path.stat().st_size / 1e6:.2f} MB)")
    return path


def start_from_ladder(run: Path, rung: str, part: str, run_dir: Path | None = None,
                      hift_channels: int | None = None) -> list[str]:
    """On a machine without checkpoints in `run_dir` (default RUN/<part>), start `part` from the committed weights of
    `rung` (fp16 -> fp32, a new optimizer and schedule): the training state that outlives the machine. With
    `hift_channels` wider than the committed vocoder, its weights are widened first (`vocalis.train.widen`: the wide
    vocoder starts with the narrow one's output). [] when there is nothing to start from."""
    import torch
    from safetensors.torch import load_file

    from vocalis.config import PRESETS
    from vocalis.models.hift.generator import hift_config_for
    from vocalis.train import checkpointing as ckpt
    from vocalis.train.widen import widen_hift

    src = LADDER / rung / f"{part}.safetensors"
    if ckpt.list_checkpoints(run_dir or run / part) or not src.is_file():
        return []
    state = {k: v.float() for k, v in load_file(str(src)).items()}
    tag = rung
    if part == "hift" and hift_channels is not None:
        config = hift_config_for(state, PRESETS["builtin"].hift)
        if config.base_channels != hift_channels:
            state, _ = widen_hift(state, config, hift_channels)
            tag = f"{rung}-c{hift_channels}"
            log(f"hift: the committed {rung} vocoder widened {config.base_channels} -> {hift_channels} channels")
    init = run / f"{part}-{tag}-init.pt"
    torch.save({"models": {part: state}}, init)
    log(f"{part}: no checkpoint in {run_dir or run / part}; starting from the committed {rung} weights ({src.name})")
    return [f"model.checkpoint={init}"]


def committed_hift_channels() -> int | None:
    """The committed L1 vocoder's width where it differs from the `builtin` preset's (a widened one), else None:
    the width the recipe's L1 trains and gates at unless --hift-channels says otherwise."""
    from safetensors.torch import load_file

    from vocalis.config import PRESETS
    from vocalis.models.hift.generator import hift_config_for

    src = LADDER / "L1" / "hift.safetensors"
    if not src.is_file():
        return None
    width = hift_config_for(load_file(str(src)), PRESETS["builtin"].hift).base_channels
    return None if width == PRESETS["builtin"].hift.base_channels else width


def hift_dir(run: Path, channels: int | None) -> Path:
    """The vocoder's run folder: RUN/hift at the preset's width, RUN/hift-c<N> for a wider one."""
    return run / "hift" if channels is None else run / f"hift-c{channels}"


def part_rungs(part: str, voices: int) -> list[str]:
    """The rungs `part` may come from, first found first: L6's three-voice part only for a run of several voices."""
    return [r for r in PART_RUNGS[part] if voices > 1 or r != "L6"]


def committed_rung(part: str, voices: int) -> str:
    """The rung whose committed `part` a trainer starts from: with one voice the one-voice rungs' (the vocoder: L2's,
    tuned on the L2 flow's mels, once there is one), with more L6's first."""
    rungs = part_rungs(part, voices)
    return next((r for r in rungs if (LADDER / r / f"{part}.safetensors").is_file()), rungs[-1])


def assemble(run: Path, out: Path, weights: dict[str, Path], voices: tuple[str, ...] = ("slt",)) -> Path:
    """A phone-model directory from fp16 rung weights (llm, flow, hift; labeller optional) with a voice per festival
    voice in `voices` (the first also `default`): the teacher speaking `PROMPT_SENTENCE`, its true labels (the
    teacher's alignment), its mel, a zero x-vector (the flow trains with zeros), and no transcript, so the flow is
    prompted and the LLM is not (cross-lingual): the
    LLM trains on single utterances, and a prompt sentence before the text made its labels worse (20 held-out
    sentences, LLM step 800: WER 89 % prompted against 50 %). What `vocalis speak --model OUT` and the ladder's
    L5 row run. -> out."""
    from dataclasses import replace

    import torch
    from safetensors.torch import load_file

    from vocalis.checkpoint import load_strict
    from vocalis.config import PHONE_LABELS
    from vocalis.frontend.voice import Voice
    from vocalis.model_dir import BUNDLED_TOKENIZER, random_model, save_vocalis
    from vocalis.models.hift.generator import HiFTGenerator, hift_config_for
    from vocalis.models.speech_tokenizer.labeller import FrameLabeller, labeller_config, save_labeller

    model = random_model("builtin-phones")
    hift_config = hift_config_for(load_file(str(weights["hift"])), model.config.hift)
    if hift_config != model.config.hift:  # a vocoder widened from the preset's
        model = replace(model, config=replace(model.config, hift=hift_config), hift=HiFTGenerator(hift_config).eval())
    modules = {"llm": model.llm, "flow": model.flow, "hift": model.hift}
    if "labeller" in weights:
        modules["labeller"] = FrameLabeller(labeller_config("builtin", PHONE_LABELS))
    for part, module in modules.items():
        load_strict(module, {k: v.float() for k, v in load_file(str(weights[part])).items()}, str(weights[part]))
    model.voices, zeros = {}, torch.zeros(model.config.flow.spk_embed_dim)
    for voice in voices:
        labels, mel = voice_prompt(run, voice)
        # one voice: `default` alone, as the shipped one-voice model; more: each by name, the first also `default`
        names = (["default"] if voice == voices[0] else []) + ([voice] if len(voices) > 1 else [])
        for name in names:
            model.voices[name] = Voice(name, "", (), tuple(labels), mel, zeros)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    save_vocalis(model, out, tokenizer_src=BUNDLED_TOKENIZER)
    if "labeller" in modules:
        save_labeller(modules["labeller"], out)
    log(f"assembled {out} from {', '.join(f'{k} {v}' for k, v in weights.items())}")
    return out


def voice_prompt(run: Path, voice: str) -> tuple[list[int], torch.Tensor]:  # labels, (2 len(labels), 80) mel
    """Festival `voice` speaking `PROMPT_SENTENCE` (RUN/assemble/prompt-<voice>.wav): its true labels (the teacher's
    alignment) and its mel, aligned: a saved voice's prompt."""
    from vocalis.config import SAMPLE_RATE
    from vocalis.corpus.phone_corpus import speak_batch, utterance_record
    from vocalis.corpus.sentences import PROMPT_SENTENCE
    from vocalis.frontend.audio import align_prompt, load_wav, prompt_mel

    wav = run / "assemble" / f"prompt-{voice}.wav"
    if not wav.is_file():
        wav.parent.mkdir(parents=True, exist_ok=True)
        if (complaint := speak_batch(voice, [(PROMPT_SENTENCE, wav)])) is not None:
            raise SystemExit(f"{voice}'s prompt sentence: {complaint}")
    labels = utterance_record("prompt", PROMPT_SENTENCE, wav)["labels"]
    mel, labels = align_prompt(prompt_mel(load_wav(wav, SAMPLE_RATE, max_seconds=None)), labels)
    return list(labels), mel


def ship(out: Path, weights: dict[str, Path]) -> None:
    """Make an assembled directory the shippable one: each part's weights replaced by the fp16 ladder file it was
    loaded from (the same values, as loading converts them exactly; the same bytes as the ladder's, so the
    repository stores them once), without the empty tokenizer folder a phone model does not read."""
    import shutil

    for part, src in weights.items():
        shutil.copyfile(src, out / f"{part}.safetensors")
    tokenizer = out / "tokenizer"
    if tokenizer.is_dir() and not any(tokenizer.iterdir()):
        tokenizer.rmdir()
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    log(f"{out}: {size / 1e6:.1f} MB, ready to commit as the built-in model")


def install_gate(run: Path, rung: str) -> None:
    """Copy RUN/gates/<rung> (weights + figures.json) into the repository's ladder folder, to be committed."""
    import shutil

    src, dest = run / "gates" / rung, LADDER / rung
    if not (src / "figures.json").is_file():
        raise SystemExit(f"{src / 'figures.json'} is missing: measure the gate first (recipes/builtin/measure_builtin.py)")
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        shutil.copy2(f, dest / f.name)
    log(f"installed {src} -> {dest}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="run folder (outside the repository)")
    ap.add_argument("--utterances", type=int, default=4000, help="corpus sentences per voice (~3 s each)")
    ap.add_argument("--voices", nargs="+", default=["slt"], choices=("slt", "kal", "ked"),
                    help="festival voices of the corpus (a run's corpus is built once: a new RUN for other voices)")
    ap.add_argument("--workers", type=int, default=1, help="corpus and prepare processes")
    ap.add_argument("--hift-steps", type=int, default=100000)
    ap.add_argument("--flow-steps", type=int, default=100000)
    ap.add_argument("--labeller-steps", type=int, default=100000)
    ap.add_argument("--llm-steps", type=int, default=100000)
    ap.add_argument("--hift-set", action="append", default=[], metavar="KEY=VALUE",
                    help="an override after the L1 settings (repeatable), e.g. an annealed learning rate when "
                         "continuing from the committed weights")
    ap.add_argument("--flow-set", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra flow trainer setting (after the recipe's; e.g. a larger batch on a GPU)")
    ap.add_argument("--hift-channels", type=int, metavar="N",
                    help="L1 at N base channels (a multiple of the preset's 64) in RUN/hift-c<N>, starting from the "
                         "committed vocoder widened to N; with --gate L1: gate that run (default: the committed "
                         "vocoder's width)")
    ap.add_argument("--tune-shards", type=int, metavar="N",
                    help="hift-flow: the flow's mels of only the first N shards of each voice (default: all)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (every trainer)")
    ap.add_argument("--save-every", type=int, default=100, help="trainer steps between checkpoints")
    ap.add_argument("--only", nargs="*", help="run only these stages")
    ap.add_argument("--gate", choices=(*PARTS, "L6"), help="write the rung's fp16 weights to RUN/gates/<rung> and stop")
    ap.add_argument("--install", action="store_true",
                    help="with --gate: copy RUN/gates/<rung> (weights + figures.json) into recipes/builtin/ladder")
    ap.add_argument("--pid-file", type=Path, help="the running trainer's pid is written here (for SIGSTOP/SIGCONT)")
    ap.add_argument("--assemble", type=Path, metavar="OUT",
                    help="write a phone-model directory to OUT from each part's committed ladder weights (else its "
                         "RUN/gates weights) and stop")
    ap.add_argument("--ship", action="store_true",
                    help="with --assemble vocalis/assets/model: the built-in model, its weights the fp16 ladder files")
    args = ap.parse_args()
    if args.hift_channels is None:
        args.hift_channels = committed_hift_channels()
    run: Path = args.run.resolve()
    run.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    voices = len(args.voices)
    if args.assemble is not None:
        found = {}
        for part in PART_RUNGS:
            files = [f / f"{part}.safetensors" for r in part_rungs(part, voices) for f in (LADDER / r, run / "gates" / r)]
            if (file := next((f for f in files if f.is_file()), None)) is not None:
                found[part] = file
        missing = [p for p in ("llm", "flow", "hift") if p not in found]
        if missing:
            raise SystemExit(f"--assemble: no gate weights for {', '.join(missing)} (run --gate for their rungs)")
        if args.ship and (outside := [str(f) for f in found.values() if not f.is_relative_to(LADDER)]):
            raise SystemExit(f"--ship: {', '.join(outside)} not installed in the ladder (--gate <rung> --install)")
        named = tuple(args.voices) if found["flow"].parent.name == "L6" else ("slt",)
        out = assemble(run, args.assemble.resolve(), found, named)
        if args.ship:
            ship(out, found)
        return 0
    if args.gate == "L6" and not args.install:
        from vocalis.train import checkpointing as ckpt

        for part, src in (("flow", run / "flow"), ("hift", hift_dir(run, args.hift_channels)),
                          ("labeller", run / "labeller")):
            if ckpt.list_checkpoints(src):
                save_gate(src, run / "gates" / "L6", part)
        return 0
    if args.gate is not None:
        if args.install:
            install_gate(run, GATE_FOLDERS.get(args.gate, args.gate))
        else:
            part = PARTS[args.gate]
            if args.gate in ("L2-hift", "L6-hift"):
                src = run / "hift-flow"
            else:
                src = hift_dir(run, args.hift_channels) if part == "hift" else run / part
            save_gate(src, run / "gates" / GATE_FOLDERS.get(args.gate, args.gate), part)
        return 0

    if stage(run, "corpus", args.only):
        vocalis("corpus", str(run / "corpus"), "--voice", *args.voices, "--utterances", str(args.utterances),
                "--workers", str(args.workers), pid_file=args.pid_file)
        mark(run, "corpus")
    base = make_base(run)
    if stage(run, "prep", args.only):
        vocalis("prepare", str(run / "corpus" / "manifest.jsonl"), str(run / "prep"), "--model", str(base),
                "--workers", str(args.workers), "--utts-per-shard", "250", "--no-speech-tokens",
                "--no-speaker-embeddings", pid_file=args.pid_file)
        mark(run, "prep")
    if stage(run, "labels", args.only):
        labels_stage(run)
        mark(run, "labels")
    if args.only is None or "hift" in args.only:
        out = hift_dir(run, args.hift_channels)
        start = start_from_ladder(run, committed_rung("hift", voices) if voices > 1 else "L1", "hift", out,
                                  args.hift_channels)
        sets = HIFT_L1 + (HIFT_TUNE if voices > 1 else []) + start + args.hift_set
        if args.hift_channels is not None:
            sets.append(f"model.hift_channels={args.hift_channels}")
        vocalis("train", "hift", "--data", str(run / "prep"),
                *train_args(out, args.hift_steps, args.device, args.save_every, sets), pid_file=args.pid_file)
    if (args.only is None and passes("L1")) or (args.only is not None and "flow" in args.only):
        labels_stage(run)  # a run labelled before the flow's x-vector size was known
        vocalis("train", "flow", "--data", str(run / "prep_labels"),
                *train_args(run / "flow", args.flow_steps, args.device, args.save_every,
                            FLOW_L2 + start_from_ladder(run, committed_rung("flow", voices), "flow") + args.flow_set),
                pid_file=args.pid_file)
    if args.only is not None and "hift-flow" in args.only:
        from vocalis.train.flow_mels import flow_mel_shards, load_phone_flow

        data = run / "prep_flow_mels"
        if not (data / "summary.json").is_file():
            flow = load_phone_flow(LADDER / committed_rung("flow", voices) / "flow.safetensors", args.device)
            prompts = {f"fest-{v}": voice_prompt(run, v) for v in args.voices} if voices > 1 else None
            made = flow_mel_shards(labels_stage(run, keep_audio=True), flow, data, prompts, args.tune_shards)
            log(f"flow mels: {made}")
        out = run / "hift-flow"
        sets = HIFT_L1 + HIFT_TUNE + start_from_ladder(run, committed_rung("hift", voices), "hift", out) + args.hift_set
        if args.hift_channels is not None:
            sets.append(f"model.hift_channels={args.hift_channels}")
        vocalis("train", "hift", "--data", str(data),
                *train_args(out, args.hift_steps, args.device, args.save_every, sets),
                pid_file=args.pid_file)
    if (args.only is None and passes("L2")) or (args.only is not None and "labeller" in args.only):
        vocalis("train", "labeller", "--data", str(labels_stage(run, keep_audio=True)),
                *train_args(run / "labeller", args.labeller_steps, args.device, args.save_every,
                            LABELLER_L3 + start_from_ladder(run, committed_rung("labeller", voices), "labeller")),
                pid_file=args.pid_file)
    if (args.only is None and passes("L3")) or (args.only is not None and "llm" in args.only):
        labels_stage(run)
        vocalis("train", "llm", "--data", str(run / "prep_labels"),
                *train_args(run / "llm", args.llm_steps, args.device, args.save_every,
                            LLM_L4 + start_from_ladder(run, "L4", "llm")),
                pid_file=args.pid_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
