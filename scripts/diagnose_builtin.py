#!/usr/bin/env python3
"""Two diagnoses of a built-in export, on the held-out teacher clips `scripts/measure_builtin.py` left in --measure.

prompting: the LLM prompted zero-shot (prompt text + prompt speech tokens before the text, as the measurement does)
           vs cross-lingually (the text only; the flow still gets the prompt): WER and how many clips are far from
           their teacher's duration (outside 0.7-1.4x).
f0:        the vocoder alone (teacher mel -> HiFT) with HiFT's own predicted F0 vs the teacher's YIN F0 driving
           its source: WER of each, and the predicted F0's mean error on voiced frames.

    python scripts/diagnose_builtin.py prompting --model DIR --measure OUT [-n 24]
    python scripts/diagnose_builtin.py f0 --model DIR --measure OUT [-n 24]   (the docs' figures: -n 30)

Wavs are written beside the teacher clips (`zero_shot-*.wav`, `cross_lingual-*.wav`, `f0p-*.wav`, `f0t-*.wav`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_builtin import load16

from vocalis.corpus.build import heldout_sentences
from vocalis.corpus.sentences import PROMPT_SENTENCE
from vocalis.corpus.voices import festival_voices
from vocalis.eval.asr import PocketsphinxTranscriber
from vocalis.eval.wer import EditCounts, word_counts
from vocalis.tts import TTS


def prompting(tts: TTS, out: Path, texts: list[str]) -> None:
    voices, asr = festival_voices(), PocketsphinxTranscriber()
    for mode in ("zero_shot", "cross_lingual"):
        wer, ratios = EditCounts(0, 0, 0, 0), []
        for i, text in enumerate(texts):
            v = voices[i % len(voices)]
            wav = tts.synthesize(text, prompt_wav=str(out / f"prompt-{v.speaker}.wav"),
                                 prompt_text=PROMPT_SENTENCE if mode == "zero_shot" else "", seed=0, language="en")
            path = out / f"{mode}-{i:03d}.wav"
            sf.write(str(path), wav, tts.sample_rate)
            wer += word_counts(text, asr(load16(path), 16000), "en")
            teacher = sf.info(str(out / f"teacher-{v.speaker}-{i:03d}.wav")).duration
            ratios.append(len(wav) / tts.sample_rate / teacher)
        r = np.array(ratios)
        far = int(((r < 0.7) | (r > 1.4)).sum())
        print(f"{mode:14s} WER {100 * wer.rate:.1f} % | duration vs teacher: median {np.median(r):.2f}x, "
              f"outside 0.7-1.4x {far}/{len(r)}")


def f0(tts: TTS, out: Path, texts: list[str]) -> None:
    from vocalis.frontend.audio import load_wav, prompt_mel
    from vocalis.train.f0 import yin_f0

    voices, asr, hift = festival_voices(), PocketsphinxTranscriber(), tts.model.hift
    wers = {"predicted": EditCounts(0, 0, 0, 0), "teacher": EditCounts(0, 0, 0, 0)}
    errors = []
    for i, text in enumerate(texts):
        v = voices[i % len(voices)]
        wav24 = load_wav(out / f"teacher-{v.speaker}-{i:03d}.wav", tts.sample_rate, max_seconds=None)
        mel = prompt_mel(wav24).transpose(0, 1).unsqueeze(0)  # (1, 80, T)
        true = torch.from_numpy(np.asarray(yin_f0(np.asarray(wav24), num_frames=mel.shape[2]), np.float32))[None]
        with torch.inference_mode():
            predicted = hift.f0_predictor(mel)  # (1, T)
            errors.append((predicted - true).abs()[true > 0].mean().item())
            for name, f0_frames in (("predicted", predicted), ("teacher", true)):
                upsampled = hift.f0_upsamp(f0_frames[:, None]).transpose(1, 2)  # (1, N, 1)
                source, _, _ = hift.m_source(upsampled, torch.Generator().manual_seed(0))
                wav = hift.decode(mel, source.transpose(1, 2))
                path = out / f"f0{name[0]}-{i:03d}.wav"
                sf.write(str(path), wav[0].numpy(), tts.sample_rate)
                wers[name] += word_counts(text, asr(load16(path), 16000), "en")
    print(f"vocoder alone: WER with predicted F0 {100 * wers['predicted'].rate:.1f} %, with the teacher's F0 "
          f"{100 * wers['teacher'].rate:.1f} %; predicted F0 error on voiced frames {np.mean(errors):.1f} Hz "
          f"({len(texts)} clips)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("check", choices=("prompting", "f0"))
    ap.add_argument("--model", required=True, help="model directory (an export)")
    ap.add_argument("--measure", type=Path, required=True, help="measure_builtin.py's --out folder")
    ap.add_argument("-n", type=int, default=24, help="first N held-out sentences")
    args = ap.parse_args()
    texts = heldout_sentences(50)[: args.n]
    if not any(args.measure.glob("teacher-*.wav")):
        sys.exit(f"diagnose_builtin: {args.measure} has no teacher clips (run scripts/measure_builtin.py --out first)")
    tts = TTS.load(args.model)
    (prompting if args.check == "prompting" else f0)(tts, args.measure, texts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
