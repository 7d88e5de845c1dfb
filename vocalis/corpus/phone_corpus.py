"""The phone-based corpus of the built-in model: recipe text spoken by festival voices (SLT's HTS voice; the kal
and ked diphones), with their alignment.

`build(PhoneCorpusConfig(out, utterances=N, voices=...))` plans N sentences (`vocalis.corpus.sentences.recipe`)
for every voice, has festival speak them in batches of 40 per process and voice (each writing the wav and the segment list, `alignment.SEGS_SCHEME`), then
writes per utterance: the text frontend's ids (`vocalis.frontend.phones.text_ids`) and the 25 Hz labels
(`alignment.frame_labels`). An utterance whose frontend phones differ from the ones festival spoke is left out of
the manifest (counted in `corpus.json` as `g2p_mismatch`): training text and labels always agree.

Output: `wavs/<voice>/*.wav` + `*.segs` + `*.txt` (the text it was spoken from), `manifest.jsonl` (utt, wav, text, speaker, language: `vocalis prepare`'s input),
`labels.jsonl` (utt, text_ids, labels, frames), `heldout_wordnet.jsonl` (the 50 held-out sentences), `corpus.json`.
The plan is a pure function of the config and the installed Debian packages; a rerun synthesises only what is
missing.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import soundfile as sf

from vocalis.corpus.alignment import SEGS_SCHEME, frame_labels, num_frames, read_segments, reconcile
from vocalis.corpus.sentences import heldout_wordnet, recipe
from vocalis.errors import InputError
from vocalis.frontend.phones import PUNCTUATION, WORD_BOUNDARY, g2p, text_ids

log = logging.getLogger(__name__)

# festival voices by corpus name; the diphone voices end ~25 ms after their last segment (the final pause's
# frames absorb it) and need `alignment.reconcile` for their post-lexical reductions
VOICES = {"slt": "cmu_us_slt_arctic_hts", "kal": "kal_diphone", "ked": "ked_diphone"}
BATCH = 40
_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class PhoneCorpusConfig:
    out_dir: str
    utterances: int = 2000  # sentences per voice (every voice speaks the same ones)
    voices: tuple[str, ...] = ("slt",)
    seed: int = 0
    workers: int = 1


@dataclass(frozen=True, slots=True)
class Planned:
    utt: str
    text: str
    wav: str  # relative to out_dir; the segment list is the same path with suffix .segs


def plan(config: PhoneCorpusConfig) -> list[tuple[str, Planned]]:
    """(voice, utterance) for every voice and recipe sentence, voice by voice."""
    texts = recipe(config.utterances, seed=config.seed)
    return [(v, Planned(f"{v}-{i:06d}", text, f"wavs/{v}/{v}-{i:06d}.wav")) for v in config.voices
            for i, text in enumerate(texts)]


def _quote(text: str) -> str:
    return '"' + text.replace("\\", " ").replace('"', '\\"') + '"'


def speak_batch(voice: str, items: list[tuple[str, Path]]) -> str | None:
    """One festival process: each (text, wav) -> wav + wav.with_suffix('.segs'), renamed into place when written.
    -> festival's complaint (its exit status and the end of its stderr) when it left an utterance unwritten."""
    lines = [f"(voice_{VOICES[voice]})", SEGS_SCHEME]
    for text, wav in items:
        lines.append(f"(set! u (SynthText {_quote(text)}))")
        lines.append(f"(utt.save.wave u {_quote(str(wav) + '.tmp')} 'riff)")
        lines.append(f"(vocalis_segs u {_quote(str(wav.with_suffix('.segs')) + '.tmp')})")
    script = items[0][1].with_name(f".batch-{os.getpid()}-{items[0][1].stem}.scm")
    script.write_text("\n".join(lines) + "\n", encoding="utf-8")
    try:
        done = subprocess.run(["festival", "-b", str(script)], check=False, capture_output=True, timeout=_TIMEOUT_S)
        complaint = f"festival exited {done.returncode}: {done.stderr.decode(errors='replace')[-400:].strip()}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        complaint = f"festival did not run: {exc}"
    finally:
        script.unlink(missing_ok=True)
    missing = 0
    for text, wav in items:
        segs = wav.with_suffix(".segs")
        if Path(str(wav) + ".tmp").is_file() and Path(str(segs) + ".tmp").is_file():
            wav.with_suffix(".txt").write_text(text, encoding="utf-8")
            os.replace(str(segs) + ".tmp", segs)
            os.replace(str(wav) + ".tmp", wav)
        else:
            missing += 1
    return f"{missing} of {len(items)} unwritten; {complaint}" if missing else None


