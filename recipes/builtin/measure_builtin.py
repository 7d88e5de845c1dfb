#!/usr/bin/env python3
"""Measure a model (default: the built-in one) against its festival teachers on held-out English sentences.

For each of N held-out sentences (`vocalis.corpus.build.heldout_sentences`, never in the training text), teacher
voice i % 3 (kal, ked, slt) speaks it, and the model speaks it zero-shot from a prompt clip of that same teacher
voice (a fixed prompt sentence synthesised here). Printed table:
- WER (pocketsphinx, US English) of the model's output vs the teachers' on the same sentences, and of silence
  (the "nothing" floor: 100 %);
- resemblyzer cosine of output vs prompt, next to the same-speaker baseline (the teacher's own rendering of the
  sentence vs the prompt) and the cross-speaker baseline (another teacher's rendering vs the prompt);
- real-time factor of the model on this CPU;
- a vocoder check: WER of the teachers' own mel resynthesised by the model's HiFT (copy synthesis);
- a token check: WER of the teachers' audio through the model's speech tokenizer, flow and HiFT (voice conversion
  to the same teacher's prompt: everything but the LLM).

    python recipes/builtin/measure_builtin.py [--model DIR] [-n 50] [--out RUN/measure] [--json out.json]

The ladder of the phone-based built-in model (docs/builtin-model.md) is measured on one voice, festival's
cmu_us_slt_arctic_hts, speaking the 50 held-out WordNet sentences (`vocalis.corpus.sentences.heldout_wordnet`):

    python recipes/builtin/measure_builtin.py --voices slt --rows L1 --hift recipes/builtin/ladder/L1/hift.safetensors
    python recipes/builtin/measure_builtin.py --voices slt --rows L2 --hift ... --flow RUN/gates/L2/flow.safetensors

  L1  teacher mel -> our HiFT (vocoder alone): WER <= 1.15x the teacher's
  L2  the teacher's true 25 Hz labels (its own alignment) -> our flow -> our HiFT: WER <= 1.3x the teacher's
  L3  the teacher's audio -> our prompt tokenizer's labels (frame accuracy >= 90 % against its alignment) -> our
      flow -> our HiFT: WER <= 1.35x the teacher's
  L4  our LLM's labels for the sentence's phones (no prompt, the phone model's seeded sampling): >= 90 % of the
      sentences within 0.8-1.25x the teacher's length; its WER through our flow and HiFT is printed beside it

    python recipes/builtin/measure_builtin.py --voices slt --rows L4 --llm RUN/gates/L4/llm.safetensors --flow ... --hift ...

  L5  the whole phone model (`recipes/builtin/train_builtin.py RUN --assemble DIR`) through `TTS` (the engine) with its
      `default` voice, seeded: WER <= 1.5x the teacher's

    python recipes/builtin/measure_builtin.py --voices slt --rows L5 --model DIR

  L7  the whole model in every teacher's voice (its saved slt/kal/ked voices, else zero-shot from each teacher's
      prompt clip) on the same sentences, each teacher speaking them too: pooled WER <= 1.5x the teachers', with
      resemblyzer similarity to each voice's prompt beside the cross-speaker baseline

    python recipes/builtin/measure_builtin.py --rows L7 --model DIR [--seeds K]

A recording no teacher made, cloned (WER of the held-out sentences spoken in its voice, and resemblyzer cosine
against it beside festival SLT's):

    python recipes/builtin/measure_builtin.py --model DIR --clone /usr/share/pocketsphinx/test/data/librivox/CLIP.wav \
        --clone-text "its transcript"

Needs festival with the three voices, pocketsphinx and resemblyzer (`pip install -e '.[eval]'` and
`pip install --no-deps resemblyzer webrtcvad-wheels`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

from vocalis.corpus.sentences import PROMPT_SENTENCE


def load16(path: Path) -> np.ndarray:
    wav, sr = sf.read(str(path), dtype="float32", always_2d=True)
    wav = wav.mean(axis=1)
    return soxr.resample(wav, sr, 16000).astype(np.float32) if sr != 16000 else wav


# ---- the ladder (--voices slt) ---------------------------------------------------------------------------

# L1-L3: most WER x the teacher's; L4: least share of lengths in range
GATES = {"L1": 1.15, "L2": 1.3, "L3": 1.35, "L4": 0.9, "L5": 1.5, "L7": 1.5}
MIN_FRAME_ACCURACY = 0.9  # L3, beside its WER
ROWS = {"L1": "teacher mel -> our HiFT", "L2": "true labels -> our flow -> our HiFT",
        "L3": "teacher audio -> our labels -> our flow -> our HiFT",
        "L4": "phones -> our LLM's labels -> our flow -> our HiFT",
        "L5": "the whole model (TTS, default voice)", "L7": "the whole model in every teacher's voice"}
LENGTH_RANGE = (0.8, 1.25)  # L4: a sentence's label count over the teacher's


def _weights(path: Path | None, flag: str, rows: str) -> Path:
    """`path`, or exit saying which flag the rows need."""
    if path is None:
        sys.exit(f"measure_builtin --voices slt --rows {rows}: give the weights with {flag}")
    return path


def _load_part(module, path: Path | None, flag: str, rows: str):  # -> the module, in eval mode
    """`module` with weights from `path` (fp16 gate weights are cast to fp32)."""
    import torch
    from safetensors.torch import load_file

    from vocalis.checkpoint import load_strict

    path = _weights(path, flag, rows)
    load_strict(module, {k: v.to(torch.float32) for k, v in load_file(str(path)).items()}, str(path))
    return module.eval()


def load_hift(path: Path | None, rows: str = "L1"):  # -> HiFTGenerator
    """The built-in preset's HiFT, at the width its weights were trained at."""
    from safetensors.torch import load_file

    from vocalis.config import PRESETS
    from vocalis.models.hift.generator import HiFTGenerator, hift_config_for

    config = PRESETS["builtin-phones"].hift
    if path is not None and path.is_file():
        config = hift_config_for(load_file(str(path)), config)
    return _load_part(HiFTGenerator(config), path, "--hift", rows)


