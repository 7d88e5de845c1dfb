"""Aggregate per-utterance scores into the report: JSON object, markdown table, PNG plots."""

from __future__ import annotations

import logging
from functools import reduce
from pathlib import Path
from typing import Any

import numpy as np

from vocalis.eval.scores import Scores, UtteranceResult
from vocalis.eval.wer import EditCounts

log = logging.getLogger(__name__)
_WORST = 10


def stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    a = np.asarray(values, dtype=np.float64)
    return {"n": int(a.size), "mean": float(a.mean()), "std": float(a.std()), "min": float(a.min()),
            "median": float(np.median(a)), "max": float(a.max())}


def _aggregate(all_scores: list[Scores]) -> dict[str, Any]:
    """Corpus WER/CER (total edits / total reference length), mean per-utterance WER, similarity statistics."""
    words = [s.word_edits for s in all_scores if s.word_edits is not None]
    chars = [s.char_edits for s in all_scores if s.char_edits is not None]
    word_total = reduce(EditCounts.__add__, words, EditCounts())
    char_total = reduce(EditCounts.__add__, chars, EditCounts())
    names = sorted({name for s in all_scores for name in s.similarity})
    return {
        "wer": word_total.rate if words else None,
        "cer": char_total.rate if chars else None,
        "wer_per_utterance": stats([w.rate for w in words]),
        "word_edits": word_total.to_json() if words else None,
        "char_edits": char_total.to_json() if chars else None,
        "similarity": {n: stats([s.similarity[n] for s in all_scores if n in s.similarity]) for n in names},
    }


def build_report(results: list[UtteranceResult], summary: dict[str, Any] | None,
                 context: dict[str, Any]) -> dict[str, Any]:
    scored = [r for r in results if r.status == "scored"]
    durations = [r.duration for r in scored if r.duration is not None]
    stats_duration = stats(durations)
    chars = sum(len(r.text) for r in scored)
    rtfs = [r.rtf for r in scored if r.rtf is not None]
    baselines = [r.baseline for r in scored if r.baseline is not None]
    return {
        **context,
        "counts": {"items": len(results), "scored": len(scored),
                   "missing": sum(r.status == "missing" for r in results),
                   "unreadable": sum(r.status == "unreadable" for r in results)},
        **_aggregate([r.output for r in scored]),
        "duration": None if stats_duration is None else {
            **stats_duration, "total": float(sum(durations)), "chars_per_second": chars / max(sum(durations), 1e-9)},
        "rtf": {
            "per_utterance": stats(rtfs),
            "run": (summary or {}).get("rtf"),  # the last `vocalis infer` run: compute / audio, per process
            "throughput": (summary or {}).get("throughput_rtf"),
        } if summary is not None else None,
        "baseline": _aggregate(baselines) if baselines else None,
        "problems": [{"id": r.id, "status": r.status, "reason": r.reason, "errors": r.output.errors}
                     for r in results if r.status != "scored" or r.output.errors],
        "utterances": [r.to_json() for r in results],
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f} %"


def _sim(s: dict[str, float] | None) -> str:
    return "n/a" if not s else f"{s['mean']:.3f} ± {s['std']:.3f} (n={s['n']})"


def _cell(text: str | None, limit: int = 80) -> str:
    text = (text or "").replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def to_markdown(report: dict[str, Any]) -> str:
    c = report["counts"]
    counts = f"{c['scored']} of {c['items']} ({c['missing']} missing, {c['unreadable']} unreadable)"
    rows = [("utterances scored", counts),
            (f"WER ({report['asr']})", _pct(report["wer"])),
            ("WER, mean per utterance", _pct((report["wer_per_utterance"] or {}).get("mean"))),
            ("CER", _pct(report["cer"]))]
    rows += [(f"speaker similarity ({name})", _sim(s)) for name, s in report["similarity"].items()]
    d = report["duration"]
    if d:
        durations = (f"total {d['total']:.1f} s; mean {d['mean']:.2f} s, median {d['median']:.2f} s, "
                     f"min {d['min']:.2f} s, max {d['max']:.2f} s; {d['chars_per_second']:.1f} chars/s")
        rows.append(("duration", durations))
    rtf = report["rtf"]
    if rtf:
        if rtf["per_utterance"]:
            rows.append(("RTF, mean per utterance", f"{rtf['per_utterance']['mean']:.3f}"))
        if rtf["run"] is not None:
            rows.append(("RTF, last infer run", f"{rtf['run']:.3f} per process, {rtf['throughput']:.3f} all ranks"))
    base = report["baseline"]
    if base:
        rows += [("baseline (reference audio) WER", _pct(base["wer"])), ("baseline CER", _pct(base["cer"]))]
        rows += [(f"baseline similarity ({name})", _sim(s)) for name, s in base["similarity"].items()]
    lines = ["# Evaluation", "", f"Manifest `{report['manifest']}`, audio `{report['audio_dir']}`.", "",
             "| metric | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    worst = sorted((u for u in report["utterances"] if u["wer"] is not None), key=lambda u: -u["wer"])[:_WORST]
    if worst:
        lines += ["", f"## Highest WER ({len(worst)})", "", "| id | WER | text | recognised |", "|---|---|---|---|"]
        lines += [f"| {_cell(u['id'], 40)} | {_pct(u['wer'])} | {_cell(u['text'])} | {_cell(u['hypothesis'])} |"
                  for u in worst]
    problems = report["problems"]
    if problems or report["invalid_lines"]:
        lines += ["", "## Problems", ""]
        lines += [f"- `{p['id']}`: {p['status']}{': ' + p['reason'] if p['reason'] else ''}"
                  + (f" ({'; '.join(p['errors'])})" if p["errors"] else "") for p in problems[:50]]
        lines += [f"- manifest line {x['line']}: {x['reason']}" for x in report["invalid_lines"][:50]]
    return "\n".join(lines) + "\n"


def write_plots(results: list[UtteranceResult], out_dir: Path) -> list[Path]:
    """wer_hist.png and similarity.png (when there is something to plot); needs matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        log.warning("matplotlib is not installed: no plots (pip install 'vocalis[eval]')")
        return []
    written: list[Path] = []
    wers = [100 * r.output.wer for r in results if r.output.wer is not None]
    if wers:
        fig = Figure(figsize=(6, 4), dpi=100)
        ax = fig.add_subplot()
        ax.hist(wers, bins=min(20, max(5, len(wers) // 2)), color="tab:blue", edgecolor="white")
        ax.set(xlabel="WER per utterance (%)", ylabel="utterances", title=f"WER per utterance (n={len(wers)})")
        written.append(_save(fig, FigureCanvasAgg, out_dir / "wer_hist.png"))
    names = sorted({n for r in results for n in r.output.similarity})
    if names:
        fig = Figure(figsize=(6, 4), dpi=100)
        ax = fig.add_subplot()
        for name in names:
            values = [r.output.similarity[name] for r in results if name in r.output.similarity]
            ax.hist(values, bins=20, range=(min(-0.2, *values), 1.0), alpha=0.6, label=f"{name} (n={len(values)})")
        ax.set(xlabel="cosine similarity to the prompt", ylabel="utterances", title="Speaker similarity")
        ax.legend()
        written.append(_save(fig, FigureCanvasAgg, out_dir / "similarity.png"))
    return written


def _save(fig: Any, canvas_cls: Any, path: Path) -> Path:
    canvas_cls(fig)
    fig.tight_layout()
    fig.savefig(path)
    return path