def _spoken(wav: Path, text: str) -> bool:
    """True when `wav` exists and was spoken from `text` (its `.txt` sidecar), so a changed recipe re-speaks it."""
    side = wav.with_suffix(".txt")
    return wav.is_file() and side.is_file() and side.read_text(encoding="utf-8") == text


def utterance_record(utt: str, text: str, wav: Path) -> dict[str, object]:
    """Labels and text ids of one spoken utterance; `mismatch` set when the frontend's phones differ from festival's."""
    segments = read_segments(wav.with_suffix(".segs"))
    frames = num_frames(sf.info(str(wav)).duration)
    predicted = [s for s in g2p(text) if s != WORD_BOUNDARY and s not in PUNCTUATION]
    spelled = reconcile(predicted, segments)
    labels = frame_labels(segments if spelled is None else spelled, frames)
    return {"utt": utt, "frames": frames, "text_ids": text_ids(text), "labels": labels, "mismatch": spelled is None}


def build(config: PhoneCorpusConfig) -> dict[str, object]:
    unknown = [v for v in config.voices if v not in VOICES]
    if unknown or not config.voices:
        raise InputError(f"unknown voices {unknown}; known: {', '.join(VOICES)}")
    out = Path(config.out_dir)
    planned = plan(config)
    todo = [(v, p) for v, p in planned if not _spoken(out / p.wav, p.text)]
    for v in config.voices:
        (out / "wavs" / v).mkdir(parents=True, exist_ok=True)
    log.info("phone corpus: %d planned, %d to speak", len(planned), len(todo))
    start = time.monotonic()
    jobs = []  # (voice, up to BATCH utterances): one festival process each
    for voice in config.voices:
        mine = [p for v, p in todo if v == voice]
        jobs += [(voice, mine[i:i + BATCH]) for i in range(0, len(mine), BATCH)]
    with ThreadPoolExecutor(max_workers=max(1, config.workers)) as pool:
        complaints = 0
        for k, complaint in enumerate(pool.map(lambda j: speak_batch(j[0], [(p.text, out / p.wav) for p in j[1]]),
                                               jobs)):
            log.info("phone corpus: batch %d/%d (%.0f s)", k + 1, len(jobs), time.monotonic() - start)
            if complaint is not None and (complaints := complaints + 1) <= 3:  # the first few say why; the count says how many
                log.warning("phone corpus: batch %d (%s): %s", k + 1, jobs[k][0], complaint)
    rows, records, failed, mismatched, seconds = [], [], [], 0, 0.0
    per_voice = dict.fromkeys(config.voices, 0)
    for v, p in planned:
        wav = out / p.wav
        if not _spoken(wav, p.text):
            failed.append(p.utt)
            continue
        try:
            rec = utterance_record(p.utt, p.text, wav)
        except ValueError as exc:
            log.warning("phone corpus: %s left out: %s", p.utt, exc)
            failed.append(p.utt)
            continue
        if rec.pop("mismatch"):
            mismatched += 1
            continue
        seconds += sf.info(str(wav)).duration
        rows.append({"utt": p.utt, "wav": p.wav, "text": p.text, "speaker": f"fest-{v}", "language": "en"})
        records.append(rec)
        per_voice[v] += 1
    if not rows:
        raise InputError(f"phone corpus: none of the {len(planned)} utterances was spoken and kept "
                         "(festival's complaints are above)")
    _write_jsonl(out / "manifest.jsonl", rows)
    _write_jsonl(out / "labels.jsonl", records)
    _write_jsonl(out / "heldout_wordnet.jsonl", [{"id": f"heldout-{i:03d}", "text": t, "language": "en"}
                                                 for i, t in enumerate(heldout_wordnet())])
    summary = {"utterances": len(rows), "hours": round(seconds / 3600, 3),
               "voices": {VOICES[v]: n for v, n in per_voice.items()}, "planned": len(planned),
               "g2p_mismatch": mismatched, "failed": len(failed), "seed": config.seed}
    (out / "corpus.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    return summary


def _write_jsonl(path: Path, rows: list[dict[str, object]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)