def load_flow(path: Path | None, rows: str = "L2"):  # -> CausalMaskedDiffWithXvec
    """The phone-based built-in preset's flow (114 label ids)."""
    from vocalis.train.flow_mels import load_phone_flow

    return load_phone_flow(_weights(path, "--flow", rows))


def load_llm(path: Path | None):  # -> Qwen2LM
    """The phone-based built-in preset's LLM (phone ids in, 25 Hz labels out)."""
    from vocalis.config import PRESETS
    from vocalis.models.speech_lm import Qwen2LM

    return _load_part(Qwen2LM(PRESETS["builtin-phones"].llm), path, "--llm", "L4")


def load_labeller(path: Path | None):  # -> FrameLabeller
    """The phone model's prompt tokenizer at the builtin preset."""
    from vocalis.config import PHONE_LABELS
    from vocalis.models.speech_tokenizer.labeller import FrameLabeller, labeller_config

    return _load_part(FrameLabeller(labeller_config("builtin", PHONE_LABELS)), path, "--labeller", "L3")


def audio_labels(labeller, wav: Path) -> list[int]:
    """L3: a clip -> its 16 kHz Whisper log-mel -> the labeller's 25 Hz labels."""
    from vocalis.frontend.audio import whisper_log_mel

    (labels,) = labeller.tokenize_mels([whisper_log_mel(load16(wav))])
    return labels


def llm_labels(llm, text: str, seed: int) -> list[int]:
    """L4: the sentence's phone ids (the inference frontend) -> labels decoded to eos (the model's length bounds
    and sampling, seeded), no prompt."""
    import torch

    from vocalis.config import PRESETS
    from vocalis.frontend.phones import text_ids
    from vocalis.reference.decode import generate

    return list(generate(llm, text_ids(text), sampling=PRESETS["builtin-phones"].sampling,
                         generator=torch.Generator().manual_seed(seed)))


def labels_to_wav(flow, hift, labels: list[int], seed: int):  # -> (N,) float32 tensor at 24 kHz
    """L2: 25 Hz labels -> the flow's mel (no prompt, the zero x-vector it was trained with) -> HiFT."""
    import torch

    from vocalis.train.flow_mels import labels_to_mel

    mel = labels_to_mel(flow, labels).transpose(0, 1)[None]  # (1, 80, 2 T)
    with torch.inference_mode():
        wav, _ = hift.inference(mel, generator=torch.Generator().manual_seed(seed))
    return wav[0]


