"""Build the synthetic multi-speaker, multilingual corpus: plan -> synthesise in parallel -> jsonl manifest.

The plan (which text, which speaker, which file) is a pure function of the settings, so a rerun with the same
settings finds the wavs already written and only synthesises the missing ones (resumable). The manifest
(`manifest.jsonl`: utt, wav, text, speaker, language) is what `vocalis prepare` reads. English sentences held
out for evaluation (`heldout_en.jsonl`) never appear in the training text.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import soundfile as sf

from vocalis.corpus.text import sentences
from vocalis.corpus.voices import TeacherVoice, check_engines, espeak_voices, festival_voices, synthesize_batch

log = logging.getLogger(__name__)

MANIFEST = "manifest.jsonl"
HELDOUT = "heldout_en.jsonl"
HELDOUT_SEED = 1_000_003  # the held-out sentences' seed; training text is drawn with other seeds and excludes them
AVG_SECONDS = 3.0  # planning estimate of one utterance's length
BATCH = 40  # utterances per synthesis job (one festival process each)


@dataclass(frozen=True, slots=True)
class CorpusConfig:
    out_dir: str
    hours: float = 2.0
    workers: int = 2
    seed: int = 0
    # share of utterances per language; English includes the festival teachers
    language_shares: tuple[tuple[str, float], ...] = (("en", 0.6), ("zh", 0.2), ("de", 0.0667), ("fr", 0.0667),
                                                       ("es", 0.0666))
    festival_share: float = 0.4  # of the English utterances, spoken by the festival voices
    espeak_speakers: tuple[tuple[str, int], ...] = (("en", 24), ("zh", 8), ("de", 4), ("fr", 4), ("es", 4))
    heldout: int = 60
    extra: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PlannedUtt:
    utt: str
    voice: TeacherVoice
    text: str
    wav: str  # relative to out_dir


def heldout_sentences(n: int) -> list[str]:
    return sentences("en", n, seed=HELDOUT_SEED)


def plan(config: CorpusConfig) -> list[PlannedUtt]:
    total = max(1, round(config.hours * 3600 / AVG_SECONDS))
    heldout = set(heldout_sentences(config.heldout))
    speakers = dict(config.espeak_speakers)
    fest = festival_voices()
    out: list[PlannedUtt] = []
    for lang, share in config.language_shares:
        n = round(total * share)
        if n <= 0:
            continue
        texts = sentences(lang, n, seed=config.seed, exclude=heldout if lang == "en" else frozenset())
        esp = espeak_voices(lang, speakers.get(lang, 4), seed=config.seed)
        n_fest = round(n * config.festival_share) if lang == "en" and fest else 0
        for i, text in enumerate(texts):
            voice = fest[i % len(fest)] if i < n_fest else esp[(i - n_fest) % len(esp)]
            utt = f"{lang}-{i:06d}"
            out.append(PlannedUtt(utt, voice, text, f"wavs/{voice.speaker}/{utt}.wav"))
    return out


def _row(p: PlannedUtt) -> dict[str, str]:
    return {"utt": p.utt, "wav": p.wav, "text": p.text, "speaker": p.voice.speaker, "language": p.voice.language}


def build(config: CorpusConfig) -> dict[str, object]:
    """Synthesise every planned utterance not yet on disk; write the manifests; return a summary."""
    out = Path(config.out_dir)
    planned = plan(config)
    check_engines([p.voice for p in planned])
    todo = [p for p in planned if not (out / p.wav).is_file()]
    log.info("corpus: %d utterances planned, %d already done, %d to synthesise with %d workers",
             len(planned), len(planned) - len(todo), len(todo), config.workers)
    failed: dict[str, str] = {}
    start, done = time.monotonic(), 0

    groups: dict[str, list[PlannedUtt]] = {}
    for p in todo:
        groups.setdefault(p.voice.speaker, []).append(p)
    jobs = [g[i:i + BATCH] for g in groups.values() for i in range(0, len(g), BATCH)]

    def work(batch: list[PlannedUtt]) -> dict[str, str]:
        for p in batch:
            (out / p.wav).parent.mkdir(parents=True, exist_ok=True)
        errors = synthesize_batch(batch[0].voice, [(p.text, out / p.wav) for p in batch])
        return {p.utt: errors[out / p.wav] for p in batch if out / p.wav in errors}

    with ThreadPoolExecutor(max_workers=max(1, config.workers)) as pool:  # each job runs child processes
        for batch, fut in [(b, pool.submit(work, b)) for b in jobs]:
            try:
                failed.update(fut.result())
            except Exception as exc:  # noqa: BLE001 - one failing batch must not end the run; reported in the summary
                failed.update({p.utt: str(exc) for p in batch})
            done += len(batch)
            log.info("corpus: %d/%d synthesised (%.0f s)", done, len(todo), time.monotonic() - start)
    seconds, rows, speakers, langs = 0.0, [], set(), {}
    for p in planned:
        path = out / p.wav
        if p.utt in failed or not path.is_file():
            continue
        dur = sf.info(str(path)).duration
        seconds += dur
        rows.append(_row(p))
        speakers.add(p.voice.speaker)
        langs[p.voice.language] = langs.get(p.voice.language, 0.0) + dur
    _write_jsonl(out / MANIFEST, rows)
    _write_jsonl(out / HELDOUT, [{"id": f"heldout-{i:03d}", "text": t, "language": "en"}
                                 for i, t in enumerate(heldout_sentences(config.heldout))])
    summary = {"utterances": len(rows), "hours": round(seconds / 3600, 3), "speakers": len(speakers),
               "hours_by_language": {k: round(v / 3600, 3) for k, v in sorted(langs.items())},
               "failed": failed, "manifest": str(out / MANIFEST), "heldout": str(out / HELDOUT)}
    (out / "corpus.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False), encoding="utf-8")
    return summary


def _write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)
