#!/usr/bin/env python3
"""Greedy-CTC character error rate of a trained speech tokenizer on random clips of a corpus manifest.

    python recipes/builtin/check_tokenizer.py RUN/base/speech_tokenizer.safetensors RUN/corpus5/manifest.jsonl -n 12

A quick health check between the tokenizer and `prepare` stages of the built-in recipe: ids that carry the
words transcribe back to them through the tokenizer's own CTC decoder.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

from vocalis.frontend.audio import load_wav, whisper_log_mel
from vocalis.models.speech_tokenizer import greedy_ctc_decode, load_speech_tokenizer
from vocalis.models.speech_tokenizer.model import edit_distance


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tokenizer", help="speech_tokenizer.safetensors (with its .json beside it)")
    ap.add_argument("manifest", type=Path, help="jsonl with wav, text, language (wav paths relative to it)")
    ap.add_argument("-n", type=int, default=12, help="random clips")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, symbols = load_speech_tokenizer(args.tokenizer)
    model.eval()
    rows = [json.loads(line) for line in args.manifest.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = random.Random(args.seed).sample(rows, min(args.n, len(rows)))
    errors = total = 0
    for row in rows:
        wav = Path(row["wav"]) if Path(row["wav"]).is_absolute() else args.manifest.parent / row["wav"]
        mel = whisper_log_mel(load_wav(wav, 16000))[None]  # (1, 128, T)
        with torch.no_grad():
            _, logits, lens = model(mel, torch.tensor([mel.shape[2]]))
        hyp = greedy_ctc_decode(logits, lens)[0]
        ref = symbols.encode_text(row["text"], row.get("language"))
        e = edit_distance(hyp, ref)
        errors, total = errors + e, total + len(ref)
        print(f"{row.get('language', '?')}  {row.get('speaker', '?')[:24]:24s}  CER {e / max(len(ref), 1):.2f}  "
              f"{''.join(symbols.decode(hyp))[:70]}")
    print(f"CER {errors / max(total, 1):.3f} over {len(rows)} clips ({total} symbols)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