def _weights_step(path: Path) -> int | None:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        step = (f.metadata() or {}).get("step")
    return int(step) if step and step.isdigit() else None


def slt_teacher(args: argparse.Namespace, prefix: str) -> tuple[Path, list[str]]:
    """The output folder (--out, else a new temporary one) and the first -n held-out WordNet sentences, each spoken
    by festival SLT into out/teacher-<i>.wav unless already there."""
    from vocalis.corpus.sentences import heldout_wordnet

    out = args.out or Path(tempfile.mkdtemp(prefix=prefix))
    out.mkdir(parents=True, exist_ok=True)
    texts = heldout_wordnet()[: args.n]
    teacher_wavs(out, texts, "slt")
    return out, texts


def teacher_wavs(out: Path, texts: list[str], voice: str) -> list[Path]:
    """Each text spoken by the festival `voice` (a `vocalis.corpus.phone_corpus.VOICES` name) unless already there:
    out/teacher-<i>.wav for SLT, out/teacher-<voice>-<i>.wav for the others."""
    from vocalis.corpus.phone_corpus import speak_batch

    paths = [out / (f"teacher-{i:03d}.wav" if voice == "slt" else f"teacher-{voice}-{i:03d}.wav")
             for i in range(len(texts))]
    todo = [(t, p) for t, p in zip(texts, paths) if not p.is_file()]
    if todo:
        speak_batch(voice, todo)
    return paths


