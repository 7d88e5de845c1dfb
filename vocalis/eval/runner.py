"""`vocalis eval`: score a folder of synthesised `<id>.wav` against the manifest they were made from."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vocalis.batch.manifest import ManifestItem, read_manifest
from vocalis.errors import InputError, VocalisError
from vocalis.eval.asr import Transcriber, load_transcriber
from vocalis.eval.report import build_report, to_markdown, write_plots
from vocalis.eval.scores import Scores, UtteranceResult
from vocalis.eval.similarity import SAMPLE_RATE, SpeakerEmbedder, cosine, make_embedders
from vocalis.eval.wer import char_counts, word_counts
from vocalis.frontend.audio import load_wav

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalOptions:
    manifest: Path
    audio_dir: Path
    out_dir: Path | None = None  # None: <audio_dir>/eval
    asr: str = "pocketsphinx"  # "pocketsphinx", "none" or "module:factory"
    model: str | None = None  # a model directory whose campplus.onnx adds CAM++ similarity
    language: str = "auto"  # used for items whose manifest language is "auto"
    similarity: bool = True
    baseline: bool = False  # also score each item's reference_wav (ground truth), as the baseline to beat
    plots: bool = True


def load_16k(path: Path) -> np.ndarray:
    """Any audio file -> mono float32 (N,) at 16 kHz; AudioError when missing, unreadable or empty."""
    return load_wav(path, SAMPLE_RATE, min_seconds=0.0, max_seconds=None, silence_peak=0.0)


class Scorer:
    """The ASR and speaker embedders, with prompt embeddings cached (prompts repeat across items)."""

    def __init__(self, transcriber: Transcriber | None, embedders: list[SpeakerEmbedder]) -> None:
        self.transcriber = transcriber
        self.embedders = embedders
        self._prompt_cache: dict[tuple[str, str], np.ndarray | str] = {}

    def _prompt_embedding(self, embedder: SpeakerEmbedder, prompt: Path) -> np.ndarray:
        key = (embedder.name, str(prompt))
        if key not in self._prompt_cache:
            try:
                self._prompt_cache[key] = embedder.embed(load_16k(prompt))
            except (VocalisError, ValueError, RuntimeError) as exc:
                self._prompt_cache[key] = f"prompt {prompt}: {exc}"
        cached = self._prompt_cache[key]
        if isinstance(cached, str):
            raise ValueError(cached)
        return cached

    def score(self, wav16k: np.ndarray, item: ManifestItem, language: str) -> Scores:
        scores = Scores()
        if self.transcriber is not None:
            try:
                scores.hypothesis = str(self.transcriber(wav16k, SAMPLE_RATE))
                scores.word_edits = word_counts(item.text, scores.hypothesis, language)
                scores.char_edits = char_counts(item.text, scores.hypothesis, language)
            except Exception as exc:  # a user's plugged-in ASR may raise anything; keep scoring the rest
                scores.errors.append(f"asr: {type(exc).__name__}: {exc}")
        if item.prompt_wav is not None:
            for embedder in self.embedders:
                try:
                    scores.similarity[embedder.name] = cosine(embedder.embed(wav16k),
                                                              self._prompt_embedding(embedder, item.prompt_wav))
                except (ValueError, RuntimeError) as exc:
                    scores.errors.append(f"{embedder.name}: {exc}")
        return scores


def _read_summary(audio_dir: Path) -> dict[str, Any] | None:
    path = audio_dir / "summary.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable %s: %s", path, exc)
        return None


def score_items(items: list[ManifestItem], options: EvalOptions, scorer: Scorer,
                summary: dict[str, Any] | None) -> list[UtteranceResult]:
    summary_items = (summary or {}).get("items", {})
    results: list[UtteranceResult] = []
    iterator: Any = items
    try:
        from tqdm import tqdm

        iterator = tqdm(items, desc="eval", unit="utt", file=sys.stderr)
    except ImportError:
        pass
    for item in iterator:
        language = item.language if item.language != "auto" else options.language
        path = options.audio_dir / f"{item.id}.wav"
        result = UtteranceResult(item.id, item.text, "scored")
        results.append(result)
        if not path.is_file():
            result.status, result.reason = "missing", f"{path.name} not found"
            continue
        try:
            wav = load_16k(path)
        except VocalisError as exc:
            result.status, result.reason = "unreadable", str(exc)
            continue
        result.duration = wav.size / SAMPLE_RATE
        result.rtf = summary_items.get(item.id, {}).get("rtf")
        result.output = scorer.score(wav, item, language)
        if options.baseline and item.reference_wav is not None:
            try:
                result.baseline = scorer.score(load_16k(item.reference_wav), item, language)
            except VocalisError as exc:
                result.baseline = Scores(errors=[f"reference: {exc}"])
    return results


def evaluate(options: EvalOptions) -> dict[str, Any]:
    """Score every item, write report.md / report.json / plots into the report folder; return the report."""
    if not options.audio_dir.is_dir():
        raise InputError(f"audio folder not found: {options.audio_dir}")
    all_items = read_manifest(options.manifest)
    items = [i for i in all_items if i.ok]
    if not items:
        raise InputError(f"manifest {options.manifest} has no valid items")
    out_dir = options.out_dir or options.audio_dir / "eval"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create report folder {out_dir}: {exc}") from None
    transcriber = load_transcriber(options.asr, options.language)
    embedders = make_embedders(options.model) if options.similarity else []
    summary = _read_summary(options.audio_dir)
    results = score_items(items, options, Scorer(transcriber, embedders), summary)
    context = {"manifest": str(options.manifest), "audio_dir": str(options.audio_dir), "asr": options.asr,
               "language": options.language, "embedders": [e.name for e in embedders],
               "invalid_lines": [{"line": i.line, "reason": i.error} for i in all_items if not i.ok]}
    report = build_report(results, summary, context)
    report["plots"] = [str(p) for p in write_plots(results, out_dir)] if options.plots else []
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    markdown = to_markdown(report)
    (out_dir / "report.md").write_text(markdown, encoding="utf-8")
    log.info("report: %s", out_dir / "report.md")
    print(markdown)
    return report