def measure_ladder(args: argparse.Namespace) -> int:
    import torch

    from vocalis.config import SAMPLE_RATE
    from vocalis.corpus.phone_corpus import utterance_record
    from vocalis.eval.asr import PocketsphinxTranscriber
    from vocalis.eval.wer import EditCounts, word_counts
    from vocalis.frontend.audio import load_wav, prompt_mel

    out, texts = slt_teacher(args, "vocalis-ladder-")
    asr = PocketsphinxTranscriber()
    teacher, figures = EditCounts(0, 0, 0, 0), {"sentences": len(texts), "voice": "cmu_us_slt_arctic_hts"}
    hyps_teacher = [asr(load16(out / f"teacher-{i:03d}.wav"), 16000) for i in range(len(texts))]
    for text, hyp in zip(texts, hyps_teacher):
        teacher += word_counts(text, hyp, "en")
    figures["wer_teacher"] = teacher.rate
    rows = [{"text": text, "teacher_asr": hyp} for text, hyp in zip(texts, hyps_teacher)]
    hift = load_hift(args.hift, " ".join(args.rows)) if set(args.rows) - {"L5"} else None
    tts = None
    if "L5" in args.rows:
        from vocalis.tts import TTS

        if args.model is None:
            sys.exit("measure_builtin --rows L5: give the assembled model directory with --model")
        tts = TTS.load(args.model)
        if args.stream:
            import dataclasses

            tts.token2wav_config = dataclasses.replace(tts.token2wav_config, final_attention=args.stream)
    flow = load_flow(args.flow, " ".join(args.rows)) if {"L2", "L3", "L4"} & set(args.rows) else None
    llm = load_llm(args.llm) if "L4" in args.rows else None
    labeller = load_labeller(args.labeller) if "L3" in args.rows else None
    # the teacher's own alignment of each sentence, as the corpus labels it (L2-L4)
    true_labels = [utterance_record(f"{i:03d}", text, out / f"teacher-{i:03d}.wav")["labels"]
                   for i, text in enumerate(texts)] if {"L2", "L3", "L4"} & set(args.rows) else []
    for rung in args.rows:
        counts, start, audio_s, lengths, hits = EditCounts(0, 0, 0, 0), time.perf_counter(), 0.0, [], [0, 0]
        # the sampled rows (L4, L5) pool --seeds draws of every sentence: the LLM's sampling varies more than the
        # difference between two settings on one draw
        seeds = [args.seed + j for j in range(args.seeds)] if rung in ("L4", "L5") else [args.seed]
        for i, text in enumerate(texts):
            for seed in seeds:
                teacher_wav = out / f"teacher-{i:03d}.wav"
                if rung == "L5" and args.stream:  # streamed, the chunks joined
                    wav = torch.from_numpy(np.concatenate([c.samples for c in tts.stream(
                        text, voice="default", seed=seed, language="en")]))
                elif rung == "L5":
                    wav = torch.from_numpy(tts.synthesize(text, voice="default", seed=seed, language="en"))
                elif rung == "L3":
                    labels = audio_labels(labeller, teacher_wav)
                    n = min(len(true_labels[i]), len(labels))  # the clip's frames and the alignment's may differ by 1
                    hit = sum(a == b for a, b in zip(true_labels[i][:n], labels[:n]))
                    hits[0] += hit
                    hits[1] += n
                    rows[i]["L3_accuracy"] = round(hit / max(n, 1), 3)
                    wav = labels_to_wav(flow, hift, labels, seed)
                elif rung == "L4":
                    labels = llm_labels(llm, text, seed)
                    lengths.append(len(labels) / len(true_labels[i]))
                    rows[i].setdefault("L4_length", []).append(round(lengths[-1], 3))
                    wav = labels_to_wav(flow, hift, labels, seed) if labels else torch.zeros(1)
                elif rung == "L1":
                    mel = prompt_mel(load_wav(teacher_wav, SAMPLE_RATE, max_seconds=None)).transpose(0, 1)  # (80, T)
                    with torch.inference_mode():
                        voc, _ = hift.inference(mel.unsqueeze(0), generator=torch.Generator().manual_seed(seed))
                    wav = voc[0]
                else:  # L2: the teacher's own labels
                    wav = labels_to_wav(flow, hift, true_labels[i], seed)
                name = f"{rung}-{i:03d}.wav" if seed == args.seed else f"{rung}-{i:03d}-s{seed}.wav"
                sf.write(str(out / name), wav.numpy(), SAMPLE_RATE)
                audio_s += wav.shape[-1] / SAMPLE_RATE
                hyp = asr(load16(out / name), 16000)
                counts += word_counts(text, hyp, "en")
                rows[i].setdefault(f"{rung}_asr", []).append(hyp)
        figures[rung] = {"wer": counts.rate, "ratio": counts.rate / teacher.rate if teacher.rate else None,
                         "gate": GATES[rung], "seeds": seeds,
                         "vocoder_rtf" if rung == "L1" else "rtf": (time.perf_counter() - start) / max(audio_s, 1e-9)}
        if rung == "L5":
            figures[rung]["model"] = str(args.model)
            figures[rung]["passes"] = figures[rung]["ratio"] is not None and figures[rung]["ratio"] <= GATES[rung]
            continue
        figures[rung].update(weights=args.hift.name, step=_weights_step(args.hift))
        if rung in ("L2", "L3", "L4"):
            figures[rung].update(flow_weights=args.flow.name, flow_step=_weights_step(args.flow))
        if rung == "L4":
            lo, hi = LENGTH_RANGE
            within = sum(lo <= r <= hi for r in lengths) / len(lengths)
            figures[rung].update(within=within, median_length=float(np.median(lengths)), passes=within >= GATES[rung],
                                 llm_weights=args.llm.name, llm_step=_weights_step(args.llm))
        elif rung == "L3":
            accuracy = hits[0] / max(hits[1], 1)
            ok = figures[rung]["ratio"] is not None and figures[rung]["ratio"] <= GATES[rung]
            figures[rung].update(frame_accuracy=accuracy, passes=ok and accuracy >= MIN_FRAME_ACCURACY,
                                 labeller_weights=args.labeller.name, labeller_step=_weights_step(args.labeller))
        elif figures[rung]["ratio"] is not None:
            figures[rung]["passes"] = figures[rung]["ratio"] <= GATES[rung]
    print(f"| rung ({len(texts)} held-out WordNet sentences, festival SLT) | WER | x teacher | gate | passes |")
    print("|---|---|---|---|---|")
    print(f"| teacher (festival cmu_us_slt_arctic_hts) | {teacher.rate:.1%} | 1.00 | | |")
    for rung in args.rows:
        r = figures[rung]
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        gate = (f"lengths within {LENGTH_RANGE[0]}-{LENGTH_RANGE[1]}x: {r['within']:.0%} (>= {r['gate']:.0%}), "
                f"median {r['median_length']:.2f}x") if rung == "L4" else f"<= {r['gate']}"
        if rung == "L3":
            gate += f"; frame accuracy {r['frame_accuracy']:.1%} (>= {MIN_FRAME_ACCURACY:.0%})"
        print(f"| {rung} {ROWS[rung]} | {r['wer']:.1%} | {ratio} | {gate} | {'yes' if r.get('passes') else 'no'} |")
    if args.json:
        args.json.write_text(json.dumps({"figures": figures, "rows": rows}, indent=1), encoding="utf-8")
    return 0


def measure_clone(args: argparse.Namespace) -> int:
    """A recording not made by a teacher (e.g. Debian pocketsphinx-testdata's LibriVox clips): the model speaks the
    held-out WordNet sentences zero-shot from it; WER against the text, resemblyzer cosine against the clip next to
    festival SLT's renderings of the same sentences against it (a different speaker: the baseline to beat)."""
    from vocalis.eval.asr import PocketsphinxTranscriber
    from vocalis.eval.similarity import ResemblyzerEmbedder, cosine
    from vocalis.eval.wer import EditCounts, word_counts
    from vocalis.tts import TTS

    out, texts = slt_teacher(args, "vocalis-clone-")
    tts = TTS.load(args.model)
    asr, emb = PocketsphinxTranscriber(), ResemblyzerEmbedder()
    clip = emb.embed(load16(args.clone))
    counts, sims, cross, rows = EditCounts(0, 0, 0, 0), [], [], []
    for i, text in enumerate(texts):
        wav = tts.synthesize(text, prompt_wav=str(args.clone), prompt_text=args.clone_text, seed=args.seed,
                             language="en")
        sf.write(str(out / f"clone-{i:03d}.wav"), wav, tts.sample_rate)
        audio = load16(out / f"clone-{i:03d}.wav")
        hyp = asr(audio, 16000)
        counts += word_counts(text, hyp, "en")
        sims.append(cosine(emb.embed(audio), clip))
        cross.append(cosine(emb.embed(load16(out / f"teacher-{i:03d}.wav")), clip))
        rows.append({"text": text, "model_asr": hyp})
    figures = {"clip": str(args.clone.name), "sentences": len(texts), "wer": counts.rate,
               "sim_model_vs_clip": float(np.mean(sims)), "sim_slt_teacher_vs_clip": float(np.mean(cross))}
    print(f"| clone of {args.clone.name} ({len(texts)} held-out WordNet sentences) | value |")
    print("|---|---|")
    print(f"| WER (pocketsphinx) | {counts.rate:.1%} |")
    print(f"| resemblyzer cos(output, clip) | {figures['sim_model_vs_clip']:.3f} |")
    print(f"| baseline: cos(festival SLT, clip) | {figures['sim_slt_teacher_vs_clip']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"figures": figures, "rows": rows}, indent=1), encoding="utf-8")
    return 0


def measure_heldout_voices(args: argparse.Namespace) -> int:
    """L7: every festival teacher (slt, kal, ked) speaks the held-out WordNet sentences and the model speaks them in
    that teacher's voice: its saved voice of that name where it has one (the three-voice model's), else zero-shot
    from the teacher's prompt clip without its transcript, as saved voices are made. WER pooled over the voices
    against the teachers' (and per voice); resemblyzer cosine of each output to its voice's prompt clip beside the
    cross-speaker baseline (the next teacher's rendering of the same sentence against that prompt)."""
    from vocalis.corpus.phone_corpus import VOICES
    from vocalis.eval.asr import PocketsphinxTranscriber
    from vocalis.eval.similarity import ResemblyzerEmbedder, cosine
    from vocalis.eval.wer import EditCounts, word_counts
    from vocalis.tts import TTS

    out, texts = slt_teacher(args, "vocalis-l7-")
    voices = list(VOICES)
    teachers = {v: teacher_wavs(out, texts, v) for v in voices}
    (out / "prompts").mkdir(exist_ok=True)
    prompts = {v: teacher_wavs(out / "prompts", [PROMPT_SENTENCE], v)[0] for v in voices}
    tts = TTS.load(args.model)
    asr, emb = PocketsphinxTranscriber(), ResemblyzerEmbedder()
    seeds = [args.seed + j for j in range(args.seeds)]
    model_all, teacher_all, per_voice, rows = EditCounts(0, 0, 0, 0), EditCounts(0, 0, 0, 0), {}, []
    sims, cross, start, audio_s = [], [], time.perf_counter(), 0.0
    for k, v in enumerate(voices):
        model, teacher, v_sims = EditCounts(0, 0, 0, 0), EditCounts(0, 0, 0, 0), []
        prompt_emb, other = emb.embed(load16(prompts[v])), voices[(k + 1) % len(voices)]
        how = {"voice": v} if v in tts.model.voices else {"prompt_wav": str(prompts[v])}
        for i, text in enumerate(texts):
            hyp_t = asr(load16(teachers[v][i]), 16000)
            teacher += word_counts(text, hyp_t, "en")
            cross.append(cosine(emb.embed(load16(teachers[other][i])), prompt_emb))
            for seed in seeds:
                wav = tts.synthesize(text, seed=seed, language="en", **how)
                audio_s += len(wav) / tts.sample_rate
                path = out / f"L7-{v}-{i:03d}-s{seed}.wav"
                sf.write(str(path), wav, tts.sample_rate)
                audio = load16(path)
                hyp = asr(audio, 16000)
                model += word_counts(text, hyp, "en")
                v_sims.append(cosine(emb.embed(audio), prompt_emb))
                rows.append({"voice": v, "text": text, "seed": seed, "model_asr": hyp, "teacher_asr": hyp_t})
        per_voice[v] = {"wer": model.rate, "wer_teacher": teacher.rate, "similarity": float(np.mean(v_sims)),
                        "saved_voice": "voice" in how}
        model_all, teacher_all, sims = model_all + model, teacher_all + teacher, sims + v_sims
    ratio = model_all.rate / teacher_all.rate if teacher_all.rate else None
    figures = {"sentences": len(texts), "model": str(args.model), "seeds": seeds, "L7": {
        "wer": model_all.rate, "wer_teacher": teacher_all.rate, "ratio": ratio, "gate": GATES["L7"],
        "passes": ratio is not None and ratio <= GATES["L7"], "similarity": float(np.mean(sims)),
        "similarity_cross_speaker": float(np.mean(cross)), "per_voice": per_voice,
        "rtf": (time.perf_counter() - start) / max(audio_s, 1e-9)}}
    print(f"| L7 ({len(texts)} held-out WordNet sentences x {len(voices)} festival voices) | model | teacher | "
          "similarity |")
    print("|---|---|---|---|")
    for v, r in per_voice.items():
        print(f"| {VOICES[v]} ({'saved voice' if r['saved_voice'] else 'zero-shot'}) | {r['wer']:.1%} | "
              f"{r['wer_teacher']:.1%} | {r['similarity']:.3f} |")
    r = figures["L7"]
    print(f"| all: {r['ratio']:.2f}x the teachers (gate <= {GATES['L7']}x: {'passes' if r['passes'] else 'no'}) | "
          f"{r['wer']:.1%} | {r['wer_teacher']:.1%} | {r['similarity']:.3f} (cross-speaker "
          f"{r['similarity_cross_speaker']:.3f}) |")
    if args.json:
        args.json.write_text(json.dumps({"figures": figures, "rows": rows}, indent=1), encoding="utf-8")
    return 0


# ---- the original measurement (--voices all) --------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the built-in model; --rows L5: the assembled phone model)")
    ap.add_argument("--seeds", type=int, default=1, help="draws per sentence of the sampled rows (L4, L5, L7), pooled "
                    "into one figure")
    ap.add_argument("-n", type=int, default=50, help="held-out sentences (>= 50 for the issue's measurement)")
    ap.add_argument("--out", type=Path, help="keep the wavs here (default: a temporary folder)")
    ap.add_argument("--json", type=Path, help="also write the figures as JSON")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stream", choices=("causal", "full"),
                    help="with --rows L5: stream each sentence, its last chunk block-causal or a full-attention pass")
    ap.add_argument("--voices", choices=("all", "slt"), default="all",
                    help="all: the three festival teachers (the original measurement); slt: the ladder rows")
    ap.add_argument("--rows", nargs="+", default=["L1"], choices=tuple(GATES), help="with --voices slt: rungs to measure")
    ap.add_argument("--hift", type=Path, help="with --voices slt: HiFT weights (.safetensors, fp16 or fp32), every row")
    ap.add_argument("--flow", type=Path, help="with --voices slt: flow weights (.safetensors) for L2-L4")
    ap.add_argument("--labeller", type=Path, help="with --voices slt: prompt tokenizer weights (.safetensors) for L3")
    ap.add_argument("--llm", type=Path, help="with --voices slt: LLM weights (.safetensors) for L4")
    ap.add_argument("--clone", type=Path, help="a recording to clone instead (e.g. Debian pocketsphinx-testdata's "
                    "LibriVox clips): WER and similarity of the model speaking the held-out sentences in its voice")
    ap.add_argument("--clone-text", help="with --clone: its transcript (zero-shot); without it, cross-lingual")
    args = ap.parse_args()
    if args.clone is not None:
        return measure_clone(args)
    if "L7" in args.rows:
        if args.rows != ["L7"]:
            sys.exit("measure_builtin --rows L7: a measurement of its own (all three voices); measure it alone")
        return measure_heldout_voices(args)
    if args.voices == "slt":
        return measure_ladder(args)

    from vocalis.corpus.build import heldout_sentences
    from vocalis.corpus.voices import festival_voices, synthesize_batch
    from vocalis.eval.asr import PocketsphinxTranscriber
    from vocalis.eval.similarity import ResemblyzerEmbedder, cosine
    from vocalis.eval.wer import EditCounts, word_counts
    from vocalis.tts import TTS

    out = args.out or Path(tempfile.mkdtemp(prefix="vocalis-measure-"))
    out.mkdir(parents=True, exist_ok=True)
    voices = festival_voices()
    if len(voices) < 2:
        sys.exit("measure_builtin: needs at least two festival voices (festvox-kallpc16k festvox-kdlpc16k "
                 "festvox-us-slt-hts)")
    texts = heldout_sentences(max(args.n, 1))[: args.n]

    # teachers: every voice speaks its prompt; voice i % V and voice (i + 1) % V speak sentence i
    for v in voices:
        items = [(PROMPT_SENTENCE, out / f"prompt-{v.speaker}.wav")]
        items += [(t, out / f"teacher-{v.speaker}-{i:03d}.wav") for i, t in enumerate(texts)
                  if v in (voices[i % len(voices)], voices[(i + 1) % len(voices)])]
        items = [(t, p) for t, p in items if not p.is_file()]
        if items and (failed := synthesize_batch(v, items)):
            sys.exit(f"measure_builtin: festival failed: {next(iter(failed.values()))}")

    tts = TTS.load(args.model)
    print(f"model: {tts.model.describe()}", file=sys.stderr)
    synth_s, audio_s = 0.0, 0.0
    for i, text in enumerate(texts):
        v = voices[i % len(voices)]
        path = out / f"model-{i:03d}.wav"
        start = time.perf_counter()
        wav = tts.synthesize(text, prompt_wav=str(out / f"prompt-{v.speaker}.wav"), prompt_text=PROMPT_SENTENCE,
                             seed=args.seed, language="en")
        synth_s += time.perf_counter() - start
        audio_s += len(wav) / tts.sample_rate
        sf.write(str(path), wav, tts.sample_rate)

    # vocoder check: the teacher's own mel through the model's HiFT (copy synthesis), isolating the vocoder
    import torch

    from vocalis.frontend.audio import load_wav, prompt_mel

    for i, _ in enumerate(texts):
        v = voices[i % len(voices)]
        wav24 = load_wav(out / f"teacher-{v.speaker}-{i:03d}.wav", tts.sample_rate, max_seconds=None)
        mel = prompt_mel(wav24).transpose(0, 1).unsqueeze(0)  # (1, 80, T)
        with torch.inference_mode():
            voc, _ = tts.model.hift.inference(mel)
        sf.write(str(out / f"vocoded-{i:03d}.wav"), voc[0].numpy(), tts.sample_rate)
        # token check: teacher audio -> our speech tokens -> flow (prompted by the same voice) -> HiFT
        chunks = tts.convert_voice(out / f"teacher-{v.speaker}-{i:03d}.wav", prompt_wav=out / f"prompt-{v.speaker}.wav",
                                   seed=args.seed)
        sf.write(str(out / f"retokenized-{i:03d}.wav"), np.concatenate([c.samples for c in chunks]), tts.sample_rate)

    asr, emb = PocketsphinxTranscriber(), ResemblyzerEmbedder()
    prompt_emb = {v.speaker: emb.embed(load16(out / f"prompt-{v.speaker}.wav")) for v in voices}
    wer_model, wer_teacher, wer_vocoded, wer_tokens = (EditCounts(0, 0, 0, 0) for _ in range(4))
    sim_model, sim_same, sim_cross, rows = [], [], [], []
    for i, text in enumerate(texts):
        v, other = voices[i % len(voices)], voices[(i + 1) % len(voices)]
        model_wav, teacher_wav = load16(out / f"model-{i:03d}.wav"), load16(out / f"teacher-{v.speaker}-{i:03d}.wav")
        hyp_m, hyp_t = asr(model_wav, 16000), asr(teacher_wav, 16000)
        wer_model += word_counts(text, hyp_m, "en")
        wer_teacher += word_counts(text, hyp_t, "en")
        wer_vocoded += word_counts(text, asr(load16(out / f"vocoded-{i:03d}.wav"), 16000), "en")
        wer_tokens += word_counts(text, asr(load16(out / f"retokenized-{i:03d}.wav"), 16000), "en")
        try:
            sim_model.append(cosine(emb.embed(model_wav), prompt_emb[v.speaker]))
        except ValueError:  # no voiced audio at all: as dissimilar as it gets
            sim_model.append(0.0)
        sim_same.append(cosine(emb.embed(teacher_wav), prompt_emb[v.speaker]))
        sim_cross.append(cosine(emb.embed(load16(out / f"teacher-{other.speaker}-{i:03d}.wav")),
                                prompt_emb[v.speaker]))
        rows.append({"text": text, "voice": v.speaker, "model_asr": hyp_m, "teacher_asr": hyp_t})

    figures = {
        "sentences": len(texts),
        "wer_model": wer_model.rate, "wer_teacher": wer_teacher.rate, "wer_silence": 1.0,
        "wer_vocoder_copy_synthesis": wer_vocoded.rate, "wer_token_copy_synthesis": wer_tokens.rate,
        "wer_ratio": wer_model.rate / wer_teacher.rate if wer_teacher.rate > 0 else None,
        "sim_model_vs_prompt": float(np.mean(sim_model)), "sim_same_speaker": float(np.mean(sim_same)),
        "sim_cross_speaker": float(np.mean(sim_cross)),
        "rtf": synth_s / audio_s if audio_s > 0 else None, "audio_seconds": audio_s,
        "model": tts.model.describe(), "wavs": str(out),
    }
    ratio = f"{figures['wer_ratio']:.2f}x teacher" if figures["wer_ratio"] is not None else "-"
    print(f"| measure ({len(texts)} held-out English sentences) | value |")
    print("|---|---|")
    print(f"| WER model (pocketsphinx) | {wer_model.rate:.1%} ({ratio}; target <= 1.5x) |")
    print(f"| WER festival teachers | {wer_teacher.rate:.1%} |")
    print("| WER silence (nothing) | 100.0% |")
    print(f"| WER teacher mel -> our HiFT (vocoder alone) | {wer_vocoded.rate:.1%} |")
    print(f"| WER teacher audio -> our tokens -> flow -> HiFT (no LLM) | {wer_tokens.rate:.1%} |")
    print(f"| resemblyzer cos(model output, prompt) | {figures['sim_model_vs_prompt']:.3f} |")
    print(f"| same-speaker baseline (teacher, prompt) | {figures['sim_same_speaker']:.3f} |")
    print(f"| cross-speaker baseline (other teacher, prompt) | {figures['sim_cross_speaker']:.3f} |")
    rtf = f"{figures['rtf']:.2f}" if figures["rtf"] is not None else "-"
    print(f"| RTF (synthesis s / audio s, this CPU) | {rtf} |")
    for r in rows[:5]:
        print(f"  e.g. [{r['voice']}] {r['text']!r}\n     model -> {r['model_asr']!r}\n   teacher -> {r['teacher_asr']!r}")
    if args.json:
        args.json.write_text(json.dumps({"figures": figures, "rows": rows}, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
